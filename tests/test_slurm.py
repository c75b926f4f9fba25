"""The generated sbatch scripts on a real SLURM cluster: slurmctld and two slurmd (node1, node2 on
127.0.0.1) with munge, started by this module (tests/slurm/slurm_up.sh) and stopped by PID.

Each script trains on both nodes (1 CPU process per node: world size 2); then a job gets the
preemption signal SLURM sends before a time limit, checkpoints, is requeued, resumes and finishes;
and so does one task of a job array, alone, and one row of a sweep (sweep.sbatch), whose rows train
as the plain runs with their flags do.
Needs root (daemons, apt-get, /etc/hosts); skipped, saying why, where the machine cannot run it.
"""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import report

SLURM_DIR = Path(__file__).parent / "slurm"
# the nodes have 2 CPUs each: 1 per GPU asks for both (#SBATCH --cpus-per-task=2)
ANSWERS = {"num_nodes": "2", "gpus_per_node": "2", "cpus_per_gpu": "1", "slurm_partition": "debug",
           "slurm_time": "00:30:00", "extras": "sweeps"}  # the core's scripts, and sweep.sbatch
TRAIN = ["--report_to", "none", "--max_seq_len", "48", "--micro_batch_size", "2", "--global_batch_size", "8",
         "--collective_timeout_s", "120"]
JOB_TIMEOUT_S = 300


def run(cmd: list[str], env: dict, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, **kwargs)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.skip("the local SLURM cluster needs root (it starts daemons and may apt-get install slurm)")
    if not shutil.which("slurmctld") and not shutil.which("apt-get"):
        pytest.skip("slurmctld is not installed and there is no apt-get to install it")
    base = tmp_path_factory.mktemp("slurm")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "WANDB_"))}
    up = subprocess.run(["bash", str(SLURM_DIR / "slurm_up.sh"), str(base)], env=env, capture_output=True,
                        text=True, timeout=600)
    try:
        assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
        yield {**env, "SLURM_CONF": str(base / "etc" / "slurm.conf")}
    finally:
        subprocess.run(["bash", str(SLURM_DIR / "slurm_down.sh"), str(base)], timeout=60)


@pytest.fixture(scope="module")
def project(baked, slurm):
    return baked(**ANSWERS)


# Imported by every Python process of a job (on PYTHONPATH): each training process writes what it
# was given for its threads.
RECORD_RANK_ENV = """import json, os
if "LOCAL_RANK" in os.environ:
    names = ("RANK", "SLURM_CPUS_PER_TASK", "SRUN_CPUS_PER_TASK", "OMP_NUM_THREADS")
    with open(os.path.join(os.environ["RANK_ENV_DIR"], f"{os.getpid()}.json"), "w") as f:
        json.dump({name: os.environ.get(name) for name in names}, f)
"""


def job_env(slurm: dict, out: Path) -> dict:
    """What a user's shell would hold at `sbatch`: the venv on PATH, offline, loopback, CPU; and
    a sitecustomize that records each training process's CPU settings in `out`.ranks/."""
    site = out.parent / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(RECORD_RANK_ENV)
    Path(f"{out}.ranks").mkdir(exist_ok=True)
    return {**slurm, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{slurm['PATH']}",
            "NPROC_PER_NODE": "1", "OUTPUT_DIR": str(out), "PYTHONPATH": str(site), "RANK_ENV_DIR": f"{out}.ranks",
            "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_DATASETS_CACHE": str(out.parent / "hf"),
            "WANDB_MODE": "offline", "GLOO_SOCKET_IFNAME": "lo",
            "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}


def rank_env(out: Path) -> list[dict]:
    return sorted((json.loads(p.read_text()) for p in Path(f"{out}.ranks").glob("*.json")), key=lambda e: e["RANK"])


def job_state(job: str, env: dict) -> dict:
    shown = run(["scontrol", "show", "job", "-o", job], env).stdout.split()
    return dict(item.split("=", 1) for item in shown if "=" in item)


def wait_for(job: str, env: dict, states: tuple[str, ...], deadline: float) -> dict:
    """Poll the job until it is in one of `states` (faster than `sbatch --wait`, which backs off)."""
    while (state := job_state(job, env))["JobState"] not in states:
        assert time.monotonic() < deadline, state
        time.sleep(0.2)
    return state


def steps_of(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [r for r in map(json.loads, lines) if "loss" in r]


FINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")
SCRIPTS = [("torchrun", {}), ("torchrun", {"ENTRY": "trainer"}), ("accelerate", {}), ("deepspeed", {})]


@pytest.mark.slow
@pytest.mark.parametrize("script,extra_env", SCRIPTS, ids=lambda v: v if isinstance(v, str) else v.get("ENTRY", ""))
def test_sbatch_script_trains_on_two_nodes(project, slurm, tmp_path, script, extra_env):
    out = tmp_path / "run"
    env = {**job_env(slurm, out), **extra_env}
    start = time.monotonic()
    submitted = run(["sbatch", "--parsable", f"--output={tmp_path}/job-%j.out", f"scripts/slurm/{script}.sbatch",
                     "--max_steps", "4", *TRAIN], env, cwd=project)
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.strip().split(";")[0]
    state = wait_for(job, slurm, FINAL, start + JOB_TIMEOUT_S)
    wall = time.monotonic() - start
    log = "".join(p.read_text() for p in tmp_path.glob("job-*.out"))
    assert state["JobState"] == "COMPLETED" and state["ExitCode"] == "0:0", f"{state}\n{log[-4000:]}"
    assert state["NodeList"] == "node[1-2]" and state["NumNodes"] == "2"
    assert [(r["step"], r["world_size"]) for r in steps_of(out)] == [(1, 2), (2, 2), (3, 2), (4, 2)]
    assert (out / "final_model" / "model.safetensors").is_file()
    # each node's 2 CPUs (--cpus-per-task), for srun (Slurm >= 22.05) and for its one process's threads
    assert rank_env(out) == [{"RANK": str(rank), "SLURM_CPUS_PER_TASK": "2", "SRUN_CPUS_PER_TASK": "2",
                              "OMP_NUM_THREADS": "2"} for rank in (0, 1)], log[-3000:]
    assert "cpus: 2 per node (SRUN_CPUS_PER_TASK=2), OMP_NUM_THREADS=2 per process; max restarts 1" in log
    report(f"slurm {script}.sbatch {extra_env or ''}: job {job}, exit code {state['ExitCode']}, "
           f"nodes {state['NodeList']}, {wall:.1f} s from sbatch to exit")


@pytest.mark.slow
def test_preempted_job_checkpoints_requeues_and_resumes(project, slurm, tmp_path):
    out = tmp_path / "run"
    env = job_env(slurm, out)
    log_path = tmp_path / "job.out"
    submitted = run(["sbatch", "--parsable", f"--output={log_path}", "scripts/slurm/torchrun.sbatch",
                     "--max_steps", "200", *TRAIN], env, cwd=project)
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.strip().split(";")[0]
    timeline = {"submitted": time.monotonic()}
    try:
        deadline = timeline["submitted"] + JOB_TIMEOUT_S
        while len(steps_of(out)) < 3:
            assert time.monotonic() < deadline, log_path.read_text() if log_path.exists() else "no log"
            time.sleep(0.1)
        timeline["training"] = time.monotonic()
        # what `#SBATCH --signal=B:USR1@120` makes SLURM do 120 s before the time limit
        assert run(["scancel", "--signal=USR1", "--batch", job], env).returncode == 0
        timeline["signalled"] = time.monotonic()
        state = wait_for(job, slurm, ("PENDING", *FINAL), deadline)
        timeline["requeued"] = time.monotonic()
        assert state["JobState"] == "PENDING" and state["Restarts"] == "1", state
        stopped = steps_of(out)[-1]["step"]
        assert (out / "checkpoints" / f"step_{stopped}" / "state.json").is_file()
        # a requeued job waits cred_expire (10 s on this cluster) before it may start again
        wait_for(job, slurm, ("RUNNING", *FINAL), deadline)
        timeline["restarted"] = time.monotonic()
        state = wait_for(job, slurm, FINAL, deadline)
        timeline["finished"] = time.monotonic()
    finally:
        run(["scancel", job], env)
    log = log_path.read_text()
    assert state["JobState"] == "COMPLETED" and state["ExitCode"] == "0:0", log[-4000:]
    assert "preemption signal: every training process checkpoints at its next optimizer step" in log
    assert "on preemption signal (SIGUSR1); continue with --resume_from_checkpoint auto" in log
    assert f"requeueing job {job}" in log
    assert f"resuming after step {stopped}" in log
    assert [r["step"] for r in steps_of(out)] == list(range(1, 201))  # each step once: no work lost or redone
    assert (out / "final_model" / "model.safetensors").is_file()
    t0 = timeline["submitted"]
    report(f"slurm preemption, job {job}: " + ", ".join(f"{k} +{v - t0:.1f} s" for k, v in timeline.items())
           + f"; stopped after step {stopped} of 200, checkpoint step_{stopped}, restarts {state['Restarts']}")


@pytest.mark.slow
def test_preempted_array_task_alone_checkpoints_requeues_and_resumes(project, slurm, tmp_path, request):
    """`sbatch --array=0-2`: three tasks of one node each, all running at once (a CPU and a fake GPU
    each). The preemption signal goes to the task whose own job id is the array's, the one that
    `scancel <job id>` and `scontrol requeue <job id>` would take for the whole array: that task
    alone checkpoints, is requeued and resumes; the other two train once, to the end."""
    env = job_env(slurm, tmp_path / "run")
    del env["OUTPUT_DIR"]  # each task's own default folder, runs/<array job id>_<index>
    steps = 150  # 6-10 s of training: every task is still at it when the signal comes
    submitted = run(["sbatch", "--parsable", "--array=0-2", "--nodes=1", "--cpus-per-task=1", "--gpus-per-node=1",
                     f"--output={tmp_path}/task-%a.out", "scripts/slurm/torchrun.sbatch", "--max_steps", str(steps),
                     *TRAIN], env, cwd=project)
    assert submitted.returncode == 0, submitted.stderr
    array = submitted.stdout.strip().split(";")[0]
    tasks = [f"{array}_{index}" for index in range(3)]
    outs = {task: project / "runs" / task for task in tasks}
    request.addfinalizer(lambda: [shutil.rmtree(out, ignore_errors=True) for out in outs.values()])
    log_paths = {task: tmp_path / f"task-{index}.out" for index, task in enumerate(tasks)}
    timeline = {"submitted": time.monotonic()}
    deadline = timeline["submitted"] + JOB_TIMEOUT_S
    try:
        states = {task: wait_for(task, slurm, ("RUNNING", *FINAL), deadline) for task in tasks}
        [target] = [task for task in tasks if states[task]["JobId"] == array]
        while len(steps_of(outs[target])) < 2:
            assert time.monotonic() < deadline, log_paths[target].read_text()
            time.sleep(0.1)
        timeline["training"] = time.monotonic()
        running = {task: job_state(task, slurm)["JobState"] for task in tasks}
        assert set(running.values()) == {"RUNNING"}, running  # the signal could reach every task
        assert run(["scancel", "--signal=USR1", "--batch", target], env).returncode == 0
        state = wait_for(target, slurm, ("PENDING", *FINAL), deadline)
        timeline["requeued"] = time.monotonic()
        assert state["JobState"] == "PENDING" and state["Restarts"] == "1", state
        stopped = steps_of(outs[target])[-1]["step"]
        wait_for(target, slurm, ("RUNNING", *FINAL), deadline)
        timeline["restarted"] = time.monotonic()
        states = {task: wait_for(task, slurm, FINAL, deadline) for task in tasks}
        timeline["finished"] = time.monotonic()
    finally:
        run(["scancel", array], env)
    logs = {task: path.read_text() for task, path in log_paths.items()}
    for task in tasks:
        assert states[task]["JobState"] == "COMPLETED" and states[task]["ExitCode"] == "0:0", logs[task][-4000:]
        assert states[task]["Restarts"] == ("1" if task == target else "0"), (task, states[task])
        assert [r["step"] for r in steps_of(outs[task])] == list(range(1, steps + 1)), logs[task][-4000:]
        assert (outs[task] / "final_model" / "model.safetensors").is_file()
        assert logs[task].startswith(f"job {task} (restart 0): 1 node x 1 process"), logs[task][:300]
        preempted = (f"job {task} got the preemption signal" in logs[task], f"requeueing job {task}:" in logs[task])
        assert preempted == ((True, True) if task == target else (False, False)), logs[task][-4000:]
    assert f"resuming after step {stopped}" in logs[target]
    assert (outs[target] / "checkpoints" / f"step_{stopped}" / "state.json").is_file()
    t0 = timeline["submitted"]
    report(f"slurm array {array}_[0-2], task {target} preempted: " + ", ".join(
        f"{k} +{v - t0:.1f} s" for k, v in timeline.items()) + f"; stopped after step {stopped} of {steps}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_a_sweep_trains_each_row_as_a_plain_run_and_a_preempted_row_resumes_exactly(project, slurm, tmp_path):
    """`sbatch --array=0-2 scripts/slurm/sweep.sbatch FILE`: task i trains row i into the row's folder,
    the three rows sharing one prepared dataset. The long row gets the preemption signal: it alone
    checkpoints, is requeued and resumes. Each row's metrics.jsonl then equals that of the plain run
    (torchrun, one process, the row's flags), bitwise: the resumed row too."""
    rows = [{"learning_rate": 0.002, "max_steps": 6}, {"learning_rate": 0.004, "max_steps": 6},
            {"learning_rate": 0.008, "max_steps": 100}]
    sweep = tmp_path / "lrs.yaml"
    sweep.write_text(f"output_root: {tmp_path}/sweep\nrows:\n" + "".join(
        f"  - {{learning_rate: {row['learning_rate']}, max_steps: {row['max_steps']}}}\n" for row in rows))
    outs = [tmp_path / "sweep" / f"learning_rate={row['learning_rate']},max_steps={row['max_steps']}" for row in rows]
    env = job_env(slurm, tmp_path / "run")
    del env["OUTPUT_DIR"]  # the row names its folder
    submitted = run(["sbatch", "--parsable", "--array=0-2", "--nodes=1", "--cpus-per-task=1", "--gpus-per-node=1",
                     f"--output={tmp_path}/task-%a.out", "scripts/slurm/sweep.sbatch", str(sweep), *TRAIN], env,
                    cwd=project)
    assert submitted.returncode == 0, submitted.stderr
    array = submitted.stdout.strip().split(";")[0]
    tasks = [f"{array}_{index}" for index in range(3)]
    long_task, long_out = tasks[2], outs[2]
    timeline = {"submitted": time.monotonic()}
    deadline = timeline["submitted"] + JOB_TIMEOUT_S
    # meanwhile, each row's plain run: torchrun on one process (as each task runs), the row's flags
    plain_env = {**env, "PYTHONPATH": "src", "MASTER_ADDR": "127.0.0.1", "OMP_NUM_THREADS": "1"}  # as each task
    plain = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1",
                               "--master_port", str(free_port()), "-m", f"{project.name}.train_pytorch", *TRAIN,
                               "--learning_rate", str(row["learning_rate"]), "--max_steps", str(row["max_steps"]),
                               "--output_dir", str(tmp_path / f"plain{index}")], cwd=project, env=plain_env,
                              stdout=subprocess.DEVNULL, stderr=(tmp_path / f"plain{index}.err").open("w"))
             for index, row in enumerate(rows)]
    try:
        while len(steps_of(long_out)) < 2:
            assert time.monotonic() < deadline, (tmp_path / "task-2.out").read_text()
            time.sleep(0.1)
        timeline["training"] = time.monotonic()
        assert run(["scancel", "--signal=USR1", "--batch", long_task], env).returncode == 0
        state = wait_for(long_task, slurm, ("PENDING", *FINAL), deadline)
        timeline["requeued"] = time.monotonic()
        assert state["JobState"] == "PENDING" and state["Restarts"] == "1", state
        stopped = steps_of(long_out)[-1]["step"]
        states = {task: wait_for(task, slurm, FINAL, deadline) for task in tasks}
        timeline["finished"] = time.monotonic()
    finally:
        run(["scancel", array], env)
        codes = [finished(proc, deadline) for proc in plain]
    assert codes == [0, 0, 0], [(tmp_path / f"plain{index}.err").read_text()[-2000:] for index in range(3)]
    logs = [(tmp_path / f"task-{index}.out").read_text() for index in range(3)]
    for task, log in zip(tasks, logs, strict=True):
        assert states[task]["JobState"] == "COMPLETED" and states[task]["ExitCode"] == "0:0", log[-4000:]
        assert states[task]["Restarts"] == ("1" if task == long_task else "0"), (task, states[task])
    assert f"requeueing job {long_task}: it resumes from {long_out}/checkpoints" in logs[2]
    assert f"resuming after step {stopped}" in logs[2]
    prepared = [re.findall(r"^data: [\d,]+ training examples from (\S+)$", log, re.M) for log in logs]
    assert len({folder for folders in prepared for folder in folders}) == 1, prepared  # one for every row

    for index, out in enumerate(outs):
        swept, straight = (strip_timing(path / "metrics.jsonl") for path in (out, tmp_path / f"plain{index}"))
        assert [r["step"] for r in swept if "loss" in r] == list(range(1, rows[index]["max_steps"] + 1))
        assert swept == straight, index
    t0 = timeline["submitted"]
    report(f"slurm sweep {array}_[0-2], row 2 preempted after step {stopped} of 100, every row equal to its plain "
           "run: " + ", ".join(f"{k} +{v - t0:.1f} s" for k, v in timeline.items()))


def finished(proc: subprocess.Popen, deadline: float) -> int | None:
    """The exit code of `proc` by `deadline`; else None, and it is killed."""
    try:
        return proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return None


def strip_timing(path: Path) -> list[dict]:
    """metrics.jsonl but the seconds each record took (the machine's, not the training's)."""
    return [{k: v for k, v in json.loads(line).items() if k != "elapsed_s"} for line in path.read_text().splitlines()]
