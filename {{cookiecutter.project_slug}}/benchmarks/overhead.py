"""Loop overhead: optimizer steps per second of each entry point against the bare reference loop
(`benchmarks/bare_loop.py`: the same config, data windows, model, optimizer and schedule, nothing
else), one process each.

Every run is its own process with the same flags (no W&B, no evaluation during the timed steps),
timed from its metrics.jsonl: `elapsed_s` of the last step minus that of the last warm-up step.
The variants are interleaved (each repeat runs them all, in a rotated order) so that a slow
moment of the machine hits them alike, and each one's median over the repeats is compared.
Goal: pytorch >= 0.98 x bare, accelerate >= 0.95 x, trainer >= 0.95 x.

    python -m benchmarks.overhead                                            # CPU: the tiny model
    python -m benchmarks.overhead --model gpt2-small --mixed_precision bf16  # a GPU
"""

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from .common import (
    ROOT,
    SLUG,
    entry_points,
    parser,
    prepare_model,
    print_table,
    save_results,
    subprocess_env,
    train_config,
    train_flags,
)

GOALS = {"pytorch": 0.98, "accelerate": 0.95, "trainer": 0.95}
STEPS, WARMUP_STEPS, REPEATS = 40, 5, 7
TIMEOUT_S = 600


def module(variant: str) -> str:
    return "benchmarks.bare_loop" if variant == "bare" else f"{SLUG}.train_{variant}"


def steps_per_s(metrics: Path) -> float:
    """Optimizer steps per second after the warm-up steps, from a run's elapsed_s."""
    elapsed = {r["step"]: r["elapsed_s"] for r in map(json.loads, metrics.read_text().splitlines()) if "elapsed_s" in r}
    last = max(elapsed)
    return (last - WARMUP_STEPS) / (elapsed[last] - elapsed[WARMUP_STEPS])


def timed_run(variant: str, flags: list[str], output_dir: Path) -> float:
    cmd = [sys.executable, "-m", module(variant), *flags, "--output_dir", str(output_dir)]
    proc = subprocess.run(cmd, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
    return steps_per_s(output_dir / "metrics.jsonl")


def run(args) -> list[dict]:
    prepare_model(args)
    variants = ["bare", *entry_points()]
    repeats = 1 if args.quick else REPEATS
    # eval_every beyond the run: no evaluation between timed steps (one per epoch otherwise)
    overrides = {"max_steps": STEPS, "eval_every": 10 * STEPS}
    flags, cfg = train_flags(args, **overrides), train_config(args, **overrides)
    speeds: dict[str, list[float]] = {variant: [] for variant in variants}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(repeats):
            for variant in variants[repeat % len(variants):] + variants[:repeat % len(variants)]:
                speeds[variant].append(timed_run(variant, flags, Path(tmp) / f"{variant}_{repeat}"))
    bare = statistics.median(speeds["bare"])
    rows = [{"entry": entry, "steps_per_s": round(statistics.median(speeds[entry]), 3),
             "bare_steps_per_s": round(bare, 3), "ratio": round(statistics.median(speeds[entry]) / bare, 4),
             "goal": GOALS[entry], "runs_steps_per_s": [round(s, 3) for s in speeds[entry]]}
            for entry in variants[1:]]
    settings = {"steps": STEPS, "warmup_steps": WARMUP_STEPS, "repeats": repeats,
                "bare_runs_steps_per_s": [round(s, 3) for s in speeds["bare"]],
                "micro_batch_size": cfg.micro_batch_size, "global_batch_size": cfg.global_batch_size,
                "max_seq_len": cfg.max_seq_len, "data": cfg.dataset}
    print_table(f"overhead: optimizer steps/s, median of {repeats} interleaved runs of {STEPS} steps "
                f"({WARMUP_STEPS} warm-up), one process",
                {"entry": "{entry}", "steps/s": "{steps_per_s:.2f}", "bare steps/s": "{bare_steps_per_s:.2f}",
                 "ratio": "{ratio:.3f}", "goal": ">= {goal}"}, rows)
    save_results(args, "overhead", rows, settings)
    return rows


def main(argv: list[str] | None = None) -> None:
    run(parser(__doc__.splitlines()[0]).parse_args(argv))


if __name__ == "__main__":
    main()
