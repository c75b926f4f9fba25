"""Seed loop 3: the HF Transformers `Trainer`.

Launch (from the project root):
    python -m {{ cookiecutter.project_slug }}.train_trainer --max_steps 20                # one process
    torchrun --nproc_per_node 2 -m {{ cookiecutter.project_slug }}.train_trainer          # DDP
    accelerate launch -m {{ cookiecutter.project_slug }}.train_trainer
    ENTRY=trainer scripts/train_local.sh

Every flag overrides the key of the same name in configs/train.yaml (`--help` lists them).

The Trainer runs the accumulation itself (no_sync on all but the last micro-batch of a window,
a shorter last window at an epoch's end). `training_arguments()` is the one place our config
becomes `TrainingArguments`. What is ours on top:
- the data order: `get_train_dataloader` returns the project's per-rank window loader, so the
  Trainer sees exactly the micro-batches the other entry points see;
- the loss: `compute_loss_func` sums the loss and divides by `num_items_in_batch`, the real
  targets of the whole global batch (the Trainer counts them across micro-batches and, with
  `average_tokens_across_devices`, across ranks);
- the record: `metrics.jsonl` and W&B come from `RunRecorder`, a TrainerCallback, with the same
  keys as the other entry points (the lr is read before the optimizer step, since the Trainer
  logs it after the scheduler has moved on).
"""

import math
import shutil
import traceback
from functools import partial

import numpy as np
import torch
from accelerate.utils import GradScalerKwargs
from safetensors.torch import load_model
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from .checkpoint import checkpoints_dir, complete_checkpoints, publish
from .config import TrainConfig, run_cli
from .distributed import GradSyncCounter, all_reduce_sum, print0
from .errors import JobFailed, first_line
from .evaluation import classification_metrics, confusion_matrix
from .model import build_model, count_targets, summed_loss
from .optim import SCHEDULES, build_optimizer, build_scheduler
from .session import Session
from .tracking import Tracker


def training_arguments(cfg: TrainConfig, session: Session) -> TrainingArguments:
    """Our config as TrainingArguments: the only place the Trainer is configured.

    The Trainer writes its checkpoints (`checkpoint-<N>`) under checkpoints/; RunRecorder then
    publishes each one atomically as step_<N>, like the other entry points."""
    return TrainingArguments(
        output_dir=str(checkpoints_dir(cfg.output_dir)),
        per_device_train_batch_size=session.plan.micro_batch_size,
        per_device_eval_batch_size=session.plan.micro_batch_size,
        gradient_accumulation_steps=session.plan.grad_accum_steps,
        max_steps=session.total_steps,
        learning_rate=cfg.learning_rate,
        weight_decay=cfg.weight_decay,
        max_grad_norm=cfg.max_grad_norm,
        lr_scheduler_type=SCHEDULES[cfg.lr_scheduler_type],  # as build_scheduler; WindowTrainer builds it
        warmup_steps=cfg.warmup_steps,
        seed=cfg.seed,
        bf16=cfg.mixed_precision == "bf16",
        fp16=cfg.mixed_precision == "fp16",
        eval_strategy="steps" if cfg.eval_every else "epoch",
        eval_steps=cfg.eval_every or None,
        logging_strategy="steps",
        logging_steps=1,
        save_strategy="steps" if cfg.save_steps else "no",
        save_steps=cfg.save_steps or None,
        report_to="none",  # W&B goes through RunRecorder, with the keys every entry point uses
        deepspeed=session.deepspeed,  # --deepspeed or the accelerate config's JSON, its "auto" keys filled
        average_tokens_across_devices=True,
        ddp_bucket_cap_mb=cfg.ddp_bucket_cap_mb,  # passed on to DDP as is, fractions included
        ddp_find_unused_parameters=False,  # every parameter is used; DDP as the other entry points build it
        accelerator_config={"gradient_accumulation_kwargs": {"sync_each_batch": not cfg.ddp_no_sync}},
        disable_tqdm=True,
        remove_unused_columns=False,
        use_cpu=session.env.device.type == "cpu",
    )


class WindowTrainer(Trainer):
    """The Trainer, fed by the project's window loader (the data order of every entry point) and
    given the project's optimizer and schedule (with DeepSpeed the Trainer builds these itself,
    from TrainingArguments, which would differ from the other entry points)."""

    def __init__(self, *args, session: Session, train_loader, **kwargs):
        self.session, self.train_loader = session, train_loader  # before __init__ builds the Accelerator
        super().__init__(*args, **kwargs)

    def _build_accelerator_args(self, **kwargs) -> dict:
        args = super()._build_accelerator_args(**kwargs)
        args["kwargs_handlers"].append(GradScalerKwargs(init_scale=self.session.cfg.fp16_init_scale))
        return args

    def get_train_dataloader(self):
        return self.train_loader

    def create_optimizer(self, model=None):
        if self.optimizer is None:
            self.optimizer = build_optimizer(model or self.model, self.session.cfg)
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        if self.lr_scheduler is None:
            self.lr_scheduler = build_scheduler(optimizer or self.optimizer, self.session.cfg, num_training_steps)
        return self.lr_scheduler


class RunRecorder(TrainerCallback):
    """Counts what each optimizer step did and writes it to metrics.jsonl (and W&B); skips a step
    whose loss or gradient is not finite, as the other entry points do."""

    def __init__(self, session: Session, tracker: Tracker):
        self.session, self.tracker = session, tracker
        self.loss_sum = torch.zeros((), dtype=torch.float64)
        self.micro_steps, self.num_targets, self.lr, self.sync_counter = 0, 0, None, None
        self.loss, self.finite, self.schedule = None, True, None
        self.step_skipped = None
        self.stopped = False
        self.trainer = None

    def compute_loss(self, outputs, labels, num_items_in_batch=None):
        """compute_loss_func: summed loss over the real targets of the global batch."""
        task = self.session.cfg.task
        loss = summed_loss(outputs.logits, labels, task)
        if num_items_in_batch is None:
            num_items_in_batch = max(count_targets(labels, task), 1)
        if torch.is_grad_enabled():  # a training micro-step (evaluation runs without grad)
            self.loss_sum = self.loss_sum + loss.detach().double()  # on the loss's device
            self.micro_steps += 1
            self.num_targets = int(num_items_in_batch)
        return loss / num_items_in_batch

    def on_train_begin(self, args, state, control, **kwargs):
        wrapped = self.trainer.model_wrapped
        if isinstance(wrapped, DDP):
            self.sync_counter = GradSyncCounter(wrapped)

    def on_epoch_begin(self, args, state, control, **kwargs):
        # The epoch's permutation; set here because a resumed epoch's loader is a skipping copy.
        self.session.sampler.set_epoch(state.global_step // self.session.sampler.steps_per_epoch)

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, lr_scheduler=None, model=None, **kwargs):
        self.lr = optimizer.param_groups[0]["lr"]  # the lr this step applies
        # One host sync per optimizer step: the window's loss (all ranks) and whether the (clipped)
        # gradients are finite. A step where either is not is skipped on every rank alike: without
        # gradients the optimizer's step() changes nothing, and on_step_end puts the schedule back.
        # (DeepSpeed keeps the gradients itself and skips such a step on its own.)
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
        loss_total, norm = torch.stack([all_reduce_sum(self.loss_sum.to(args.device)),
                                        norm.to(args.device, torch.float64)]).tolist()
        self.loss = loss_total / max(self.num_targets, 1)
        self.finite = math.isfinite(loss_total) and math.isfinite(norm)
        if not self.finite:
            for p in model.parameters():
                p.grad = None
            self.schedule = lr_scheduler.state_dict()

    def on_step_end(self, args, state, control, optimizer=None, lr_scheduler=None, **kwargs):
        if not self.finite:  # the Trainer moved the schedule after the skipped step: put it back
            lr_scheduler.load_state_dict(self.schedule)
            for group, lr in zip(optimizer.param_groups, self.schedule["_last_lr"], strict=True):
                group["lr"] = lr
        # fp16, DeepSpeed: the Trainer moved the schedule only when their own check did not skip the step
        skipped = not self.finite or self.trainer.accelerator.optimizer_step_was_skipped
        self.step_skipped = skipped if (args.fp16 or skipped) else None
        self.session.job_steps += 1
        if self.session.should_stop(state.global_step):
            control.should_save = control.should_training_stop = True
            self.stopped = True

    def on_epoch_end(self, args, state, control, **kwargs):
        # Stopped mid-epoch (stop_after_steps, preemption): the epoch's evaluation comes after the resume.
        if self.stopped and state.global_step % self.session.sampler.steps_per_epoch:
            control.should_evaluate = False

    def on_save(self, args, state, control, **kwargs):
        step, cfg = state.global_step, self.session.cfg
        written = checkpoints_dir(cfg.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{step}"
        publish(cfg, self.session.env, written, checkpoints_dir(cfg.output_dir) / f"step_{step}",
                self.session.state(step))

    def on_log(self, args, state, control, logs=None, **kwargs):
        if "loss" in logs:
            values = {"loss": self.loss, "lr": self.lr, "grad_norm": logs.get("grad_norm"),
                      "tokens": self.num_targets, "micro_steps": self.micro_steps}
            if self.step_skipped is not None:
                values["step_skipped"] = self.step_skipped
            if self.sync_counter is not None:
                values["grad_sync_calls"] = self.sync_counter.take()
            self.tracker.log(self.session.record(state.global_step, values, self.tracker.elapsed()))
            self.session.check_finite(state.global_step, values, self.tracker)
            self.loss_sum = torch.zeros((), dtype=torch.float64)
            self.micro_steps = 0
        eval_keys = {k: v for k, v in logs.items()
                     if k.startswith("eval_") and not k.endswith(("_runtime", "_per_second"))}
        if eval_keys:
            self.tracker.log({"step": state.global_step, **eval_keys})


def eval_summaries(logits: torch.Tensor, labels: torch.Tensor, task: str) -> torch.Tensor:
    """preprocess_logits_for_metrics: per example (summed loss, real targets, prediction), so
    evaluation gathers three numbers per example instead of its logits."""
    per_example = [summed_loss(logits[i:i + 1], labels[i:i + 1], task) for i in range(len(labels))]
    counts = [count_targets(labels[i:i + 1], task) for i in range(len(labels))]
    prediction = logits.argmax(-1) if task == "sequence_classification" else torch.zeros(len(labels))
    return torch.stack([torch.stack(per_example).float(), torch.tensor(counts, dtype=torch.float32,
                        device=logits.device), prediction.float().view(len(labels), -1)[:, -1]], dim=1)


def compute_metrics(eval_prediction, task: str, num_labels: int) -> dict:
    """Mean loss over real targets (returned as `loss`, which the Trainer reports as eval_loss in
    place of its per-batch average), plus perplexity or accuracy and F1."""
    summary = np.asarray(eval_prediction.predictions)
    loss = float(summary[:, 0].sum() / max(summary[:, 1].sum(), 1.0))
    if task == "causal_lm":
        return {"loss": loss, "perplexity": float(np.exp(min(loss, 50.0)))}
    labels = np.asarray(eval_prediction.label_ids).astype(np.int64)
    confusion = confusion_matrix(labels, summary[:, 2].astype(np.int64), num_labels)
    metrics = classification_metrics(confusion)
    return {"loss": loss, "accuracy": metrics["eval_accuracy"], "f1": metrics["eval_f1"]}


def train(cfg: TrainConfig) -> None:
    session = Session.start(cfg, entry="trainer", on_accelerate=True)  # every input check, before any waiting
    model = build_model(cfg, session.model_config)
    session.init_distributed()  # the process group the Trainer then uses
    if session.start_step >= session.total_steps:  # trained to the end, stopped before final_model was saved
        load_model(model, str(session.resume / "model.safetensors"))
        session.save_model(session.start_step, model)
        session.done(session.start_step)
        return
    args = training_arguments(cfg, session)
    print0(session.banner("train_trainer", model))
    train_loader, _ = session.loaders()
    tracker = Tracker(cfg, session.env, session.plan, resumed=session.resume is not None)
    recorder = RunRecorder(session, tracker)
    trainer = WindowTrainer(
        model=model,
        args=args,
        train_dataset=session.data["train"],
        eval_dataset=session.data["validation"],
        data_collator=train_loader.collate_fn,
        processing_class=session.tokenizer,
        compute_loss_func=recorder.compute_loss,
        compute_metrics=partial(compute_metrics, task=cfg.task,
                                num_labels=getattr(session.model_config, "num_labels", 2)),
        preprocess_logits_for_metrics=partial(eval_summaries, task=cfg.task),
        callbacks=[recorder],
        session=session,
        train_loader=train_loader,
    )
    recorder.trainer = trainer
    try:
        trainer.train(resume_from_checkpoint=str(session.resume) if session.resume else None)
    except Exception as err:  # the Trainer writes its checkpoints itself: a full disk ends here
        if not any(frame.name == "_save_checkpoint" for frame in traceback.extract_tb(err.__traceback__)):
            raise
        if session.env.is_main_process:  # the Trainer's unpublished checkpoint-<N>: never read, free its space
            for partial_write in checkpoints_dir(cfg.output_dir).glob(f"{PREFIX_CHECKPOINT_DIR}-*"):
                shutil.rmtree(partial_write, ignore_errors=True)
        newest = complete_checkpoints(cfg.output_dir)
        kept = f"the newest complete checkpoint is {newest[-1]}" if newest else "no checkpoint was completed before"
        raise JobFailed(f"could not write a checkpoint ({type(err).__name__}: {first_line(err)}); {kept}: free "
                        "space and resume it with --resume_from_checkpoint auto") from None
    if recorder.stopped:
        print0(session.stopping(trainer.state.global_step))
        tracker.finish()
        return
    session.save_final(trainer.state.global_step, trainer.save_model)
    session.done(trainer.state.global_step, tracker)


def main() -> None:
    run_cli(train)


if __name__ == "__main__":
    main()
