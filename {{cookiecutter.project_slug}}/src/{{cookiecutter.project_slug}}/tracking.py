"""The run's record: `metrics.jsonl` and Weights & Biases, written by the main process only.

One JSON object per optimizer step (`step`, `loss`, `lr`, `grad_norm`, `tokens`, `micro_steps`,
`grad_sync_calls`, `world_size`, `grad_accum_steps`, `global_batch_size`, `elapsed_s`) and one
per evaluation (`step`, `eval_loss`, ...). On resume the file is appended to.

W&B: the W&B step is the optimizer step; training keys go under `train/`, evaluation keys under
`eval/`. Without an API key (no WANDB_API_KEY, no `wandb login`) the run is offline, and the
`wandb sync` command is printed. The key itself is never written anywhere by this code.
"""

import json
import math
import netrc
import os
import shlex
import time
from pathlib import Path

from .batch import BatchPlan
from .config import TrainConfig
from .distributed import DistEnv, print0

TRAIN_KEYS = {"loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm",
              "grad_sync_calls": "train/grad_sync_calls"}


def _has_wandb_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False


def run_name(env: DistEnv, plan: BatchPlan) -> str:
    procs = env.world_size // env.num_nodes
    return f"{env.num_nodes}x{procs}-acc{plan.grad_accum_steps}-mb{plan.micro_batch_size}"


class Tracker:
    """Rank 0 writes; other ranks hold a Tracker that does nothing.

    W&B runs through Accelerate's tracker when an `accelerator` is given, else through wandb.init.
    """

    def __init__(self, cfg: TrainConfig, env: DistEnv, plan: BatchPlan, resumed: bool, accelerator=None):
        self.active = env.is_main_process
        self.path = Path(cfg.output_dir) / "metrics.jsonl"
        self.wandb_run = None
        self.start = time.perf_counter()
        self.last_elapsed = 0.0  # elapsed_s of the previous step record, for tokens_per_s
        if not self.active:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if not resumed:
            self.path.write_text("")
        if cfg.report_to == "wandb":
            self.wandb_run = _init_wandb(cfg, env, plan, resumed, accelerator)

    def log(self, record: dict) -> None:
        """Append one record (a training step or an evaluation) and send it to W&B. A value that is
        not a finite number (a diverging step's loss) is written as null: the file stays strict JSON."""
        if not self.active:
            return
        record = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}
        with self.path.open("a") as f:
            f.write(json.dumps(record, allow_nan=False) + "\n")
        if self.wandb_run is not None:
            self.wandb_run.log(self._wandb_record(record), step=record["step"])

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def _wandb_record(self, record: dict) -> dict:
        if "eval_loss" in record:
            return {f"eval/{k.removeprefix('eval_')}": v for k, v in record.items() if k.startswith("eval_")}
        out = {wandb_key: record[key] for key, wandb_key in TRAIN_KEYS.items() if record.get(key) is not None}
        seconds = record["elapsed_s"] - self.last_elapsed
        out["train/tokens_per_s"] = record["tokens"] / seconds if seconds > 0 else 0.0
        self.last_elapsed = record["elapsed_s"]
        return out

    def finish(self) -> None:
        if self.wandb_run is not None:
            run, self.wandb_run = self.wandb_run, None
            run.finish()
            if run.settings.mode == "offline":
                print0(f"W&B run saved offline in {run.dir}; upload it with: "
                       f"wandb sync {shlex.quote(str(Path(run.dir).parent))}")


def wandb_settings(cfg: TrainConfig, env: DistEnv, plan: BatchPlan, resumed: bool) -> tuple[dict, dict]:
    """(run config, wandb.init keyword arguments other than project and config)."""
    id_file = Path(cfg.output_dir) / "wandb_run_id"
    run_id = id_file.read_text().strip() if resumed and id_file.is_file() else None
    slurm_job = os.environ.get("SLURM_JOB_ID")
    run_config = {**cfg.to_dict(), "world_size": env.world_size, "num_nodes": env.num_nodes,
                  "grad_accum_steps": plan.grad_accum_steps,
                  "global_batch_size": plan.global_batch_size, "slurm_job_id": slurm_job}
    init = {
        "entity": cfg.wandb_entity or None,
        "name": run_name(env, plan),
        "group": slurm_job,
        "id": run_id,
        "resume": "allow" if run_id else None,
        "mode": os.environ.get("WANDB_MODE") or ("online" if _has_wandb_key() else "offline"),
        "dir": None if os.environ.get("WANDB_DIR") else cfg.output_dir,
    }
    return run_config, init


def _init_wandb(cfg: TrainConfig, env: DistEnv, plan: BatchPlan, resumed: bool, accelerator):
    run_config, init = wandb_settings(cfg, env, plan, resumed)
    if accelerator is None:
        import wandb

        run = wandb.init(project=cfg.wandb_project, config=run_config, **init)
    else:  # through Accelerate's tracker (Accelerator(log_with="wandb"))
        accelerator.init_trackers(cfg.wandb_project, config=run_config, init_kwargs={"wandb": init})
        run = accelerator.get_tracker("wandb", unwrap=True)
    (Path(cfg.output_dir) / "wandb_run_id").write_text(run.id)
    return run
