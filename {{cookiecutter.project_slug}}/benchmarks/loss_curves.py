"""Loss per optimizer step of one or more runs, on one plot: the entry points trained with the same
seed, data and batch draw one curve (`make demo` at the template's root plots its three runs);
with `--noise`, the first run's gradient noise scale against its global batch (docs/batch.md).

    python -m benchmarks.loss_curves runs/pytorch runs/accelerate runs/trainer --out loss_curves.png
    python -m benchmarks.loss_curves runs/pytorch --noise noise_scale.png
"""

import argparse
import json
from pathlib import Path

from .harness import figure, save_figure

STYLES = [("-", 3.0), ("--", 2.0), (":", 1.5), ("-.", 1.0)]  # overlapping curves stay visible


def losses(run_dir: Path) -> dict[int, float]:
    """Training loss per optimizer step from the run's metrics.jsonl (a step logged twice after a
    restart: the later record counts)."""
    records = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def largest_difference(curves: list[dict[int, float]]) -> float:
    """The largest spread between the runs' losses at a step they all logged."""
    steps = set.intersection(*(set(curve) for curve in curves))
    return max((max(c[s] for c in curves) - min(c[s] for c in curves) for s in steps), default=0.0)


def plot(run_dirs: list[Path], out: Path, title: str) -> float:
    """Draw the runs' loss curves into `out`; returns their largest difference at a step."""
    curves = [losses(run_dir) for run_dir in run_dirs]
    spread = largest_difference(curves)
    fig, ax = figure(title, "optimizer step", "training loss")
    for i, (run_dir, curve) in enumerate(zip(run_dirs, curves, strict=True)):
        style, width = STYLES[i % len(STYLES)]
        ax.plot(list(curve), list(curve.values()), style, linewidth=width, label=run_dir.name)
    ax.legend(title=f"largest difference at a step: {spread:.1e}" if spread else "identical at every step")
    save_figure(fig, out)
    return spread


def plot_noise(run_dir: Path, out: Path) -> None:
    """The run's grad_noise_scale per optimizer step, and its global batch, on one log scale: where
    the noise scale is far above the batch, a larger batch would pay; far below, it wastes compute."""
    records = {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
               if "loss" in r}
    steps = sorted(records)
    noise = [(s, records[s]["grad_noise_scale"]) for s in steps if "grad_noise_scale" in records[s]]
    fig, ax = figure(f"Gradient noise scale, {records[steps[-1]]['world_size']} processes ({run_dir.name})",
                     "optimizer step", "examples")
    ax.plot([s for s, _ in noise], [b for _, b in noise], "-", linewidth=2, label="grad_noise_scale (B_simple)")
    ax.plot(steps, [records[s]["global_batch_size"] for s in steps], "--", label="global_batch_size")
    ax.set_yscale("log")
    ax.legend()
    save_figure(fig, out)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", type=Path, help="run folders (--output_dir of each), each with metrics.jsonl")
    p.add_argument("--out", type=Path, default=Path("loss_curves.png"), help="the PNG to write")
    p.add_argument("--title", default="Training loss per optimizer step", help="the plot's title")
    p.add_argument("--noise", type=Path, help="also plot the first run's gradient noise scale into this PNG")
    args = p.parse_args(argv)
    plot(args.runs, args.out, args.title)
    if args.noise:
        plot_noise(args.runs[0], args.noise)


if __name__ == "__main__":
    main()
