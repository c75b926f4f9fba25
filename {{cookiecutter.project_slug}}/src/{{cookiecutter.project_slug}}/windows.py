"""Batch maths and accumulation windows. BatchPlan: global_batch_size = micro_batch_size x grad_accum_steps x
world_size, from the real world size at start-up. WindowSampler: the examples each optimizer step takes on this rank
(docs/data.md gives the order). Window: a step's facts as one value. finite(): whether a step's values are finite.
"""

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
from torch.utils.data import Sampler

from .errors import ConfigError


@dataclass(frozen=True)
class BatchPlan:
    micro_batch_size: int
    world_size: int
    global_batch_size: int
    chosen_by: str = ""  # how micro_batch_size auto found micro_batch_size; empty when given

    @property
    def grad_accum_steps(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.world_size)

    def table(self, max_seq_len: int) -> str:
        """The start-up table: micro x accum x world = global, and tokens per optimizer step."""
        rows = [("micro_batch_size", self.micro_batch_size), ("x grad_accum_steps", self.grad_accum_steps),
                ("x world_size", self.world_size), ("= global_batch_size", self.global_batch_size),
                ("tokens/step (at most)", self.global_batch_size * max_seq_len)]
        lines = [f"  {name:<22}{value:>10}" for name, value in rows]
        if self.chosen_by:
            lines[0] += f"   (auto: {self.chosen_by})"
        return "\n".join(lines)


def plan_batches(global_batch_size: int, micro_batch_size: int, world_size: int, chosen_by: str = "") -> BatchPlan:
    """Derive grad_accum_steps; a global batch that does not divide is a ConfigError."""
    per_micro_step = micro_batch_size * world_size
    if global_batch_size % per_micro_step:
        raise ConfigError(f"global_batch_size {global_batch_size} is not divisible by micro_batch_size "
                          f"{micro_batch_size} x world_size {world_size} = {per_micro_step}; use a multiple of "
                          f"{per_micro_step} or another micro_batch_size")
    return BatchPlan(micro_batch_size, world_size, global_batch_size, chosen_by)


@dataclass(frozen=True)
class Window:
    """One optimizer step's facts, derived once: the loops, the record and the evaluation read them here."""

    step: int  # the optimizer step this window completes (1-based)
    micro_batches: list[dict]  # this rank's (empty where the Trainer draws them itself)
    examples: np.ndarray  # the step's examples on all ranks (fewer than the global batch at an epoch's end)
    global_batch_size: int  # this step's global batch
    grad_accum_steps: int  # micro-batches per rank in a full window of this step
    micro_batch_size: int
    ends_epoch: bool


class WindowSampler(Sampler):
    """Yields this rank's micro-batches, one accumulation window (optimizer step) after another: lists of
    `(index, real)` pairs, `real` False only in filler micro-batches (docs/data.md). One global batch G
    throughout: an epoch is num_examples // G full steps, then one of the remainder."""

    per_epoch = "per epoch"  # the banner's words for steps_per_epoch

    def __init__(self, num_examples: int, plan: BatchPlan, rank: int, seed: int, min_rows: int = 1):
        self.num_examples, self.plan, self.rank, self.seed = num_examples, plan, rank, seed
        self.min_rows = min_rows  # filler rows make up the difference (at most micro_batch_size)
        self.epoch, self.start_step = 0, 0
        self._drawn: tuple[int, np.ndarray] | None = None  # (epoch, its permutation): drawn once per epoch

    def steps_in(self, epoch: int) -> int:
        return -(-self.num_examples // self.plan.global_batch_size)

    def span(self, epoch: int, step: int) -> tuple[int, int]:
        """(where step `step` of `epoch` begins in the epoch's permutation, its examples)."""
        offset = step * self.plan.global_batch_size
        return offset, min(self.plan.global_batch_size, self.num_examples - offset)

    def epoch_of(self, step: int) -> tuple[int, int]:
        """(epoch, its steps done) after `step` optimizer steps of the run."""
        return divmod(step, self.steps_in(0))

    def first_step(self, epoch: int) -> int:
        """The run's step at which `epoch` begins (the steps of the epochs before it)."""
        return epoch * self.steps_in(0)

    @property
    def steps_per_epoch(self) -> int:
        return self.steps_in(self.epoch)

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        """Choose the epoch's permutation and the optimizer step to start from (for resuming)."""
        self.epoch, self.start_step = epoch, start_step

    def permutation(self, epoch: int) -> np.ndarray:
        """The epoch's order of the training set, drawn once per epoch (a step then only slices it)."""
        if self._drawn is None or self._drawn[0] != epoch:
            order = np.random.default_rng([self.seed, epoch]).permutation(self.num_examples)
            self._drawn = epoch, order.astype(np.int32) if self.num_examples < 2**31 else order
        return self._drawn[1]

    def micro_steps(self, step: int, epoch: int | None = None) -> int:
        """Micro-batches in window `step` of `epoch` (the current one when None) on every rank (the
        step's grad_accum_steps, fewer at an epoch's end)."""
        share = math.ceil(self.span(self.epoch if epoch is None else epoch, step)[1] / self.plan.world_size)
        return math.ceil(share / self.plan.micro_batch_size)

    def window_at(self, done: int, micro_batches: list[dict] | None = None) -> "Window":
        """The facts of the run's optimizer step after `done` steps, as one value."""
        epoch, step = self.epoch_of(done)
        plan = self.plan
        return Window(done + 1, micro_batches or [], self._examples(epoch, step), plan.global_batch_size,
                      plan.grad_accum_steps, plan.micro_batch_size, ends_epoch=step + 1 == self.steps_in(epoch))

    def _examples(self, epoch: int, step: int) -> np.ndarray:
        offset, size = self.span(epoch, step)
        return self.permutation(epoch)[offset:offset + size]

    def window(self, epoch: int, step: int) -> list[list[tuple[int, bool]]]:
        order = self._examples(epoch, step).tolist()
        share = order[self.rank::self.plan.world_size]
        b = self.plan.micro_batch_size
        rows = min(self.min_rows, b)  # filler rows make a micro-batch up to this many
        parts = [[(i, True) for i in share[m * b:(m + 1) * b]] for m in range(self.micro_steps(step, epoch))]
        return [part + [(order[0], False)] * max(rows - len(part), 0) for part in parts]

    def __iter__(self):
        for step in range(self.start_step, self.steps_per_epoch):
            yield from self.window(self.epoch, step)

    def __len__(self) -> int:
        return sum(self.micro_steps(step) for step in range(self.start_step, self.steps_per_epoch))


def finite(values: dict) -> bool:
    return math.isfinite(values["loss"]) and math.isfinite(values["grad_norm"])


def windows_from(loader, sampler: WindowSampler, start_step: int, total_steps: int) -> Iterator[Window]:
    """From `start_step` on, each optimizer step's window with this rank's micro-batches of `loader`
    (the step's grad_accum_steps of them, fewer in an epoch's short last window)."""
    done = start_step
    while done < total_steps:
        epoch, first = sampler.epoch_of(done)
        sampler.set_epoch(epoch, first)
        micro_batches = iter(loader)  # (draws the loader's seed from torch's generator)
        for s in range(first, min(sampler.steps_per_epoch, first + total_steps - done)):
            yield sampler.window_at(done, [next(micro_batches) for _ in range(sampler.micro_steps(s))])
            done += 1
