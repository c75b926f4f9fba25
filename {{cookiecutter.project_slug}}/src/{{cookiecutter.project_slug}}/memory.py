"""The auto_batch extra's work: peak memory of a piece of training on the device it runs on
(`torch.cuda.max_memory_allocated` on a GPU; on CPU `LiveBytes`, a dispatch mode counting the
storages alive at once), the start-up search of `--micro_batch_size auto` and its out-of-memory
retry at run time (MicroBatchRetry). docs/memory.md says what each number counts, docs/batch.md
the retry's rules; benchmarks/memory.py measures with the same functions.
"""

import math
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from .checkpoint import rng_state, set_rng_state
from .config import TrainConfig
from .data import IGNORE_INDEX
from .distributed import DistEnv, init_distributed, ranks_with
from .errors import ConfigError, JobFailed, first_line
from .launch import Launch
from .model import autocast_for, build_model, summed_loss
from .optim import build_optimizer
from .windows import BatchPlan, Window, plan_batches, windows_from

MIB = 2**20
AUTO_CEILING = "auto_micro_batch_size"  # in output_dir: the micro batch a restart of an auto run starts from


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
    if cfg.task != "sequence_classification":  # as data.Collator has it: no attention mask
        return {"input_ids": input_ids.to(device), "labels": input_ids.to(device)}
    return {"input_ids": input_ids.to(device), "attention_mask": torch.ones_like(input_ids, device=device),
            "labels": torch.zeros(size, dtype=torch.long, device=device)}


def training_step_peak(cfg: TrainConfig, model_config, size: int, device: torch.device, ddp: bool = False,
                       accumulation: int = 2, fp32_logits: bool = False) -> int:
    """Peak bytes of a training window at micro batch `size` as every window after the first has it:
    the optimizer's state already there (a first window makes it), two micro-steps (the second's
    backward with the first's gradients held), clipping and the optimizer step; parameters,
    gradients, activations (gradient checkpointing and mixed precision as configured) and the
    micro-batches: on the CPU the window's `accumulation` of them at once, as its loader collates
    them, on a GPU the current one and the next. `ddp`: plus DDP's gradient buckets, a second copy
    of the gradients. `fp32_logits`: the logits made fp32, as Accelerate's model does under mixed precision.
    Raises torch.OutOfMemoryError where it does not fit."""
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
            loss = summed_loss(logits.float() if fp32_logits else logits, labels, cfg.task)
            loss.backward()
            loss_sum, targets = loss_sum + loss.detach(), targets + (labels != IGNORE_INDEX).sum()  # as the loops
        if cfg.max_grad_norm:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    window()
    buckets = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad) if ddp else 0
    return peak_bytes(window, device, model, optimizer) + buckets


def check_auto_micro_batch(cfg: TrainConfig, env: DistEnv, launch: Launch) -> None:
    """What --micro_batch_size auto needs (an up-front check)."""
    if launch.backend == "deepspeed" or launch.fsdp:  # the probe holds the whole model, as a DDP process does
        raise ConfigError(f"micro_batch_size auto measures a whole model per process, not the shards of "
                          f"{'FSDP' if launch.fsdp else 'DeepSpeed'}; give micro_batch_size")
    if cfg.global_batch_size % env.world_size:
        raise ConfigError(f"micro_batch_size auto: global_batch_size {cfg.global_batch_size} is not divisible by "
                          f"world_size {env.world_size}; use a multiple of {env.world_size}")
    if env.device.type != "cuda" and not cfg.memory_budget_mb:
        raise ConfigError(f"micro_batch_size auto on {env.device.type} needs --memory_budget_mb (there is no "
                          "out-of-memory error to search by); or give micro_batch_size")


def auto_micro_batch_size(cfg: TrainConfig, model_config, env: DistEnv, at_most: int = 0,
                          fp32_logits: bool = False) -> tuple[int, str]:
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
                                      accumulation=math.ceil(cfg.global_batch_size / env.world_size / size),
                                      fp32_logits=fp32_logits)
        except torch.OutOfMemoryError:
            peaks[size] = "out of memory"
            return False
        finally:  # the probe's model is gone: give its memory back to the device
            if env.device.type == "cuda":
                torch.cuda.empty_cache()
        peaks[size] = f"{peak / MIB:.1f} MiB"
        return not budget or peak <= budget

    local = largest_fitting(cfg.global_batch_size // env.world_size, fits, at_most)
    smallest = torch.tensor(local, device=env.device)
    if dist.is_initialized():
        dist.all_reduce(smallest, op=dist.ReduceOp.MIN)  # what every process can hold
    size = int(smallest.item())
    limit = f"budget {cfg.memory_budget_mb:g} MiB" if budget else f"{env.device.type} memory"
    tried = ", ".join(f"{b}: {peak}" for b, peak in peaks.items())
    if size == 0:
        where = "" if local == 0 else " on another process"  # (this one's own search found one)
        raise ConfigError(f"micro_batch_size auto: not even 1 example fits in the {limit}{where} (peak per training "
                          f"step {tried}); raise --memory_budget_mb, use gradient_checkpointing or mixed_precision")
    capped = f", at most {at_most} (an earlier out-of-memory error)" if at_most else ""
    return size, f"largest within the {limit}{capped}; peak per step {tried}"


def auto_plan(cfg: TrainConfig, model_config, env: DistEnv, state: dict | None, launch: Launch) -> BatchPlan:
    """startup's batch plan under --micro_batch_size auto: the search, below the ceiling an
    out-of-memory error left. It needs the process group: every rank must agree on the result."""
    init_distributed(env, cfg.rendezvous_timeout_s, cfg.collective_timeout_s)
    micro_batch_size, chosen_by = auto_micro_batch_size(cfg, model_config, env, auto_ceiling(cfg, state),
                                                        launch.on_accelerate and cfg.mixed_precision != "no")
    return plan_batches(cfg.global_batch_size, micro_batch_size, env.world_size, chosen_by)


def auto_ceiling(cfg: TrainConfig, state: dict | None) -> int:
    """The largest micro batch a --micro_batch_size auto search may choose (0: no limit), left by an
    out-of-memory error: the one the resumed checkpoint records, or the one noted after an error in
    a synchronising micro-step."""
    ceilings = [int(state["auto_micro_batch_ceiling"])] if state and state.get("auto_micro_batch_ceiling") else []
    note = Path(cfg.output_dir) / AUTO_CEILING
    noted = note.read_text().strip() if note.is_file() else ""
    if noted.isdigit():
        ceilings.append(int(noted))
    return min(ceilings, default=0)


def largest_divisor(per_rank: int, at_most: int) -> int:
    """The largest micro batch up to `at_most` that divides `per_rank` (so the global batch stays
    exact); 0 when `at_most` is below 1."""
    return max((d for d in range(1, at_most + 1) if per_rank % d == 0), default=0)


def largest_fitting(per_rank: int, fits: Callable[[int], bool], at_most: int = 0) -> int:
    """The largest micro batch that fits, searched from `per_rank` (= global_batch_size /
    world_size, accumulation 1; or its largest divisor up to `at_most`) down by halving: each
    candidate is the largest divisor of `per_rank` at most half the last one, so the global batch
    stays exact. 0 when even 1 does not fit."""
    candidate = largest_divisor(per_rank, min(at_most or per_rank, per_rank))
    while candidate and not fits(candidate):
        candidate = largest_divisor(per_rank, candidate // 2)
    return candidate


class MicroBatchRetry:
    """--micro_batch_size auto at run time (DDP or one process; docs/batch.md), as a Session keeps it
    (session.Session.retry): an out-of-memory error in a micro-step that does not synchronise is
    noted, the ranks agree once per window, and every rank drops the window and takes it again at
    the next smaller micro batch (kept from then on). One in a synchronising micro-step stops the
    job with one line; its restart continues at the smaller micro batch, noted in
    output_dir/auto_micro_batch_size."""

    def __init__(self, session):
        run = session.run
        self.session, self.env, self.sampler = session, run.env, session.sampler
        self.note = Path(run.cfg.output_dir) / AUTO_CEILING
        auto = run.cfg.micro_batch_size == "auto"
        self.enabled = auto and run.launch.entry != "trainer" and run.launch.backend == "ddp" and not run.launch.fsdp
        self.out_of_memory = False  # this rank ran out of memory in the current window
        self.retrying = False  # the current window is dropped: it comes again in smaller micro-batches
        self.retries = 0  # windows dropped since the last record
        # the micro batch an out-of-memory error left (0: none): auto searches no higher
        self.ceiling = auto_ceiling(run.cfg, run.recorded) if auto else 0

    def windows(self, loader) -> Iterator[Window]:
        """From the resume point on, each optimizer step's window (windows.windows_from). A window
        dropped for an out-of-memory error comes again, cut into the smaller micro-batches, from the
        same RNG state."""
        done, total = self.session.run.start_step, self.session.run.total_steps
        if not self.enabled:
            yield from windows_from(loader, self.sampler, done, total)
            return
        random_state = None
        while done < total:
            for window in windows_from(loader, self.sampler, done, total):
                if random_state is not None:  # a window taken again: from where the dropped attempt began
                    set_rng_state(random_state, self.env.device)
                random_state = rng_state(self.env.device)
                yield window
                if self.retrying:  # the loader starts again at this window, with the smaller micro batch
                    self.retrying = False
                    break
                done, random_state = done + 1, None

    def every_micro_step_syncs(self) -> bool:
        """Whether each micro-step of this window runs a collective: with DDP on 2 or more processes,
        without ddp_no_sync, and in the job's second window (its first forward rebuilds DDP's buckets)."""
        return self.env.world_size > 1 and (not self.session.cfg.ddp_no_sync or self.session.job_steps == 1)

    def micro_step(self, is_last: bool):
        """Around one micro-step: an out-of-memory error is noted where the micro-step does not
        synchronise, and stops the job where it does."""
        return self._guard(is_last or self.every_micro_step_syncs()) if self.enabled else nullcontext()

    @contextmanager
    def _guard(self, syncs: bool):
        try:
            yield
        except torch.OutOfMemoryError as err:
            if not syncs:
                self.out_of_memory = True
                return
            raise self._oom_in_sync(err) from None

    def window_fits(self) -> bool:
        """Before a window's synchronising micro-step: did every rank get through the others? One
        tiny all-reduce per window (else always True). When not, every rank returns False: the
        caller drops the window's gradients, and the window comes again, smaller."""
        if not self.enabled or self.every_micro_step_syncs():  # nothing can have been noted
            return True
        failed = ranks_with(self.out_of_memory, self.env.device)
        self.out_of_memory = False
        if not failed:
            return True
        plan = self.sampler.plan
        smaller = self.next_micro_batch()
        if not smaller:
            raise JobFailed(f"out of memory on {failed} process(es) at micro batch 1: not even one example fits; "
                            "use gradient_checkpointing, mixed_precision or a shorter max_seq_len",
                            agreed=True)
        self.sampler.plan = replace(plan, micro_batch_size=smaller,
                                    chosen_by=f"{smaller} after an out-of-memory error at {plan.micro_batch_size}")
        self.retrying, self.retries, self.ceiling = True, self.retries + 1, smaller
        if self.env.device.type == "cuda":
            torch.cuda.empty_cache()  # what the failed attempt held goes back to the device
        return False

    def next_micro_batch(self) -> int:
        """The micro batch after an out-of-memory error: the largest divisor of the first global
        batch's share at most half the current one (0 below 1)."""
        plan = self.sampler.plan
        return largest_divisor(plan.global_batch_size // self.env.world_size, plan.micro_batch_size // 2)

    def _oom_in_sync(self, err: BaseException) -> JobFailed:
        """The other ranks wait in this micro-step's all-reduce, so nothing can be agreed: the job
        ends, and the next smaller micro batch is noted for the restart (auto_ceiling)."""
        smaller = self.next_micro_batch()
        if smaller:
            self.note.write_text(f"{smaller}\n")
        then = (f"its restart (torchrun --max_restarts, a requeue, --resume_from_checkpoint auto) continues from "
                f"the newest checkpoint with micro batch {smaller} ({self.note})" if smaller else
                "not even one example fits: use gradient_checkpointing, mixed_precision or a shorter max_seq_len")
        return JobFailed(f"rank {self.env.rank} ran out of memory in a synchronising micro-step at micro batch "
                         f"{self.sampler.plan.micro_batch_size} ({first_line(err)}); the job stops, {then}")

    def record(self) -> dict:
        """`oom_retries`: the windows dropped since the last record (none: no key)."""
        retries, self.retries = self.retries, 0
        return {"oom_retries": retries} if retries else {}

    def state(self) -> dict:
        return {"auto_micro_batch_ceiling": self.ceiling}
