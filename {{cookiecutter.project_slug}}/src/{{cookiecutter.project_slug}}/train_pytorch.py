"""Loop 1: plain PyTorch, DistributedDataParallel, gradient accumulation done by hand.

Launch: `python -m {{ cookiecutter.project_slug }}.train_pytorch` (one process), `torchrun
--nproc_per_node 2 -m ...` or `scripts/train_local.sh`; every flag overrides its key in
configs/train.yaml (`--help`). Every micro-step of a window but the last runs under `no_sync()`
(one all-reduce per optimizer step); each micro-batch's summed loss is divided by the whole window's
targets on all ranks: exactly the global batch's mean loss gradient (docs/guarantees.md).
"""

import math
from contextlib import nullcontext
from functools import partial
from pathlib import Path

import torch
from safetensors.torch import load_model, save_model
from torch.nn.parallel import DistributedDataParallel as DDP

from . import extras
from .checkpoint import load_rng, save_rng
from .cli import run_cli
from .config import TrainConfig
from .distributed import sync_counter_for, wrap_ddp
from .evaluation import evaluate
from .model import autocast_for, build_model, summed_loss
from .optim import build_optimizer, build_scheduler, clip_gradients
from .session import Session
from .speed import COMPILE
from .startup import start
from .windows import Window, finite

# The fsdp extra: the model sharded in DDP's stead where its config asks for it (else None), and a
# checkpoint's optimizer state whatever the sharding it was written with (else DDP's own)
shard = extras.plug("fsdp", "sharding:sharded", default=lambda run: None)
load_training_state = extras.plug(
    "fsdp", "sharding:load_training_state",
    default=lambda model, optimizer, folder, state: optimizer.load_state_dict(state["optimizer"]))


def train_step(ddp_model, forward, window: Window, optimizer, lr_scheduler, scaler, session: Session,
               autocast) -> dict | None:
    """One optimizer step over this rank's micro-batches of the window; `forward` is ddp_model, or its torch.compile'd
    self (the same module, so no_sync() on ddp_model holds for it). A sharded model (an extra's) is its own ddp_model,
    with a no_sync() of its own.

    The textbook loop over k micro-batches (k = grad_accum_steps, fewer in an epoch's short last window) whose boundary
    test `(index + 1) % k == 0` is `is_last` here: the only micro-step that syncs, then step, schedule, zero. None: the
    window did not fit in memory on some rank (micro_batch_size auto), and comes again."""
    cfg, env = session.cfg, session.env
    model = ddp_model.module if isinstance(ddp_model, DDP) else ddp_model
    num_targets = session.targets(window)  # real targets, all ranks (counted on the host)
    loss_sum = torch.zeros((), dtype=torch.float64, device=env.device)
    skip_sync = cfg.ddp_no_sync and hasattr(ddp_model, "no_sync")  # one process has nothing to sync
    for micro_step, micro_batch in enumerate(window.micro_batches):
        is_last = micro_step == len(window.micro_batches) - 1
        if is_last and not session.window_fits():  # micro_batch_size auto: out of memory on some rank
            optimizer.zero_grad(set_to_none=True)  # every rank drops the window; it comes again, smaller
            return None
        with session.micro_step(is_last), (ddp_model.no_sync() if skip_sync and not is_last else nullcontext()):
            batch = {k: v.to(env.device, non_blocking=True) for k, v in micro_batch.items()}
            labels = batch.pop("labels")
            with autocast():
                logits = forward(**batch).logits
            loss = summed_loss(logits, labels, cfg.task)
            # DDP (and a sharded model) averages over ranks, hence x world_size: the sum over the window and the ranks
            # is then the gradient of the global batch's mean loss.
            scaler.scale(loss * (env.world_size / num_targets)).backward()
            loss_sum += loss.detach().double()
    scaler.unscale_(optimizer)  # once per optimizer step, before clipping
    grad_norm = clip_gradients(model, cfg.max_grad_norm)  # the whole model's norm, sharded or not
    values = session.read_step(loss_sum, grad_norm, num_targets, optimizer.param_groups[0]["lr"],
                               len(window.micro_batches))  # the step's one collective and one read
    skipped = not finite(values)  # parameters, optimizer state and schedule stay put, on every rank
    if scaler.is_enabled():  # fp16: the scaler skips a step whose gradients overflowed, and halves the scale
        scale = scaler.get_scale()
        if not math.isfinite(values["loss"]):
            optimizer.zero_grad(set_to_none=True)  # nothing left to apply: its step() is a no-op
        scaler.step(optimizer)
        scaler.update()
        skipped = skipped or scaler.get_scale() < scale
        values["step_skipped"] = skipped
    elif not skipped:
        optimizer.step()
    if skipped:
        values["step_skipped"] = True
    else:  # a skipped step leaves the schedule where it is
        lr_scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return values


def train(cfg: TrainConfig) -> None:
    run = start(cfg, entry="pytorch")  # every up-front check
    env = run.env
    sharded = shard(run)  # None: DDP's, below; else the model built sharded, each process filling its own shards
    model = sharded.model if sharded else build_model(cfg, run.model_config).to(env.device)
    if run.resume is not None and (run.resume / "model.safetensors").is_file() and not sharded:  # whole weights
        load_model(model, str(run.resume / "model.safetensors"), device=str(env.device))
    optimizer = build_optimizer(model, cfg, env.device)
    lr_scheduler = build_scheduler(optimizer, cfg, run.total_steps, run.plan)
    scaler = (sharded.GradScaler if sharded else torch.amp.GradScaler)(
        env.device.type, init_scale=cfg.fp16_init_scale, enabled=cfg.mixed_precision == "fp16")
    if run.resume is not None:
        state = torch.load(run.resume / "training_state.pt", map_location=env.device, weights_only=True)
        load_training_state(model, optimizer, run.resume, state)
        lr_scheduler.load_state_dict(state["lr_scheduler"])
        scaler.load_state_dict(state["scaler"])
        load_rng(run.resume, env.rank, env.device)

    run.init_distributed()
    ddp_model, sync_counter = model, sharded.counter if sharded else None
    if env.world_size > 1 and not sharded:
        ddp_model = wrap_ddp(model, env, cfg.ddp_bucket_cap_mb, cfg.ddp_find_unused_parameters)
        sync_counter = sync_counter_for(ddp_model)
    # compiled around DDP, so that dynamo splits the graph at DDP's buckets (its DDPOptimizer);
    # a sharded model's layers are compiled on their own
    forward = torch.compile(ddp_model, **COMPILE) if cfg.compile and not sharded else ddp_model
    autocast = partial(autocast_for, cfg, env.device)
    session = Session(run, model, sync_counter=sync_counter)
    train_loader, eval_loader = session.loaders()

    def write_checkpoint(folder: Path):
        save_rng(folder, env.rank, env.device)
        training = {"lr_scheduler": lr_scheduler.state_dict(), "scaler": scaler.state_dict()}
        if sharded:  # each rank its shards (maybe in the background: their Future)
            return sharded.save(optimizer, folder, training)
        if env.is_main_process:
            save_model(model, str(folder / "model.safetensors"))
            torch.save({"optimizer": optimizer.state_dict(), **training}, folder / "training_state.pt")

    model.train()
    for window in session.windows(train_loader):
        values = train_step(ddp_model, forward, window, optimizer, lr_scheduler, scaler, session, autocast)
        if values is None:  # dropped for an out-of-memory error: the same window again, smaller
            continue
        session.log_step(window, values)
        if session.eval_due(window):
            session.log_eval(window.step, evaluate(model, eval_loader, cfg.task, env.device, autocast))
        stop = session.should_stop(window.step)  # --stop_after_steps, or a preemption signal on any process
        if stop or session.save_due(window.step):
            session.save_checkpoint(window.step, write_checkpoint)
        if stop:
            return session.stopped()

    session.save_model(model, sharded.write_weights if sharded else None)
    session.done()


def main() -> None:
    run_cli(train)


if __name__ == "__main__":
    main()
