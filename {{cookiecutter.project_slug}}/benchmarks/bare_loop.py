"""The anchor of the GPU check: a training loop written the way karpathy/nanoGPT's train.py writes
its own, on the project's model, data windows and optimizer settings, and nothing else: TF32 (set
by startup.start), fused AdamW, bf16 autocast, torch.compile with the entry points' arguments,
accumulation with the loss divided by the micro-steps, clipping, one step per window; one process.
It logs nothing but `metrics.jsonl` with the step, its real tokens and `elapsed_s`, so its tokens
per second and MFU compare one to one with the entry points'.

    python -m benchmarks.bare_loop --max_steps 40 --output_dir runs/bare --compile true   # any training flag
"""

import json
import math
import time
from pathlib import Path

import torch

from {{ cookiecutter.project_slug }}.cli import run_cli
from {{ cookiecutter.project_slug }}.config import TrainConfig
from {{ cookiecutter.project_slug }}.model import autocast_for, build_model, count_targets, summed_loss
from {{ cookiecutter.project_slug }}.optim import build_optimizer, build_scheduler
from {{ cookiecutter.project_slug }}.session import Session
from {{ cookiecutter.project_slug }}.speed import COMPILE
from {{ cookiecutter.project_slug }}.startup import start


def train(cfg: TrainConfig) -> None:
    run = start(cfg, entry="bare")
    device = run.env.device
    model = build_model(cfg, run.model_config).to(device)
    optimizer = build_optimizer(model, cfg, device)  # fused AdamW on CUDA
    lr_scheduler = build_scheduler(optimizer, cfg, run.total_steps, run.plan)
    forward = torch.compile(model, **COMPILE) if cfg.compile else model  # the entry points' dynamic shapes
    ctx = autocast_for(cfg, device)  # bf16 autocast (nanoGPT's ctx), or none in fp32
    session = Session(run, model)
    train_loader, _ = session.loaders()
    records, began = [], time.perf_counter()
    for window in session.windows(train_loader):
        tokens = 0
        for micro_batch in window.micro_batches:
            batch = {k: v.to(device, non_blocking=True) for k, v in micro_batch.items()}
            labels = batch.pop("labels")
            targets = count_targets(micro_batch["labels"], cfg.task)
            tokens += targets
            with ctx:
                logits = forward(**batch).logits
            loss = summed_loss(logits, labels, cfg.task) / max(targets, 1)
            (loss / len(window.micro_batches)).backward()  # nanoGPT: the mean of the micro-steps' means
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm or math.inf)
        optimizer.step()
        lr_scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        records.append({"step": window.step, "tokens": tokens, "elapsed_s": round(time.perf_counter() - began, 4)})
    Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
    (Path(cfg.output_dir) / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


if __name__ == "__main__":
    run_cli(train)
