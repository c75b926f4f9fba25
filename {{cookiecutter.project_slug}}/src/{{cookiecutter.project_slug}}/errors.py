"""How a run ends early on purpose, each with one line (cli.run_cli)."""

import contextlib
import errno
import os
import signal


class ConfigError(Exception):
    """A mistake the user can fix: bad config, bad flag, bad input data, a launch that does not fit.
    Found by an *up-front* check: one that every process makes before any process waits on
    another, so each reports it itself instead of hanging. Exit code 2."""


class JobFailed(Exception):
    """The job cannot go on and says why in one line: a checkpoint that could not be written, a
    rendezvous that timed out (exit code 1), a training that diverged (exit code 3). `agreed`: every
    process raises it at the same point (after a collective that told them all)."""

    def __init__(self, message: str, exit_code: int = 1, agreed: bool = False):
        super().__init__(message)
        self.exit_code = exit_code
        self.agreed = agreed


class RunFinished(Exception):
    """Not an error: the run in output_dir is already done with this config. One line, exit code 0,
    and no file changed (what makes a SLURM requeue loop safe)."""


FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # no room: a full disk, a quota, a file size limit


def disk_full(err: BaseException | None) -> OSError | None:
    """The full disk (or quota, or a file size limit) behind `err`, wherever a library wrapped it;
    None if there is none: only then does a failed write say to free space."""
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
    """SIGINT (Ctrl-C) or SIGTERM where the run cannot stop at a step boundary (while it prepares
    data): one line after the `finally` blocks have removed what was half written, exit code 128 +
    the signal's number."""

    def __init__(self, signum: int, doing: str):
        super().__init__(f"stopped by {signal.Signals(signum).name} {doing}")
        self.signum = signum


@contextlib.contextmanager
def interruptible(doing: str):
    """Within the block SIGINT and SIGTERM raise Interrupted (once: a second signal does not cut the
    clean-up short); whatever a library turns the first into on its way out, Interrupted comes out."""
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
