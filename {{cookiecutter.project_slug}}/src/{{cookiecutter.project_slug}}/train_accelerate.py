"""Loop 2: HF Accelerate, `with accelerator.accumulate(model):`.

Launch: `python -m {{ cookiecutter.project_slug }}.train_accelerate` (one process), under `torchrun` or
`accelerate launch --config_file configs/accelerate/multi_gpu.yaml -m ...`, or `ENTRY=accelerate
scripts/train_local.sh`; every flag overrides its key in configs/train.yaml (`--help`).

Inside `accumulate()` Accelerate skips DDP's all-reduce until a window's last micro-step and the prepared
optimizer steps only when `sync_gradients`. Corrected on top: a window's length follows the data;
`accelerator.backward`'s division by gradient_accumulation_steps is multiplied back; the scheduler steps once
per optimizer step; with DeepSpeed on CPU, the world comes from DistEnv.
"""

import math

import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import (
    DeepSpeedPlugin,
    DistributedDataParallelKwargs,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    TorchDynamoPlugin,
)

from .cli import run_cli
from .config import TrainConfig
from .distributed import sync_counter_for
from .evaluation import evaluate
from .model import accelerate_fsdp_plugin, build_model, save_weights, summed_loss
from .optim import build_optimizer, build_scheduler
from .session import Session
from .speed import COMPILE
from .startup import start
from .windows import Window, finite


def train_step(accelerator: Accelerator, model, window: Window, optimizer, lr_scheduler,
               session: Session) -> dict | None:
    """One optimizer step: the accumulate() loop over this rank's micro-batches.

    The textbook loop over k micro-batches (k = grad_accum_steps, fewer in an epoch's short last
    window); Accelerate's own boundary test, `(index + 1) % k == 0`, is `accelerator.sync_gradients`,
    aligned so that it is True on the window's last micro-step. None: the window did not fit in
    memory on some rank (micro_batch_size auto), and comes again."""
    cfg, world_size, micro_batches = session.cfg, session.env.world_size, window.micro_batches
    num_targets = session.targets(window)  # real targets, all ranks (counted on the host)
    accelerator.gradient_accumulation_steps = k = window.grad_accum_steps  # this step's (the schedule's)
    accelerator.step = k - len(micro_batches)  # the window's last micro-step is the one that syncs
    lr = optimizer.param_groups[0]["lr"]  # the lr this step applies (DeepSpeed steps inside backward)
    loss_sum = torch.zeros((), dtype=torch.float64, device=accelerator.device)
    values, skipped = None, False  # set at the last micro-step: there sync_gradients is True (accelerator.step)
    for micro_step, micro_batch in enumerate(micro_batches):
        is_last = micro_step == len(micro_batches) - 1
        if is_last and not session.window_fits():  # micro_batch_size auto: out of memory on some rank
            model.zero_grad(set_to_none=True)  # every rank drops the window (the prepared optimizer
            return None  # zeroes only at a sync); it comes again, smaller
        with session.micro_step(is_last), accelerator.accumulate(model):
            batch = {key: value.to(accelerator.device, non_blocking=True) for key, value in micro_batch.items()}
            labels = batch.pop("labels")
            logits = model(**batch).logits
            loss = summed_loss(logits, labels, cfg.task)
            # x k undoes backward()'s (or DeepSpeed's) division by gradient_accumulation_steps;
            # x world_size undoes the average over ranks: the window then sums to the gradient of
            # the global batch's mean loss.
            accelerator.backward(loss * (k * world_size / num_targets))
            loss_sum += loss.detach().double()
            if accelerator.sync_gradients:  # DeepSpeed clips inside its step and reports the norm
                grad_norm = accelerator.clip_grad_norm_(model.parameters(), cfg.max_grad_norm or math.inf)
                values = session.read_step(loss_sum, grad_norm, num_targets, lr, len(micro_batches))
                # a non-finite loss or gradient norm skips the step on every rank alike: without
                # gradients the optimizer's step() changes nothing (DeepSpeed and fp16's scaler also
                # skip such a step themselves: optimizer_step_was_skipped)
                if not finite(values):
                    optimizer.zero_grad(set_to_none=True)
                optimizer.step()
                skipped = not finite(values) or accelerator.optimizer_step_was_skipped
                if not skipped:
                    lr_scheduler.step()  # fp16: a step skipped for overflow leaves the schedule
            optimizer.zero_grad()
    assert values is not None, "the window's last micro-step syncs"
    if accelerator.mixed_precision == "fp16" or skipped:
        values["step_skipped"] = skipped
    return values


def train(cfg: TrainConfig) -> None:
    run = start(cfg, entry="accelerate")  # every up-front check
    env = run.env
    on_cpu = env.device.type == "cpu"
    # Our process group, which Accelerate then uses; also what DeepSpeed on CPU needs (Accelerate
    # only starts DeepSpeed off the CPU path, and DeepSpeed's own CPU backend is oneCCL).
    run.init_distributed()
    accelerator = Accelerator(
        cpu=on_cpu and not run.deepspeed,  # without it Accelerate ignores torchrun's ranks on CPU
        gradient_accumulation_plugin=GradientAccumulationPlugin(
            num_steps=run.plan.grad_accum_steps, sync_with_dataloader=False,
            sync_each_batch=run.launch.sync_each_batch(cfg)),
        mixed_precision=cfg.mixed_precision,
        step_scheduler_with_optimizer=False,
        log_with="wandb" if cfg.report_to == "wandb" else None,
        # no buffer broadcast in every forward (distributed.wrap_ddp says why)
        kwargs_handlers=[DistributedDataParallelKwargs(bucket_cap_mb=cfg.ddp_bucket_cap_mb, broadcast_buffers=False,
                                                       find_unused_parameters=cfg.ddp_find_unused_parameters),
                         GradScalerKwargs(init_scale=cfg.fp16_init_scale)],
        deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=run.deepspeed) if run.deepspeed else None,
        # FSDP (configs/accelerate/fsdp.yaml) with gradients reduced and accumulated in fp32
        fsdp_plugin=accelerate_fsdp_plugin(cfg, run.launch),
        dynamo_plugin=TorchDynamoPlugin(**COMPILE) if cfg.compile else None,  # compiled in prepare()
    )
    if accelerator.process_index != env.rank:  # DeepSpeed on CPU (see the module docstring)
        PartialState().process_index = accelerator.state.process_index = env.rank
    # built once the Accelerator exists: under ZeRO-3 (zero3_init_flag, on by default for a stage 3
    # file) each rank then builds only its partition of the weights, never the whole model
    model = build_model(cfg, run.model_config)
    optimizer = build_optimizer(model, cfg, env.device)
    lr_scheduler = build_scheduler(optimizer, cfg, run.total_steps, run.plan)
    model, optimizer, lr_scheduler = accelerator.prepare(model, optimizer, lr_scheduler)
    sync_counter = sync_counter_for(model)
    if run.resume is not None:
        accelerator.load_state(str(run.resume))
    # keep_torch_compile=False: the default unwraps the DDP module inside a compiled model in place
    # (Accelerate's extract_model_from_parallel), after which no_sync() no longer reaches it
    unwrapped = accelerator.unwrap_model(model, keep_torch_compile=False)
    session = Session(run, unwrapped, accelerator, sync_counter)
    train_loader, eval_loader = session.loaders()

    def write_model(folder) -> None:
        # the prepared model's state (under ZeRO-3 gathered, on the main process only: None elsewhere);
        # torch.compile's wrapper prefixes its keys
        state = accelerator.get_state_dict(model)
        state = state and {key.removeprefix("_orig_mod."): value for key, value in state.items()}
        save_weights(unwrapped, folder, cfg, run.model_config, state, is_main_process=env.is_main_process,
                     save_function=accelerator.save)
        if env.is_main_process:
            run.tokenizer.save_pretrained(folder)

    model.train()
    for window in session.windows(train_loader):
        values = train_step(accelerator, model, window, optimizer, lr_scheduler, session)
        if values is None:  # dropped for an out-of-memory error: the same window again, smaller
            continue
        session.log_step(window, values)
        if session.eval_due(window):
            session.log_eval(window.step, evaluate(unwrapped, eval_loader, cfg.task, accelerator.device,
                                                   accelerator.autocast))
        stop = session.should_stop(window.step)  # --stop_after_steps, or a preemption signal on any process
        if stop or session.save_due(window.step):  # DeepSpeed's files without frozen weights (a LoRA base)
            session.save_checkpoint(window.step, lambda folder: accelerator.save_state(
                str(folder), exclude_frozen_parameters=True))
        if stop:
            return session.stopped()

    session.save_final(write_model)
    session.done()


def main() -> None:
    run_cli(train)


if __name__ == "__main__":
    main()
