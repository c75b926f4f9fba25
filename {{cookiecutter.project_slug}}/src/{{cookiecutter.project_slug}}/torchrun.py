"""torchrun as scripts/train_local.sh starts it (`python -m {{ cookiecutter.project_slug }}.torchrun`, the same options):
a stop by Ctrl-C or SIGTERM is one line and exit code 128 + the signal's number, not the agent's
traceback. torchrun passes the signal on to its workers, which print their own line each (SIGTERM:
they stop after the next optimizer step with a checkpoint). Workers that got SIGTERM themselves
end with exit code 143 too, and so does torchrun, in one line.
"""

import logging
import signal
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main


class _SaidByTheLine(logging.Filter):
    """torchrun's own notes of a stop by signal, which the one line says."""

    def filter(self, record: logging.LogRecord) -> bool:
        by_sigterm = record.msg.startswith("failed (exitcode") and record.args[0] in TERMINATED
        return not by_sigterm and "death signal" not in record.msg and "closing signal" not in record.msg


# A worker's exit codes after SIGTERM: its own (Session.stopped, errors.Interrupted), or the signal's
# when torchrun, seeing the first worker end, stopped one that was already on its way out.
TERMINATED = (128 + signal.SIGTERM, -signal.SIGTERM)


if __name__ == "__main__":
    for name in ("torch.distributed.elastic.agent.server.api", "torch.distributed.elastic.multiprocessing.api"):
        logging.getLogger(name).addFilter(_SaidByTheLine())
    try:
        main()
    except (SignalException, KeyboardInterrupt) as stop:
        signum = signal.Signals(getattr(stop, "sigval", signal.SIGINT))  # KeyboardInterrupt: before torchrun's handlers
        print(f"error: torchrun stopped by {signum.name} and stopped its workers; a restart resumes from the newest "
              "checkpoint", file=sys.stderr, flush=True)
        sys.exit(128 + signum)
    except ChildFailedError as failed:
        codes = [failure.exitcode for failure in failed.failures.values()]
        if TERMINATED[0] not in codes or not set(codes) <= set(TERMINATED):
            raise
        ranks = ", ".join(map(str, sorted(failed.failures)))
        print(f"error: rank{'s' if len(codes) > 1 else ''} {ranks} stopped by SIGTERM; a restart resumes from the "
              "newest checkpoint", file=sys.stderr, flush=True)
        sys.exit(TERMINATED[0])
