"""What every entry point does around its own loop: check the input, build the data, walk the
accumulation windows, and decide when to evaluate, checkpoint and stop.

`Session.start()` does every check a user's mistake can fail *before* any process group exists,
so each process reports a ConfigError (exit 2) without waiting on another. (With
`--micro_batch_size auto` the ranks meet once, to agree on the micro batch; every check after that
fails the same way on every rank.)
"""

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .batch import BatchPlan, plan_batches
from .checkpoint import read_state, resolve_resume
from .config import TrainConfig
from .coordination import check_back_end, check_launcher_env, deepspeed_config
from .data import Collator, WindowSampler, eval_dataloader, load_raw_dataset, num_labels, tokenize, train_dataloader
from .distributed import DistEnv, PreemptionSignal, dist_env, init_distributed, print0
from .memory import auto_micro_batch_size, check_auto_micro_batch
from .model import load_tokenizer, model_config
from .optim import total_steps


@dataclass
class Session:
    cfg: TrainConfig
    env: DistEnv
    plan: BatchPlan
    resume: Path | None
    tokenizer: object
    model_config: object
    data: object
    sampler: WindowSampler
    total_steps: int
    deepspeed: dict | None
    preemption: PreemptionSignal
    start_step: int = 0  # optimizer steps done before this job: the resumed checkpoint's step
    job_steps: int = 0  # optimizer steps taken by this job (a resumed job starts again at 0)
    stop_reason: str = ""

    @classmethod
    def start(cls, cfg: TrainConfig, on_accelerate: bool) -> "Session":
        """`on_accelerate`: the entry point runs on Accelerate (DeepSpeed, FSDP, its mixed precision)."""
        env = dist_env()
        check_back_end(cfg, env, on_accelerate)
        auto = cfg.micro_batch_size == "auto"
        if auto:
            check_auto_micro_batch(cfg, env)
        else:
            plan = plan_batches(cfg.global_batch_size, cfg.micro_batch_size, env.world_size)
        resume = resolve_resume(cfg)
        tokenizer = load_tokenizer(cfg)
        raw = load_raw_dataset(cfg)
        labels = num_labels(raw) if cfg.task == "sequence_classification" else 2
        config = model_config(cfg, tokenizer, labels)
        data = tokenize(raw, tokenizer, cfg)
        start_step = read_state(resume)["step"] if resume else 0
        if auto:  # the one search needs the process group: every rank must agree on the result
            init_distributed(env)
            micro_batch_size, chosen_by = auto_micro_batch_size(cfg, config, env)
            plan = plan_batches(cfg.global_batch_size, micro_batch_size, env.world_size, chosen_by)
        check_launcher_env(plan)
        ds_config = deepspeed_config(cfg, plan) if on_accelerate else None
        sampler = WindowSampler(len(data["train"]), plan, env.rank, cfg.seed)
        return cls(cfg, env, plan, resume, tokenizer, config, data, sampler,
                   total_steps(cfg, sampler.steps_per_epoch), ds_config, PreemptionSignal(), start_step)

    def banner(self, entry: str, model) -> str:
        return (f"{entry}: {self.cfg.task}, {sum(p.numel() for p in model.parameters()):,} parameters, "
                f"{self.total_steps} optimizer steps ({self.sampler.steps_per_epoch} per epoch)"
                + (f", resuming after step {self.start_step} from {self.resume}" if self.resume else "")
                + "\n" + self.plan.table(self.cfg.max_seq_len))

    def loaders(self):
        collator = Collator(self.tokenizer, self.cfg.task)
        train = train_dataloader(self.data["train"], self.sampler, collator)
        evaluation = eval_dataloader(self.data["validation"], self.env.rank, self.env.world_size,
                                     self.plan.micro_batch_size, collator)
        return train, evaluation

    def windows(self, loader) -> Iterator[tuple[int, list[dict], bool]]:
        """From start_step on: (the optimizer step it completes, its micro-batches, ends an epoch)."""
        per_epoch, step = self.sampler.steps_per_epoch, self.start_step
        while step < self.total_steps:
            epoch, first = divmod(step, per_epoch)
            self.sampler.set_epoch(epoch, first)
            micro_batches = iter(loader)
            for s in range(first, min(per_epoch, first + self.total_steps - step)):
                window = [next(micro_batches) for _ in range(self.sampler.micro_steps(s))]
                step += 1
                yield step, window, s == per_epoch - 1 or step == self.total_steps

    def record(self, step: int, values: dict, elapsed_s: float) -> dict:
        """The metrics.jsonl object of an optimizer step."""
        return {"step": step, **values, "world_size": self.env.world_size,
                "grad_accum_steps": self.plan.grad_accum_steps,
                "global_batch_size": self.plan.global_batch_size, "elapsed_s": round(elapsed_s, 3)}

    @property
    def final_dir(self) -> Path:
        """Where the trained model goes: `save_pretrained` output plus the tokenizer."""
        return Path(self.cfg.output_dir) / "final_model"

    def done(self, step: int, tracker) -> None:
        """The run's last words, once the entry point has saved the model in final_dir."""
        print0(f"done: {step} steps; metrics in {tracker.path}, model in {self.final_dir}")
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

    def stopping(self, step: int) -> str:
        return (f"stopping after {self.job_steps} steps of this job (step {step} of {self.total_steps}), "
                f"on {self.stop_reason}; continue with --resume_from_checkpoint auto")

    def end_step(self, step: int, values: dict, tracker, sync_counter, ends_epoch: bool,
                 evaluate, checkpoint) -> bool:
        """Record optimizer step `step`, evaluate and checkpoint when due; True when this job must
        stop here (stop_after_steps or preemption), with its checkpoint written."""
        cfg = self.cfg
        if sync_counter is not None:
            values["grad_sync_calls"] = sync_counter.take()
        tracker.log(self.record(step, values, tracker.elapsed()))
        self.job_steps += 1
        if (cfg.eval_every and step % cfg.eval_every == 0) or (cfg.eval_every == 0 and ends_epoch):
            evaluate()
        stop = self.should_stop(step)
        if stop or (cfg.save_steps and step % cfg.save_steps == 0):
            checkpoint()
        if stop:
            print0(self.stopping(step))
            tracker.finish()
        return stop
