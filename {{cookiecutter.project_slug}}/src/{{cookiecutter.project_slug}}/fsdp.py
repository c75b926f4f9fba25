"""The fsdp extra's keys: FSDP2/HSDP in train_pytorch (sharding.py does the work)."""

from dataclasses import dataclass
from typing import Literal

from .errors import ConfigError
from .extras import key


@dataclass
class Keys:
    fsdp: Literal["none", "full_shard", "hybrid_shard"] = key(
        "train_pytorch: shard parameters, gradients and optimizer state with FSDP2 (fully_shard) instead of DDP: "
        "full_shard over every process, hybrid_shard within each of fsdp_replicas groups (HSDP).", "none",
        resume="free", data=False)
    fsdp_replicas: int = key(
        "hybrid_shard: replica groups of the mesh (replicate x shard); the world size must be a multiple.", 1,
        resume="free", data=False)
    async_checkpoint: bool = key(
        "FSDP2: write sharded checkpoints in the background while training continues.", False,
        resume="free", data=False)


def check(cfg) -> None:
    if cfg.fsdp_replicas < 1:
        raise ConfigError(f"fsdp_replicas must be >= 1, got {cfg.fsdp_replicas}")
    if cfg.fsdp_replicas > 1 and cfg.fsdp != "hybrid_shard":
        raise ConfigError(f"fsdp_replicas {cfg.fsdp_replicas} needs fsdp hybrid_shard (replicas of a sharded "
                          f"model), got fsdp {cfg.fsdp}")
