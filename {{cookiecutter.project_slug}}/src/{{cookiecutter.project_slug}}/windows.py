"""Accumulation windows: the examples each optimizer step takes on this rank (WindowSampler), a
step's facts carried as one value (Window), the arithmetic the hand-written loops share, and the
out-of-memory retry of --micro_batch_size auto (MicroBatchRetry). docs/data.md gives the data
order, docs/batch.md the retry's rules.
"""

import bisect
import itertools
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Sampler

from .batch import BatchPlan, largest_divisor
from .checkpoint import rng_state, set_rng_state
from .distributed import DistEnv, ranks_with
from .errors import JobFailed, first_line


@dataclass(frozen=True)
class Window:
    """One optimizer step's facts, derived once: the loops, the record, the evaluation and the
    noise scale read them here."""

    step: int  # the optimizer step this window completes (1-based)
    micro_batches: list[dict]  # this rank's (empty where the Trainer draws them itself)
    examples: np.ndarray  # the step's examples on all ranks (fewer than the global batch at an epoch's end)
    global_batch_size: int  # the schedule's global batch for this step
    grad_accum_steps: int  # micro-batches per rank in a full window of this step
    micro_batch_size: int
    ends_epoch: bool


class WindowSampler(Sampler):
    """Yields this rank's micro-batches, one accumulation window (optimizer step) after another.

    Each micro-batch is a list of `(index, real)` pairs; `real` is False only in filler
    micro-batches (docs/data.md). Steps are counted over the run (the schedule's global batch
    follows them) and, within an epoch, from its first step.
    """

    def __init__(self, num_examples: int, plan: BatchPlan, rank: int, seed: int, min_rows: int = 1):
        self.num_examples = num_examples
        self.min_rows = min_rows  # filler rows make up the difference (at most micro_batch_size)
        self.plan = plan
        self.rank = rank
        self.seed = seed
        self.epoch = 0
        self.start_step = 0
        self._drawn: tuple[int, np.ndarray] | None = None  # (epoch, its permutation): drawn once per epoch
        self._firsts = [0]  # the run's step at which each epoch begins (and the one after the last known)
        self._sizes: tuple[int, tuple[list[int], list[int]]] | None = None  # (epoch, _epoch(epoch))

    def epoch_sizes(self, epoch: int) -> list[int]:
        """The global batch of each optimizer step of `epoch`: the schedule's, the last one the remainder."""
        return self._epoch(epoch)[0]

    def _epoch(self, epoch: int) -> tuple[list[int], list[int]]:
        """(the global batch of each step of `epoch`, where each begins in its permutation)."""
        if self._sizes is None or self._sizes[0] != epoch:
            sizes = [size for size, count in self._runs(self.first_step(epoch)) for _ in range(count)]
            self._sizes = epoch, (sizes, list(itertools.accumulate(sizes[:-1], initial=0)))
        return self._sizes[1]

    def _runs(self, first_step: int) -> Iterator[tuple[int, int]]:
        """The epoch that begins at the run's step `first_step`, as (global batch, steps) runs: the
        schedule's sizes, then the remainder (one step) when the examples do not divide."""
        offset, step = 0, first_step
        while offset < self.num_examples:
            size = self.plan.global_batch_at(step)
            full = (self.num_examples - offset) // size
            if not full:
                yield self.num_examples - offset, 1
                return
            later = [start - step for start, _ in self.plan.schedule if start > step]
            count = min([full, *later[:1]])
            yield size, count
            offset, step = offset + size * count, step + count

    def epoch_of(self, step: int) -> tuple[int, int]:
        """(epoch, its steps done) after `step` optimizer steps of the run."""
        while self._firsts[-1] <= step:
            self._firsts.append(self._firsts[-1] + sum(count for _, count in self._runs(self._firsts[-1])))
        epoch = bisect.bisect_right(self._firsts, step) - 1
        return epoch, step - self._firsts[epoch]

    def first_step(self, epoch: int) -> int:
        """The run's step at which `epoch` begins (the steps of the epochs before it)."""
        while len(self._firsts) <= epoch:
            self.epoch_of(self._firsts[-1])
        return self._firsts[epoch]

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps of the current epoch (of every epoch without a schedule)."""
        return len(self.epoch_sizes(self.epoch))

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        """Choose the epoch's permutation and the optimizer step to start from (for resuming)."""
        self.epoch = epoch
        self.start_step = start_step

    def permutation(self, epoch: int) -> np.ndarray:
        """The epoch's order of the training set, drawn once per epoch (a step then only slices it)."""
        if self._drawn is None or self._drawn[0] != epoch:
            order = np.random.default_rng([self.seed, epoch]).permutation(self.num_examples)
            self._drawn = epoch, order.astype(np.int32) if self.num_examples < 2**31 else order
        return self._drawn[1]

    def micro_steps(self, step: int, epoch: int | None = None) -> int:
        """Micro-batches in window `step` of `epoch` (the current one when None) on every rank (the
        step's grad_accum_steps, fewer at an epoch's end)."""
        share = math.ceil(self.epoch_sizes(self.epoch if epoch is None else epoch)[step] / self.plan.world_size)
        return math.ceil(share / self.plan.micro_batch_size)

    def window_at(self, done: int, micro_batches: list[dict] | None = None) -> "Window":
        """The facts of the run's optimizer step after `done` steps, as one value."""
        epoch, step = self.epoch_of(done)
        return Window(done + 1, micro_batches or [], self._examples(epoch, step), self.plan.global_batch_at(done),
                      self.plan.accum_at(done), self.plan.micro_batch_size,
                      ends_epoch=step + 1 == len(self.epoch_sizes(epoch)))

    def _examples(self, epoch: int, step: int) -> np.ndarray:
        sizes, offsets = self._epoch(epoch)
        return self.permutation(epoch)[offsets[step]:offsets[step] + sizes[step]]

    def window(self, epoch: int, step: int) -> list[list[tuple[int, bool]]]:
        order = self._examples(epoch, step).tolist()
        share = order[self.rank::self.plan.world_size]
        b = self.plan.micro_batch_size
        rows = min(self.min_rows, b)
        batches = []
        for m in range(self.micro_steps(step, epoch)):
            part = [(i, True) for i in share[m * b:(m + 1) * b]]
            batches.append(part + [(order[0], False)] * max(rows - len(part), 0))
        return batches

    def __iter__(self):
        for step in range(self.start_step, self.steps_per_epoch):
            yield from self.window(self.epoch, step)

    def __len__(self) -> int:
        """Micro-batches from start_step to the epoch's end."""
        return sum(self.micro_steps(step) for step in range(self.start_step, self.steps_per_epoch))


def finite(values: dict) -> bool:
    return math.isfinite(values["loss"]) and math.isfinite(values["grad_norm"])


class MicroBatchRetry:
    """--micro_batch_size auto at run time (DDP or one process; docs/batch.md): an out-of-memory
    error in a micro-step that does not synchronise is noted, the ranks agree once per window, and
    every rank drops the window and takes it again at the next smaller micro batch (kept from then
    on). One in a synchronising micro-step stops the job with one line; its restart continues at
    the smaller micro batch, noted in output_dir/auto_micro_batch_size."""

    def __init__(self, enabled: bool, env: DistEnv, note: Path, sampler: WindowSampler, ceiling: int):
        self.enabled, self.env, self.note, self.sampler = enabled, env, note, sampler
        self.out_of_memory = False  # this rank ran out of memory in the current window
        self.retrying = False  # the current window is dropped: it comes again in smaller micro-batches
        self.retries = 0  # windows dropped since the last record
        self.ceiling = ceiling  # the micro batch an out-of-memory error left (0: none): auto searches no higher

    @contextmanager
    def micro_step(self, syncs: bool):
        """Around one micro-step: an out-of-memory error is noted where the micro-step does not
        synchronise (`syncs`), and stops the job where it does."""
        if not self.enabled:
            yield
            return
        try:
            yield
        except torch.OutOfMemoryError as err:
            if not syncs:
                self.out_of_memory = True
                return
            raise self._oom_in_sync(err) from None

    def window_fits(self, every_micro_step_syncs: bool) -> bool:
        """Before a window's synchronising micro-step: did every rank get through the others? One
        tiny all-reduce per window (else always True). When not, every rank returns False: the
        caller drops the window's gradients, and the window comes again, smaller."""
        if not self.enabled or every_micro_step_syncs:  # nothing can have been noted
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
        self.sampler.plan = plan.with_micro_batch(
            smaller, f"{smaller} after an out-of-memory error at {plan.micro_batch_size}")
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
        ends, and the next smaller micro batch is noted for the restart (startup.auto_ceiling)."""
        smaller = self.next_micro_batch()
        if smaller:
            self.note.write_text(f"{smaller}\n")
        then = (f"its restart (torchrun --max_restarts, a requeue, --resume_from_checkpoint auto) continues from "
                f"the newest checkpoint with micro batch {smaller} ({self.note})" if smaller else
                "not even one example fits: use gradient_checkpointing, mixed_precision or a shorter max_seq_len")
        return JobFailed(f"rank {self.env.rank} ran out of memory in a synchronising micro-step at micro batch "
                         f"{self.sampler.plan.micro_batch_size} ({first_line(err)}); the job stops, {then}")


def windows_from(loader, sampler: WindowSampler, retry: "MicroBatchRetry", start_step: int,
                 total_steps: int) -> Iterator[Window]:
    """From `start_step` on, each optimizer step's window with this rank's micro-batches of `loader`
    (the step's grad_accum_steps of them, fewer in an epoch's short last window). A window dropped
    for an out-of-memory error comes again, cut into the smaller micro-batches, from the same RNG state."""
    done, random_state = start_step, None
    while done < total_steps:
        epoch, s = sampler.epoch_of(done)
        sampler.set_epoch(epoch, s)
        micro_batches = iter(loader)  # (draws the loader's seed from torch's generator)
        if random_state is not None:  # a window taken again: from where the dropped attempt began
            set_rng_state(random_state)
        end = min(sampler.steps_per_epoch, s + total_steps - done)
        while s < end:
            window = sampler.window_at(done, [next(micro_batches) for _ in range(sampler.micro_steps(s))])
            random_state = rng_state() if retry.enabled else None
            yield window
            if retry.retrying:  # the loader starts again at this window, with the smaller micro batch
                retry.retrying = False
                break
            s, done = s + 1, done + 1
