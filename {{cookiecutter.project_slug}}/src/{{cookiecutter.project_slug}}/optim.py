"""Optimizer and learning-rate schedule, identical for the three entry points: weight decay on
matrices only (not biases or norm gains); the schedule steps once per optimizer step.
"""

import math

import torch
from transformers import get_scheduler
from transformers.optimization import Adafactor

from .config import TrainConfig
from .distributed import full_norm
from .extras import plug
from .windows import BatchPlan

lr_batch_factor = plug("batch_schedule", "batch_schedule:lr_batch_factor", default=lambda cfg, plan: None)
SCHEDULES = {"linear": "linear", "cosine": "cosine", "constant": "constant_with_warmup"}


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices, none on biases and norms: by each parameter's whole shape (under
    ZeRO-3 a partitioned parameter's own tensor is flat and empty; DeepSpeed keeps the shape in ds_shape)."""
    params = [p for p in model.parameters() if p.requires_grad]
    matrix = [len(getattr(p, "ds_shape", p.shape)) >= 2 for p in params]
    groups = [{"params": [p for p, m in zip(params, matrix, strict=True) if m], "weight_decay": weight_decay},
              {"params": [p for p, m in zip(params, matrix, strict=True) if not m], "weight_decay": 0.0}]
    return [group for group in groups if group["params"]]  # DeepSpeed drops an empty one (LoRA's: no biases)


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig, device: torch.device) -> torch.optim.Optimizer:
    """The optimizer of `model`, which trains on `device` (where AdamW may use its fused kernel)."""
    groups = param_groups(model, cfg.weight_decay)
    if cfg.optimizer == "adamw":
        fused = True if cfg.fused_adamw and device.type == "cuda" else None  # None: torch's own choice
        return torch.optim.AdamW(groups, lr=cfg.learning_rate, fused=fused)
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=cfg.learning_rate, momentum=0.0)
    return Adafactor(groups, lr=cfg.learning_rate, scale_parameter=False, relative_step=False, warmup_init=False)


def clip_gradients(model: torch.nn.Module, max_grad_norm: float) -> torch.Tensor:
    """Clip to `max_grad_norm` (0: no clipping) by the whole model's gradient norm and return it; of sharded
    gradients (DTensors) that is the full norm, not this rank's part of it."""
    parameters = [p for p in model.parameters() if p.grad is not None]
    norm = full_norm(torch.nn.utils.get_total_norm([p.grad for p in parameters]))
    torch.nn.utils.clip_grads_with_norm_(parameters, max_grad_norm or math.inf, norm)
    return norm


def total_steps(cfg: TrainConfig, sampler) -> int:
    return cfg.max_steps if cfg.max_steps > 0 else sampler.first_step(cfg.num_epochs)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig, steps: int, plan: BatchPlan):
    """The lr schedule over `steps` optimizer steps, linear and cosine decaying to min_lr_ratio x learning_rate; with
    lr_batch_scaling (batch_schedule) each step's lr scales with its global batch (a skipped step is not counted)."""
    scheduler = get_scheduler(SCHEDULES[cfg.lr_scheduler_type], optimizer,
                              num_warmup_steps=cfg.warmup_steps, num_training_steps=steps)
    if cfg.lr_scheduler_type != "constant" and cfg.min_lr_ratio:  # after warmup, decay from 1 to the floor
        floor, warmup = cfg.min_lr_ratio, cfg.warmup_steps
        scheduler.lr_lambdas = [lambda step, f=f: f(step) if step < warmup else floor + (1 - floor) * f(step)
                                for f in scheduler.lr_lambdas]
    factor = lr_batch_factor(cfg, plan)
    if factor is not None:  # LambdaLR's own hook; 1 at step 0, so the first lr is unchanged
        scheduler.lr_lambdas = [lambda step, f=f: f(step) * factor(step) for f in scheduler.lr_lambdas]
    return scheduler
