"""The seam between the core and the extras: how a config key is declared, which extras the project
was baked with, and `plug` (a core module gets an extra's function where baked). A key of an extra
that is not baked is refused in one line that names it. docs/extending.md tells the story.
"""

import importlib
from dataclasses import field

from .errors import ConfigError

BAKED = frozenset("{{ cookiecutter.__extras }}".split(",")) - {""}
# Every extra, baked or not: what it adds, the module declaring its keys (`Keys`, and `check(cfg)`
# where it has one), and each key with the value that leaves the extra off.
EXTRAS = {
    "fsdp": ("FSDP2/HSDP sharding in train_pytorch, with sharded and asynchronous checkpoints", "fsdp",
             {"fsdp": "none", "fsdp_replicas": 1, "fsdp_layer_classes": "", "async_checkpoint": False}),
    "auto_batch": ("micro_batch_size auto: the micro-batch search and its out-of-memory retry", "auto_batch",
                   {"memory_budget_mb": 0.0}),
    "batch_schedule": ("a global batch that grows during the run, and the gradient noise scale", "batch_schedule",
                       {"global_batch_size_schedule": "", "lr_batch_scaling": "none"}),
    "doctor": ("the doctor (python -m {{ cookiecutter.project_slug }}.doctor) and the record of a hung collective",
               "hangs", {"debug_distributed": False}),
    "safe_checkpoints": ("a resume reads checkpoint pickles and headers first: none may run code", None, {}),
    "benchmarks": ("benchmarks/ beyond gpu_check: memory, communication, overhead, start-up", None, {}),
    "peft": ("LoRA adapters (peft) on a frozen model: small checkpoints, an adapter folder as the final model", "lora",
             {"lora_r": 0, "lora_alpha": 16, "lora_dropout": 0.0, "lora_target_modules": ""}),
    "sweeps": ("sweeps: a training run per row of overrides, as a SLURM job array or one after another", None, {}),
}
RESUME = ("match", "free", "length")  # must a resume have the checkpoint's value? (checkpoint.check_same_training)


def key(help: str, default, *, resume: str, data: bool):
    """One config key: its default, its help (--help, configs/train.yaml), whether a resume must keep
    it (`resume`: "match", "free", or "length") and whether it changes the prepared data (`data`)."""
    if resume not in RESUME:
        raise ValueError(f"resume must be one of {RESUME}, got {resume!r}")
    return field(default=default, metadata={"help": help, "resume": resume, "data": data})


def owner(name: str) -> str | None:
    return next((extra for extra, (_, _, keys) in EXTRAS.items() if name in keys), None)


def not_baked(what: str, extra: str) -> str:
    """The one line for `what` (a key, flag or value) of an extra this project was baked without."""
    return (f"{what} belongs to the extra {extra!r} ({EXTRAS[extra][0]}), which this project was baked without; "
            f"add it with `cruft update` and extras including {extra}, or re-bake (docs/extending.md)")


def require(extra: str, what: str) -> None:
    if extra not in BAKED:
        raise ConfigError(not_baked(what, extra))


def modules() -> list:
    return [importlib.import_module(f".{module}", __package__) for name, (_, module, _) in EXTRAS.items()
            if name in BAKED and module]


def plug(extra: str, where: str, default=None):
    """`where` ("module:name") of `extra` where it is baked, else `default`; called at import, one line a seam."""
    if extra not in BAKED:
        return default
    module, name = where.split(":")
    return getattr(importlib.import_module(f".{module}", __package__), name)


def check(cfg) -> None:
    for module in modules():
        if hasattr(module, "check"):
            module.check(cfg)


def recorded_off(recorded: dict) -> None:
    """A run recorded with an extra this project lacks continues only where it was off (ConfigError)."""
    for name, value in recorded.items():
        if (extra := owner(name)) and extra not in BAKED and value != EXTRAS[extra][2][name]:
            raise ConfigError(not_baked(f"the run was trained with {name} {value!r}, which", extra))
