"""The seam between the core and the extras: how a config key is declared, and which extras the
project was baked with. An extra is a training feature beside gradient accumulation itself, in
files of its own; a key of an extra that is not baked is refused in one line that names it.
docs/extending.md says how to add an extra to a project later.
"""

import importlib
from dataclasses import field

from .errors import ConfigError

BAKED = frozenset("{{ cookiecutter.__extras }}".split(",")) - {""}
# Every extra, baked or not: what it adds, the module declaring its keys (`Keys`, and `check(cfg)`
# where it has one), and each key with the value that leaves the extra off.
EXTRAS = {
    "fsdp": ("FSDP2/HSDP sharding in train_pytorch, with sharded and asynchronous checkpoints", "fsdp",
             {"fsdp": "none", "fsdp_replicas": 1, "async_checkpoint": False}),
    "auto_batch": ("micro_batch_size auto: the micro-batch search and its out-of-memory retry", "auto_batch",
                   {"memory_budget_mb": 0.0}),
    "batch_schedule": ("a global batch that grows during the run, and the gradient noise scale", "batch_schedule",
                       {"global_batch_size_schedule": "", "lr_batch_scaling": "none"}),
    "doctor": ("the doctor (python -m {{ cookiecutter.project_slug }}.doctor) and the record of a hung collective",
               "hangs", {"debug_distributed": False}),
    "benchmarks": ("benchmarks/ beyond gpu_check: memory, communication, overhead, start-up", None, {}),
}
RESUME = ("match", "free", "length")  # must a resume have the checkpoint's value? (checkpoint.check_same_training)


def key(help: str, default, *, resume: str, data: bool):
    """One config key, declared once: its default, its help (the --help text and the comment in
    configs/train.yaml), whether a resume must have the checkpoint's value (`resume`: "match", "free",
    or "length": part of the run's length) and whether it changes the prepared data (`data`: in the
    data cache's key)."""
    if resume not in RESUME:
        raise ValueError(f"resume must be one of {RESUME}, got {resume!r}")
    return field(default=default, metadata={"help": help, "resume": resume, "data": data})


def owner(name: str) -> str | None:
    """The extra that declares config key `name`, or None."""
    return next((extra for extra, (_, _, keys) in EXTRAS.items() if name in keys), None)


def not_baked(what: str, extra: str) -> str:
    """The one line for `what` (a key, flag or value) of an extra this project was baked without."""
    return (f"{what} belongs to the extra {extra!r} ({EXTRAS[extra][0]}), which this project was baked without; "
            f"add it with `cruft update` and extras including {extra}, or re-bake (docs/extending.md)")


def require(extra: str, what: str) -> None:
    """ConfigError unless `extra` is baked."""
    if extra not in BAKED:
        raise ConfigError(not_baked(what, extra))


def modules() -> list:
    """The baked extras' key modules, in the order of EXTRAS."""
    return [importlib.import_module(f".{module}", __package__) for name, (_, module, _) in EXTRAS.items()
            if name in BAKED and module]


def plug(extra: str, where: str, default=None):
    """A seam of the core: `where` ("module:name") of `extra` where that extra is baked, else
    `default` (the core's own behaviour). Core modules call this at import, one line per seam."""
    if extra not in BAKED:
        return default
    module, name = where.split(":")
    return getattr(importlib.import_module(f".{module}", __package__), name)


def key_classes() -> list[type]:
    """The baked extras' keys, each a dataclass that TrainConfig inherits."""
    return [module.Keys for module in modules()]


def check(cfg) -> None:
    """Each baked extra's checks of its own keys (ConfigError)."""
    for module in modules():
        if hasattr(module, "check"):
            module.check(cfg)


def recorded_off(recorded: dict) -> None:
    """A checkpoint or finished run written with an extra this project lacks continues only where
    that extra was off (ConfigError naming it)."""
    for name, value in recorded.items():
        extra = owner(name)
        if extra and extra not in BAKED and value != EXTRAS[extra][2][name]:
            raise ConfigError(not_baked(f"the run was trained with {name} {value!r}, which", extra))
