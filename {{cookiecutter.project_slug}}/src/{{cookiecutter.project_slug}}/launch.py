"""How this job was launched (`Launch`, read once): the entry point, its back end, the DeepSpeed file and FSDP; what
each cannot run is refused, and the launcher's and DeepSpeed's copies of the batch numbers are checked against ours (one
line, exit code 2) or filled where they say "auto". docs/launching.md tells the story.
"""

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

from accelerate.utils import is_deepspeed_available

from . import extras
from .config import TrainConfig
from .distributed import DistEnv
from .errors import ConfigError
from .windows import BatchPlan

check_sharding = extras.plug("fsdp", "fsdp:check_launch", default=lambda cfg, env, entry: None)


@dataclass(frozen=True)
class Launch:
    """What the command line and the launcher chose, read once at start-up."""

    entry: str  # pytorch | accelerate | trainer (| bare, the benchmark's loop): the checkpoint format
    deepspeed_path: str  # --deepspeed, or the DeepSpeed JSON `accelerate launch` names; "" for none
    fsdp: bool  # `accelerate launch` was given an FSDP config (it exports ACCELERATE_USE_FSDP)

    @property
    def on_accelerate(self) -> bool:
        """train_accelerate and train_trainer run on Accelerate (DeepSpeed, FSDP, its precision)."""
        return self.entry in ("accelerate", "trainer")

    @property
    def backend(self) -> str:
        return "deepspeed" if self.on_accelerate and self.deepspeed_path else "ddp"

    def sync_each_batch(self, cfg: TrainConfig) -> bool:
        """Accelerate's sync_each_batch: fsdp_grad_sync's under its FSDP (micro_step: sharded gradients), else DDP's."""
        return cfg.fsdp_grad_sync == "micro_step" if self.fsdp else not cfg.ddp_no_sync


def launch_of(cfg: TrainConfig, entry: str) -> Launch:
    """The launch; its DeepSpeed JSON is --deepspeed, or the one `accelerate launch` names."""
    from_launcher = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "")
    if cfg.deepspeed and from_launcher and Path(cfg.deepspeed).resolve() != Path(from_launcher).resolve():
        raise ConfigError(f"--deepspeed {cfg.deepspeed} and the accelerate config's deepspeed_config_file "
                          f"{from_launcher} differ; give one of them")
    return Launch(entry, cfg.deepspeed or from_launcher,
                  os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true")


def check_back_end(cfg: TrainConfig, env: DistEnv, launch: Launch) -> None:
    """Refuse what the entry point cannot run, instead of letting it train something else silently."""
    entry, on_accelerate, fsdp = launch.entry, launch.on_accelerate, launch.fsdp
    if not on_accelerate and launch.deepspeed_path:
        raise ConfigError(f"train_{entry} does not run DeepSpeed; use train_accelerate or train_trainer with "
                          "--deepspeed, or drop --deepspeed")
    if launch.deepspeed_path and not is_deepspeed_available():
        raise ConfigError(f"DeepSpeed config {launch.deepspeed_path}: DeepSpeed is not installed; pip install -e "
                          "'.[deepspeed]'")
    if not on_accelerate and fsdp:
        raise ConfigError(f"train_{entry} shards with its own --fsdp full_shard (FSDP2), not through an accelerate "
                          "config; launch it with torchrun, or train_accelerate with configs/accelerate/fsdp.yaml")
    check_sharding(cfg, env, entry)
    if fsdp and env.device.type == "cpu":
        raise ConfigError("FSDP needs GPUs: on CPU Accelerate ignores the FSDP config and would train plain DDP; "
                          "use configs/accelerate/multi_gpu.yaml on CPU, fsdp.yaml on GPUs")
    if cfg.compile and env.world_size > 1 and cfg.ddp_bucket_cap_mb < 1 and not launch.deepspeed_path:
        raise ConfigError(f"compile with DDP needs ddp_bucket_cap_mb >= 1, got {cfg.ddp_bucket_cap_mb:g}: "
                          "torch.compile splits the graph at DDP's buckets and refuses buckets smaller than DDP's "
                          "first one (1 MiB)")
    if cfg.attn_implementation == "flash_attention_2" and env.device.type != "cuda":  # its package: with_attention
        raise ConfigError("attn_implementation flash_attention_2 needs a CUDA GPU, and this machine has none; use auto")
    if on_accelerate and cfg.mixed_precision == "fp16" and env.device.type == "cpu":
        raise ConfigError("mixed_precision fp16 on CPU: Accelerate (and the Trainer on it) runs no fp16 autocast "
                          "or loss scaling on CPU and would train in fp32; use bf16 on CPU, or train_pytorch")


def check_launcher_env(plan: BatchPlan) -> None:
    """`accelerate launch` exports the YAML's gradient_accumulation_steps; it must be ours."""
    value = os.environ.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS")
    if value not in (None, "", "auto") and int(value) != plan.grad_accum_steps:
        raise ConfigError(f"the accelerate config sets gradient_accumulation_steps {value}, but global_batch_size "
                          f"{plan.global_batch_size} / (micro_batch_size {plan.micro_batch_size} x world_size "
                          f"{plan.world_size}) gives {plan.grad_accum_steps}; remove it from the YAML "
                          "(train.yaml decides)")


def deepspeed_config(cfg: TrainConfig, plan: BatchPlan, path: str) -> dict | None:
    """The DeepSpeed config at `path` (None without one), every "auto" filled from ours; disagreements refused."""
    if not path:
        return None
    try:
        config = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"DeepSpeed config {path} not found; pass --deepspeed configs/deepspeed/zero2.json") from None
    except (OSError, ValueError) as err:
        raise ConfigError(f"DeepSpeed config {path} is not valid JSON: {err}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"DeepSpeed config {path} must hold a JSON object of settings, got {type(config).__name__}")
    zero = config.get("zero_optimization")
    stage = zero.get("stage") if isinstance(zero, dict) else None
    if type(stage) is not int or stage not in (1, 2, 3):
        raise ConfigError(f"DeepSpeed config {path}: zero_optimization.stage is {stage!r}, not 1, 2 or 3; DeepSpeed "
                          "trains here with ZeRO (configs/deepspeed/), and without it as DDP: drop --deepspeed")
    ours = {"train_micro_batch_size_per_gpu": plan.micro_batch_size, "gradient_accumulation_steps":
            plan.grad_accum_steps, "train_batch_size": plan.global_batch_size, "gradient_clipping": cfg.max_grad_norm}
    for key, value in ours.items():
        theirs = config.get(key, "auto")
        if theirs == "auto":
            config[key] = value
        elif not isinstance(theirs, (int, float)) or float(theirs) != float(value):
            raise ConfigError(f"DeepSpeed config {path} sets {key} {theirs!r} but this run derives {value} "
                              f"(global_batch_size {plan.global_batch_size}, micro_batch_size {plan.micro_batch_size}, "
                              f"world_size {plan.world_size}, max_grad_norm {cfg.max_grad_norm}); set it to \"auto\"")
    for precision in ("bf16", "fp16"):
        section = config.setdefault(precision, {})
        wanted = cfg.mixed_precision == precision
        if section.get("enabled", "auto") == "auto":
            section["enabled"] = wanted
        elif bool(section["enabled"]) != wanted:
            raise ConfigError(f"DeepSpeed config {path} sets {precision}.enabled {section['enabled']} but "
                              f"mixed_precision is {cfg.mixed_precision!r}; set it to \"auto\"")
    if cfg.mixed_precision == "fp16":  # DeepSpeed's own loss scaler starts at 2**initial_scale_power
        power = math.log2(cfg.fp16_init_scale)
        theirs = config["fp16"].get("initial_scale_power", "auto")
        if theirs == "auto" and power.is_integer():
            config["fp16"]["initial_scale_power"] = int(power)
        elif theirs == "auto" or float(theirs) != power:
            raise ConfigError(f"DeepSpeed config {path}: fp16 initial_scale_power {theirs!r} and fp16_init_scale "
                              f"{cfg.fp16_init_scale:g} disagree; DeepSpeed needs a power of 2: set fp16_init_scale to "
                              "one and initial_scale_power to \"auto\"")
    return config
