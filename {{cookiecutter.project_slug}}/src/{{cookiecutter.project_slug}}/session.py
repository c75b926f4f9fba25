"""The loop's one handle on a running job (`Session`, built once the model is ready): its windows, its
record (metrics.jsonl, W&B, the progress line), the non-finite count and the stop signal; it decides when
to evaluate, checkpoint and stop. What the job *is* stays in the frozen `startup.Run` it is built from.
"""

import math
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from pathlib import Path

import torch

from .checkpoint import checkpoints_dir, final_dir, newest_checkpoint, write_atomically, write_final
from .data import Collator, eval_dataloader, example_sizes, loading, train_dataloader
from .distributed import print0, sum_and_read
from .errors import JobFailed
from .extras import plug
from .model import save_weights
from .output_lock import check_held
from .speed import compiled_graphs, flop_counts, training_flops
from .startup import Run
from .tracking import Tracker
from .windows import Window, windows_from


class Without:
    """An extra's part of a Session where it is not baked: each window taken once (auto_batch's
    memory.MicroBatchRetry retries it after an out-of-memory error), no noise scale (noise.SessionNoise)."""

    def __init__(self, session):
        self.session = session

    def windows(self, loader) -> Iterator[Window]:
        return windows_from(loader, self.session.sampler, self.session.run.start_step, self.session.run.total_steps)

    def micro_step(self, is_last: bool):
        return nullcontext()

    def window_fits(self) -> bool:
        return True

    def slots(self) -> tuple[list, list]:
        return [], []

    def read(self, values: list[float]) -> None:
        pass

    def record(self, *window_and_values) -> dict:
        return {}

    def state(self) -> dict:
        return {}


Retry = plug("auto_batch", "memory:MicroBatchRetry", default=Without)  # micro_batch_size auto at run time
Noise = plug("batch_schedule", "noise:SessionNoise", default=Without)  # the gradient noise scale

at_step = plug("doctor", "hangs:at_step", default=lambda step: None)  # the step a failed collective names
# a checkpoint whose files an extra writes in the background: published once written; `finish()` waits for it
write_checkpoint = plug("fsdp", "sharding:write_in_background", default=write_atomically)


class Session:
    """The loop's handle: `for window in session.windows(loader)`, then `log_step`, `eval_due`,
    `save_due`, `should_stop`, and at the end `save_model` (or `save_final`) and `done`."""

    def __init__(self, run: Run, model: torch.nn.Module, accelerator=None, sync_counter=None):
        """Announce the run (rank 0) and start its record; `model` is the unwrapped model (for mfu), W&B
        goes through `accelerator` when given, `sync_counter` is DDP's GradSyncCounter (or a sharded model's)."""
        self.run, self.cfg, self.env, self.sync_counter = run, run.cfg, run.env, sync_counter
        self.stop_signal = ""  # the preemption signal any rank got (SIGTERM before SIGUSR1), as of the latest read
        self.sampler = run.sampler  # the run's one sampler: its plan is the current one
        self.retry = Retry(self)  # the windows, taken again after an out-of-memory error where auto_batch is baked
        self.noise = Noise(self)  # the gradient noise scale's running estimate (batch_schedule)
        self.job_steps = 0  # optimizer steps taken by this job (a resumed job starts again at 0)
        self.nonfinite: list[int] = []  # the latest consecutive non-finite steps
        self.stop_reason = ""
        self.pending = None  # a checkpoint still being written in the background (write_checkpoint)
        self.last_elapsed_s = 0.0
        self.flop_counts = flop_counts(model)
        self.input_lengths, self.example_targets = example_sizes(run.data["train"])
        run.announce(model)
        self.tracker = Tracker(self.cfg, self.env, run.plan, run.total_steps, run.start_step, run.resume is not None,
                               accelerator)

    @property
    def plan(self):
        """The batch plan now (an out-of-memory error at run time lowers its micro batch)."""
        return self.sampler.plan

    @property
    def step(self) -> int:  # optimizer steps done, this job's and those before it
        return self.run.start_step + self.job_steps

    def loaders(self):
        """The training loader (this rank's windows) and the evaluation loader (its shard)."""
        collator = Collator(self.run.tokenizer, self.cfg.task)
        cuda = self.env.device.type == "cuda"
        workers = self.cfg.dataloader_workers if self.cfg.dataloader_workers >= 0 else (4 if cuda else 0)
        train = train_dataloader(self.run.data["train"], self.sampler, collator, **loading(workers, cuda))
        evaluation = eval_dataloader(self.run.data["validation"], self.env.rank, self.env.world_size,
                                     self.plan.micro_batch_size, collator, **loading(workers, cuda))
        return train, evaluation

    def windows(self, loader) -> Iterator[Window]:
        """From the resume point on, each optimizer step's window (windows.windows_from)."""
        for window in self.retry.windows(loader):
            at_step(window.step)  # named in the line of a collective that fails (the doctor extra)
            yield window

    def micro_step(self, is_last: bool):
        """Around one micro-step of a loop: nothing, or micro_batch_size auto's out-of-memory guard."""
        return self.retry.micro_step(is_last)

    def window_fits(self) -> bool:
        """Before the window's synchronising micro-step: True, or False where micro_batch_size auto
        ran out of memory on some rank (every rank then drops the window; it comes again, smaller)."""
        return self.retry.window_fits()

    def state(self, step: int) -> dict:
        return {**self.run.state(step, self.plan.micro_batch_size), **self.retry.state(), **self.noise.state()}

    def targets(self, window: Window) -> int:
        """The real targets of the whole window on every rank (at least 1), which each micro-step's summed
        loss is divided by; counted on the host from the step's examples (no device read)."""
        return max(int(self.example_targets[window.examples].sum()), 1)

    def read_step(self, loss_sum: torch.Tensor, grad_norm, num_targets: int, lr: float, micro_steps: int) -> dict:
        """A step's record values in one collective and one device read: the ranks' summed loss and preemption
        flags, the gradient norm (the same on every rank: a non-finite step is skipped alike), the noise scale's."""
        summed, kept = self.noise.slots()
        preemption = self.run.preemption
        read = sum_and_read([loss_sum, preemption.received, preemption.terminated, *summed], [*kept, grad_norm])
        loss_total, signalled, terminated, norm = *read[:3], read[-1]
        self.noise.read(read[3:-1])
        self.stop_signal = "SIGTERM" if terminated else "SIGUSR1" if signalled else ""
        return {"loss": loss_total / num_targets, "lr": lr, "grad_norm": norm, "tokens": num_targets,
                "micro_steps": micro_steps}

    def _record(self, window: Window, values: dict) -> dict:
        """A step's metrics.jsonl object; its mfu (where the peak is known): the model FLOPs of the step's
        sequences (their real lengths) per second over every device's peak. `tokens` are the targets the loss
        counts, `input_tokens` what the model reads."""
        elapsed_s = self.tracker.elapsed()
        seconds, self.last_elapsed_s = elapsed_s - self.last_elapsed_s, elapsed_s
        record = {"step": window.step, **values, "world_size": self.env.world_size,
                  "grad_accum_steps": window.grad_accum_steps, "micro_batch_size": window.micro_batch_size,
                  "global_batch_size": window.global_batch_size, "elapsed_s": round(elapsed_s, 3)}
        record.update(self.retry.record())  # oom_retries, where micro_batch_size auto dropped a window
        lengths = self.input_lengths[window.examples]
        record["input_tokens"] = int(lengths.sum())
        if self.run.peak_flops and self.flop_counts and seconds > 0:
            achieved = training_flops(self.flop_counts, lengths) / seconds
            record["mfu"] = round(achieved / (self.run.peak_flops * self.env.world_size), 4)
        if self.cfg.compile:
            record["compiled_graphs"] = compiled_graphs()
        return record

    def log_step(self, window: Window, values: dict) -> None:
        """Record the window's step and count it in this job; a run whose steps keep being non-finite stops here."""
        if self.sync_counter is not None:
            values.update(self.sync_counter.record())
        values.update(self.noise.record(window, values))
        self.tracker.log(self._record(window, values))
        self.job_steps += 1
        self._check_finite(window.step, values)

    def log_eval(self, step: int, metrics: dict) -> None:
        self.tracker.log({"step": step, **metrics})

    def _check_finite(self, step: int, values: dict) -> None:
        """Stop the job (exit code 3) after max_nonfinite_steps steps in a row whose loss or gradient norm was
        not finite; fp16's own overflow skips (a finite loss, an infinite scaled gradient) are the scaler's."""
        grad_norm, loss = values.get("grad_norm"), values["loss"]
        bad_norm = grad_norm is not None and not math.isfinite(grad_norm) and self.cfg.mixed_precision != "fp16"
        if not (bad_norm or not math.isfinite(loss)):
            self.nonfinite.clear()
            return
        self.nonfinite.append(step)
        if len(self.nonfinite) >= self.cfg.max_nonfinite_steps:
            self.tracker.finish()
            what, value = ("loss", loss) if not math.isfinite(loss) else ("gradient norm", grad_norm)
            raise JobFailed(f"training diverged: steps {self.nonfinite[0]}-{step} in a row had a non-finite {what} "
                            f"({value}), each skipped; {newest_checkpoint(self.cfg.output_dir)}, no model saved: "
                            "lower --learning_rate or --max_grad_norm and start again, or check the data",
                            exit_code=3, agreed=True)

    def eval_due(self, window: Window) -> bool:
        """Every eval_every steps (at the run's end where that is sooner), or (eval_every 0) at each
        epoch's end, the last step ending the last epoch."""
        if self.cfg.eval_every:
            return window.step % min(self.cfg.eval_every, self.run.total_steps) == 0
        return window.ends_epoch or window.step == self.run.total_steps

    def save_due(self, step: int) -> bool:
        return bool(self.cfg.save_steps) and step % self.cfg.save_steps == 0

    def should_stop(self, step: int) -> bool:
        """End this job here with a checkpoint? At --stop_after_steps, or on any rank's preemption signal."""
        if step >= self.run.total_steps:
            return False
        if self.job_steps == self.cfg.stop_after_steps:
            self.stop_reason = f"--stop_after_steps {self.cfg.stop_after_steps}"
        elif self.stop_signal:
            self.stop_reason = f"preemption signal ({self.stop_signal})"
        return bool(self.stop_reason)

    def save_checkpoint(self, step: int, write) -> None:
        """checkpoints/step_<step> by `write(folder)` on every process, atomically (one written in the
        background is published once written; the next save, or the end, waits for it)."""
        check_held()
        self.finish_checkpoint()
        written = write_checkpoint(self.cfg, self.env, checkpoints_dir(self.cfg.output_dir) / f"step_{step}", write,
                                   self.state(step))
        self.pending = None if isinstance(written, Path) else written

    def finish_checkpoint(self) -> None:
        """Wait for the checkpoint written in the background, if any, and publish it."""
        if self.pending is not None:
            self.pending.finish()
            self.pending = None

    def save_final(self, write) -> None:
        """final_model/, written by `write(folder)` on every process, atomically: the run is finished."""
        check_held()
        self.finish_checkpoint()
        write_final(self.cfg, self.env, write, self.state(self.step))

    def save_model(self, model, write_weights: Callable | None = None) -> None:
        """final_model/ from the unwrapped model; a sharded one's by `write_weights(folder, write)` on every process."""
        def write(folder: Path, state_dict: dict | None = None) -> None:
            if self.env.is_main_process:
                save_weights(model, folder, self.cfg, self.run.model_config, state_dict)
                self.run.tokenizer.save_pretrained(folder)

        self.save_final(write if write_weights is None else lambda folder: write_weights(folder, write))

    def done(self) -> None:
        """The run's last words, once the model is saved in final_model/."""
        print0(f"done: {self.step} steps; metrics in {Path(self.cfg.output_dir) / 'metrics.jsonl'}, model in "
               f"{final_dir(self.cfg.output_dir)}")
        self.tracker.finish()

    def stopped(self) -> int:
        """The last words of a job that stops early: how to continue; its exit code (PreemptionSignal)."""
        self.finish_checkpoint()
        print0(f"stopping after {self.job_steps} steps of this job (step {self.step} of {self.run.total_steps}), "
               f"on {self.stop_reason}; continue with --resume_from_checkpoint auto")
        self.tracker.finish()
        return self.run.preemption.exit_code()
