"""The batch_schedule extra's keys: a global batch that grows during the run."""

from dataclasses import dataclass
from typing import Literal

from .batch import parse_schedule
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
