"""Batch maths, in one place.

    global_batch_size = micro_batch_size x grad_accum_steps x world_size

`grad_accum_steps` is derived from the real world size at start-up, so the same config gives the
same optimisation on 1 CPU process, 8 GPUs or 4 nodes: only the number of micro-steps changes.
"""

from collections.abc import Callable
from dataclasses import dataclass

from .errors import ConfigError


@dataclass(frozen=True)
class BatchPlan:
    micro_batch_size: int
    grad_accum_steps: int
    world_size: int
    chosen_by: str = ""  # how micro_batch_size auto found micro_batch_size; empty when given

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.grad_accum_steps * self.world_size

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
        return "\n".join(lines)


def plan_batches(global_batch_size: int, micro_batch_size: int, world_size: int, chosen_by: str = "") -> BatchPlan:
    """Derive grad_accum_steps; a global batch that does not divide is a ConfigError."""
    per_micro_step = micro_batch_size * world_size
    if global_batch_size % per_micro_step:
        raise ConfigError(
            f"global_batch_size {global_batch_size} is not divisible by micro_batch_size "
            f"{micro_batch_size} x world_size {world_size} = {per_micro_step}; use a multiple of "
            f"{per_micro_step} or another micro_batch_size"
        )
    return BatchPlan(micro_batch_size, global_batch_size // per_micro_step, world_size, chosen_by)


def largest_fitting(per_rank: int, fits: Callable[[int], bool]) -> int:
    """The largest micro batch that fits, searched from `per_rank` (= global_batch_size /
    world_size, accumulation 1) down by halving: each candidate is the largest divisor of `per_rank`
    at most half the last one, so the global batch stays exact. 0 when even 1 does not fit."""
    candidate = per_rank
    while not fits(candidate):
        if candidate == 1:
            return 0
        candidate = max(d for d in range(1, candidate // 2 + 1) if per_rank % d == 0)
    return candidate
