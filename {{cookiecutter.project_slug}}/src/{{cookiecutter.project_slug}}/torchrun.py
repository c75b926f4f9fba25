"""torchrun as scripts/train_local.sh starts it (`python -m {{ cookiecutter.project_slug }}.torchrun`, the same options):
a stop by Ctrl-C or SIGTERM is one line and exit code 128 + the signal's number, not the agent's
traceback. torchrun passes the signal on to its workers, which print their own line each.
"""

import logging
import signal
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.run import main


class _SaidByTheLine(logging.Filter):
    """torchrun's own notes of a stop by signal, which the one line says."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "death signal" not in record.msg and "closing signal" not in record.msg


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
