"""What the benchmarks beyond gpu_check share: the hand-written optimizer step they measure, the
device clock, the processes they spawn themselves, and results.json with its tables and plots.
"""

import argparse
import json
import os
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from {{ cookiecutter.project_slug }}.config import TrainConfig
from {{ cookiecutter.project_slug }}.distributed import DistEnv, dist_env
from {{ cookiecutter.project_slug }}.model import autocast_for, count_targets, summed_loss
from {{ cookiecutter.project_slug }}.optim import clip_gradients

from .common import machine


def optimizer_step(model, window: list[dict], optimizer, cfg: TrainConfig, device: torch.device,
                   no_sync: bool = True, on_gradients=None) -> None:
    """One optimizer step over the micro-batches of `window`, written plainly: forward and backward
    of each (DDP's no_sync() on all but the last when `no_sync`, or FSDP2's, as cfg.fsdp_grad_sync says),
    `on_gradients()` if given, clip, step, zero_grad.

    Each micro-batch's summed loss is divided by the real targets of the window on this process
    (the entry points divide by those of all processes: the same work, another scale)."""
    num_targets = max(sum(count_targets(b["labels"], cfg.task) for b in window), 1)
    for micro_step, micro_batch in enumerate(window):
        batch = {key: value.to(device, non_blocking=True) for key, value in micro_batch.items()}
        labels = batch.pop("labels")
        skip_sync = no_sync and micro_step < len(window) - 1 and hasattr(model, "no_sync")  # one process: none
        with model.no_sync() if skip_sync else nullcontext():
            with autocast_for(cfg, device):
                logits = model(**batch).logits
            (summed_loss(logits, labels, cfg.task) / num_targets).backward()
    if on_gradients is not None:
        on_gradients()
    clip_gradients(model, cfg.max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def lacks_gpus(benchmark: str, processes: int) -> bool:
    """Whether this machine has GPUs but fewer than `processes` (nccl takes one GPU per process):
    then `benchmark` is skipped, and says so."""
    gpus = torch.cuda.device_count()
    if 0 < gpus < processes:
        print(f"{benchmark}: skipped, {processes} processes need {processes} GPUs (nccl); this machine has {gpus}")
    return 0 < gpus < processes


def clock(device: torch.device) -> float:
    """Seconds, once the device has finished the work queued so far (CUDA runs asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def spawned_process(rank: int, world_size: int, port: int) -> DistEnv:
    """In a process that a benchmark spawned itself (torch.multiprocessing): torchrun's variables
    for `rank` of `world_size` on this machine, loopback and, as torchrun does, one CPU thread per
    process unless set. The process then joins with distributed.init_distributed."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_PORT=str(port))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
    return dist_env()


def save_results(args: argparse.Namespace, key: str, rows: list[dict], settings: dict) -> None:
    """Write `rows` as `key` of the results file, with how they were measured under
    settings[key] and the machine; the other benchmarks' keys stay."""
    path = args.results
    results = json.loads(path.read_text()) if path.is_file() else {}
    results[key] = rows
    results.setdefault("settings", {})[key] = {"model": args.model, "mixed_precision": args.mixed_precision,
                                               **settings}
    results["machine"] = machine()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2) + "\n")


def print_table(title: str, columns: dict[str, str], rows: list[dict]) -> None:
    """`rows` under `title`; `columns` maps each header to a format string applied to a row."""
    cells = [[fmt.format(**row) for fmt in columns.values()] for row in rows]
    widths = [max(len(header), *(len(line[i]) for line in cells)) for i, header in enumerate(columns)]
    print(f"\n{title}")
    print("  ".join(header.rjust(w) for header, w in zip(columns, widths, strict=True)))
    for line in cells:
        print("  ".join(cell.rjust(w) for cell, w in zip(line, widths, strict=True)))


def figure(title: str, xlabel: str, ylabel: str):
    """A new matplotlib figure and its axes (the Agg back end: files only, no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2), layout="constrained")
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.grid(alpha=0.3)
    return fig, ax


def save_powers_of_two_plot(fig, ax, xs: list[int], path: Path) -> None:
    """Finish a plot whose x values are powers of two (micro batches, micro-steps) and save it."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_ylim(bottom=0)
    ax.legend()
    save_figure(fig, path)


def save_figure(fig, path: Path) -> None:
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"plot: {path}")
