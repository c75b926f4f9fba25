"""The fsdp extra's keys, what cannot go with them, and the pickled index of its sharded
checkpoints (what a resume's check of the files lets it name): FSDP2/HSDP in train_pytorch, which
sharding.py does. Light on purpose: the config is built from it.
"""

import pickle
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
    fsdp_layer_classes: str = key(
        "FSDP2: the class names of the layers each sharded as a unit of its own, comma-separated (e.g. "
        "LlamaDecoderLayer); empty: the model's _no_split_modules.", "", resume="free", data=False)
    async_checkpoint: bool = key(
        "FSDP2: write sharded checkpoints in the background while training continues.", False,
        resume="free", data=False)


def check(cfg) -> None:
    if cfg.fsdp_replicas < 1:
        raise ConfigError(f"fsdp_replicas must be >= 1, got {cfg.fsdp_replicas}")
    if cfg.fsdp_replicas > 1 and cfg.fsdp != "hybrid_shard":
        raise ConfigError(f"fsdp_replicas {cfg.fsdp_replicas} needs fsdp hybrid_shard (replicas of a sharded "
                          f"model), got fsdp {cfg.fsdp}")


def check_launch(cfg, env, entry: str) -> None:
    """train_pytorch's own FSDP2 (`fsdp`) and what cannot go with it (launch.check_back_end)."""
    if cfg.fsdp == "none":
        if cfg.async_checkpoint:
            raise ConfigError("async_checkpoint writes sharded checkpoints in the background: it needs --fsdp "
                              "full_shard or hybrid_shard; drop it for a run without fsdp")
        return
    if entry != "pytorch":
        raise ConfigError(f"fsdp {cfg.fsdp} is train_pytorch's FSDP2; train_{entry} shards through its library's "
                          "own switch on GPUs (accelerate launch --config_file configs/accelerate/fsdp.yaml): "
                          "use train_pytorch, or set fsdp none")
    if env.world_size % cfg.fsdp_replicas:
        raise ConfigError(f"fsdp_replicas {cfg.fsdp_replicas} does not divide the world size {env.world_size}: "
                          "hybrid_shard needs replica groups of equal size; use a divisor of it")
    if cfg.optimizer == "adafactor":
        raise ConfigError("optimizer adafactor keeps factored statistics that FSDP2's sharded parameters do not "
                          "support; use adamw or sgd under fsdp")
    if not cfg.ddp_no_sync:
        raise ConfigError("ddp_no_sync false is DDP's (an all-reduce every micro-step); under fsdp choose the "
                          "gradient sync with fsdp_grad_sync micro_step or window")
    if cfg.micro_batch_size == "auto":
        raise ConfigError("micro_batch_size auto measures DDP's memory per process, not a sharded model's; give "
                          "a number under fsdp (or measure it: python -m benchmarks.memory)")


# A sharded checkpoint's index (torch.distributed.checkpoint's `.metadata`, which it reads with a
# plain pickle.load) may name its own record classes, paths, sizes, dtypes and layouts; the shards
# themselves DCP reads with weights_only=True.
DCP_GLOBALS = {
    *(("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "ChunkStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("pathlib", "PosixPath"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    *(("torch", name) for name in ("float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8",
                                   "uint8", "bool")),
}


def dcp_index_problem(data: bytes) -> str:
    """Why an index, whose pickle names only DCP's own classes (so unpickling it runs nothing
    else), is not DCP's Metadata, or ""."""
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        return "" if isinstance(pickle.loads(data), Metadata) else "is not the index of a sharded checkpoint"
    except Exception:  # a pickle that breaks off, or builds its classes wrongly
        return "is not the index of a sharded checkpoint"


# The pickles of its checkpoints that are no torch files (checkpoint_checks.check_file): name -> what they
# may name, and what else is wrong with them
PICKLED_INDEXES = {".metadata": (DCP_GLOBALS, dcp_index_problem)}
