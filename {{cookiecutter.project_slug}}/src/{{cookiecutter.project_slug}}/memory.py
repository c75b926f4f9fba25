"""Peak memory of a piece of training, on the device it runs on.

GPU: `torch.cuda.max_memory_allocated` (the caching allocator's own count of live tensor bytes).
CPU: torch has no allocator statistics there, so `MemTracker` (torch.distributed._tools) counts the
bytes of every live tensor storage (rounded up to 512 bytes, as the CUDA allocator rounds) while the
piece runs: parameters, gradients and optimizer state that are passed in as `tracked`, plus
everything the piece allocates. The same numbers on a laptop and a cluster mean the same thing.

Used by `--micro_batch_size auto` (session.py) and by the memory benchmark (benchmarks/memory.py).
"""

from collections.abc import Callable

import torch

from .batch import largest_fitting
from .config import ConfigError, TrainConfig
from .distributed import DistEnv, all_reduce_min
from .model import autocast_for, build_model, summed_loss
from .optim import build_optimizer

MIB = 2**20


def peak_bytes(piece: Callable[[], object], device: torch.device, *tracked) -> int:
    """Run `piece()` and return the peak bytes of live tensors on `device` while it ran.
    `tracked` (modules, optimizers) are counted from the start, as the GPU counts them."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        piece()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device)
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    if tracked:
        tracker.track_external(*tracked)
    with tracker:
        piece()
    peaks = tracker.get_tracker_snapshot("peak")
    return int(peaks.get(device, peaks.get(torch.device(device.type), {})).get("Total", 0))


def worst_case_batch(cfg: TrainConfig, model_config, size: int, device: torch.device) -> dict:
    """`size` examples of max_seq_len real tokens each: no padding, so every batch of the data
    fits where this one does."""
    generator = torch.Generator().manual_seed(cfg.seed)
    input_ids = torch.randint(0, model_config.vocab_size, (size, cfg.max_seq_len), generator=generator)
    labels = input_ids if cfg.task == "causal_lm" else torch.zeros(size, dtype=torch.long)
    return {"input_ids": input_ids.to(device), "attention_mask": torch.ones_like(input_ids, device=device),
            "labels": labels.to(device)}


def training_step_peak(cfg: TrainConfig, model_config, size: int, device: torch.device) -> int:
    """Peak bytes of one micro-step at micro batch `size` and the optimizer step after it, on a
    fresh model: parameters, gradients, optimizer state and activations (gradient checkpointing
    and mixed precision as configured). Raises torch.OutOfMemoryError where it does not fit."""
    model = build_model(cfg, model_config).to(device)
    optimizer = build_optimizer(model, cfg)
    batch = worst_case_batch(cfg, model_config, size, device)
    labels = batch.pop("labels")

    def step() -> None:
        with autocast_for(cfg, device):
            logits = model(**batch).logits
        summed_loss(logits, labels, cfg.task).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return peak_bytes(step, device, model, optimizer)


def check_auto_micro_batch(cfg: TrainConfig, env: DistEnv) -> None:
    """What --micro_batch_size auto needs, checked before any process waits on another."""
    if cfg.global_batch_size % env.world_size:
        raise ConfigError(f"micro_batch_size auto: global_batch_size {cfg.global_batch_size} is not divisible by "
                          f"world_size {env.world_size}; use a multiple of {env.world_size}")
    if env.device.type != "cuda" and not cfg.memory_budget_mb:
        raise ConfigError(f"micro_batch_size auto on {env.device.type} needs --memory_budget_mb (there is no "
                          "out-of-memory error to search by); or give micro_batch_size")


def auto_micro_batch_size(cfg: TrainConfig, model_config, env: DistEnv) -> tuple[int, str]:
    """--micro_batch_size auto: the largest micro batch whose training step fits, the same on every
    rank (the smallest of the ranks' answers), and how it was found, for the batch table.

    Fits: within --memory_budget_mb when one is set, and without a CUDA out-of-memory error.
    Needs the process group (the ranks agree through one all-reduce)."""
    budget = cfg.memory_budget_mb * MIB
    peaks: dict[int, str] = {}

    def fits(size: int) -> bool:
        try:
            peak = training_step_peak(cfg, model_config, size, env.device)
        except torch.OutOfMemoryError:
            peaks[size] = "out of memory"
            return False
        finally:  # the probe's model is gone: give its memory back to the device
            if env.device.type == "cuda":
                torch.cuda.empty_cache()
        peaks[size] = f"{peak / MIB:.1f} MiB"
        return not budget or peak <= budget

    local, _ = largest_fitting(cfg.global_batch_size // env.world_size, fits)
    size = int(all_reduce_min(torch.tensor(local, device=env.device)).item())
    limit = f"budget {cfg.memory_budget_mb:g} MiB" if budget else f"{env.device.type} memory"
    tried = ", ".join(f"{b}: {peak}" for b, peak in peaks.items())
    if size == 0:
        raise ConfigError(f"micro_batch_size auto: not even 1 example fits in the {limit} (peak per training "
                          f"step {tried}); raise --memory_budget_mb, use gradient_checkpointing or mixed_precision")
    return size, f"largest within the {limit}; peak per step {tried}"
