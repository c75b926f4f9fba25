"""Start-up: everything decided once, before the first optimizer step, as one frozen `Run`: `start()` makes every
up-front check a user's mistake can fail, then reads the resume point, the data, the tokenizer and the batch plan.
"""

import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import transformers

from . import checkpoint
from .config import TrainConfig
from .distributed import DistEnv, PreemptionSignal, dist_env, init_distributed, keep_flight_recorder, print0
from .errors import ConfigError, RunFinished
from .extras import plug
from .launch import Launch, check_back_end, check_launcher_env, deepspeed_config, launch_of
from .model import load_tokenizer, model_config
from .optim import total_steps
from .output_lock import OutputLock, check_shared
from .prepare import prepare
from .speed import matmul_precision, numel, peak_flops, set_tf32
from .tracking import check_wandb
from .windows import BatchPlan, WindowSampler, plan_batches

# global_batch_size_schedule (batch_schedule): a plan and sampler that follow it; micro_batch_size auto (auto_batch)
schedule_of = plug("batch_schedule", "batch_schedule:schedule_of",
                   default=lambda cfg, launch: ((0, cfg.global_batch_size),))
scheduled = plug("batch_schedule", "batch_schedule:scheduled", default=lambda plan, schedule: plan)
Sampler = plug("batch_schedule", "batch_schedule:ScheduledSampler", default=WindowSampler)
check_auto_micro_batch = plug("auto_batch", "memory:check_auto_micro_batch")
auto_plan = plug("auto_batch", "memory:auto_plan")


@dataclass(frozen=True)
class Run:
    """What this job is, decided at start-up; `sampler` (auto_batch may lower its plan) and `preemption` live on."""

    cfg: TrainConfig
    env: DistEnv
    launch: Launch
    plan: BatchPlan  # the plan the job starts with
    sampler: WindowSampler  # this rank's windows, built once (Session and total_steps use this one)
    resume: Path | None  # the checkpoint this job continues from
    start_step: int  # optimizer steps done before this job
    total_steps: int
    tokenizer: object
    model_config: object
    data: object  # DatasetDict: train and validation, memory-mapped
    data_folder: Path
    data_fingerprint: str  # of the training examples' content: a resume needs the same
    deepspeed: dict | None  # the DeepSpeed config, its "auto" keys filled
    peak_flops: float  # the device's peak FLOP/s; 0 where unknown (no mfu)
    recorded: dict  # the resumed checkpoint's state ({} for a fresh run): what the extras continue from
    preemption: PreemptionSignal  # SIGUSR1 and SIGTERM, listened for from start-up on

    def announce(self, model) -> None:
        """The run's banner (rank 0): what trains on what data, the speed levers, the batch plan."""
        cfg = self.cfg
        examples = f"blocks of {cfg.max_seq_len} tokens" if cfg.packing else "examples"
        cuda = self.env.device.type == "cuda"
        levers = [f"compile {'on' if cfg.compile else 'off'}",
                  f"{'its own' if cfg.model_factory else cfg.attn_implementation} attention",
                  f"matmuls in {matmul_precision(cfg, self.env.device)}",
                  *(["fused AdamW"] if cuda and cfg.fused_adamw and cfg.optimizer == "adamw" else []),
                  f"peak {self.peak_flops / 1e12:g} TFLOP/s per device" if self.peak_flops else "no known peak: no mfu"]
        print0(f"train_{self.launch.entry}: {cfg.task}, {sum(map(numel, model.parameters())):,} parameters, "
               f"{self.total_steps} optimizer steps ({self.sampler.steps_per_epoch} {self.sampler.per_epoch})"
               + (f", resuming after step {self.start_step} from {self.resume}" if self.resume else "")
               + f"\ndata: {len(self.data['train']):,} training {examples} from {self.data_folder}"
               + f"\nspeed: {', '.join(levers)}" + "\n" + self.sampler.plan.table(cfg.max_seq_len))

    def init_distributed(self) -> None:
        """Join the process group (once; one process joins none, unless it runs DeepSpeed); the nodes
        must share output_dir."""
        init_distributed(self.env, self.cfg.rendezvous_timeout_s, self.cfg.collective_timeout_s,
                         alone_too=self.launch.backend == "deepspeed")
        check_shared(self.cfg.output_dir, self.env)

    def state(self, step: int, micro_batch_size: int) -> dict:
        """What a checkpoint (or the final model) records besides its files, for a later job to check."""
        return {"step": step, "world_size": self.env.world_size, "entry": self.launch.entry,
                "backend": self.launch.backend, "total_steps": self.total_steps,
                "num_train_examples": len(self.data["train"]), "data_fingerprint": self.data_fingerprint,
                "micro_batch_size": micro_batch_size, "config": self.cfg.to_dict(),
                "versions": checkpoint.library_versions()}


def start(cfg: TrainConfig, entry: str) -> Run:
    """Every up-front check, then the run's facts. A finished run is compared (its data too) and answered
    without output_dir's lock, which any other job holds from here to its end. The preemption signals are
    listened for from the first line (SIGUSR1 while the data is prepared stops the run at its first step)."""
    preemption = PreemptionSignal()
    env = dist_env()
    # never needed: a "Writing model shards" bar per save, DeepSpeed's no-GPU warning, a DDP deprecation notice
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", message="`broadcast_buffers` is deprecated", category=FutureWarning)
    if env.device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    launch = launch_of(cfg, entry)
    schedule = schedule_of(cfg, launch)
    check_back_end(cfg, env, launch)
    check_wandb(cfg)
    resume = checkpoint.resume_point(cfg)
    state, finished, lock = None, resume == checkpoint.final_dir(cfg.output_dir), OutputLock(cfg.output_dir)
    if resume is not None:
        state = checkpoint.read_state(resume) if finished else checkpoint.verify_checkpoint(resume)
        checkpoint.check_same_training(state, cfg, resume)
        if not finished:
            checkpoint.check_same_entry(state, entry, launch.backend, env.world_size, resume)
    if not finished:
        out = Path(cfg.output_dir)
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise ConfigError(f"output_dir {out} cannot be created ({err.strerror}); choose a folder you can "
                              "write to") from None
        if not os.access(out, os.W_OK | os.X_OK):
            raise ConfigError(f"output_dir {out} is not writable; choose a folder you can write to")
        lock.take(env)
        keep_flight_recorder(env, cfg.output_dir)  # before any process group exists
    try:
        return _start(cfg, env, launch, schedule, resume, state, finished, preemption)
    except BaseException:
        lock.release()
        raise


def _start(cfg: TrainConfig, env: DistEnv, launch: Launch, schedule: tuple, resume: Path | None,
           state: dict | None, finished: bool, preemption: PreemptionSignal) -> Run:
    auto = cfg.micro_batch_size == "auto"  # (config.py allows it only where auto_batch is baked)
    if auto:
        check_auto_micro_batch(cfg, env, launch)
    else:
        plan = plan_batches(cfg.global_batch_size, cfg.micro_batch_size, env.world_size)
    tokenizer = load_tokenizer(cfg)
    prepared = prepare(cfg, tokenizer)
    config = model_config(cfg, tokenizer, prepared.num_labels or 2)
    data = prepared.data
    if (largest := max(size for _, size in schedule)) > len(data["train"]):  # no step would take the batch it records
        what = (f"global_batch_size {largest}" if len(schedule) == 1 else
                f"global_batch_size_schedule {cfg.global_batch_size_schedule!r} reaches {largest}, which")
        raise ConfigError(f"{what} is larger than the training set of dataset {cfg.dataset}: {len(data['train'])} "
                          f"{f'blocks of {cfg.max_seq_len} tokens' if cfg.packing else 'examples'}; use a global "
                          f"batch of at most {len(data['train'])}, or more data")
    if state is not None:
        checkpoint.check_same_data(state, cfg, prepared.fingerprint, len(data["train"]), resume)
        if finished:
            raise RunFinished(f"already done at step {state['step']}: {resume} (nothing changed)")
        checkpoint.note_versions(state, resume)
    if auto:  # the ranks meet once, to agree on the micro batch
        plan = auto_plan(cfg, config, env, state, launch)
    check_launcher_env(plan)
    ds_config = deepspeed_config(cfg, plan, launch.deepspeed_path) if launch.on_accelerate else None
    set_tf32(cfg, env.device)
    sampler = Sampler(len(data["train"]), scheduled(plan, schedule), env.rank, cfg.seed, 2 if cfg.compile else 1)
    return Run(cfg=cfg, env=env, launch=launch, plan=sampler.plan, sampler=sampler, resume=resume,
               start_step=int(state["step"]) if state else 0, total_steps=total_steps(cfg, sampler),
               tokenizer=tokenizer, model_config=config, data=data, data_folder=prepared.folder,
               data_fingerprint=prepared.fingerprint, deepspeed=ds_config, peak_flops=peak_flops(cfg, env.device),
               recorded=state or {}, preemption=preemption)
