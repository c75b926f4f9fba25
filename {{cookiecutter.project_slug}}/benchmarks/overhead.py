"""Loop overhead, by a low-noise method: each entry point's real training with a bare optimizer
step interleaved between its steps (benchmarks/abab.py: A, B, A, B in one process, both timed in
CPU time on the same micro-batches), one process per entry point. The ratio is the bare step's
median time over the entry's: the entry point's steps per second as a share of the bare loop's.
Goal: pytorch >= 0.98, accelerate >= 0.97, trainer >= 0.95.

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
    entry_points,
    parser,
    prepare_model,
    print_table,
    save_results,
    subprocess_env,
    train_config,
    train_flags,
)

GOALS = {"pytorch": 0.98, "accelerate": 0.97, "trainer": 0.95}
STEPS, WARMUP_STEPS = 60, 5
TIMEOUT_S = 900


def interleaved(entry: str, flags: list[str], out: Path) -> dict:
    """The CPU seconds of every step of `entry` and of the bare step beside it."""
    times = out / "times.json"
    cmd = [sys.executable, "-m", "benchmarks.abab", entry, str(times), *flags, "--output_dir", str(out / "run")]
    proc = subprocess.run(cmd, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
    return json.loads(times.read_text())


def run(args) -> list[dict]:
    prepare_model(args)
    steps = 20 if args.quick else STEPS
    # eval_every beyond the run: no evaluation between timed steps (one per epoch otherwise)
    overrides = {"max_steps": steps, "eval_every": 10 * steps, "log_every": 10 * steps}
    flags, cfg = train_flags(args, **overrides), train_config(args, **overrides)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for entry in entry_points():
            times = interleaved(entry, flags, Path(tmp) / entry)
            entry_s, bare_s = (statistics.median(times[side][WARMUP_STEPS:]) for side in ("entry_s", "bare_s"))
            ratios = [b / e for e, b in zip(times["entry_s"][WARMUP_STEPS:], times["bare_s"][WARMUP_STEPS:],
                                            strict=True)]
            rows.append({"entry": entry, "ratio": round(bare_s / entry_s, 4), "goal": GOALS[entry],
                         "entry_ms": round(entry_s * 1e3, 3), "bare_ms": round(bare_s * 1e3, 3),
                         "ratio_quartiles": [round(q, 4) for q in statistics.quantiles(ratios, n=4)],
                         "steps": len(ratios)})
    settings = {"method": "ABAB in one process, CPU time (time.process_time), medians", "steps": steps,
                "warmup_steps": WARMUP_STEPS, "micro_batch_size": cfg.micro_batch_size,
                "global_batch_size": cfg.global_batch_size, "max_seq_len": cfg.max_seq_len, "data": cfg.dataset}
    print_table(f"overhead: CPU ms per optimizer step, the entry point's and a bare step's beside it (ABAB, medians "
                f"of steps {WARMUP_STEPS + 1}-{steps}), one process",
                {"entry": "{entry}", "entry ms": "{entry_ms:.2f}", "bare ms": "{bare_ms:.2f}",
                 "ratio": "{ratio:.3f}", "quartiles": "{ratio_quartiles}", "goal": ">= {goal}"}, rows)
    save_results(args, "overhead", rows, settings)
    return rows


def main(argv: list[str] | None = None) -> None:
    run(parser(__doc__.splitlines()[0]).parse_args(argv))


if __name__ == "__main__":
    main()
