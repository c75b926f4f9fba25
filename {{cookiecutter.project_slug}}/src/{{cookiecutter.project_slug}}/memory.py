"""Peak memory of a piece of training, on the device it runs on: `torch.cuda.max_memory_allocated`
on a GPU, and on CPU `LiveBytes`, a dispatch mode counting the storages alive at once (torch keeps
no allocator statistics there). Used by `--micro_batch_size auto` and benchmarks/memory.py;
docs/memory.md says what each number counts.
"""

import math
import weakref
from collections.abc import Callable, Iterable

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from .batch import largest_fitting
from .config import TrainConfig
from .data import IGNORE_INDEX
from .distributed import DistEnv, all_reduce_min
from .errors import ConfigError
from .model import autocast_for, build_model, summed_loss
from .optim import build_optimizer

MIB = 2**20


class LiveBytes(TorchDispatchMode):
    """Bytes of the live tensor storages on one device type, and their peak, while active."""

    def __init__(self, device_type: str):
        super().__init__()
        self.device_type, self.live, self.peak = device_type, 0, 0
        self.seen = WeakIdKeyDictionary()  # storage -> its bytes, until the storage is freed

    def add(self, tensors: Iterable) -> None:
        for tensor in tensors:
            if isinstance(tensor, DTensor):  # a shard of a tensor that is split across the processes
                tensor = tensor.to_local()
            if not isinstance(tensor, torch.Tensor) or tensor.device.type != self.device_type:
                continue
            storage = tensor.untyped_storage()
            if storage not in self.seen:
                self.seen[storage] = nbytes = storage.nbytes()
                self.live += nbytes
                weakref.finalize(storage, self._free, nbytes)
        self.peak = max(self.peak, self.live)

    def _free(self, nbytes: int) -> None:
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.add(tree_leaves(out))
        return out


def tensors_of(*tracked) -> list[torch.Tensor]:
    """The parameters, gradients and optimizer state of modules and optimizers."""
    found = []
    for item in tracked:
        if isinstance(item, torch.nn.Module):
            found += [t for p in item.parameters() for t in (p, p.grad) if t is not None]
            found += list(item.buffers())
        else:
            found += [t for state in item.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
    return found


def peak_bytes(piece: Callable[[], object], device: torch.device, *tracked) -> int:
    """Run `piece()` and return the peak bytes of live tensors on `device` while it ran.
    `tracked` (modules, optimizers) are counted from the start, as the GPU counts them."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        piece()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device)
    with LiveBytes(device.type) as counter:
        counter.add(tensors_of(*tracked))
        piece()
    return counter.peak


def worst_case_batch(cfg: TrainConfig, model_config, size: int, device: torch.device) -> dict:
    """`size` examples of max_seq_len real tokens each: no padding, so every batch of the data
    fits where this one does."""
    generator = torch.Generator().manual_seed(cfg.seed)
    input_ids = torch.randint(0, model_config.vocab_size, (size, cfg.max_seq_len), generator=generator)
    if cfg.task == "causal_lm":  # as data.Collator has it: no attention mask
        return {"input_ids": input_ids.to(device), "labels": input_ids.to(device)}
    return {"input_ids": input_ids.to(device), "attention_mask": torch.ones_like(input_ids, device=device),
            "labels": torch.zeros(size, dtype=torch.long, device=device)}


def training_step_peak(cfg: TrainConfig, model_config, size: int, device: torch.device, ddp: bool = False,
                       accumulation: int = 2) -> int:
    """Peak bytes of a training window at micro batch `size` as every window after the first has it:
    the optimizer's state already there (a first window makes it), two micro-steps (the second's
    backward with the first's gradients held), clipping and the optimizer step; parameters,
    gradients, activations (gradient checkpointing and mixed precision as configured) and the
    micro-batches: on the CPU the window's `accumulation` of them at once, as its loader collates
    them, on a GPU the current one and the next. `ddp`: plus DDP's gradient buckets, a second copy
    of the gradients. Raises torch.OutOfMemoryError where it does not fit."""
    model = build_model(cfg, model_config).to(device)
    optimizer = build_optimizer(model, cfg, device)
    held = 2 if device.type == "cuda" else max(2, accumulation)

    def window() -> None:
        batches = [worst_case_batch(cfg, model_config, size, device) for _ in range(held)]
        loss_sum = targets = 0
        for batch in batches[:2]:
            labels = batch.pop("labels")
            with autocast_for(cfg, device):
                logits = model(**batch).logits
            loss = summed_loss(logits, labels, cfg.task)
            loss.backward()
            loss_sum, targets = loss_sum + loss.detach(), targets + (labels != IGNORE_INDEX).sum()  # as the loops
        if cfg.max_grad_norm:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    window()
    buckets = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad) if ddp else 0
    return peak_bytes(window, device, model, optimizer) + buckets


def check_auto_micro_batch(cfg: TrainConfig, env: DistEnv) -> None:
    """What --micro_batch_size auto needs (an up-front check)."""
    if cfg.global_batch_size % env.world_size:
        raise ConfigError(f"micro_batch_size auto: global_batch_size {cfg.global_batch_size} is not divisible by "
                          f"world_size {env.world_size}; use a multiple of {env.world_size}")
    if env.device.type != "cuda" and not cfg.memory_budget_mb:
        raise ConfigError(f"micro_batch_size auto on {env.device.type} needs --memory_budget_mb (there is no "
                          "out-of-memory error to search by); or give micro_batch_size")


def auto_micro_batch_size(cfg: TrainConfig, model_config, env: DistEnv, at_most: int = 0) -> tuple[int, str]:
    """--micro_batch_size auto: the largest micro batch whose training step fits, the same on every
    rank (the smallest of the ranks' answers), and how it was found, for the batch table. `at_most`
    (0: no limit) caps the search: a resumed run keeps the micro batch an out-of-memory error left.

    Fits: within --memory_budget_mb when one is set, and without a CUDA out-of-memory error.
    Needs the process group (the ranks agree through one all-reduce)."""
    budget = cfg.memory_budget_mb * MIB
    peaks: dict[int, str] = {}

    def fits(size: int) -> bool:
        try:
            peak = training_step_peak(cfg, model_config, size, env.device, ddp=env.world_size > 1,
                                      accumulation=math.ceil(cfg.global_batch_size / env.world_size / size))
        except torch.OutOfMemoryError:
            peaks[size] = "out of memory"
            return False
        finally:  # the probe's model is gone: give its memory back to the device
            if env.device.type == "cuda":
                torch.cuda.empty_cache()
        peaks[size] = f"{peak / MIB:.1f} MiB"
        return not budget or peak <= budget

    local = largest_fitting(cfg.global_batch_size // env.world_size, fits, at_most)
    size = int(all_reduce_min(torch.tensor(local, device=env.device)).item())
    limit = f"budget {cfg.memory_budget_mb:g} MiB" if budget else f"{env.device.type} memory"
    tried = ", ".join(f"{b}: {peak}" for b, peak in peaks.items())
    if size == 0:
        where = "" if local == 0 else " on another process"  # (this one's own search found one)
        raise ConfigError(f"micro_batch_size auto: not even 1 example fits in the {limit}{where} (peak per training "
                          f"step {tried}); raise --memory_budget_mb, use gradient_checkpointing or mixed_precision")
    capped = f", at most {at_most} (an earlier out-of-memory error)" if at_most else ""
    return size, f"largest within the {limit}{capped}; peak per step {tried}"
