"""Optimizer and learning-rate schedule, identical for the three entry points.

Weight decay applies to matrices (embeddings, linear weights) and not to biases or norm gains,
for every optimizer. The schedule is stepped once per optimizer step, never per micro-step.
"""

import torch
from transformers import get_scheduler
from transformers.optimization import Adafactor

from .config import TrainConfig

SCHEDULES = {"linear": "linear", "cosine": "cosine", "constant": "constant_with_warmup"}


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig, device: torch.device) -> torch.optim.Optimizer:
    """The optimizer of `model`, which trains on `device` (where AdamW may use its fused kernel)."""
    groups = param_groups(model, cfg.weight_decay)
    if cfg.optimizer == "adamw":
        fused = True if cfg.fused_adamw and device.type == "cuda" else None  # None: torch's own choice
        return torch.optim.AdamW(groups, lr=cfg.learning_rate, fused=fused)
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=cfg.learning_rate, momentum=0.0)
    return Adafactor(groups, lr=cfg.learning_rate, scale_parameter=False, relative_step=False,
                     warmup_init=False)


def total_steps(cfg: TrainConfig, steps_per_epoch: int) -> int:
    """Optimizer steps of the whole run: max_steps, or num_epochs epochs when it is -1."""
    return cfg.max_steps if cfg.max_steps > 0 else cfg.num_epochs * steps_per_epoch


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig, steps: int):
    return get_scheduler(SCHEDULES[cfg.lr_scheduler_type], optimizer,
                         num_warmup_steps=cfg.warmup_steps, num_training_steps=steps)
