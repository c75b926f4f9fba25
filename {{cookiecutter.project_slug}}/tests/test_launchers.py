"""scripts/node_launch.sh, the command of the Kubernetes and SkyPilot files: each file's command,
read out of it, runs as two nodes on this machine with the variables its controller sets on each
node (the first node's address 127.0.0.1, 1 CPU process per node, gloo) and trains exactly like
one torchrun of 2 processes; SIGTERM (an eviction) stops it after a checkpoint with exit code 143
and a restart resumes. No Kubernetes or SkyPilot here: their documented variables stand in."""

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import (
    ACCUM,
    LAUNCH_TIMEOUT_S,
    LONG,
    ROOT,
    SLUG,
    Run,
    flag_args,
    free_port,
    last_records,
    max_abs_diff,
    one_error_line,
    report,
    wait_for_step,
)

LAUNCH_FILES = [path for path in (ROOT / "k8s" / "trainjob.yaml", ROOT / "k8s" / "jobset.yaml",
                                  ROOT / "sky" / "train.yaml") if path.is_file()]
WORKSPACE = "/workspace/"  # where the Kubernetes files' image holds the project
NODES = 2


def documents(path: Path) -> dict[str, dict]:
    return {doc["kind"]: doc for doc in yaml.safe_load_all(path.read_text())}


def kubernetes_env(entries: list[dict], given: dict[str, str]) -> dict[str, str]:
    """A container's env as the kubelet sets it: `given` for the downward API's fields, Secrets left
    out (no W&B key here), `$(NAME)` replaced by an earlier entry's value."""
    env: dict[str, str] = {}
    for entry in entries:
        if "value" in entry:
            env[entry["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env[m[1]], entry["value"])
        elif "fieldRef" in entry["valueFrom"]:
            env[entry["name"]] = given[entry["name"]]
    return env


def node_launches(path: Path, out: Path) -> tuple[list[str], list[dict[str, str]]]:
    """The command that `path` runs on every node, and each node's environment from its file and
    its controller: node count 2, 1 process per node, the first node at 127.0.0.1 on a free port,
    OUTPUT_DIR (the mounted volume) at `out`, one thread per process (as the runs compared with)."""
    port = str(free_port())
    if path.name == "train.yaml":  # SkyPilot: `run` in a shell on every node
        task = yaml.safe_load(path.read_text())
        command = ["bash", "-c", f'{task["run"].strip()} "$@"', "run"]  # the flags, as if written into `run`
        nodes = [{**task["envs"], "SKYPILOT_NODE_RANK": str(rank), "SKYPILOT_NUM_NODES": str(NODES),
                  "SKYPILOT_NODE_IPS": "\n".join(["127.0.0.1"] * NODES), "SKYPILOT_NUM_GPUS_PER_NODE": "1",
                  "SKYPILOT_TASK_ID": "sky-test", "MASTER_PORT": port} for rank in range(NODES)]
    elif path.name == "trainjob.yaml":  # Kubeflow Trainer's torch runtime sets PET_*
        job = documents(path)["TrainJob"]
        trainer, name = job["spec"]["trainer"], job["metadata"]["name"]
        command = trainer["command"] + trainer.get("args", [])
        env = kubernetes_env(trainer["env"], {"RUN_ID": name})  # the JobSet the TrainJob makes has its name
        nodes = [{**env, "PET_NNODES": str(NODES), "PET_NODE_RANK": str(rank), "PET_MASTER_ADDR": "127.0.0.1",
                  "PET_MASTER_PORT": port, "PET_NPROC_PER_NODE": "1"} for rank in range(NODES)]
    else:  # JobSet: an Indexed Job's pods
        jobset = documents(path)["JobSet"]
        name = jobset["metadata"]["name"]
        [container] = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"]
        command = container["command"] + container.get("args", [])
        env = kubernetes_env(container["env"], {"JOBSET_NAME": name})
        # pod 0 of replicated job "node" under the JobSet's headless service; DNS would give its address
        assert env["MASTER_ADDR"] == f"{name}-node-0-0.{name}"
        nodes = [{**env, "JOB_COMPLETION_INDEX": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
                  "NNODES": str(NODES), "NPROC_PER_NODE": "1"} for rank in range(NODES)]
    command = [arg.replace(WORKSPACE, f"{ROOT}/", 1) if arg.startswith(WORKSPACE) else arg for arg in command]
    for node in nodes:
        node.update(OUTPUT_DIR=str(out), PYTHON=sys.executable, OMP_NUM_THREADS="1")
    return command, nodes


def start_nodes(path: Path, out: Path, base_env: dict, flags: dict) -> list[subprocess.Popen]:
    """Both nodes of `path`'s job, each in a session of its own (as each pod is), output in files."""
    command, nodes = node_launches(path, out)
    base = {k: v for k, v in base_env.items() if k != "MASTER_ADDR"}
    procs = []
    for rank, node in enumerate(nodes):
        logs = {stream: (out.parent / f"{out.name}.node{rank}.{stream}").open("a") for stream in ("stdout", "stderr")}
        procs.append(subprocess.Popen([*command, *flag_args(flags)], cwd=ROOT, env={**base, **node},
                                      stdout=logs["stdout"], stderr=logs["stderr"], start_new_session=True))
    return procs


def finish(procs: list[subprocess.Popen], out: Path) -> tuple[list[int], str]:
    """Wait for the nodes (killing them all if one hangs); their exit codes and output."""
    try:
        for proc in procs:
            proc.wait(timeout=LAUNCH_TIMEOUT_S)
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    output = "".join((out.parent / f"{out.name}.node{rank}.{stream}").read_text()
                     for rank in range(len(procs)) for stream in ("stdout", "stderr"))
    return [proc.returncode for proc in procs], output


def entry_of(path: Path) -> str:
    """The entry point that `path`'s job trains (its ENTRY)."""
    return node_launches(path, ROOT / "runs" / "unused")[1][0]["ENTRY"]


@pytest.mark.slow
@pytest.mark.parametrize("path", LAUNCH_FILES, ids=lambda p: p.name)
def test_a_launch_files_command_trains_two_nodes_like_one_torchrun(runs, path, tmp_path):
    entry = entry_of(path)
    one_torchrun = runs(entry, 2, **ACCUM)
    out = tmp_path / "two_nodes"
    codes, output = finish(start_nodes(path, out, runs.env, ACCUM), out)
    assert codes == [0, 0], output[-4000:]
    two_nodes = Run(0, output, "", out)
    assert [(r["world_size"], r["micro_steps"]) for r in last_records(two_nodes)] == [(2, 4)] * ACCUM["max_steps"]
    assert [r["loss"] for r in two_nodes.steps] == [r["loss"] for r in one_torchrun.steps]
    diff = max_abs_diff(two_nodes.params(), one_torchrun.params())
    report(f"{path.parent.name}/{path.name}, 2 nodes x 1 process on loopback vs one torchrun of 2 ({entry}): "
           f"max |param diff| {diff:.3g}")
    assert diff == 0.0


@pytest.mark.slow
def test_sigterm_checkpoints_exits_143_and_a_restart_resumes(env, tmp_path):
    """Kubernetes stops a pod with SIGTERM to its first process, the launcher: every process of the
    job stops after the same optimizer step with a checkpoint; the stopped node exits 143 (so that
    the JobSet restarts the job), the other 0; the restarted job resumes from the checkpoint."""
    path = LAUNCH_FILES[0]
    out = tmp_path / "evicted"
    procs = start_nodes(path, out, env, LONG)
    try:
        wait_for_step(out, procs[0], 2)
    finally:
        procs[0].send_signal(signal.SIGTERM)
    codes, output = finish(procs, out)
    assert codes == [143, 0], output[-4000:]
    assert "SIGTERM: every training process checkpoints after its next optimizer step" in output
    steps = [r["step"] for r in Run(0, "", "", out).steps]
    stopped = steps[-1]
    assert steps == list(range(1, stopped + 1)) and stopped < LONG["max_steps"]
    assert f"(step {stopped} of {LONG['max_steps']}), on preemption signal (SIGUSR1)" in output
    assert json.loads((out / "checkpoints" / f"step_{stopped}" / "state.json").read_text())["step"] == stopped
    assert not (out / "final_model").exists()

    codes, output = finish(start_nodes(path, out, env, LONG), out)
    assert codes == [0, 0], output[-4000:]
    assert f"resuming after step {stopped}" in output
    assert [r["step"] for r in last_records(Run(0, "", "", out))] == list(range(1, LONG["max_steps"] + 1))
    assert (out / "final_model" / "model.safetensors").is_file()


def dry_run(env: dict, **variables: str) -> subprocess.CompletedProcess:
    return subprocess.run(["scripts/node_launch.sh", "--max_steps", "3"], cwd=ROOT, capture_output=True, text=True,
                          env={**env, "DRY_RUN": "1", "PYTHON": "python3", **variables}, timeout=60)


TRAINJOB = {"PET_NNODES": "4", "PET_NODE_RANK": "2", "PET_MASTER_ADDR": "job-node-0-0.job", "PET_MASTER_PORT": "29400",
            "PET_NPROC_PER_NODE": "8", "RUN_ID": "job"}
JOBSET = {"JOB_COMPLETION_INDEX": "0", "NNODES": "2", "NPROC_PER_NODE": "4", "MASTER_ADDR": "js-node-0-0.js"}
SKYPILOT = {"SKYPILOT_NODE_RANK": "1", "SKYPILOT_NUM_NODES": "3", "SKYPILOT_NODE_IPS": "10.0.0.5\n10.0.0.6\n10.0.0.7",
            "SKYPILOT_NUM_GPUS_PER_NODE": "8", "SKYPILOT_TASK_ID": "sky-1"}

SKYPILOT_TORCHRUN = ("--nnodes 3 --nproc_per_node 8 --max-restarts 1 --rdzv_backend c10d --rdzv_endpoint "
                     "10.0.0.5:29500 --rdzv_id sky-1 --rdzv_conf is_host=0")


@pytest.mark.parametrize("variables,torchrun,said,output", [
    (TRAINJOB, "--nnodes 4 --nproc_per_node 8 --max-restarts 1 --rdzv_backend c10d --rdzv_endpoint "
               "job-node-0-0.job:29400 --rdzv_id job --rdzv_conf is_host=0",
     "node 2 of 4 (a TrainJob (Kubeflow Trainer's torch runtime)): 8 processes, rendezvous job-node-0-0.job:29400, "
     "run job, output runs/job", "runs/job"),
    (JOBSET, "--nnodes 2 --nproc_per_node 4 --max-restarts 1 --rdzv_backend c10d --rdzv_endpoint js-node-0-0.js:29500 "
             "--rdzv_id js-node-0-0.js --rdzv_conf is_host=1", "node 0 of 2 (k8s/jobset.yaml)", "runs/js-node-0-0.js"),
    (SKYPILOT, SKYPILOT_TORCHRUN, "node 1 of 3 (SkyPilot)", "runs/sky-1"),
    ({**JOBSET, "NNODES": "1:4", "MAX_RESTARTS": "3", "OUTPUT_DIR": "/output"},
     "--nnodes 1:4 --nproc_per_node 4 --max-restarts 3 ", "node 0 of 1:4", "/output"),
    ({**TRAINJOB, "NNODES": "2:4", "NPROC_PER_NODE": "2"}, "--nnodes 2:4 --nproc_per_node 2 ", "node 2 of 2:4",
     "runs/job"),
    ({**SKYPILOT, "SKYPILOT_NODE_IPS": "10.0.0.5 10.0.0.6 10.0.0.7"}, SKYPILOT_TORCHRUN, "rendezvous 10.0.0.5:29500,",
     "runs/sky-1"),
    ({**SKYPILOT, "SKYPILOT_NODE_IPS": "\n 10.0.0.5\n10.0.0.6\n"}, SKYPILOT_TORCHRUN, "rendezvous 10.0.0.5:29500,",
     "runs/sky-1"),
], ids=["trainjob", "jobset", "skypilot", "jobset-elastic", "trainjob-elastic", "skypilot-ips-on-one-line",
        "skypilot-ips-after-a-blank-line"])
def test_each_controllers_variables_make_one_torchrun_command(env, variables, torchrun, said, output):
    proc = dry_run(env, **variables)
    assert proc.returncode == 0, proc.stderr
    said_line, command = proc.stdout.splitlines()
    assert said in said_line
    assert f"python3 -m {SLUG}.torchrun {torchrun}" in command
    assert command.strip().endswith(f"--config configs/train.yaml --output_dir {output} --resume_from_checkpoint auto "
                                    "--max_steps 3")


# (variables, the line's start, whether that is the whole line): node_launch.sh's checks, each message's whole
# line once (flags.sh's: test_scripts.py)
@pytest.mark.parametrize("variables,expected,exact", [
    ({}, "error: no node rank: PET_NODE_RANK (TrainJob), JOB_COMPLETION_INDEX (JobSet) or SKYPILOT_NODE_RANK "
         "(SkyPilot) is set; on this machine use scripts/train_local.sh", True),
    ({**TRAINJOB, "PET_MASTER_ADDR": ""}, "error: PET_MASTER_ADDR is not set; a TrainJob (Kubeflow Trainer's torch "
                                          "runtime) sets it on every node (scripts/node_launch.sh runs there)", True),
    ({k: v for k, v in JOBSET.items() if k != "MASTER_ADDR"}, "error: MASTER_ADDR is not set; k8s/jobset.yaml", False),
    ({k: v for k, v in SKYPILOT.items() if k != "SKYPILOT_NODE_IPS"}, "error: SKYPILOT_NODE_IPS is not set; SkyPilot",
     False),
    ({**JOBSET, "NNODES": "4:2"}, "error: NNODES=4:2 is not a node count N or a range MIN:MAX of at least 1 (e.g. 2 "
                                  "or 1:4)", True),
    ({**JOBSET, "NNODES": "0"}, "error: NNODES=0 is not a node count N", False),
    ({**JOBSET, "JOB_COMPLETION_INDEX": "x"}, "error: JOB_COMPLETION_INDEX=x is not a whole number", False),
    ({**TRAINJOB, "PET_NPROC_PER_NODE": "auto"}, "error: PET_NPROC_PER_NODE=auto is not a whole number of at least 1; "
                                                 "NPROC_PER_NODE overrides it", True),
    ({**SKYPILOT, "SKYPILOT_NUM_GPUS_PER_NODE": "0"}, "error: SKYPILOT_NUM_GPUS_PER_NODE=0 is not a whole number",
     False),
    ({**TRAINJOB, "PET_MASTER_PORT": "abc"}, "error: PET_MASTER_PORT=abc is not a port", False),
    ({**SKYPILOT, "SKYPILOT_NODE_IPS": " \n"}, "error: SKYPILOT_NODE_IPS is not set; SkyPilot", False),
    ({**JOBSET, "JOB_COMPLETION_INDEX": "3"}, "error: JOB_COMPLETION_INDEX=3 is not a node rank of NNODES=2 (0 to 1): "
                                              "the job has more nodes than that; make NNODES and the node count of "
                                              "k8s/jobset.yaml agree", True),
    ({**TRAINJOB, "PET_NODE_RANK": "4"}, "error: PET_NODE_RANK=4 is not a node rank of PET_NNODES=4 (0 to 3)", False),
    ({**SKYPILOT, "NNODES": "1:2", "SKYPILOT_NODE_RANK": "2"}, "error: SKYPILOT_NODE_RANK=2 is not a node rank of "
                                                                "NNODES=1:2 (0 to 1)", False),
    ({**SKYPILOT, "MAX_RESTARTS": "-1"}, "error: MAX_RESTARTS=-1 is not a whole number", False),
    ({**JOBSET, "CONFIG": "configs/trian.yaml"}, "error: CONFIG=configs/trian.yaml names configs/trian.yaml", False),
], ids=["no-controller", "trainjob-no-master", "jobset-no-master", "skypilot-no-ips", "range-backwards",
        "no-nodes", "rank-not-a-number", "nproc-auto", "no-gpus", "trainjob-port", "skypilot-blank-ips",
        "jobset-rank-beyond", "trainjob-rank-beyond", "skypilot-rank-beyond-the-range", "restarts-negative",
        "config-missing"])
def test_a_missing_or_bad_variable_is_one_line(env, variables, expected, exact):
    proc = dry_run({k: v for k, v in env.items() if k != "MASTER_ADDR"}, **variables)
    one_error_line(proc, expected, exact=exact, alone=True)
