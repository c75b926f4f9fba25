"""Each library's own minimal loop, the baselines of the overhead benchmark, on the project's model,
data and optimizer settings and nothing else of ours: torch's (a bare optimizer step) and
Accelerate's (its documented `accumulate()` loop), each one window at a time between an entry
point's steps (benchmarks/abab.py), and the Trainer's (`TrainingArguments`, `Trainer(...)`,
`.train()`), a run of its own:

    python -m benchmarks.library_loops OUT.json --max_steps 60 ...   # the overhead benchmark runs it
"""

import json
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from accelerate import Accelerator
from accelerate.state import GradientState
from transformers import Trainer, TrainingArguments

from {{ cookiecutter.project_slug }}.cli import run_cli
from {{ cookiecutter.project_slug }}.config import TrainConfig
from {{ cookiecutter.project_slug }}.data import Collator
from {{ cookiecutter.project_slug }}.model import build_model
from {{ cookiecutter.project_slug }}.optim import SCHEDULES, build_optimizer, build_scheduler
from {{ cookiecutter.project_slug }}.startup import start

from .harness import optimizer_step


def training_copy(session):
    """A model, optimizer and schedule of their own, as the entry point's are built."""
    model = build_model(session.cfg, session.run.model_config).to(session.env.device)
    optimizer = build_optimizer(model, session.cfg, session.env.device)
    return model, optimizer, build_scheduler(optimizer, session.cfg, session.run.total_steps, session.plan)


class TorchLoop:
    """A bare optimizer step (harness.optimizer_step) and the schedule's step: CPU seconds per window."""

    def __init__(self, session):
        self.cfg, self.device = session.cfg, session.env.device
        self.model, self.optimizer, self.lr_scheduler = training_copy(session)

    def __call__(self, window: list[dict]) -> float:
        start = time.process_time()
        optimizer_step(self.model, window, self.optimizer, self.cfg, self.device)
        self.lr_scheduler.step()
        return time.process_time() - start


class AccelerateLoop:
    """Accelerate's documented loop: `with accelerator.accumulate(model):` the model's own loss,
    `accelerator.backward`, clipping at the boundary, then `step`, the schedule's step and
    `zero_grad` on every micro-step, on a prepared model, optimizer and schedule of its own.

    Accelerate keeps one GradientState per process (a class-level dict that every Accelerator
    shares: sync_gradients, the accumulation plugin's settings); this loop runs on contents of its
    own, swapped in and out around it, so that the entry point's state is left exactly as it was."""

    def __init__(self, session):
        self.gradient_state: dict = {}
        self.max_grad_norm = session.cfg.max_grad_norm
        with self.own_gradient_state():
            self.accelerator = Accelerator(mixed_precision=session.cfg.mixed_precision,
                                           gradient_accumulation_steps=session.plan.grad_accum_steps)
            self.model, self.optimizer, self.lr_scheduler = self.accelerator.prepare(*training_copy(session))
        self.model.train()

    @contextmanager
    def own_gradient_state(self):
        shared = GradientState._shared_state
        entry = shared.copy()
        shared.clear()
        shared.update(self.gradient_state)
        try:
            yield
        finally:
            self.gradient_state = shared.copy()
            shared.clear()
            shared.update(entry)

    def __call__(self, window: list[dict]) -> float:
        accelerator, model, optimizer = self.accelerator, self.model, self.optimizer
        with self.own_gradient_state():
            start = time.process_time()
            # an epoch's short last window ends in a sync, as at the end of a prepared dataloader
            accelerator.step = accelerator.gradient_accumulation_steps - len(window)
            for micro_batch in window:
                with accelerator.accumulate(model):
                    loss = model(**{key: value.to(accelerator.device) for key, value in micro_batch.items()}).loss
                    accelerator.backward(loss)
                    if accelerator.sync_gradients:
                        accelerator.clip_grad_norm_(model.parameters(), self.max_grad_norm)
                    optimizer.step()
                    self.lr_scheduler.step()
                    optimizer.zero_grad()
            return time.process_time() - start


class WindowClock:
    """CPU seconds from asking for one window to asking for the next, less the time spent loading
    it: wraps `Trainer.get_batch_samples`, which pulls each window's micro-batches."""

    def __init__(self):
        self.step_s: list[float] = []
        self.asked = None
        self.loading_s = 0.0

    def wrap(self, get_batch_samples):
        def timed(epoch_iterator, num_batches, device):
            now = time.process_time()
            if self.asked is not None:
                self.step_s.append(now - self.asked - self.loading_s)
            self.asked, self.loading_s = now, 0.0
            return get_batch_samples(self.loading(epoch_iterator), num_batches, device)

        return timed

    def loading(self, micro_batches):
        while True:
            start = time.process_time()
            try:
                micro_batch = next(micro_batches)
            except StopIteration:
                return
            finally:
                self.loading_s += time.process_time() - start
            yield micro_batch


def trainer_loop(cfg: TrainConfig, clock: WindowClock) -> None:
    """`TrainingArguments`, `Trainer(model, args, train_dataset, data_collator)`, `.train()`: the
    entry point's micro batch, accumulation, steps, optimizer and schedule, the library's defaults
    otherwise (no progress bar: the entry point shows none). The training set is read in the order
    of the entry point's first epoch: the same windows then, and the same window sizes after."""
    run = start(cfg, entry="bare")
    device = run.env.device
    args = TrainingArguments(
        output_dir=cfg.output_dir,
        per_device_train_batch_size=run.plan.micro_batch_size,
        gradient_accumulation_steps=run.plan.grad_accum_steps,
        max_steps=run.total_steps,
        learning_rate=cfg.learning_rate,
        weight_decay=cfg.weight_decay,
        max_grad_norm=cfg.max_grad_norm,
        lr_scheduler_type=SCHEDULES[cfg.lr_scheduler_type],
        warmup_steps=cfg.warmup_steps,
        optim="adamw_torch_fused" if cfg.fused_adamw and device.type == "cuda" else "adamw_torch",  # as optim.py
        seed=cfg.seed,
        bf16=cfg.mixed_precision == "bf16",
        report_to="none",
        disable_tqdm=True,
        train_sampling_strategy="sequential",
        use_cpu=device.type == "cpu",
    )
    trainer = Trainer(model=build_model(cfg, run.model_config), args=args,
                      train_dataset=run.data["train"].select(run.sampler.permutation(0)),
                      data_collator=Collator(run.tokenizer, cfg.task))
    trainer.get_batch_samples = clock.wrap(trainer.get_batch_samples)
    trainer.train()


def main() -> None:
    out = Path(sys.argv[1])
    del sys.argv[1]
    clock = WindowClock()
    try:
        run_cli(lambda cfg: trainer_loop(cfg, clock))
    finally:
        out.write_text(json.dumps({"trainer": clock.step_s}))


if __name__ == "__main__":
    main()
