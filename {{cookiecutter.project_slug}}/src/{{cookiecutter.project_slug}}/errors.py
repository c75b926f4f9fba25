"""How a run ends early on purpose, each with one line (cli.run_cli)."""

import contextlib
import errno
import os
import signal


class ConfigError(Exception):
    """A mistake the user can fix (config, flag, input data, launch), found by an up-front check that
    every process makes before any waits on another. Exit code 2."""


class JobFailed(Exception):
    """The job cannot go on (a failed write, a rendezvous timeout: exit 1; divergence: 3). `agreed`:
    every process raises it at the same point, after a collective that told them all."""

    def __init__(self, message: str, exit_code: int = 1, agreed: bool = False):
        super().__init__(message)
        self.exit_code, self.agreed = exit_code, agreed


class RunFinished(Exception):
    """The run in output_dir is already done with this config: one line, exit 0, no file changed."""


FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # no room: a full disk, a quota, a file size limit


def disk_full(err: BaseException | None) -> OSError | None:
    """The full disk (quota, file size limit) behind `err`, wherever a library wrapped it, or None."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in FULL:
            return err
        for code in FULL:  # a library's own error that says it in words (safetensors' Rust, torch's writer)
            if os.strerror(code) in str(err):
                return OSError(code, os.strerror(code))
        err = err.__cause__ or err.__context__
    return None


def first_line(err: BaseException) -> str:
    """The part of a library's error a user needs: its first line."""
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


class Interrupted(BaseException):
    """SIGINT or SIGTERM where the run cannot stop at a step boundary (preparing data): one line once
    `finally` blocks removed what was half written, exit 128 + the signal's number."""

    def __init__(self, signum: int, doing: str):
        super().__init__(f"stopped by {signal.Signals(signum).name} {doing}")
        self.signum = signum


@contextlib.contextmanager
def interruptible(doing: str):
    """Within the block SIGINT and SIGTERM raise Interrupted once (a second does not cut clean-up
    short), whatever a library turns it into on its way out."""
    got = []

    def handle(signum, frame):
        if not got:
            got.append(signum)
            raise Interrupted(signum, doing)

    previous = {signum: signal.signal(signum, handle) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    except BaseException:
        if got:
            raise Interrupted(got[0], doing) from None
        raise
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
