"""What train_trainer.py puts into the HF `Trainer` so that it trains exactly as the other two entry points do,
each adapter replacing a library default through the Trainer's public hooks: WindowTrainer, WindowLoss (the loss
normalisation), RunRecorder (records, non-finite steps, checkpoints, stopping), eval_summaries and compute_metrics.
"""

from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_model
from transformers import PrinterCallback, Trainer, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from .checkpoint import checkpoints_dir, publish
from .distributed import sync_counter_for
from .evaluation import confusion_matrix, eval_metrics
from .model import accelerate_fsdp_plugin, count_targets, save_weights, summed_loss
from .optim import build_optimizer, build_scheduler
from .windows import finite


class WindowTrainer(Trainer):
    """The Trainer with the project's window loader (the same micro-batches in the same windows as the other
    loops), optimizer and scheduler (which DeepSpeed would ignore if passed in), fp16 scale (fp16_init_scale), FSDP
    plugin (fp32 reduction) and progress line; no FLOP count (it walks the parameters every micro-step); a
    model_factory model saved and loaded as the other loops do (safetensors refuses tied weights' state dict)."""

    def __init__(self, *args, session, train_loader, **kwargs):
        self.session, self.train_loader = session, train_loader
        super().__init__(*args, **kwargs)
        if (scaler := self.accelerator.scaler) is not None:
            scaler.load_state_dict({**scaler.state_dict(), "scale": session.cfg.fp16_init_scale})
        self.remove_callback(PrinterCallback)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        if not self.session.cfg.model_factory:
            return super()._save(output_dir, state_dict)
        folder = Path(output_dir or self.args.output_dir)
        folder.mkdir(parents=True, exist_ok=True)
        save_weights(self.model, folder, self.session.cfg, self.session.run.model_config, state_dict)
        self.processing_class.save_pretrained(folder)
        return None

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        if not self.session.cfg.model_factory:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        load_model(model or self.model, str(Path(resume_from_checkpoint) / "model.safetensors"))
        return None

    def _build_accelerator_args(self, **kwargs) -> dict:
        kwargs["fsdp_plugin"] = accelerate_fsdp_plugin(self.session.cfg, self.session.run.launch)
        return super()._build_accelerator_args(**kwargs)

    def get_train_dataloader(self):
        return self.train_loader

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device):
        """A training window's divisor: its real targets on all ranks as the labelling rule counts them
        (Session.targets, as the other loops). The Trainer's own count keeps each row's first label for a model
        it does not know as a causal LM (GPT-2, a model_factory's), and gathers it from every rank."""
        if not torch.is_grad_enabled():  # an evaluation batch (compute_metrics replaces the loss it gives)
            return super()._get_num_items_in_batch(batch_samples, device)
        return self.session.targets(self.session.sampler.window_at(self.state.global_step))

    def _prepare_input(self, data):
        """A micro-batch's token tensors go to the device without waiting for it (the Trainer's copy blocks)."""
        if isinstance(data, torch.Tensor) and not data.is_floating_point():
            return data.to(self.args.device, non_blocking=True)
        return super()._prepare_input(data)

    def floating_point_ops(self, inputs) -> int:
        return 0

    def create_optimizer(self, model=None):
        if self.optimizer is None:
            self.optimizer = build_optimizer(model or self.model, self.session.cfg, self.session.env.device)
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        if self.lr_scheduler is None:
            self.lr_scheduler = build_scheduler(optimizer or self.optimizer, self.session.cfg, num_training_steps,
                                              self.session.plan)
        return self.lr_scheduler


class WindowLoss:
    """`compute_loss_func`: the summed loss over the global batch's real targets (the Trainer's
    `num_items_in_batch`), not the model's per-micro-batch mean; keeps the window's sum for RunRecorder."""

    def __init__(self, task: str):
        self.task, self.window_sum, self.micro_steps = task, torch.zeros((), dtype=torch.float64), 0

    def __call__(self, outputs, labels, num_items_in_batch=None):
        loss = summed_loss(outputs.logits, labels, self.task)
        if num_items_in_batch is None:
            num_items_in_batch = max(count_targets(labels, self.task), 1)
        if torch.is_grad_enabled():  # a training micro-step (evaluation runs without grad)
            self.window_sum = self.window_sum + loss.detach().double()  # on the loss's device
            self.micro_steps += 1
        return loss / num_items_in_batch

    def take(self) -> tuple[torch.Tensor, int]:
        """The window's loss sum (this rank) and its micro-steps; reset."""
        taken = self.window_sum, self.micro_steps
        self.window_sum, self.micro_steps = torch.zeros((), dtype=torch.float64), 0
        return taken


class RunRecorder(TrainerCallback):
    """As the other loops: each step's record (lr read before the scheduler moves it); a non-finite
    step skipped on every rank (gradients dropped, schedule put back); checkpoint-<N> published as
    step_<N>; --stop_after_steps and preemption end the job with a checkpoint."""

    def __init__(self, session, trainer, loss: WindowLoss):
        self.session, self.trainer, self.loss = session, trainer, loss
        self.values: dict = {}
        self.finite, self.schedule, self.stopped = True, None, False

    def on_train_begin(self, args, state, control, **kwargs):
        self.session.sync_counter = sync_counter_for(self.trainer.model_wrapped)

    def on_epoch_begin(self, args, state, control, **kwargs):
        # The epoch's permutation; set here because a resumed epoch's loader is a skipping copy.
        self.session.sampler.set_epoch(self.session.sampler.epoch_of(state.global_step)[0])

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, lr_scheduler=None, model=None, **kwargs):
        # the step's one collective and one read: the window's loss (all ranks), the clipped
        # gradients' norm, the preemption signal, the noise scale's norms
        window_sum, micro_steps = self.loss.take()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros((), device=args.device)
        num_targets = self.session.targets(self.session.sampler.window_at(state.global_step))
        self.values = self.session.read_step(window_sum.to(args.device, non_blocking=True), norm, num_targets,
                                             optimizer.param_groups[0]["lr"], micro_steps)
        self.finite = finite(self.values)
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
        if args.fp16 or skipped:
            self.values["step_skipped"] = skipped

    def on_log(self, args, state, control, logs=None, **kwargs):
        # after each optimizer step (logging_steps 1), before the Trainer evaluates and saves
        if "loss" in logs:
            values = {**self.values, "grad_norm": logs.get("grad_norm")}
            window = self.session.sampler.window_at(state.global_step - 1)
            self.session.log_step(window, values)
            if self.session.should_stop(state.global_step):
                control.should_save = control.should_training_stop = True
                self.stopped = True
        eval_keys = {k: v for k, v in logs.items()
                     if k.startswith("eval_") and not k.endswith(("_runtime", "_per_second"))}
        if eval_keys:
            self.session.log_eval(state.global_step, eval_keys)

    def on_epoch_end(self, args, state, control, **kwargs):
        if self.stopped and self.session.sampler.epoch_of(state.global_step)[1]:
            control.should_evaluate = False

    def on_save(self, args, state, control, **kwargs):
        step, folder = state.global_step, checkpoints_dir(self.session.cfg.output_dir)
        publish(self.session.cfg, self.session.env, folder / f"{PREFIX_CHECKPOINT_DIR}-{step}", folder / f"step_{step}",
                self.session.state(step))


def eval_summaries(logits: torch.Tensor, labels: torch.Tensor, task: str) -> torch.Tensor:
    """preprocess_logits_for_metrics: per example (summed loss, real targets, prediction), so
    evaluation gathers three numbers per example instead of its logits (the Trainer's default)."""
    per_example = [summed_loss(logits[i:i + 1], labels[i:i + 1], task) for i in range(len(labels))]
    counts = [count_targets(labels[i:i + 1], task) for i in range(len(labels))]
    prediction = logits.argmax(-1) if task == "sequence_classification" else torch.zeros(len(labels))
    return torch.stack([torch.stack(per_example).float(), torch.tensor(counts, dtype=torch.float32,
                        device=logits.device), prediction.float().view(len(labels), -1)[:, -1]], dim=1)


def compute_metrics(eval_prediction, task: str, num_labels: int) -> dict:
    """compute_metrics: evaluation.eval_metrics of the gathered summaries (the Trainer adds the
    `eval_` prefix; its `loss` then replaces the Trainer's average of batch means as eval_loss)."""
    summary = np.asarray(eval_prediction.predictions)
    confusion = None if task != "sequence_classification" else confusion_matrix(
        np.asarray(eval_prediction.label_ids).astype(np.int64), summary[:, 2].astype(np.int64), num_labels)
    metrics = eval_metrics(float(summary[:, 0].sum()), float(summary[:, 1].sum()), confusion)
    return {name.removeprefix("eval_"): value for name, value in metrics.items()}
