"""The generated Containerfile built for real, without a registry, and a training run inside it.

The image's base stands in for an NGC PyTorch image: a Debian bookworm root file system made here
by mmdebstrap, with a venv (first on PATH) holding this environment's CPU torch under a pre-release
version such as NGC's (`2.13.0a0+standin.cpu`: its metadata and `torch.__version__` relabelled).
buildah builds the default bake's Containerfile on it (`--build-arg BASE=`); pip reaches no index:
the base's pip reads a folder of wheels (`pip wheel` here, pinned to this environment's versions)
mounted for the build. Then two processes train inside the image (scripts/train_local.sh, as the
user the image runs as, the caches on a folder mounted at /cache, loopback) and the same run on
this machine outside it: the same metrics.jsonl (but its clock) and the same final weights, byte
for byte. Everything lies in one temporary folder (buildah's storage included) and is removed.

Not part of `make test` (marker `container`, left out by addopts): `.ci/run` runs it as its own
step, after installing buildah and mmdebstrap. Skipped, saying why, where buildah cannot run.
"""

import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
from conftest import bake_cli, report
from packaging.version import Version

pytestmark = [pytest.mark.container, pytest.mark.timeout(5400)]

# this machine's cgroups (v1 and v2 both mounted) make crun refuse to start a container: buildah's
# chroot isolation needs no runtime (it shares the host's network: the runs use loopback only)
ISOLATION = "--isolation=chroot"
SUITE = "bookworm"
MIRROR = "http://deb.debian.org/debian"
BASE = "localhost/standin-pytorch"
IMAGE = "localhost/gacc-train-test"
TRAIN = ["--report_to", "none", "--max_seq_len", "48", "--micro_batch_size", "2", "--global_batch_size", "8",
         "--max_steps", "4"]
RUN_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "offline", "GLOO_SOCKET_IFNAME": "lo",
           "TOKENIZERS_PARALLELISM": "false", "NPROC_PER_NODE": "2"}
CLOCK = ("elapsed_s",)

# Run inside the base: the installed torch relabelled with a version no index has, as NGC's are.
RELABEL = """import importlib.metadata as m, pathlib, re, sys
new = sys.argv[1]
info = pathlib.Path(m.distribution("torch")._path)
meta = info / "METADATA"
meta.write_text(re.sub(r"^Version: .*$", "Version: " + new, meta.read_text(), count=1, flags=re.M))
renamed = info.with_name(f"torch-{new}.dist-info")
record = info / "RECORD"
record.write_text(record.read_text().replace(info.name + "/", renamed.name + "/"))
info.rename(renamed)
version = info.parent / "torch" / "version.py"
version.write_text(re.sub(r"^__version__ = .*$", f"__version__ = {new!r}", version.read_text(), flags=re.M))
"""


def run(cmd: list, timeout: int, **kwargs) -> subprocess.CompletedProcess:
    """A command in its own process group, killed whole at its timeout (the tests fail then)."""
    proc = subprocess.Popen([str(c) for c in cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, **kwargs)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{' '.join(map(str, cmd))} ran past {timeout} s:\n{out[-4000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, "")


def ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, f"{' '.join(proc.args)} exited {proc.returncode}:\n{proc.stdout[-6000:]}"
    return proc.stdout


class Buildah:
    """buildah with its storage in `root` (nothing of it outside the test's folder)."""

    def __init__(self, root: Path):
        self.args = ["buildah", "--root", root / "storage", "--runroot", root / "runroot",
                     "--storage-driver", "overlay"]

    def __call__(self, *args, timeout: int = 600, **kwargs) -> subprocess.CompletedProcess:
        return run([*self.args, *args], timeout, **kwargs)


def runnable(buildah: Buildah) -> str:
    """Why buildah cannot build and run here, or ''."""
    if os.geteuid() != 0:
        return "buildah and mmdebstrap run as root here (storage, chroot)"
    missing = [name for name in ("buildah", "mmdebstrap") if not shutil.which(name)]
    if missing:
        return f"{' and '.join(missing)} not installed (apt-get install buildah mmdebstrap, as .ci/run does)"
    probe = buildah("from", "scratch", timeout=60)
    if probe.returncode != 0:
        return f"buildah cannot make a container here: {probe.stdout.strip()[-300:]}"
    buildah("rm", probe.stdout.strip(), timeout=60)
    return ""


@functools.cache
def freeze() -> tuple[str, ...]:
    """This environment's packages, `name==version` each."""
    listed = ok(run([sys.executable, "-m", "pip", "freeze", "--exclude-editable"], 120)).splitlines()
    return tuple(line for line in listed if "==" in line)


def torch_version() -> str:
    return next(line.split("==", 1)[1] for line in freeze() if line.lower().startswith("torch=="))


def requirements(project: Path) -> list[str]:
    """What the Containerfile installs: pyproject's dependencies and its default EXTRAS' groups."""
    extras = re.search(r"^ARG EXTRAS=(.*)$", (project / "Containerfile").read_text(), re.M).group(1)
    meta = tomllib.loads((project / "pyproject.toml").read_text())["project"]
    return meta["dependencies"] + [r for e in extras.split(",") if e for r in meta["optional-dependencies"][e]]


def wheels(project: Path, folder: Path) -> None:
    """Wheels of every dependency (and the build's setuptools) at this environment's versions, this
    CPU torch among them: the image's packages are those the run outside uses."""
    (folder.parent / "constraints.txt").write_text("\n".join(freeze()) + "\n")
    ok(run([sys.executable, "-m", "pip", "wheel", "--quiet", "--wheel-dir", folder, "-c",
            folder.parent / "constraints.txt", *requirements(project), f"torch=={torch_version()}",
            "setuptools>=69", "wheel"], 1800))


def root_file_system(rootfs: Path) -> None:
    """Debian's minimal root file system with python3 and its venv module, as a tar file."""
    ok(run(["mmdebstrap", "--variant=minbase", "--include=python3,python3-venv", SUITE, rootfs, MIRROR], 1800))


def base_image(buildah: Buildah, rootfs: Path, wheel_dir: Path, version: str) -> None:
    """The root file system and a venv with this CPU torch relabelled `version`, its pip set to read
    only the wheels mounted at /wheels; committed as BASE."""
    ctr = ok(buildah("from", "scratch")).strip()
    ok(buildah("add", ctr, rootfs, "/"))
    inside = [ISOLATION, "-v", f"{wheel_dir}:/wheels:ro", ctr, "--"]
    ok(buildah("run", *inside, "python3", "-m", "venv", "/opt/venv"))
    ok(buildah("run", *inside, "/opt/venv/bin/python", "-m", "pip", "install", "--quiet", "--no-index",
               "--find-links", "/wheels", f"torch=={torch_version()}", timeout=1200))
    ok(buildah("run", *inside, "/opt/venv/bin/python", "-c", RELABEL, version))
    ok(buildah("config", "--env", "PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
               "--env", "PIP_NO_INDEX=1", "--env", "PIP_FIND_LINKS=/wheels", ctr))
    ok(buildah("commit", "--quiet", "--rm", ctr, BASE))


def steps(out: Path) -> list[dict]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in CLOCK} for r in records]


def test_the_containerfile_builds_and_trains_as_outside(tmp_path):
    buildah = Buildah(tmp_path)
    if why := runnable(buildah):
        pytest.skip(why)
    try:
        bake = bake_cli(tmp_path)
        assert bake.returncode == 0, bake.stderr
        project = tmp_path / "gacc_train"
        version = f"{Version(torch_version()).base_version}a0+standin.cpu"
        wheel_dir = tmp_path / "wheels"
        times, begun = {}, time.monotonic()
        start = time.monotonic()
        wheels(project, wheel_dir)
        times["wheels"] = time.monotonic() - start
        start = time.monotonic()
        root_file_system(tmp_path / "rootfs.tar")
        times["rootfs"] = time.monotonic() - start
        start = time.monotonic()
        base_image(buildah, tmp_path / "rootfs.tar", wheel_dir, version)
        times["base"] = time.monotonic() - start
        start = time.monotonic()
        # --format docker: an OCI image has no SHELL (buildah keeps it, and says so, for docker's)
        ok(buildah("bud", ISOLATION, "--pull=never", "--format", "docker", "-v", f"{wheel_dir}:/wheels:ro",
                   "--build-arg", f"BASE={BASE}", "-f", "Containerfile", "-t", IMAGE, ".", timeout=2400, cwd=project))
        times["build"] = time.monotonic() - start

        ctr = ok(buildah("from", "--pull=never", IMAGE)).strip()
        shown = ok(buildah("run", ISOLATION, ctr, "--", "python", "-c", "import importlib.metadata as m, torch, "
                           "glob; print(m.version('torch'), torch.__version__, len(glob.glob('/opt/venv/lib/*/site-"
                           "packages/torch-*.dist-info')))"))
        assert shown.split() == [version, version, "1"], shown  # the image's torch, as it was, and no other

        inside, cache = tmp_path / "inside", tmp_path / "cache"
        for folder, mode in ((inside, 0o777), (cache, 0o1777)):
            folder.mkdir()
            folder.chmod(mode)
        env = [f"--env={k}={v}" for k, v in RUN_ENV.items()]
        start = time.monotonic()
        ok(buildah("run", ISOLATION, "-v", f"{inside}:/out", "-v", f"{cache}:/cache", *env, ctr, "--",
                   "scripts/train_local.sh", *TRAIN, "--output_dir", "/out/run"))
        times["inside"] = time.monotonic() - start
        start = time.monotonic()
        ok(run(["scripts/train_local.sh", *TRAIN, "--output_dir", tmp_path / "outside"], 600, cwd=project,
               env={**os.environ, **RUN_ENV, "PYTHON": sys.executable}))
        times["outside"] = time.monotonic() - start

        assert (inside / "run" / "metrics.jsonl").stat().st_uid != 0  # written by the image's own user
        assert [p.name for p in (cache / "data").iterdir()]  # the prepared data on the mounted /cache
        assert [r["step"] for r in steps(inside / "run") if "loss" in r] == [1, 2, 3, 4]
        assert steps(inside / "run") == steps(tmp_path / "outside")
        weights = "final_model/model.safetensors"
        assert (inside / "run" / weights).read_bytes() == (tmp_path / "outside" / weights).read_bytes()
        report(f"container: wheels {times['wheels']:.0f} s, mmdebstrap {times['rootfs']:.0f} s, base image (torch "
               f"{version}) {times['base']:.0f} s, buildah bud {times['build']:.0f} s; 2-process run inside "
               f"{times['inside']:.0f} s, outside {times['outside']:.0f} s: metrics.jsonl and weights bitwise equal; "
               f"{time.monotonic() - begun:.0f} s in all, before the clean-up")
    finally:
        buildah("rm", "--all", timeout=120)  # unmounted; the images go with the storage (rmi takes minutes)
        for folder in ("storage", "runroot", "wheels"):  # gigabytes, which pytest would keep
            shutil.rmtree(tmp_path / folder, ignore_errors=True)
        (tmp_path / "rootfs.tar").unlink(missing_ok=True)
