"""Helpers for the template's own tests: bake with the real cookiecutter, list what came out."""

import subprocess
import sys
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
