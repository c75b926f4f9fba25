"""Batch maths, in one place: global_batch_size = micro_batch_size x grad_accum_steps x world_size,
with grad_accum_steps derived from the real world size at start-up (only the number of micro-steps
changes between 1 CPU process and 4 nodes), and the global_batch_size_schedule that grows the
global batch by growing the accumulation (docs/batch.md).
"""

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from .errors import ConfigError


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


@dataclass(frozen=True)
class BatchPlan:
    micro_batch_size: int
    world_size: int
    schedule: tuple[tuple[int, int], ...]  # (from optimizer step, global batch size); the first from 0
    chosen_by: str = ""  # how micro_batch_size auto found micro_batch_size; empty when given

    @property
    def global_batch_size(self) -> int:
        """The first global batch (all of them without a schedule)."""
        return self.schedule[0][1]

    @property
    def grad_accum_steps(self) -> int:
        return self.accum_at(0)

    def global_batch_at(self, step: int) -> int:
        """The global batch of the optimizer step after `step` steps done."""
        return next(size for start, size in reversed(self.schedule) if start <= step)

    def accum_at(self, step: int) -> int:
        """Micro-batches per rank in a full window of the optimizer step after `step` steps done."""
        return self.global_batch_at(step) // (self.micro_batch_size * self.world_size)

    def with_micro_batch(self, micro_batch_size: int, chosen_by: str) -> "BatchPlan":
        """The same global batches in micro-batches of another size (a divisor of the first share)."""
        return replace(self, micro_batch_size=micro_batch_size, chosen_by=chosen_by)

    def table(self, max_seq_len: int) -> str:
        """The start-up table: micro x accum x world = global, and tokens per optimizer step."""
        rows = [
            ("micro_batch_size", self.micro_batch_size),
            ("x grad_accum_steps", self.grad_accum_steps),
            ("x world_size", self.world_size),
            ("= global_batch_size", self.global_batch_size),
            ("tokens/step (at most)", self.global_batch_size * max_seq_len),
        ]
        lines = [f"  {name:<22}{value:>10}" for name, value in rows]
        if self.chosen_by:
            lines[0] += f"   (auto: {self.chosen_by})"
        lines += [f"  from step {start:<12}{size:>10}   (grad_accum_steps {self.accum_at(start)})"
                  for start, size in self.schedule[1:]]
        return "\n".join(lines)


def plan_batches(global_batch_size: int, micro_batch_size: int, world_size: int, chosen_by: str = "",
                 schedule: str | tuple = "") -> BatchPlan:
    """Derive grad_accum_steps; a global batch that does not divide is a ConfigError. `schedule`:
    global_batch_size_schedule, parsed (parse_schedule) or as its text."""
    per_micro_step = micro_batch_size * world_size
    if global_batch_size % per_micro_step:
        raise ConfigError(
            f"global_batch_size {global_batch_size} is not divisible by micro_batch_size "
            f"{micro_batch_size} x world_size {world_size} = {per_micro_step}; use a multiple of "
            f"{per_micro_step} or another micro_batch_size"
        )
    if isinstance(schedule, str):
        schedule = parse_schedule(schedule, global_batch_size)
    return BatchPlan(micro_batch_size, world_size, schedule, chosen_by)


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


def lr_batch_factor(scaling: str, plan: BatchPlan) -> Callable[[int], float] | None:
    """lr_batch_scaling: the learning rate's factor after `step` steps, (global batch / first)^p
    with p 1/2 (sqrt) or 1 (linear); None without a schedule or scaling."""
    power = {"none": 0.0, "sqrt": 0.5, "linear": 1.0}[scaling]
    if not power or len(plan.schedule) == 1:
        return None
    return lambda step: math.pow(plan.global_batch_at(step) / plan.global_batch_size, power)
