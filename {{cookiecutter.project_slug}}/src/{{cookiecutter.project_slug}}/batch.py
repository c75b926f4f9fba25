"""Batch maths, in one place: global_batch_size = micro_batch_size x grad_accum_steps x world_size,
with grad_accum_steps derived from the real world size at start-up (only the number of micro-steps
changes between 1 CPU process and 4 nodes). One global batch (batch_schedule's ScheduledPlan changes it).
"""

from dataclasses import dataclass

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
