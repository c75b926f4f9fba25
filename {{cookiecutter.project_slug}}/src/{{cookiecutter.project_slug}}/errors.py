"""How a run ends early on purpose, each with one line (cli.run_cli)."""


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


def first_line(err: BaseException) -> str:
    """The part of a library's error a user needs: its first line."""
    return (str(err).strip().splitlines() or [type(err).__name__])[0]
