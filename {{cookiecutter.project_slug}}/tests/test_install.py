"""The install tells the truth: requires-python is what the dependencies need (their own
Requires-Python, read from the installed distributions), ruff and the README say the same, and pip
on an older Python refuses the package in one line naming it."""

import importlib.metadata
import importlib.util
import shutil
import subprocess
import sys
import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

from conftest import ROOT

PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PYTHONS = [Version(f"3.{minor}") for minor in range(30)]  # what a Requires-Python is tried against


def oldest_python(requires_python: str) -> Version:
    return min(version for version in PYTHONS if version in SpecifierSet(requires_python))


def installed_dependencies() -> dict[str, tuple[str, str | None]]:
    """Name -> (version, Requires-Python) of every installed distribution that installing the project
    with all its extras brings in, dependencies of dependencies included."""
    meta = PROJECT["project"]
    wanted = [*meta["dependencies"], *(r for extra in meta["optional-dependencies"].values() for r in extra)]
    found: dict[str, tuple[str, str | None]] = {}
    while wanted:
        requirement = Requirement(wanted.pop())
        name = canonicalize_name(requirement.name)
        if name in found or (requirement.marker and not requirement.marker.evaluate({"extra": ""})):
            continue
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:  # an extra's package this environment lacks
            continue
        found[name] = (dist.version, dist.metadata["Requires-Python"])
        wanted += dist.requires or []
    return found


def test_requires_python_is_what_the_dependencies_need():
    """pip refuses a Python that requires-python excludes before it resolves anything; a Python that
    only a dependency excludes fails later, on that dependency (transformers 5 needs 3.11), and
    `uv lock` refuses the project. The installed releases are the ones pip chose for this Python."""
    floor = oldest_python(PROJECT["project"]["requires-python"])
    needs = {f"{name} {version}": oldest_python(requires)
             for name, (version, requires) in installed_dependencies().items() if requires}
    assert {"torch", "transformers", "accelerate", "datasets"} <= {need.split()[0] for need in needs}
    higher = {need: str(python) for need, python in needs.items() if python > floor}
    assert higher == {}, f"requires-python admits Python {floor}, older than these need: raise it, ruff's target too"
    assert Version(f"{sys.version_info.major}.{sys.version_info.minor}") >= floor
    assert PROJECT["tool"]["ruff"]["target-version"] == f"py{floor.major}{floor.minor}"
    assert f"Python {floor} or newer" in (ROOT / "README.md").read_text()


def test_pip_on_an_older_python_refuses_the_package_in_one_line(tmp_path):
    """The wheel that `pip install .` builds carries requires-python; pip asked to install it for
    the Python just below the floor says so in one line, offline."""
    if importlib.util.find_spec("setuptools") is None:
        pytest.skip("setuptools is not installed: the wheel is built without build isolation (offline)")
    source = tmp_path / "source"  # a copy: setuptools builds in the source tree (build/, *.egg-info)
    shutil.copytree(ROOT / "src", source / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    built = subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(tmp_path),
                            str(source)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    [wheel] = tmp_path.glob("*.whl")
    floor = oldest_python(PROJECT["project"]["requires-python"])
    older = f"{floor.major}.{floor.minor - 1}"
    proc = subprocess.run([*pip, "install", "--dry-run", "--no-deps", "--no-index", "--only-binary=:all:",
                           "--python-version", older, "--target", str(tmp_path / "target"), str(wheel)],
                          capture_output=True, text=True, timeout=300)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("ERROR")]
    assert proc.returncode == 1 and errors == [
        f"ERROR: Package '{canonicalize_name(PROJECT['project']['name'])}' requires a different Python: "
        f"{older}.0 not in '{PROJECT['project']['requires-python']}'"], proc.stderr[-3000:]
