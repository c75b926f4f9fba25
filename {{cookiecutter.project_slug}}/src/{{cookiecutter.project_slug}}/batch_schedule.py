"""The batch_schedule extra: a global batch that grows during the run (global_batch_size_schedule),
the learning rate scaled with it (lr_batch_scaling), and the gradient noise scale that tells when to
grow it (noise.py). Its keys, their parsing and the lr factor; docs/batch.md says how to use them.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from .batch import BatchPlan
from .errors import ConfigError
from .extras import key


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
