"""Loop overhead, by a low-noise method: each entry point's CPU time per optimizer step against the
minimal loop of its own library (benchmarks/library_loops.py) on the same model, data and
optimizer settings, and against torch's bare optimizer step (which states what the library itself
costs). Torch's step, and Accelerate's documented accumulate() loop, run between the entry point's
steps in its own process (benchmarks/abab.py: A, B, A, B), each step paired with the baseline's on
the same window. The Trainer cannot share a process with another Trainer's loop: its minimal run
and train_trainer alternate as whole processes (A B A B), step i of one paired with step i of the
other, over the same window sizes. Every step is timed in CPU time (time.process_time), data
loading charged to neither side. The ratio is the baseline's median step time over the entry's:
the entry point's steps per second as a share of the baseline's. Goal: each entry point >= 0.98
of its own library's minimal loop.

    python -m benchmarks.overhead                                            # CPU: the tiny model
    python -m benchmarks.overhead --model gpt2-small --mixed_precision bf16  # a GPU
"""

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from .common import ROOT, entry_points, parser, prepare_model, subprocess_env, train_config, train_flags
from .harness import print_table, save_results

GOAL = 0.98  # each entry point against its own library's minimal loop
OWN_LIBRARY = {"pytorch": "torch", "accelerate": "accelerate", "trainer": "trainer"}
STEPS, WARMUP_STEPS, PAIRS = 60, 5, 2  # PAIRS: alternations of the Trainer's processes (1 with --quick)
TIMEOUT_S = 900


def timed_run(module: list[str], flags: list[str], out: Path) -> dict[str, list[float]]:
    """The CPU seconds per step that `python -m <module> OUT.json <flags>` measured."""
    times = out / "times.json"
    cmd = [sys.executable, "-m", *module, str(times), *flags, "--output_dir", str(out / "run")]
    proc = subprocess.run(cmd, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
    return {side: seconds[WARMUP_STEPS:] for side, seconds in json.loads(times.read_text()).items()}


def row(entry: str, baseline: str, entry_s: list[float], baseline_s: list[float]) -> dict:
    """The entry point against `baseline`, from the paired CPU seconds of the same steps."""
    entry_median, baseline_median = statistics.median(entry_s), statistics.median(baseline_s)
    ratios = [b / e for e, b in zip(entry_s, baseline_s, strict=True)]
    return {"entry": entry, "baseline": baseline, "ratio": round(baseline_median / entry_median, 4),
            "goal": GOAL if OWN_LIBRARY[entry] == baseline else None,
            "entry_ms": round(entry_median * 1e3, 3), "baseline_ms": round(baseline_median * 1e3, 3),
            "ratio_quartiles": [round(q, 4) for q in statistics.quantiles(ratios, n=4)], "steps": len(ratios)}


def entry_rows(entry: str, flags: list[str], out: Path, pairs: int) -> list[dict]:
    """The entry point's rows: against each baseline run in its process, and for the Trainer
    against its minimal run, the two processes alternating `pairs` times."""
    entry_s, baselines = [], {}
    for pair in range(pairs if entry == "trainer" else 1):
        times = timed_run(["benchmarks.abab", entry], flags, out / f"{entry}_{pair}")
        if entry == "trainer":
            times |= timed_run(["benchmarks.library_loops"], flags, out / f"trainer_loop_{pair}")
        entry_s += times.pop("entry_s")
        for baseline, seconds in times.items():
            baselines.setdefault(baseline, []).extend(seconds)
    return [row(entry, baseline, entry_s, seconds) for baseline, seconds in baselines.items()]


def run(args) -> list[dict]:
    prepare_model(args)
    steps, pairs = (20, 1) if args.quick else (STEPS, PAIRS)
    # eval_every beyond the run: no evaluation between timed steps (one per epoch otherwise)
    overrides = {"max_steps": steps, "eval_every": 10 * steps, "log_every": 10 * steps}
    flags, cfg = train_flags(args, **overrides), train_config(args, **overrides)
    with tempfile.TemporaryDirectory() as tmp:
        rows = [row for entry in entry_points() for row in entry_rows(entry, flags, Path(tmp), pairs)]
    settings = {"method": "each entry point against its own library's minimal loop and torch's bare step; "
                          "torch and accelerate: ABAB in one process; trainer: whole runs alternated "
                          "(A B A B), step i paired with step i; CPU time (time.process_time), medians",
                "steps": steps, "warmup_steps": WARMUP_STEPS, "trainer_pairs": pairs,
                "micro_batch_size": cfg.micro_batch_size, "global_batch_size": cfg.global_batch_size,
                "max_seq_len": cfg.max_seq_len, "data": cfg.dataset}
    print_table(f"overhead: CPU ms per optimizer step, the entry point's and each baseline's on the same windows "
                f"(medians of steps {WARMUP_STEPS + 1}-{steps})",
                {"entry": "{entry}", "baseline": "{baseline}", "entry ms": "{entry_ms:.2f}",
                 "baseline ms": "{baseline_ms:.2f}", "ratio": "{ratio:.3f}", "quartiles": "{ratio_quartiles}",
                 "goal": "{goal_text}"}, [{**r, "goal_text": f">= {r['goal']}" if r["goal"] else "-"} for r in rows])
    save_results(args, "overhead", rows, settings)
    return rows


def main(argv: list[str] | None = None) -> None:
    run(parser(__doc__.splitlines()[0]).parse_args(argv))


if __name__ == "__main__":
    main()
