"""torchrun as the launch scripts start it (`python -m {{ cookiecutter.project_slug }}.torchrun`, the same options),
ending in one line where torchrun would print a traceback: Ctrl-C or SIGTERM exits 128 + the signal
(workers that got SIGTERM end with 143, and so does torchrun), a lost rendezvous 1, and workers whose
own line says it all (a configuration error, the doctor's failed check) 2. docs/launching.md tells the story.
"""

import logging
import signal
import sys

from torch.distributed.elastic import rendezvous
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main, parse_args

TERMINATED = (128 + signal.SIGTERM, -signal.SIGTERM)  # a worker's after SIGTERM: its own 143, or the signal's
SAID = 2  # a worker's configuration error (cli.run_cli) or the doctor's failed check: its own line says it all


def said_by_the_line(record: logging.LogRecord) -> bool:
    """False for torchrun's notes of what the one line says (a worker's exit code SAID or TERMINATED, signals)."""
    said = record.msg.startswith("failed (exitcode") and record.args[0] in (*TERMINATED, SAID)
    return not said and not any(note in record.msg for note in ("death signal", "closing signal", "forcefully exiting",
                                                                 "has failed to shutdown the rendezvous"))


def rendezvous_failure(error: rendezvous.RendezvousError, endpoint: str, nnodes: str) -> str:
    if isinstance(error, rendezvous.RendezvousConnectionError):
        what = f"lost the rendezvous at {endpoint}: the node that holds it stopped or cannot be reached"
    elif isinstance(error, rendezvous.RendezvousTimeoutError):
        what = (f"waited in vain at the rendezvous at {endpoint}: fewer nodes than --nnodes {nnodes} joined "
                "within its join_timeout")
    elif isinstance(error, rendezvous.RendezvousClosedError):
        what = f"found the rendezvous at {endpoint} closed: the job's other nodes have ended it"
    else:
        what = f"failed at the rendezvous at {endpoint} ({type(error).__name__}: {error})"
    return (f"error: torchrun {what}; the job stops: start every node again (with --resume_from_checkpoint auto "
            "it resumes from the newest checkpoint)")


if __name__ == "__main__":
    args = parse_args(sys.argv[1:])
    for name in ("torch.distributed.elastic.agent.server.api", "torch.distributed.elastic.multiprocessing.api",
                 "torch.distributed.elastic.rendezvous.dynamic_rendezvous"):
        logging.getLogger(name).addFilter(said_by_the_line)
    try:
        main()
    except (SignalException, KeyboardInterrupt) as stop:
        signum = signal.Signals(getattr(stop, "sigval", signal.SIGINT))  # KeyboardInterrupt: before torchrun's handlers
        print(f"error: torchrun stopped by {signum.name} and stopped its workers; a restart resumes from the newest "
              "checkpoint", file=sys.stderr, flush=True)
        sys.exit(128 + signum)
    except rendezvous.RendezvousError as error:
        endpoint = args.rdzv_endpoint or f"{args.master_addr}:{args.master_port}"  # the static rendezvous's
        print(rendezvous_failure(error, endpoint, args.nnodes), file=sys.stderr, flush=True)
        sys.exit(1)
    except ChildFailedError as failed:
        codes = [failure.exitcode for failure in failed.failures.values()]
        # the others stopped by torchrun after it (SIGKILL: they took SIGTERM as a request to stop at a step)
        if SAID in codes and set(codes) <= {SAID, -signal.SIGTERM, -signal.SIGKILL}:
            sys.exit(SAID)
        if TERMINATED[0] not in codes or not set(codes) <= set(TERMINATED):
            raise
        ranks = ", ".join(map(str, sorted(failed.failures)))
        print(f"error: rank{'s' if len(codes) > 1 else ''} {ranks} stopped by SIGTERM; a restart resumes from the "
              "newest checkpoint", file=sys.stderr, flush=True)
        sys.exit(TERMINATED[0])
