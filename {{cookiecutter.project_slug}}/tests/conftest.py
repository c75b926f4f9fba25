"""Shared test helpers: run an entry point for real (1 process, or torchrun on CPU with gloo)
and cache the runs, so tests that need the same run share it (also across pytest-xdist workers;
the cached runs fork from a process that has the entry point imported: helpers/fork_launcher.py).

Everything stays on loopback (127.0.0.1, GLOO_SOCKET_IFNAME=lo), offline (HF_HUB_OFFLINE=1,
WANDB_MODE=offline in a temporary WANDB_DIR), and every launch has a timeout.

The runs use whatever the entry points pick: gloo on CPU, nccl where there are GPUs (a test that
needs more processes than this machine has GPUs is skipped, saying so). `TEST_MIXED_PRECISION=bf16`
runs every launch in bf16 and widens the tolerances to `TOLERANCES["bf16"]`.
"""

import contextlib
import fcntl
import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from {{ cookiecutter.project_slug }}.distributed import free_port  # noqa: F401 (the tests' ports, from here)

from helpers.fork_launcher import ForkLauncher

ROOT = Path(__file__).resolve().parents[1]
SLUG = "{{ cookiecutter.project_slug }}"
# The entry points this project was generated with, and the task its config trains by default.
ENTRIES = [e for e in ("pytorch", "accelerate", "trainer") if (ROOT / "src" / SLUG / f"train_{e}.py").exists()]
TASK = yaml.safe_load((ROOT / "configs" / "train.yaml").read_text())["task"]
LAUNCH_TIMEOUT_S = 240
MIXED_PRECISION = os.environ.get("TEST_MIXED_PRECISION", "no")
GPUS = torch.cuda.device_count()
# The tokenised data, prepared once per data and settings and shared by every run of the suite
# (kept between sessions: a changed file or setting is prepared anew).
DATA_CACHE = ROOT / ".pytest_cache" / "data_cache"
# Small, fast, exact: fp32 unless asked, no dropout, no warmup, no W&B unless a test asks for it.
FAST = {"report_to": "none", "warmup_steps": "0", "max_seq_len": "48", "mixed_precision": MIXED_PRECISION,
        "data_cache_dir": DATA_CACHE}


# The runs several modules share (RunCache launches each once): 8 optimizer steps at global batch
# 16, 2 of warmup then a cosine decay, so the schedule shows in every logged lr; 0.05 MiB DDP
# buckets, so the tiny model has several and sync counts mean something.
GLOBAL_BATCH = 16
MATRIX = {"global_batch_size": GLOBAL_BATCH, "max_steps": 8, "warmup_steps": 2, "lr_scheduler_type": "cosine",
          "ddp_bucket_cap_mb": 0.05}
ACCUM = {"micro_batch_size": 2, **MATRIX}  # on 2 processes: accumulation 4


def cell(runs, entry: str, nproc: int, accum: int, **flags):
    """The parity matrix's run of `nproc` processes x `accum` micro-steps (RunCache: once per session)."""
    return runs(entry, nproc, micro_batch_size=GLOBAL_BATCH // (nproc * accum), **MATRIX, **flags)


def short_windows(dataset: Path) -> dict:
    """2 epochs of `small_dataset` in windows of 16, 16 and 5 examples, plain SGD: parameters move
    by exactly lr x gradient, so a mis-scaled window shows (Adam would hide it)."""
    return {"dataset": dataset, "num_epochs": 2, "optimizer": "sgd", "learning_rate": 0.1,
            "global_batch_size": GLOBAL_BATCH}


@dataclass(frozen=True)
class Tolerance:
    param: float  # max |parameter difference| after the run
    loss: float  # max |difference| of a step's loss


# How far two runs may drift apart when they see the same examples grouped differently (other
# micro-batches, processes or entry points): only the order of floating-point sums differs.
# fp32: measured at most 1.2e-07 (parameters) and 5.8e-07 (loss) on CPU; the bound leaves room for
# other BLAS and GPU kernels. bf16: autocast keeps 8 mantissa bits, so a near-zero gradient can change
# sign between groupings and Adam turns that into a whole lr-sized step (lr 1e-3 here): measured on
# CPU at most 7.6e-04 and 2.4e-04; the bound is 4 such steps. docs/guarantees.md, "Accumulation is exact".
TOLERANCES = {"no": Tolerance(param=1e-5, loss=1e-5), "bf16": Tolerance(param=4e-3, loss=1e-2)}
TOL = TOLERANCES[MIXED_PRECISION]
MEASURED: list[str] = []


def report(line: str) -> None:
    """Keep a measured number for the "measured" section printed at the end of the session."""
    MEASURED.append(line)


def pytest_sessionfinish(session):
    """Under pytest-xdist, each worker's measured lines go to the controller, which prints them."""
    if hasattr(session.config, "workeroutput"):
        session.config.workeroutput["measured"] = MEASURED


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    MEASURED.extend(getattr(node, "workeroutput", {}).get("measured", []))


def pytest_terminal_summary(terminalreporter):
    if MEASURED:
        terminalreporter.section("measured")
        for line in MEASURED:
            terminalreporter.write_line(line)


def pytest_configure(config):
    """In-process tests load data and tokenizers too: keep them offline and out of ~/.cache."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["HF_DATASETS_DISABLE_PROGRESS_BARS"] = "1"
    os.environ.setdefault("HF_DATASETS_CACHE", str(config.rootpath / ".pytest_cache" / "hf_datasets"))


def assert_one_stream(sampler_class, n: int, plan, batch_at, accum_at) -> int:
    """Over 3 epochs of `n` examples on every rank of `plan`'s world: each step takes the next
    `batch_at(step)` examples of the epoch's permutation (the last one the remainder) with
    `accum_at(step)` micro-batches, every example once per epoch, epochs counting the run's steps.
    Returns the run's steps (windows.WindowSampler, and the batch_schedule extra's sampler)."""
    ranks = [sampler_class(n, plan, rank, seed=3) for rank in range(plan.world_size)]
    sampler, step = ranks[0], 0
    for epoch in range(3):
        assert sampler.epoch_of(step) == (epoch, 0) and sampler.first_step(epoch) == step
        order, offset = sampler.permutation(epoch).tolist(), 0
        for s in range(sampler.steps_in(epoch)):
            size = min(batch_at(step), n - offset)
            window = sampler.window_at(step)
            assert len(window.examples) == size and sampler.epoch_of(step) == (epoch, s)
            assert (window.global_batch_size, window.grad_accum_steps) == (batch_at(step), accum_at(step))
            assert window.ends_epoch == (offset + size == n)
            windows = [r.window(epoch, s) for r in ranks]
            assert len({len(w) for w in windows}) == 1
            if size == batch_at(step):
                assert len(windows[0]) == accum_at(step)
            real = sorted(i for w in windows for mb in w for i, keep in mb if keep)
            assert real == sorted(order[offset:offset + size])
            offset, step = offset + size, step + 1
        assert offset == n
    return step


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    output_dir: Path

    @property
    def records(self) -> list[dict]:
        path = self.output_dir / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    @property
    def steps(self) -> list[dict]:
        return [r for r in self.records if "loss" in r]

    @property
    def evals(self) -> list[dict]:
        return [r for r in self.records if "eval_loss" in r]

    def params(self) -> dict:
        return load_file(self.output_dir / "final_model" / "model.safetensors")


def offline_env(tmp: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "SLURM_"))}
    env.update(
        PYTHONPATH=str(ROOT / "src"),
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        HF_DATASETS_DISABLE_PROGRESS_BARS="1",
        HF_DATASETS_CACHE=str(ROOT / ".pytest_cache" / "hf_datasets"),  # as the in-process tests' (pytest_configure)
        TORCHINDUCTOR_CACHE_DIR=str(ROOT / ".pytest_cache" / "torchinductor"),  # compiled kernels, kept
        WANDB_MODE="offline",
        WANDB_DIR=str(tmp / "wandb"),
        WANDB_SILENT="true",
        GLOO_SOCKET_IFNAME="lo",
        MASTER_ADDR="127.0.0.1",
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
    )
    (tmp / "wandb").mkdir(parents=True, exist_ok=True)
    return env


def launch_cmd(entry: str, nproc: int, script: tuple = (), agent: list[str] | None = None) -> list[str]:
    """The command line of `entry` on `nproc` processes, without its flags: as `python -m` starts it, or
    under torchrun for more processes or where `agent` gives torchrun's own options (c10d_agent); then
    `script` (a Python file and its first arguments) in place of `-m <entry module>`."""
    program = [str(arg) for arg in script] or ["-m", f"{SLUG}.train_{entry}"]
    if nproc == 1 and agent is None:
        return [sys.executable, *program]
    agent = agent or ["--nnodes", "1", "--master_addr", "127.0.0.1", "--master_port", str(free_port())]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), *agent, *program]


def c10d_agent(port: int, nnodes: int = 1, *more: str) -> list[str]:
    """torchrun's options for a c10d rendezvous of `nnodes` agents on 127.0.0.1:`port`, as
    scripts/slurm/torchrun.sbatch starts one agent per node; `more` are further options (--node_rank,
    --max_restarts)."""
    return ["--nnodes", str(nnodes), "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", *more]


# A shell that ignores SIGUSR1 and then becomes the launch, as scripts/slurm/common.sh starts one.
IGNORING_USR1 = ("bash", "-c", "trap '' USR1; exec \"$@\"", "bash")


def accelerate_launch(config: str | None, nproc: int, env: dict, out: Path, *extra: str,
                      entry: str = "accelerate") -> Run:
    """An entry point under `accelerate launch --config_file configs/accelerate/<config>.yaml`
    (`--multi_gpu` when `config` is None: a project generated without the Accelerate configs)."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch",
           *(["--config_file", f"configs/accelerate/{config}.yaml"] if config else ["--multi_gpu"]),
           "--num_processes", str(nproc), "--main_process_ip", "127.0.0.1", "--main_process_port", str(free_port()),
           "-m", f"{SLUG}.train_{entry}", "--report_to", "none", "--output_dir", str(out), *extra]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    return Run(proc.returncode, proc.stdout, proc.stderr, out)


def flag_args(flags: dict | None = None) -> list[str]:
    """FAST, then `flags`, as command-line flags."""
    return [arg for key, value in {**FAST, **(flags or {})}.items() for arg in (f"--{key}", str(value))]


def run_entry(entry: str, nproc: int, output_dir: Path, env: dict, flags: dict | None = None,
              extra: list[str] | None = None, *, script: tuple = (), agent: list[str] | None = None,
              under: tuple = (), background: bool = False,
              logs: Path | None = None) -> Run | contextlib.AbstractContextManager[subprocess.Popen]:
    """The one way the tests launch a run: the entry point on `nproc` processes with FAST, `flags`, the
    output folder and then `extra` (raw arguments) as its command line; returns a `Run`. One process
    is forked as `python -m` starts it (forked_run), unless the test sets RANK or WORLD_SIZE itself (a
    worker started by hand keeps its MASTER_PORT); more run under torchrun, whose exit code and report
    a failed worker gets.
    `script`: a Python file and its first arguments, run in place of `-m <entry module>` (a stand-in
    that changes the entry point, then runs it). `agent`: torchrun's own options (c10d_agent).
    `under`: a command the launch runs under (IGNORING_USR1). `background`: a `with` block instead,
    given the launcher's process (background_run; its output in `logs`, else `output_dir`, .stdout
    and .stderr). `runs` (RunCache) keeps the runs that several tests read."""
    if 0 < GPUS < nproc:
        pytest.skip(f"{nproc} processes need {nproc} GPUs (nccl: one process per GPU); this machine has {GPUS}")
    args = flag_args(flags) + ["--output_dir", str(output_dir)] + (extra or [])
    cmd = [*under, *launch_cmd(entry, nproc, script, agent), *args]
    if background:
        return background_run(cmd, env, logs or output_dir)
    by_hand = env.keys() & {"RANK", "WORLD_SIZE"}
    if nproc == 1 and agent is None and not (script or under or by_hand) and output_dir.parent.is_dir():
        proc = forked_run(entry, 1, args, env, output_dir.parent / f"{output_dir.name}.log")
    else:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    return Run(proc.returncode, proc.stdout, proc.stderr, output_dir)


# Fork servers (helpers/fork_launcher.py) by entry point and environment (but W&B's variables, which only
# the run reads: wandb is imported when a run starts it), the most recently used last; each holds
# an entry point's imports (about half a GB), so a few are kept.
LAUNCHERS: dict[tuple, ForkLauncher] = {}
KEPT_LAUNCHERS = 4


def forked_run(entry: str, nproc: int, args: list[str], env: dict, logs: Path,
               timeout: float = LAUNCH_TIMEOUT_S) -> subprocess.CompletedProcess:
    """The entry point with `args` on `nproc` processes, as `python -m` or torchrun would start it,
    forked from a process that imported it in `env` (helpers/fork_launcher.py); its output also in
    `logs`.stdout and .stderr. Under torchrun where there are GPUs (a process that may have touched
    CUDA must not fork) and for torch.compile (its compile workers hang in a forked process). One
    process: any run (its exit code is the process's, as under `python -m`); more: runs that should
    succeed (the exit code and report of a failed worker are torchrun's own)."""
    if GPUS or "--compile" in args and args[args.index("--compile") + 1] == "true":
        return subprocess.run(launch_cmd(entry, nproc) + args, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=timeout)
    module = f"{SLUG}.train_{entry}"
    key = (module, tuple(sorted((k, v) for k, v in env.items() if not k.startswith("WANDB_"))))
    LAUNCHERS[key] = LAUNCHERS.pop(key, None) or ForkLauncher([module], env, ROOT)
    while len(LAUNCHERS) > KEPT_LAUNCHERS:
        LAUNCHERS.pop(next(iter(LAUNCHERS))).close()
    return LAUNCHERS[key].run(module, args, nproc, {**env, "MASTER_PORT": str(free_port())}, logs, timeout)


def successful_run(entry: str, nproc: int, out: Path, env: dict, flags: dict | None = None) -> Run:
    """A run that should succeed, into `out` (forked_run: its output also in `out`.stdout and .stderr)."""
    proc = forked_run(entry, nproc, flag_args(flags) + ["--output_dir", str(out)], env, out)
    return Run(proc.returncode, proc.stdout, proc.stderr, out)


class RunCache:
    """Runs keyed by (entry, processes, flags); each is launched once per test session, also when
    pytest-xdist's workers share the session: the first worker to need a run launches it under a
    file lock in their common folder, the others then read its folder and output."""

    def __init__(self, root: Path):
        self.root = root
        self.env = offline_env(root)

    def run(self, entry: str, nproc: int, out: Path, flags: dict) -> Run:
        """A run into `out` in this cache's environment, not cached."""
        return successful_run(entry, nproc, out, self.env, flags)

    def __call__(self, entry: str, nproc: int, **flags) -> Run:
        key = (entry, nproc, tuple(sorted((k, str(v)) for k, v in flags.items())))
        name = hashlib.sha256(repr(key).encode()).hexdigest()[:16]
        out, output = self.root / f"run_{name}", self.root / f"run_{name}.json"
        with (self.root / f"run_{name}.lock").open("w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not output.is_file():
                run = self.run(entry, nproc, out, flags)
                assert run.returncode == 0, f"{key} failed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
                output.write_text(json.dumps({"stdout": run.stdout, "stderr": run.stderr}))
        logged = json.loads(output.read_text())
        return Run(0, logged["stdout"], logged["stderr"], out)


def shared_folder(tmp_path_factory, name: str) -> Path:
    """A folder of the test session, the same for every pytest-xdist worker."""
    base = tmp_path_factory.getbasetemp()
    folder = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / name
    folder.mkdir(exist_ok=True)
    return folder


@pytest.fixture(scope="session")
def runs(tmp_path_factory) -> RunCache:
    return RunCache(shared_folder(tmp_path_factory, "runs"))


@pytest.fixture(scope="session")
def small_dataset(tmp_path_factory) -> Path:
    """The first 37 training and 9 validation examples of the task's data, so that windows of 16
    or 24 examples leave a short last window in every epoch, and 2 processes evaluate shards of 5
    and 4 examples (at micro batch 2 or 4, a different number of batches)."""
    folder = shared_folder(tmp_path_factory, "small")
    source = ROOT / "src" / SLUG / "assets" / "data" / TASK
    for split, n in (("train", 37), ("validation", 9)):
        if not (folder / f"{split}.jsonl").is_file():  # written whole by the first worker to get here
            rows = (source / f"{split}.jsonl").read_text().splitlines()[:n]
            part = folder / f".{split}.{os.getpid()}"
            part.write_text("\n".join(rows) + "\n")
            os.replace(part, folder / f"{split}.jsonl")
    return folder


@pytest.fixture
def env(tmp_path) -> dict:
    return offline_env(tmp_path)


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error: ")]


def one_error_line(proc, expected: str, code: int = 2, workers: int = 1, exact: bool = False,
                   alone: bool = False) -> str:
    """The one way the tests assert a one-line error: `proc` (a Run or a finished process) exited with
    `code`, and its output holds one `error:` line. `expected` is the line's start (the part that names
    the key, file or cause) or, without its `error: `, a part of it; with `exact`, the whole line, as one
    test per error family pins it. `alone`: stderr holds the error lines and nothing else (no launcher
    report, no note). One process: exactly one line and no traceback. Under a launcher (`workers`
    processes): each worker that reaches the check prints its line and exits 2, and the launcher stops
    the others (a worker still starting may be stopped before it prints), so 1 to `workers` lines, all
    the same; the launcher's own report may hold a traceback."""
    output = (proc.stdout or "") + (proc.stderr or "")
    lines = error_lines(output)
    assert proc.returncode == code, (proc.returncode, output[-3000:])
    assert 1 <= len(lines) <= workers and len(set(lines)) == 1, output[-3000:]
    matches = (lines[0] == expected if exact else
               lines[0].startswith(expected) if expected.startswith("error: ") else expected in lines[0])
    assert matches, (expected, lines[0])
    assert workers > 1 or "Traceback" not in output, output[-3000:]
    assert not alone or proc.stderr.strip().splitlines() == lines, output[-3000:]
    return lines[0]


def snapshot(folder: Path) -> dict[str, tuple[str, int]]:
    """Every file under `folder`: its content hash and modification time (to prove nothing changed)."""
    return {p.relative_to(folder).as_posix(): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


def strict_records(path: Path) -> list[dict]:
    """metrics.jsonl read as strict JSON: NaN and Infinity are not JSON."""
    def refuse(constant):
        raise ValueError(f"{constant} in {path}")

    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


def max_abs_diff(a: dict, b: dict) -> float:
    """Largest parameter difference. A DeepSpeed-gathered save also writes the tied lm_head copy
    of the embeddings, which the other save leaves out; it must then equal the embeddings."""
    for params, other in ((a, b), (b, a)):
        if "lm_head.weight" in params.keys() - other.keys() and "model.embed_tokens.weight" in params:
            assert params.pop("lm_head.weight").equal(params["model.embed_tokens.weight"])
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def max_loss_diff(a: Run, b: Run, key: str = "loss") -> float:
    """Largest difference between the losses (or another figure, `key`) two runs logged for the same steps."""
    assert [r["step"] for r in a.steps] == [r["step"] for r in b.steps]
    return max(abs(x[key] - y[key]) for x, y in zip(a.steps, b.steps, strict=True))


# Long enough (200 optimizer steps) that a signal or a kill lands mid-run, small enough to stay quick.
LONG = {"micro_batch_size": 2, "global_batch_size": 8, "max_steps": 200}


def last_records(run: Run) -> list[dict]:
    """The step records that count, each step once (a resume sets aside the records after its
    checkpoint: metrics.jsonl never holds a step twice)."""
    steps = [r["step"] for r in run.steps]
    assert len(steps) == len(set(steps)), f"a step recorded twice in metrics.jsonl: {steps}"
    return sorted(run.steps, key=lambda r: r["step"])


def assert_same_training(resumed: Run, straight: Run) -> float:
    """Every step's loss and the final parameters: bitwise on CPU; GPU kernels (atomic adds) are
    not bitwise reproducible run to run. Returns the largest parameter difference."""
    losses = [r["loss"] for r in last_records(resumed)]
    assert len(losses) == len(straight.steps)
    diff = max_abs_diff(resumed.params(), straight.params())
    if GPUS:
        assert max(abs(a - b["loss"]) for a, b in zip(losses, straight.steps, strict=True)) <= TOL.loss
        assert diff <= TOL.param
    else:
        assert losses == [r["loss"] for r in straight.steps]
        assert diff == 0.0
    return diff


@contextlib.contextmanager
def background_run(cmd: list[str], env: dict, logs: Path):
    """`cmd` in the background for the `with` block, then waited for (run_entry's background form, and
    the launch scripts'); its output goes to `logs`.stdout and .stderr (a full pipe would stall it), and
    if the block fails the run is killed with all its processes."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=Path(f"{logs}.stdout").open("w"),
                            stderr=Path(f"{logs}.stderr").open("w"), text=True)
    try:
        yield proc
        proc.wait(timeout=LAUNCH_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            signal_process_tree(proc.pid, signal.SIGKILL)


def read_logs(logs: Path) -> tuple[str, str]:
    """The output so far of a background run: `logs`.stdout and .stderr."""
    return Path(f"{logs}.stdout").read_text(), Path(f"{logs}.stderr").read_text()


def children_of() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):  # gone meanwhile
            ppid = int(stat.read_text().rpartition(")")[2].split()[1])
            children.setdefault(ppid, []).append(int(stat.parent.name))
    return children


def signal_process_tree(pid: int, signum: int) -> None:
    """Signal `pid` and all its descendants, whatever their session, as SLURM signals a job step."""
    children, todo = children_of(), [pid]
    while todo:
        member = todo.pop()
        todo += children.get(member, [])
        with contextlib.suppress(ProcessLookupError):  # exited meanwhile
            os.kill(member, signum)


def wait_for_step(out: Path, proc: subprocess.Popen, step: int) -> None:
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    while max([r["step"] for r in Run(0, "", "", out).steps] or [0]) < step:
        assert proc.poll() is None and time.monotonic() < deadline, f"the run ended before step {step}"
        time.sleep(0.02)


def run_with_publish_hook(entry: str, hook: str, flags: dict, out: Path, env: dict) -> Run:
    """The entry point on 2 processes under torchrun, with `checkpoint.publish` (which marks a
    checkpoint complete) replaced by `hook`: the body of a function of (cfg, env, written, final,
    state) that may call the original as `publish(...)`, to make a fault happen at a chosen step."""
    body = "\n".join("    " + line for line in textwrap.dedent(hook).strip().splitlines())
    script = out.parent / f"hooked_{out.name}.py"
    script.write_text(f"""import importlib, os, resource, signal, sys
from {SLUG} import checkpoint
entry = importlib.import_module("{SLUG}.train_" + sys.argv.pop(1))
publish = checkpoint.publish

def hooked(cfg, env, written, final, state):
{body}

for name, module in list(sys.modules.items()):  # every module of the project that imported it
    if name.startswith("{SLUG}.") and getattr(module, "publish", None) is publish:
        module.publish = hooked
entry.main()
""")
    return run_entry(entry, 2, out, env, flags, script=(script, entry))


def fault_one_worker(out: Path, proc: subprocess.Popen, signum: int) -> tuple[int, dict, float]:
    """Once the job under `proc` (torchrun --max_restarts 1, checkpoints every 10 steps) has logged
    step 15, send `signum` to one of its 2 workers, then wait for the first record of the restarted
    job: a step the faulted job had already logged, which the restart set aside (with the others
    after its checkpoint) in metrics.dropped.jsonl. Returns the last step logged before the fault,
    that first redone record, and the seconds from the fault to it."""
    wait_for_step(out, proc, 15)  # past the checkpoint at step 10
    records = (out / "metrics.jsonl").read_text().splitlines()
    faulted_at, faulted_step = time.monotonic(), json.loads(records[-1])["step"]
    os.kill(children_of()[proc.pid][-1], signum)  # one of torchrun's 2 workers
    redone = []
    while not redone:
        assert proc.poll() is None and time.monotonic() < faulted_at + LAUNCH_TIMEOUT_S, read_logs(out)[1][-3000:]
        time.sleep(0.02)
        set_aside = dropped_steps(out)
        if set_aside:
            redone = [r for r in Run(0, "", "", out).steps if r["step"] == min(set_aside)]
    return faulted_step, redone[0], time.monotonic() - faulted_at


def dropped_steps(out: Path) -> list[int]:
    """The steps whose records a resume set aside in metrics.dropped.jsonl (lines a crash cut short
    aside)."""
    path, steps = out / "metrics.dropped.jsonl", []
    for line in path.read_text().splitlines() if path.is_file() else []:
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            steps += [record["step"]] if "loss" in record else []
    return steps
