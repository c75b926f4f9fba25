"""The bare reference loop of the overhead benchmark: the same config, data windows, model,
optimizer and schedule as the entry points, and nothing else (no logging, no checkpoints, no
evaluation). It writes only `metrics.jsonl` with `step` and `elapsed_s` per optimizer step, timed
as the entry points time theirs, so steps per second compare one to one.

    python -m benchmarks.bare_loop --max_steps 40 --output_dir runs/bare   # any training flag
"""

import json
from pathlib import Path

from {{ cookiecutter.project_slug }}.config import TrainConfig, run_cli
from {{ cookiecutter.project_slug }}.model import build_model
from {{ cookiecutter.project_slug }}.optim import build_optimizer, build_scheduler
from {{ cookiecutter.project_slug }}.session import Session

from .common import clock, optimizer_step


def train(cfg: TrainConfig) -> None:
    session = Session.start(cfg, entry="bare", on_accelerate=False)
    device = session.env.device
    model = build_model(cfg, session.model_config).to(device)
    optimizer = build_optimizer(model, cfg)
    lr_scheduler = build_scheduler(optimizer, cfg, session.total_steps)
    train_loader, _ = session.loaders()
    model.train()
    start, records = clock(device), []
    for step, window, _ in session.windows(train_loader):
        optimizer_step(model, window, optimizer, cfg, device)
        lr_scheduler.step()
        records.append({"step": step, "elapsed_s": round(clock(device) - start, 3)})
    Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
    (Path(cfg.output_dir) / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


if __name__ == "__main__":
    run_cli(train)
