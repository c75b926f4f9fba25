"""The batch_schedule extra: a global batch that grows during the run (global_batch_size_schedule),
the learning rate scaled with it (lr_batch_scaling), and the gradient noise scale that tells when to
grow it (noise.py). Its keys, the plan and the sampler that follow a schedule, the lr factor;
docs/batch.md says how to use them.
"""

import bisect
import functools
import itertools
import math
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from typing import Literal

from .errors import ConfigError
from .extras import key
from .windows import BatchPlan, Window, WindowSampler


@dataclass
class Keys:
    global_batch_size_schedule: str = key(
        "Grow the global batch during the run: \"0:32,20:64,50:128\" (from optimizer step 20 the global batch "
        "is 64, ...); the first size is global_batch_size, each one a multiple of the one before; the micro "
        "batch stays, the accumulation follows. Empty: global_batch_size throughout.", "",
        resume="match", data=False)
    lr_batch_scaling: Literal["none", "sqrt", "linear"] = key(
        "With global_batch_size_schedule: scale the learning rate with the global batch (sqrt or linear in "
        "global batch / the first); none keeps the schedule's lr. No effect without a schedule.", "none",
        resume="match", data=False)


def check(cfg) -> None:
    parse_schedule(cfg.global_batch_size_schedule, cfg.global_batch_size)


@functools.cache  # parsed once: config.py's check, then startup's schedule_of reuse the result
def parse_schedule(text: str, global_batch_size: int) -> tuple[tuple[int, int], ...]:
    """`global_batch_size_schedule` as ((from_step, size), ...); empty: global_batch_size throughout.
    Raises ConfigError naming what is wrong."""
    if not text.strip():
        return ((0, global_batch_size),)
    schedule = []
    for part in text.split(","):
        step, colon, size = part.strip().partition(":")
        if not (colon and step.strip().isdigit() and size.strip().isdigit()):
            raise ConfigError(f"global_batch_size_schedule {text!r}: {part.strip()!r} is not STEP:SIZE (whole "
                              "numbers), e.g. \"0:32,20:64,50:128\"")
        schedule.append((int(step), int(size)))
    if schedule[0][0] != 0 or schedule[0][1] != global_batch_size:
        raise ConfigError(f"global_batch_size_schedule {text!r} must start with 0:{global_batch_size} (step 0 at "
                          f"global_batch_size {global_batch_size})")
    for (step, size), (next_step, next_size) in zip(schedule, schedule[1:], strict=False):
        if next_step <= step:
            raise ConfigError(f"global_batch_size_schedule {text!r}: steps must increase, {next_step} follows {step}")
        if next_size <= size or next_size % size:
            raise ConfigError(f"global_batch_size_schedule {text!r}: {next_size} (from step {next_step}) must be a "
                              f"larger multiple of {size}, the size before it")
    return tuple(schedule)


def schedule_of(cfg, launch) -> tuple[tuple[int, int], ...]:
    """The run's schedule (startup.start), refused where the entry point cannot follow it."""
    schedule = parse_schedule(cfg.global_batch_size_schedule, cfg.global_batch_size)
    grows = len(schedule) > 1
    if grows and launch.entry == "trainer":
        raise ConfigError("train_trainer cannot follow global_batch_size_schedule: the Trainer fixes "
                          "gradient_accumulation_steps for the whole run in its own loop; use train_pytorch or "
                          "train_accelerate, or drop the schedule")
    if grows and launch.deepspeed_path:
        raise ConfigError("global_batch_size_schedule with DeepSpeed: DeepSpeed's engine fixes its batch keys "
                          "(gradient_accumulation_steps, train_batch_size) when it starts; drop --deepspeed or the "
                          "schedule")
    return schedule


def lr_batch_factor(cfg, plan: BatchPlan) -> Callable[[int], float] | None:
    """lr_batch_scaling: the learning rate's factor after `step` steps, (global batch / first)^p
    with p 1/2 (sqrt) or 1 (linear); None without a schedule or scaling."""
    power = {"none": 0.0, "sqrt": 0.5, "linear": 1.0}[cfg.lr_batch_scaling]
    if not power or len(plan.schedule) == 1:
        return None
    return lambda step: math.pow(plan.global_batch_at(step) / plan.global_batch_size, power)


@dataclass(frozen=True)
class ScheduledPlan(BatchPlan):
    """A batch plan whose global batch changes at given optimizer steps (global_batch_size is the first)."""

    schedule: tuple[tuple[int, int], ...] = ()  # (from optimizer step, global batch size); the first from 0

    def global_batch_at(self, step: int) -> int:
        """The global batch of the optimizer step after `step` steps done."""
        return next(size for start, size in reversed(self.schedule) if start <= step)

    def accum_at(self, step: int) -> int:
        """Micro-batches per rank in a full window of the optimizer step after `step` steps done."""
        return self.global_batch_at(step) // (self.micro_batch_size * self.world_size)

    def table(self, max_seq_len: int) -> str:
        return "\n".join([super().table(max_seq_len), *(
            f"  from step {start:<12}{size:>10}   (grad_accum_steps {self.accum_at(start)})"
            for start, size in self.schedule[1:])])


def scheduled(plan: BatchPlan, schedule: tuple[tuple[int, int], ...]) -> ScheduledPlan:
    """`plan` following `schedule` (((0, its global batch), ...): startup's plan)."""
    return ScheduledPlan(**asdict(plan), schedule=schedule)


class ScheduledSampler(WindowSampler):
    """WindowSampler under a ScheduledPlan: each step of an epoch takes the schedule's global batch for
    the run's step (the epoch's last, the remainder), so epochs differ and keep counting the run's steps."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._firsts = [0]  # the run's step at which each epoch begins (and the one after the last known)
        self._sizes: tuple[int, tuple[list[int], list[int]]] | None = None  # (epoch, _epoch(epoch))

    @property
    def per_epoch(self) -> str:
        return "in the first epoch" if len(self.plan.schedule) > 1 else "per epoch"

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

    def steps_in(self, epoch: int) -> int:
        return len(self.epoch_sizes(epoch))

    def span(self, epoch: int, step: int) -> tuple[int, int]:
        sizes, offsets = self._epoch(epoch)
        return offsets[step], sizes[step]

    def epoch_of(self, step: int) -> tuple[int, int]:
        while self._firsts[-1] <= step:
            self._firsts.append(self._firsts[-1] + sum(count for _, count in self._runs(self._firsts[-1])))
        epoch = bisect.bisect_right(self._firsts, step) - 1
        return epoch, step - self._firsts[epoch]

    def first_step(self, epoch: int) -> int:
        while len(self._firsts) <= epoch:
            self.epoch_of(self._firsts[-1])
        return self._firsts[epoch]

    def window_at(self, done: int, micro_batches: list[dict] | None = None) -> Window:
        return replace(super().window_at(done, micro_batches), global_batch_size=self.plan.global_batch_at(done),
                       grad_accum_steps=self.plan.accum_at(done))
