"""What every entry point does around its own loop: check the input, build the data, walk the
accumulation windows, and decide when to evaluate, checkpoint and stop.

`Session.start()` does every check a user's mistake can fail *before* any process group exists,
so each process reports a ConfigError (exit 2) without waiting on another. (With
`--micro_batch_size auto` the ranks meet once, to agree on the micro batch; every check after that
fails the same way on every rank.)

`--micro_batch_size auto` also holds at run time in train_pytorch and train_accelerate on DDP (or
one process): an out-of-memory error in a micro-step that does not synchronise is noted, the ranks
agree once per window, just before its synchronising micro-step (DDP broadcasts no buffers here, so
the micro-steps before it run no collective), and every rank then drops the window and takes the
same window again in micro-batches half as large, accumulating twice as many: the same examples,
the same global batch, from the same random state. The smaller micro batch is kept for the rest of
the run (checkpoints record it; a resumed auto run searches no higher). An out-of-memory error in a
micro-step that synchronises leaves the other ranks waiting in its all-reduce: the job stops with
one line, and its restart continues from the newest checkpoint with the smaller micro batch (noted
in output_dir/auto_micro_batch_size). Synchronising: the window's last micro-step, every one with
accumulation 1 or ddp_no_sync false, and on 2 or more processes every one of the job's second
window, whose first forward pass rebuilds DDP's buckets (a broadcast, and new buffers).
"""

import functools
import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import torch
import transformers

from .batch import BatchPlan, largest_divisor, plan_batches
from .checkpoint import (
    check_same_entry,
    check_same_training,
    checkpoints_dir,
    complete_checkpoints,
    final_dir,
    library_versions,
    note_versions,
    read_state,
    resume_point,
    verify_checkpoint,
    write_atomically,
)
from .config import TrainConfig
from .coordination import check_back_end, check_launcher_env, deepspeed_config, deepspeed_config_path, uses_fsdp
from .data import Collator, WindowSampler, eval_dataloader, loading, train_dataloader
from .distributed import DistEnv, PreemptionSignal, all_reduce_sum, dist_env, init_distributed, print0
from .errors import ConfigError, JobFailed, RunFinished, first_line
from .memory import auto_micro_batch_size, check_auto_micro_batch
from .model import load_tokenizer, model_config
from .noise import NoiseScale
from .optim import total_steps
from .prepare import prepare
from .speed import compiled_graphs, flops_per_token, matmul_precision, numel, peak_flops, set_tf32

AUTO_CEILING = "auto_micro_batch_size"  # in output_dir: the micro batch a restart of an auto run starts from


def auto_ceiling(cfg: TrainConfig, state: dict | None) -> int:
    """The largest micro batch a --micro_batch_size auto search may choose (0: no limit), left by an
    out-of-memory error: the one the resumed checkpoint records, or the one noted after an error in
    a synchronising micro-step."""
    ceilings = [int(state["auto_micro_batch_ceiling"])] if state and state.get("auto_micro_batch_ceiling") else []
    note = Path(cfg.output_dir) / AUTO_CEILING
    noted = note.read_text().strip() if note.is_file() else ""
    if noted.isdigit():
        ceilings.append(int(noted))
    return min(ceilings, default=0)


def get_random_state(device: torch.device) -> tuple:
    """torch's generators (CPU, and the device's on CUDA): what dropout draws from."""
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None, device


def set_random_state(state: tuple) -> None:
    cpu, cuda, device = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, device)


def make_output_dir(output_dir: str) -> None:
    """The output folder exists and is writable, found on every process before any waiting."""
    out = Path(output_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"output_dir {out} cannot be created ({err.strerror}); choose a folder you can "
                          "write to") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise ConfigError(f"output_dir {out} is not writable; choose a folder you can write to")


def quiet_libraries(env: DistEnv) -> None:
    """What a user sees on every run and never needs: a "Writing model shards" bar per save, and on
    CPU DeepSpeed's warning that it found no GPU (it probes when Accelerate first imports it)."""
    transformers.utils.logging.disable_progress_bar()
    if env.device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


@dataclass
class Session:
    cfg: TrainConfig
    env: DistEnv
    entry: str  # pytorch | accelerate | trainer: the checkpoint format
    backend: str  # ddp | deepspeed
    plan: BatchPlan
    resume: Path | None
    tokenizer: object
    model_config: object
    data: object
    data_folder: Path
    sampler: WindowSampler
    total_steps: int
    deepspeed: dict | None
    preemption: PreemptionSignal
    start_step: int = 0  # optimizer steps done before this job: the resumed checkpoint's step
    job_steps: int = 0  # optimizer steps taken by this job (a resumed job starts again at 0)
    stop_reason: str = ""
    nonfinite: list[int] = field(default_factory=list)  # the latest consecutive non-finite steps
    flops_per_token: float = 0.0  # the model's training FLOPs per token (announce)
    peak_flops: float = 0.0  # the device's peak FLOP/s; 0 where unknown (no mfu)
    last_elapsed_s: float = 0.0
    noise: NoiseScale = field(default_factory=NoiseScale)  # the gradient noise scale's running estimate
    adaptive: bool = False  # micro_batch_size auto at run time (see the module docstring)
    out_of_memory: bool = False  # this rank ran out of memory in the current window
    retrying: bool = False  # the current window is dropped: it comes again in smaller micro-batches
    oom_retries: int = 0  # windows dropped since the last record
    ceiling: int = 0  # the micro batch an out-of-memory error left (0: none): auto searches no higher

    @classmethod
    def start(cls, cfg: TrainConfig, entry: str, on_accelerate: bool) -> "Session":
        """Every check a user's mistake can fail, on every process, before any process waits on
        another. `on_accelerate`: the entry point runs on Accelerate (DeepSpeed, FSDP, its mixed
        precision)."""
        env = dist_env()
        quiet_libraries(env)
        check_back_end(cfg, env, entry)
        backend = "deepspeed" if on_accelerate and deepspeed_config_path(cfg) else "ddp"
        resume = resume_point(cfg)
        state = None
        if resume is not None:
            finished = resume == final_dir(cfg.output_dir)
            state = read_state(resume) if finished else verify_checkpoint(resume)
            check_same_training(state, cfg, resume)
            if finished:
                raise RunFinished(f"already done at step {state['step']}: {resume} (nothing changed)")
            check_same_entry(state, entry, backend, resume)
        make_output_dir(cfg.output_dir)
        auto, ceiling = cfg.micro_batch_size == "auto", 0
        if auto:
            check_auto_micro_batch(cfg, env)
        else:
            plan = plan_batches(cfg.global_batch_size, cfg.micro_batch_size, env.world_size,
                                schedule=cfg.global_batch_size_schedule)
        tokenizer = load_tokenizer(cfg)
        prepared = prepare(cfg, tokenizer)
        config = model_config(cfg, tokenizer, prepared.num_labels or 2)
        data = prepared.data
        if state is not None:
            before = state.get("num_train_examples", len(data["train"]))
            if before != len(data["train"]):
                raise ConfigError(f"{resume} was trained on {before} training examples, dataset {cfg.dataset} now "
                                  f"has {len(data['train'])}; a run continues only on the same data, or start a "
                                  "new run in another --output_dir")
            note_versions(state, resume)
        if auto:  # the one search needs the process group: every rank must agree on the result
            init_distributed(env, cfg.rendezvous_timeout_s, cfg.collective_timeout_s)
            ceiling = auto_ceiling(cfg, state)
            micro_batch_size, chosen_by = auto_micro_batch_size(cfg, config, env, ceiling)
            plan = plan_batches(cfg.global_batch_size, micro_batch_size, env.world_size, chosen_by,
                                cfg.global_batch_size_schedule)
        check_launcher_env(plan)
        ds_config = deepspeed_config(cfg, plan) if on_accelerate else None
        sampler = WindowSampler(len(data["train"]), plan, env.rank, cfg.seed, min_rows=2 if cfg.compile else 1)
        start_step = int(state["step"]) if state else 0
        set_tf32(cfg, env.device)
        return cls(cfg, env, entry, backend, plan, resume, tokenizer, config, data, prepared.folder, sampler,
                   total_steps(cfg, sampler), ds_config, PreemptionSignal(), start_step,
                   peak_flops=peak_flops(cfg, env.device), noise=NoiseScale(*(state or {}).get("grad_noise", ())),
                   adaptive=auto and entry != "trainer" and backend == "ddp" and not uses_fsdp(),
                   ceiling=ceiling)

    def init_distributed(self) -> None:
        """Join the process group (once; one process joins none, unless it runs DeepSpeed)."""
        init_distributed(self.env, self.cfg.rendezvous_timeout_s, self.cfg.collective_timeout_s,
                         alone_too=self.backend == "deepspeed")

    def state(self, step: int) -> dict:
        """What a checkpoint (or the finished model) records besides its files: a later job checks
        it before it continues."""
        return {"step": step, "world_size": self.env.world_size, "entry": self.entry, "backend": self.backend,
                "total_steps": self.total_steps, "num_train_examples": len(self.data["train"]),
                "micro_batch_size": self.plan.micro_batch_size, "auto_micro_batch_ceiling": self.ceiling,
                "grad_noise": self.noise.state(),
                "config": self.cfg.to_dict(), "versions": library_versions()}

    def announce(self, entry: str, model) -> None:
        """Print what this job trains and how (rank 0), and take the model's FLOPs per token for
        the MFU of every step record."""
        self.flops_per_token = flops_per_token(model, self.cfg.max_seq_len)
        examples = f"blocks of {self.cfg.max_seq_len} tokens" if self.cfg.packing else "examples"
        print0(f"{entry}: {self.cfg.task}, {sum(map(numel, model.parameters())):,} parameters, "
               f"{self.total_steps} optimizer steps ({self.sampler.steps_per_epoch} "
               + ("in the first epoch)" if len(self.plan.schedule) > 1 else "per epoch)")
               + (f", resuming after step {self.start_step} from {self.resume}" if self.resume else "")
               + f"\ndata: {len(self.data['train']):,} training {examples} from {self.data_folder}"
               + f"\nspeed: {', '.join(self.levers())}" + "\n" + self.plan.table(self.cfg.max_seq_len))

    def levers(self) -> list[str]:
        cfg, cuda = self.cfg, self.env.device.type == "cuda"
        return [f"compile {'on' if cfg.compile else 'off'}", f"{cfg.attn_implementation} attention",
                f"matmuls in {matmul_precision(cfg, self.env.device)}",
                *(["fused AdamW"] if cuda and cfg.fused_adamw and cfg.optimizer == "adamw" else []),
                f"peak {self.peak_flops / 1e12:g} TFLOP/s per device" if self.peak_flops else "no known peak: no mfu"]

    def loaders(self):
        """The training loader (this rank's windows) and the evaluation loader (its shard)."""
        collator = Collator(self.tokenizer, self.cfg.task)
        cuda = self.env.device.type == "cuda"
        workers = self.cfg.dataloader_workers if self.cfg.dataloader_workers >= 0 else (4 if cuda else 0)
        train = train_dataloader(self.data["train"], self.sampler, collator, **loading(workers, cuda))
        evaluation = eval_dataloader(self.data["validation"], self.env.rank, self.env.world_size,
                                     self.plan.micro_batch_size, collator, **loading(workers, cuda))
        return train, evaluation

    def windows(self, loader) -> Iterator[tuple[int, list[dict]]]:
        """From start_step on: the optimizer step each window completes, and its micro-batches on
        this process (the step's grad_accum_steps of them, fewer in an epoch's short last window).
        A window dropped for an out-of-memory error comes again, cut into the smaller micro-batches."""
        step, random_state = self.start_step, None
        while step < self.total_steps:
            epoch, s = self.sampler.epoch_of(step)
            self.sampler.set_epoch(epoch, s)
            micro_batches = iter(loader)  # (draws the loader's seed from torch's generator)
            if random_state is not None:  # a window taken again: from where the dropped attempt began
                set_random_state(random_state)
            end = min(self.sampler.steps_per_epoch, s + self.total_steps - step)
            while s < end:
                window = [next(micro_batches) for _ in range(self.sampler.micro_steps(s))]
                random_state = get_random_state(self.env.device) if self.adaptive else None
                yield step + 1, window
                if self.retrying:  # the loader starts again at this window, with the smaller micro batch
                    self.retrying = False
                    break
                s, step = s + 1, step + 1

    @contextmanager
    def micro_step(self, is_last: bool):
        """Around one micro-step of an entry point's loop: with micro_batch_size auto at run time, an
        out-of-memory error in a micro-step that does not synchronise is noted (the window is then
        dropped on every rank, `window_fits`); in one that does (the module docstring says which)
        it stops the job."""
        syncs = is_last or self.every_micro_step_syncs()
        if not self.adaptive:
            yield
            return
        try:
            yield
        except torch.OutOfMemoryError as err:
            if not syncs:
                self.out_of_memory = True
                return
            raise self._oom_in_sync(err) from None

    def window_fits(self) -> bool:
        """Before a window's synchronising micro-step: did every rank get through the others? One
        tiny all-reduce per window, with micro_batch_size auto at run time (else always True). When
        not, every rank returns False: the caller drops the window's gradients, and the window comes
        again in micro-batches of the next smaller size."""
        if not self.adaptive or self.every_micro_step_syncs():  # nothing can have been noted
            return True
        failed = all_reduce_sum(torch.tensor(float(self.out_of_memory), device=self.env.device)).item()
        self.out_of_memory = False
        if not failed:
            return True
        smaller = self.next_micro_batch()
        if not smaller:
            raise JobFailed(f"out of memory on {failed:g} process(es) at micro batch 1: not even one example fits; "
                            "use gradient_checkpointing, mixed_precision or a shorter max_seq_len",
                            agreed=True)
        self.plan = self.sampler.plan = self.plan.with_micro_batch(
            smaller, f"{smaller} after an out-of-memory error at {self.plan.micro_batch_size}")
        self.retrying, self.oom_retries, self.ceiling = True, self.oom_retries + 1, smaller
        if self.env.device.type == "cuda":
            torch.cuda.empty_cache()  # what the failed attempt held goes back to the device
        return False

    def every_micro_step_syncs(self) -> bool:
        """Whether each micro-step of this window runs a collective (see the module docstring)."""
        several = self.env.world_size > 1
        return several and (not self.cfg.ddp_no_sync or self.job_steps == 1)

    def next_micro_batch(self) -> int:
        """The micro batch after an out-of-memory error: the largest divisor of the first global
        batch's share at most half the current one (0 below 1)."""
        return largest_divisor(self.plan.global_batch_size // self.env.world_size, self.plan.micro_batch_size // 2)

    def _oom_in_sync(self, err: BaseException) -> JobFailed:
        """The job's end after an out-of-memory error in a synchronising micro-step: the other ranks
        wait in its all-reduce, so nothing can be agreed. The next smaller micro batch is noted for
        the restart (auto_ceiling)."""
        smaller = self.next_micro_batch()
        note = Path(self.cfg.output_dir) / AUTO_CEILING
        if smaller:
            note.write_text(f"{smaller}\n")
        then = (f"its restart (torchrun --max_restarts, a requeue, --resume_from_checkpoint auto) continues from "
                f"the newest checkpoint with micro batch {smaller} ({note})" if smaller else
                "not even one example fits: use gradient_checkpointing, mixed_precision or a shorter max_seq_len")
        return JobFailed(f"rank {self.env.rank} ran out of memory in a synchronising micro-step at micro batch "
                         f"{self.plan.micro_batch_size} ({first_line(err)}); the job stops, {then}")

    def record(self, step: int, values: dict, elapsed_s: float) -> dict:
        """The metrics.jsonl object of an optimizer step, with its MFU where the peak is known:
        model FLOPs of the step's input tokens (padding aside) over the step's time, over the peak
        of every device. `tokens` are the targets the loss counts (for classification, one per
        example), `input_tokens` what the model reads."""
        seconds, self.last_elapsed_s = elapsed_s - self.last_elapsed_s, elapsed_s
        record = {"step": step, **values, "world_size": self.env.world_size,
                  "grad_accum_steps": self.plan.accum_at(step - 1), "micro_batch_size": self.plan.micro_batch_size,
                  "global_batch_size": self.plan.global_batch_at(step - 1), "elapsed_s": round(elapsed_s, 3)}
        if self.oom_retries:
            record["oom_retries"], self.oom_retries = self.oom_retries, 0
        record["input_tokens"] = int(self.input_lengths[self.sampler.examples(step - 1)].sum())
        if self.peak_flops and seconds > 0:  # every input token, where the loss counts targets
            achieved = self.flops_per_token * record["input_tokens"] / seconds
            record["mfu"] = round(achieved / (self.peak_flops * self.env.world_size), 4)
        if self.cfg.compile:
            record["compiled_graphs"] = compiled_graphs()
        return record

    @functools.cached_property
    def input_lengths(self) -> np.ndarray:
        """Tokens of each training example (a packed block: max_seq_len), from the prepared data's
        list offsets: no pass over the tokens."""
        return pc.list_value_length(self.data["train"].data.column("input_ids")).to_numpy()

    @property
    def final_dir(self) -> Path:
        """Where the trained model goes: `save_pretrained` output plus the tokenizer."""
        return final_dir(self.cfg.output_dir)

    def save_checkpoint(self, step: int, write) -> Path:
        """checkpoints/step_<step>, written by `write(folder)` on every process, atomically."""
        return write_atomically(self.cfg, self.env, checkpoints_dir(self.cfg.output_dir) / f"step_{step}", write,
                                self.state(step))

    def save_final(self, step: int, write) -> None:
        """final_model/, written by `write(folder)` on every process, atomically: the run is finished."""
        write_atomically(self.cfg, self.env, self.final_dir, write, self.state(step))

    def save_model(self, step: int, model) -> None:
        """final_model/ from a whole (unwrapped, unsharded) model: save_pretrained plus the tokenizer."""
        def write(folder: Path) -> None:
            if self.env.is_main_process:
                model.save_pretrained(folder)
                self.tokenizer.save_pretrained(folder)

        self.save_final(step, write)

    def check_finite(self, step: int, values: dict, tracker) -> None:
        """Count the steps in a row whose loss or gradient norm was not finite (each one skipped);
        stop the job (exit code 3) after max_nonfinite_steps of them. fp16's own overflow skips (a
        finite loss, an infinite scaled gradient) are the loss scaler's business and do not count."""
        grad_norm = values.get("grad_norm")
        bad_norm = grad_norm is not None and not math.isfinite(grad_norm) and self.cfg.mixed_precision != "fp16"
        if not (bad_norm or not math.isfinite(values["loss"])):
            self.nonfinite.clear()
            return
        self.nonfinite.append(step)
        if len(self.nonfinite) >= self.cfg.max_nonfinite_steps:
            tracker.finish()
            newest = complete_checkpoints(self.cfg.output_dir)
            kept = f"the last good checkpoint is {newest[-1]}" if newest else "no checkpoint was written"
            loss = values["loss"]
            what, value = ("loss", loss) if not math.isfinite(loss) else ("gradient norm", grad_norm)
            raise JobFailed(f"training diverged: steps {self.nonfinite[0]}-{step} in a row had a non-finite {what} "
                            f"({value}), each skipped; {kept}, no model saved: lower --learning_rate or "
                            "--max_grad_norm and start again, or check the data",
                            exit_code=3, agreed=True)

    def done(self, step: int, tracker=None) -> None:
        """The run's last words, once the entry point has saved the model in final_dir."""
        print0(f"done: {step} steps; metrics in {Path(self.cfg.output_dir) / 'metrics.jsonl'}, model in "
               f"{self.final_dir}")
        if tracker is not None:
            tracker.finish()

    def should_stop(self, step: int) -> bool:
        """After optimizer step `step` (counted in job_steps): must this job end here, with a
        checkpoint? At --stop_after_steps, or when any process got the preemption signal."""
        if step >= self.total_steps:
            return False
        if self.job_steps == self.cfg.stop_after_steps:
            self.stop_reason = f"--stop_after_steps {self.cfg.stop_after_steps}"
        elif self.preemption.agreed(self.env.device):
            self.stop_reason = "preemption signal (SIGUSR1)"
        return bool(self.stop_reason)

    def log_step(self, step: int, values: dict, tracker, sync_counter=None) -> None:
        """Record optimizer step `step` (metrics.jsonl, W&B, the progress line) and count it in this
        job; a run whose steps keep being non-finite stops here (JobFailed, exit code 3)."""
        if sync_counter is not None:
            values["grad_sync_calls"] = sync_counter.take()
            local, reduced = sync_counter.take_norms()
            examples = len(self.sampler.examples(step - 1))  # the remainder at an epoch's end
            # estimated where every rank's gradient is of the same number of examples (not in an
            # epoch's uneven last window); not under fp16, whose loss scale changes the units
            even = examples % self.env.world_size == 0 and self.cfg.ddp_no_sync
            if even and self.cfg.mixed_precision != "fp16" and not values.get("step_skipped"):
                values.update(self.noise.update(local, reduced, examples, self.env.world_size))
        tracker.log(self.record(step, values, tracker.elapsed()))
        self.job_steps += 1
        self.check_finite(step, values, tracker)

    def eval_due(self, step: int) -> bool:
        """Evaluate after optimizer step `step`? Every eval_every steps, or (eval_every 0) at the end
        of each epoch, the run's last step ending the last (maybe partial) epoch."""
        if self.cfg.eval_every:
            return step % self.cfg.eval_every == 0
        return self.sampler.epoch_of(step)[1] == 0 or step == self.total_steps

    def save_due(self, step: int) -> bool:
        """Write a checkpoint after optimizer step `step`? Every save_steps steps."""
        return bool(self.cfg.save_steps) and step % self.cfg.save_steps == 0

    def stopped(self, step: int, tracker) -> None:
        """The last words of a job that stops early (its checkpoint written): how to continue."""
        print0(f"stopping after {self.job_steps} steps of this job (step {step} of {self.total_steps}), "
               f"on {self.stop_reason}; continue with --resume_from_checkpoint auto")
        tracker.finish()
