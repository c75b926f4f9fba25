"""The command line of every entry point: read the config, train, and turn each way a run ends
early (errors.py) into one line and its exit code."""

import os
import signal
import sys
from collections.abc import Callable

import torch.distributed as dist

from .config import TrainConfig, load_config
from .distributed import cleanup, lost_contact, print0
from .errors import ConfigError, Interrupted, JobFailed, RunFinished, first_line
from .extras import plug
from .output_lock import release_held

# With the doctor's extra, a failed collective leaves each rank's record and names who did not arrive (hangs.py).
watch = plug("doctor", "hangs:watch", default=lambda cfg: None)
disagreement = plug("doctor", "hangs:disagreement", default=lambda err: None)
explain = plug("doctor", "hangs:explain", default=lambda err, cfg: "")


def say(error) -> None:
    """The one line of an error, in one write: another process's line cannot split it."""
    sys.stderr.write(f"error: {error}\n")
    sys.stderr.flush()


def run_cli(train: Callable[[TrainConfig], int | None]) -> None:
    """Parse the config and train; each way a run ends early is one line and its exit code: ConfigError 2, JobFailed
    its own, RunFinished 0, a lost process 1, Ctrl-C 128 + the signal, or the code `train` returns. The group is
    destroyed once `train` returned and DDP's reducer is freed (the other order can abort in gloo's destructor)."""
    code, cfg = 0, None
    try:
        cfg = load_config()
        watch(cfg)  # before any process group exists
        code = train(cfg) or 0
    except RunFinished as done:
        print0(str(done))  # every rank found it so; the job says it once
        sys.exit(0)
    except ConfigError as err:
        say(err)
        sys.exit(2)
    except JobFailed as err:
        say(err)
        if not err.agreed:  # the others may be waiting in a collective: nothing may meet them now
            os._exit(err.exit_code)
        code = err.exit_code  # every process stops here together: the group can still be destroyed
    except RuntimeError as err:
        differ = disagreement(err)
        if not (differ or lost_contact(err)):
            raise
        forensics = explain(err, cfg)
        if differ:
            say(f"the processes ran different collectives ({differ}){forensics}; the job stops: make every rank "
                "run the same collectives in the same order")
        else:
            say(f"lost contact with the other processes ({first_line(err)}){forensics}; the job stops: a restart "
                "(torchrun --max_restarts, a requeue) resumes it from its newest checkpoint")
        os._exit(1)  # a peer is gone or stuck: nothing may wait on it again, not even the exit
    except (Interrupted, KeyboardInterrupt) as err:
        signum = getattr(err, "signum", signal.SIGINT)
        say(err if isinstance(err, Interrupted) else "stopped by SIGINT; a restart resumes from the newest checkpoint")
        if dist.is_initialized():
            release_held()  # a stopped job lets the next one have its folder
            os._exit(128 + signum)  # the others may be waiting in a collective: nothing may meet them now
        sys.exit(128 + signum)
    cleanup()
    if code:
        sys.exit(code)
