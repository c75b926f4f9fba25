"""The GPU check, on one GPU within 8 minutes: what this project does where it is meant to run.

- tokens per second and MFU of each entry point beside the nanoGPT-style loop
  (benchmarks/bare_loop.py) on GPT-2 small's shape (124M parameters, random weights, no
  download), bf16, compile off and on, the same packed batches and optimizer;
- with the extra auto_batch: peak memory of a training step against the micro batch
  (torch.cuda.max_memory_allocated), and `--micro_batch_size auto` without a budget: the largest
  micro batch found by real CUDA OOM;
- two processes on the one GPU (DIST_BACKEND=gloo: nccl refuses two ranks per device): the 2x4
  cell against 1x1, and DDP's all-reduces per optimizer step.

Each section's result goes to bench/gpu_check.json the moment it is measured (a later failure
keeps it); bench/gpu_check.md at the end. Each section has a budget of seconds (BUDGET_S, 7 min 15 s
in all; the model and corpus take the rest): a run is stopped when its section's budget is spent,
the section keeps what it measured, and the output says which section stopped. Compiled runs share
one compile cache (bench/compile_cache) that outlives the check: a graph compiled before is read back.
Without a GPU it says so in one line and exits 0; `--device cpu` runs every section on the CPU
as a self-test of the check itself (the tiny model, 64 tokens, fp32, compile off, a memory budget
standing in for an out-of-memory error; about a minute). What stays exact on GPUs and what does
not: docs/performance.md.

    python -m benchmarks.gpu_check                 # make gpu-check
    python -m benchmarks.gpu_check --quick         # half the steps
    python -m benchmarks.gpu_check --device cpu    # the self-test, anywhere
"""

import json
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch
from safetensors.torch import load_file

from {{ cookiecutter.project_slug }}.config import load_config
from {{ cookiecutter.project_slug }}.extras import BAKED, plug
from {{ cookiecutter.project_slug }}.model import build_model, load_tokenizer, model_config
from {{ cookiecutter.project_slug }}.speed import flops_per_token, peak_flops

from .common import (
    GPT2_SMALL,
    ROOT,
    SLUG,
    entry_points,
    free_port,
    machine,
    parser,
    prepare_model,
    subprocess_env,
    write_corpus,
)

TIMEOUT_S = 600
# Seconds each section may take; the speed section runs 8 loops on a GPU (4 with compile off, 4 on).
BUDGET_S = {"speed": 320, "memory": 25, "auto_micro_batch": 40, "two_ranks_on_one_gpu": 50}
# --device cpu: each budget times this; the budgets bound a GPU's check, and a CPU shared with other
# work (a test suite's) runs the self-test's small sections several times slower than alone
CPU_BUDGET_FACTOR = 10
COMPILE_CACHE = ROOT / "bench" / "compile_cache"
training_step_peak = plug("auto_batch", "memory:training_step_peak")  # the memory section's, with its extra
# What each device measures: GPT-2 small on a GPU; on the CPU the self-test's tiny model. Causal LM
# whatever the project's own task (packing is for causal LM only).
SETTINGS = {
    "cuda": {"task": "causal_lm", "model_name_or_path": GPT2_SMALL, "max_seq_len": 1024, "packing": "true",
             "mixed_precision": "bf16", "micro_batch_size": 8, "global_batch_size": 32, "report_to": "none",
             "warmup_steps": 2, "eval_every": 100000, "log_every": 100000},
    "cpu": {"task": "causal_lm", "model_name_or_path": "tiny", "max_seq_len": 64, "packing": "true",
            "mixed_precision": "no", "micro_batch_size": 4, "global_batch_size": 16, "report_to": "none",
            "warmup_steps": 2, "eval_every": 100000, "log_every": 100000},
}


def flags(values: dict) -> list[str]:
    return [arg for key, value in values.items() for arg in (f"--{key}", str(value))]


class BudgetSpent(Exception):
    """A section's budget ran out: what it measured so far stays, the rest is not run."""


class Budget:
    """The seconds left to one section of the check."""

    def __init__(self, section: str, seconds: float):
        self.section, self.seconds, self.deadline = section, seconds, time.monotonic() + seconds

    def left(self) -> float:
        """Seconds left; BudgetSpent when none are."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise BudgetSpent(f"{self.section}: stopped, its budget of {self.seconds:g} s is spent")
        return left


def run(module: str, values: dict, out: Path, budget: Budget, nproc: int = 1, env: dict | None = None) -> list[dict]:
    """`module` on `nproc` processes of this GPU, stopped when `budget` is spent; its step records."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr",
                "127.0.0.1", "--master_port", str(free_port()), "-m"] if nproc > 1 else [sys.executable, "-m"]
    cmd = [*launcher, module, *flags({**values, "output_dir": out})]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env={**subprocess_env(), "TORCHINDUCTOR_CACHE_DIR": str(COMPILE_CACHE),
                                                  **(env or {})},
                              capture_output=True, text=True, timeout=min(TIMEOUT_S, budget.left()))
    except subprocess.TimeoutExpired:
        budget.left()
        raise
    if proc.returncode:
        raise RuntimeError(f"{' '.join(map(str, cmd))}:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
    (out / "log.txt").write_text(proc.stdout + proc.stderr)
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "tokens" in r]


def throughput(records: list[dict], skip: int) -> float:
    """Tokens per second after the first `skip` steps (compilation and warm-up)."""
    timed = records[skip:]
    return sum(r["tokens"] for r in timed[1:]) / (timed[-1]["elapsed_s"] - timed[0]["elapsed_s"])


def speed_rows(base: dict, steps: int, compiles: tuple[str, ...], tmp: Path, cache: Path, corpus: Path,
               device: torch.device, budget: Budget) -> list[dict]:
    """Each loop's tokens per second, compile off then on (the bare loop first: it warms the compile
    cache); once the budget is spent, the rows measured so far (BudgetSpent carries them)."""
    cfg = load_config(["--config", str(ROOT / "configs" / "train.yaml"), *flags(base)])
    tokenizer = load_tokenizer(cfg)
    per_token = flops_per_token(build_model(cfg, model_config(cfg, tokenizer)), cfg.max_seq_len)
    peak = peak_flops(cfg, device)
    rows = []
    for compiled in compiles:
        values = {**base, "max_steps": steps, "compile": compiled, "data_cache_dir": cache, "dataset": corpus}
        for name in ("bare", *entry_points()):
            module = "benchmarks.bare_loop" if name == "bare" else f"{SLUG}.train_{name}"
            try:
                records = run(module, values, tmp / f"{name}_{compiled}", budget)
            except BudgetSpent as spent:
                spent.rows = with_vs_bare(rows)
                raise
            tokens_per_s = throughput(records, skip=steps // 3)
            rows.append({"loop": name, "compile": compiled == "true", "tokens_per_s": round(tokens_per_s),
                         "mfu": round(per_token * tokens_per_s / peak, 4) if peak else None})
    return with_vs_bare(rows)


def with_vs_bare(rows: list[dict]) -> list[dict]:
    """`rows` with each loop's speed over the bare loop's, compiled alike (None: the bare loop's is missing)."""
    for row in rows:
        bare = next((r for r in rows if r["loop"] == "bare" and r["compile"] == row["compile"]), None)
        row["vs_bare"] = round(row["tokens_per_s"] / bare["tokens_per_s"], 4) if bare else None
    return rows


def memory_rows(base: dict, device: torch.device, budget: Budget) -> list[dict]:
    cfg = load_config(["--config", str(ROOT / "configs" / "train.yaml"), *flags(base)])
    config = model_config(cfg, load_tokenizer(cfg))
    rows = []
    for micro in (1, 2, 4, 8, 16):
        try:
            budget.left()
        except BudgetSpent as spent:
            spent.rows = rows
            raise
        try:
            rows.append({"micro_batch_size": micro, "peak_mib": round(training_step_peak(cfg, config, micro, device)
                                                                      / 2**20, 3)})
        except torch.OutOfMemoryError:
            rows.append({"micro_batch_size": micro, "peak_mib": None})
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def auto_micro_batch(base: dict, tmp: Path, cache: Path, corpus: Path, budget_mb: float | None,
                     budget: Budget) -> str:
    """What --micro_batch_size auto chose: on a GPU with no budget (a real CUDA OOM decides), on the
    CPU within `budget_mb`."""
    values = {**base, "max_steps": 1, "global_batch_size": 256, "micro_batch_size": "auto",
              "data_cache_dir": cache, "dataset": corpus}
    if budget_mb is not None:
        values["memory_budget_mb"] = budget_mb
    run(f"{SLUG}.train_pytorch", values, tmp / "auto", budget)
    return next(line.strip() for line in (tmp / "auto" / "log.txt").read_text().splitlines() if "(auto:" in line)


def two_ranks_on_one_gpu(tmp: Path, cache: Path, budget: Budget) -> dict:
    """The parity matrix's 2x4 cell against 1x1 (the tiny model, fp32), the two ranks on one GPU
    (or both on the CPU)."""
    cell = {"task": "causal_lm", "report_to": "none", "max_seq_len": 48, "global_batch_size": 16, "max_steps": 8,
            "warmup_steps": 2, "lr_scheduler_type": "cosine", "ddp_bucket_cap_mb": 0.05, "data_cache_dir": cache,
            "tf32": "false"}
    one = run(f"{SLUG}.train_pytorch", {**cell, "micro_batch_size": 16}, tmp / "one", budget)
    two = run(f"{SLUG}.train_pytorch", {**cell, "micro_batch_size": 2}, tmp / "two", budget, nproc=2,
              env={"DIST_BACKEND": "gloo"})
    a, b = (load_file(tmp / name / "final_model" / "model.safetensors") for name in ("one", "two"))
    return {"max_param_diff": max((a[k] - b[k]).abs().max().item() for k in a),
            "max_loss_diff": max(abs(x["loss"] - y["loss"]) for x, y in zip(one, two, strict=True)),
            "grad_sync_calls": [r["grad_sync_calls"] for r in two], "micro_steps": two[0]["micro_steps"]}


def markdown(result: dict) -> str:
    lines = [f"# GPU check: {result['machine'].get('gpu') or 'the CPU (self-test)'}", "",
             "| loop | compile | tokens/s | MFU | vs nanoGPT-style |", "|---|---|---|---|---|"]
    lines += [f"| {r['loop']} | {'on' if r['compile'] else 'off'} | {r['tokens_per_s']:,} | "
              f"{'-' if r['mfu'] is None else format(r['mfu'], '.1%')} | "
              f"{'-' if r['vs_bare'] is None else format(r['vs_bare'], '.3f')} |" for r in result["speed"] or []]
    if "memory" in result:
        lines += ["", "| micro batch | peak MiB |", "|---|---|"]
        lines += [f"| {r['micro_batch_size']} | {r['peak_mib'] if r['peak_mib'] is not None else 'OOM'} |"
                  for r in result["memory"] or []]
        lines += ["", f"micro_batch_size auto: `{result['auto_micro_batch']}`"]
    if parity := result["two_ranks_on_one_gpu"]:
        lines += ["", f"2 ranks on one GPU (gloo), 2x4 vs 1x1: max |param diff| {parity['max_param_diff']:.3g}, "
                  f"max |loss diff| {parity['max_loss_diff']:.3g}, all-reduces per step {parity['grad_sync_calls']}"]
    lines += ["", *result.get("stopped", [])] if result.get("stopped") else []
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    cli = parser(__doc__.splitlines()[0])
    cli.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                     help="cuda: GPU 0 (no GPU: one line, exit 0); cpu: the self-test of every section")
    args = cli.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no GPU here (torch.cuda.is_available() is False): nothing to measure")
        return 0
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    base = SETTINGS[args.device]
    if args.device == "cuda":
        args.model = "gpt2-small"
        prepare_model(args)
    steps = 6 if args.device == "cpu" else 45 if args.quick else 90  # a third warms up, the rest is timed
    out = args.results.parent
    out.mkdir(parents=True, exist_ok=True)
    result = {"machine": machine(), "device": args.device, "steps": steps}

    def write(key: str, value) -> None:
        result[key] = value
        part = out / "gpu_check.json.part"
        part.write_text(json.dumps(result, indent=2) + "\n")
        part.replace(out / "gpu_check.json")  # whole at every moment: a reader never finds it half written

    def section(key: str, measure) -> None:
        """write(key, measure(budget)), or what it measured before its budget was spent, and that it stopped."""
        try:
            value = measure(Budget(key, BUDGET_S[key] * (CPU_BUDGET_FACTOR if args.device == "cpu" else 1)))
        except BudgetSpent as spent:
            print(spent)
            result.setdefault("stopped", []).append(str(spent))
            value = getattr(spent, "rows", None)
        write(key, value)

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        cache, corpus = tmp / "data_cache", tmp / "corpus"
        # about 4M tokens on a GPU: 4k packed blocks of 1024, more than the steps take
        write_corpus(corpus, 60_000 if args.device == "cuda" else 2_000)
        compiles = ("false", "true") if args.device == "cuda" else ("false",)
        section("speed", partial(speed_rows, base, steps, compiles, tmp, cache, corpus, device))
        if "auto_batch" in BAKED:
            section("memory", partial(memory_rows, base, device))
            peaks = {r["micro_batch_size"]: r["peak_mib"] for r in result["memory"] or []}
            budget_mb = (peaks[4] + peaks[8]) / 2 if args.device == "cpu" else None  # a GPU: a real OOM decides
            section("auto_micro_batch", partial(auto_micro_batch, base, tmp, cache, corpus, budget_mb))
        section("two_ranks_on_one_gpu", partial(two_ranks_on_one_gpu, tmp, cache))
    (out / "gpu_check.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
