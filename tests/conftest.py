"""Helpers for the template's own tests: bake with the real cookiecutter, list what came out, run a
bake's own test suite (the default bake's slow tier in the background from the start)."""

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

TEMPLATE = Path(__file__).resolve().parents[1]
MEASURED: list[str] = []


def report(text: str) -> None:
    """Keep measured numbers for the "measured" section printed at the end of the session."""
    MEASURED.append(text)


def pytest_terminal_summary(terminalreporter):
    if MEASURED:
        terminalreporter.section("measured")
        for text in MEASURED:
            terminalreporter.write_line(text)


DEFAULTS = {"task": "causal_lm", "entry_points": "all", "deepspeed_stage": "2"}


def bake_cli(out: Path, **answers) -> subprocess.CompletedProcess:
    """`cookiecutter TEMPLATE --no-input key=value ...` as a user types it, run inside `out`."""
    cmd = [sys.executable, "-m", "cookiecutter", str(TEMPLATE), "--no-input", "-o", str(out)]
    cmd += [f"{key}={value}" for key, value in answers.items()]
    return subprocess.run(cmd, cwd=out, capture_output=True, text=True, timeout=120)


def project_files(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and ".pytest_cache" not in p.parts}


@pytest.fixture(scope="session")
def baked(cookies_session):
    """Bake (with pytest-cookies) once per set of answers for the whole session."""
    cache: dict[tuple, Path] = {}

    def bake(**answers) -> Path:
        key = tuple(sorted(answers.items()))
        if key not in cache:
            result = cookies_session.bake(template=str(TEMPLATE), extra_context=answers)
            assert result.exit_code == 0, result.exception
            cache[key] = Path(result.project_path)
        return cache[key]

    return bake


GENERATED_SUITE_TIMEOUT_S = 3600  # every extra's whole suite: about 40 minutes on a 2-core VM beside the rest

# The task only sets the generated config's default. The whole suite of the bake with every extra
# runs here (both tiers: the extras' tests and the core's); the default bake (the core alone) runs
# its fast tier as the CI workflow's `make test`, in test_team. The parity tests run again on the
# sequence_classification bake, for its loss (the mean over examples), in the 1x1 and 2x4 cells
# (2x4 holds both data parallelism and accumulation; 1x4 and 2x1 are the other bake's), less what
# does not depend on the task: two torchrun agents, sync counts, the lr of every cell, and the packed
# cells (causal_lm's). The latter in 2 pytest-xdist workers, as the project's Makefile runs its tests;
# the former, the longest path of the run, in 3: most of its tests wait on processes they start (a
# timeout, a restart, a rendezvous), and once the template's other tests are done 2 workers left a
# core idle. Its tests are handed out one by one and taken over by an idle worker (worksteal:
# modules differ tenfold).
SUITE_ANSWERS = {"causal_lm": {"extras": "all"}, "sequence_classification": {}}
TASK_SUITES = {"causal_lm": ["-n", "3", "--dist", "worksteal"],
               "sequence_classification": ["-n", "2", "tests/test_parity.py", "-k", "not two_torchrun_agents and not "
                                           "ddp_syncs and not learning_rate and not packed and not 1x4 and not 2x1"]}
# The longest of them mostly waits on a few processes: it starts as soon as the tests are collected
# and its test runs last, so that the template's other tests run meanwhile.
BACKGROUND_TASKS = ("causal_lm",)
SUITE_TEST = "test_generated_suite_passes"


def ahead() -> None:
    """A background suite is the longest path of the run: ahead of the tests that run beside it
    (a lower nice value, which only root may set; elsewhere it shares the cores evenly)."""
    with contextlib.suppress(PermissionError):
        os.nice(-5)


class GeneratedSuite:
    """A bake's own pytest in a process group of its own, its output in files beside the project
    (a full pipe would stall it)."""

    def __init__(self, project: Path, *pytest_args: str, priority: bool = False):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "PYTEST_"))}
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
        self.cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *pytest_args]
        self.logs = tempfile.mkdtemp(prefix="suite-", dir=project.parent)
        with open(f"{self.logs}/stdout", "w") as stdout, open(f"{self.logs}/stderr", "w") as stderr:
            self.proc = subprocess.Popen(self.cmd, cwd=project, env=env, stdout=stdout, stderr=stderr,
                                         start_new_session=True, preexec_fn=ahead if priority else None)
        self.deadline = time.monotonic() + GENERATED_SUITE_TIMEOUT_S

    def result(self) -> subprocess.CompletedProcess:
        """Wait for it (until GENERATED_SUITE_TIMEOUT_S after its start, then kill it and fail)."""
        try:
            self.proc.wait(timeout=max(1.0, self.deadline - time.monotonic()))
        finally:
            self.kill()
        return subprocess.CompletedProcess(self.cmd, self.proc.returncode, Path(f"{self.logs}/stdout").read_text(),
                                           Path(f"{self.logs}/stderr").read_text())

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


BACKGROUND: dict[str, GeneratedSuite] = {}
BACKGROUND_BAKES: list[Path] = []


def pytest_collection_modifyitems(config, items):
    """The tests of the background suites go last (their suites start in pytest_collection_finish)."""
    items.sort(key=lambda item: item.originalname == SUITE_TEST and item.callspec.params["task"] in BACKGROUND_TASKS)


def pytest_collection_finish(session):
    if session.config.option.collectonly:
        return
    for item in session.items:
        task = item.callspec.params["task"] if item.originalname == SUITE_TEST else None
        if task in BACKGROUND_TASKS and task not in BACKGROUND:
            out = Path(tempfile.mkdtemp(prefix=f"bake-{task}-"))
            BACKGROUND_BAKES.append(out)
            bake = bake_cli(out, task=task, **SUITE_ANSWERS[task])
            assert bake.returncode == 0, bake.stderr
            BACKGROUND[task] = GeneratedSuite(out / "gacc_train", *TASK_SUITES[task], priority=True)


def pytest_unconfigure(config):
    for suite in BACKGROUND.values():
        suite.kill()
    for out in BACKGROUND_BAKES:
        shutil.rmtree(out, ignore_errors=True)
