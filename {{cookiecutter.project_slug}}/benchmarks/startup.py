"""Start-up: wall seconds from launching each entry point (one process) to the end of its first
optimizer step, and what `python -c "import torch"` alone takes, so that the project's own share
(first step minus the torch import) shows. With --bake_s (`make bench` at the template's root
passes the seconds `cookiecutter --no-input` took), also the bake and the total from the bake to
the first step. Goal: bake < 1 s; first step < 10 s apart from importing torch.

The first run of each entry point comes first, right after the bake if nothing ran before it (no
bytecode of the project cached yet): it is reported as `cold_first_step_s`; `first_step_s` is
the median of 3 runs. A run's first step is the moment its metrics.jsonl holds step 1 (polled
every 10 ms).

    python -m benchmarks.startup                                            # CPU: the tiny model
    python -m benchmarks.startup --model gpt2-small --mixed_precision bf16  # a GPU
"""

import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .common import ROOT, SLUG, entry_points, parser, prepare_model, subprocess_env, train_flags
from .harness import print_table, save_results

RUNS = 3
BAKE_GOAL_S, FIRST_STEP_GOAL_S = 1.0, 10.0
TIMEOUT_S = 300
POLL_S = 0.01


def torch_import_s() -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], env=subprocess_env(), check=True, timeout=TIMEOUT_S)
    return time.perf_counter() - start


def has_first_step(metrics: Path) -> bool:
    return metrics.is_file() and '"step"' in metrics.read_text()


def first_step_s(entry: str, flags: list[str], output_dir: Path) -> float:
    """Seconds from starting `entry` to its first optimizer step; the run then finishes."""
    output_dir.mkdir(parents=True)
    metrics, log = output_dir / "metrics.jsonl", output_dir / "log.txt"
    cmd = [sys.executable, "-m", f"{SLUG}.train_{entry}", *flags, "--output_dir", str(output_dir)]
    with log.open("w") as out:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=subprocess_env(), stdout=out, stderr=subprocess.STDOUT)
        try:
            while not has_first_step(metrics):
                if proc.poll() is not None or time.perf_counter() - start > TIMEOUT_S:
                    raise RuntimeError(f"{' '.join(cmd)} ended without a first step:\n{log.read_text()[-3000:]}")
                time.sleep(POLL_S)
            seconds = time.perf_counter() - start
            proc.wait(timeout=TIMEOUT_S)
        finally:
            if proc.poll() is None:
                proc.kill()
    return seconds


def run(args) -> list[dict]:
    prepare_model(args)
    runs = 1 if args.quick else RUNS
    flags = train_flags(args, max_steps=1, eval_every=10)  # one step, no evaluation
    entries = entry_points()
    seconds: dict[str, list[float]] = {entry: [] for entry in entries}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(runs):
            for entry in entries:
                seconds[entry].append(first_step_s(entry, flags, Path(tmp) / f"{entry}_{repeat}"))
    torch_s = statistics.median(torch_import_s() for _ in range(runs))
    rows = []
    for entry in entries:
        cold, first = seconds[entry][0], statistics.median(seconds[entry])
        rows.append({"entry": entry, "bake_s": args.bake_s, "cold_first_step_s": round(cold, 3),
                     "first_step_s": round(first, 3), "torch_import_s": round(torch_s, 3),
                     "first_step_excl_torch_import_s": round(first - torch_s, 3),
                     "bake_to_first_step_s": None if args.bake_s is None else round(args.bake_s + cold, 3)})
    settings = {"runs": runs, "bake": "`python -m cookiecutter TEMPLATE --no-input` (CLI, a new process)",
                "goal_bake_s": BAKE_GOAL_S, "goal_first_step_excl_torch_import_s": FIRST_STEP_GOAL_S}
    table = [{**row, "bake": "-" if args.bake_s is None else f"{args.bake_s:.2f}",
              "total": "-" if args.bake_s is None else f"{row['bake_to_first_step_s']:.2f}"} for row in rows]
    print_table(f"start-up: seconds to the first optimizer step, one process (median of {runs}; cold: the first run)",
                {"entry": "{entry}", "bake (goal < 1)": "{bake}", "cold first step": "{cold_first_step_s:.2f}",
                 "first step": "{first_step_s:.2f}", "import torch": "{torch_import_s:.2f}",
                 "first step - torch (goal < 10)": "{first_step_excl_torch_import_s:.2f}",
                 "bake + cold first step": "{total}"}, table)
    save_results(args, "startup", rows, settings)
    return rows


def main(argv: list[str] | None = None) -> None:
    run(parser(__doc__.splitlines()[0]).parse_args(argv))


if __name__ == "__main__":
    main()
