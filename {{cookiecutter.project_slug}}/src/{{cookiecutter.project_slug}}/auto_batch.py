"""The auto_batch extra's keys: micro_batch_size auto (memory.py searches, windows.py retries)."""

from dataclasses import dataclass

from .errors import ConfigError
from .extras import key


@dataclass
class Keys:
    memory_budget_mb: float = key(
        "With micro_batch_size auto: the peak MiB one micro-step may use (0: the device's memory, "
        "found by trying; on CPU a budget is needed to search).", 0.0, resume="free", data=False)


def check(cfg) -> None:
    if cfg.memory_budget_mb < 0:
        raise ConfigError(f"memory_budget_mb must be >= 0, got {cfg.memory_budget_mb}")
