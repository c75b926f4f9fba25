"""The run's record, written by the main process only: `metrics.jsonl` (one JSON object per
optimizer step and per evaluation), Weights & Biases (step = optimizer step; `train/`, `eval/`;
offline without an API key) and the progress line. docs/guarantees.md lists the keys.
"""

import contextlib
import json
import math
import netrc
import os
import shlex
import sys
import time
from pathlib import Path

from tqdm import tqdm

from .checkpoint import after_a_failed_write
from .config import TrainConfig
from .distributed import DistEnv, print0
from .errors import ConfigError, JobFailed, first_line
from .output_lock import check_held
from .windows import BatchPlan

TRAIN_KEYS = {key: f"train/{key}" for key in ("loss", "lr", "grad_norm", "grad_sync_calls", "mfu", "grad_noise_scale",
                                               "global_batch_size", "micro_batch_size")}


def _has_wandb_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False


def check_wandb(cfg: TrainConfig) -> None:
    """An up-front check: W&B told to upload (WANDB_MODE=online) has a key to upload with."""
    if cfg.report_to == "wandb" and os.environ.get("WANDB_MODE", "").lower() == "online" and not _has_wandb_key():
        raise ConfigError(f"WANDB_MODE={os.environ['WANDB_MODE']}, but there is no W&B key (WANDB_API_KEY, or "
                          "`wandb login`); log in, or set WANDB_MODE=offline and upload later with `wandb sync`")


def _duration(seconds: float) -> str:
    """3725 -> 1h02m, 200 -> 3m20s, 45 -> 45s."""
    seconds = int(round(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


class Progress:
    """Rank 0's line every `log_every` steps and after the last, `step 120/3900 | loss 3.2140 | lr
    2.90e-04 | grad_norm 0.93 | 41.2k tok/s | eta 1h02m` and what else the record holds; on a
    terminal a live bar shows the steps between, elsewhere (a SLURM log) only plain lines."""

    LINES_PER_RUN = 30  # log_every 0: about this many lines, whatever the run's length

    def __init__(self, total_steps: int, start_step: int, log_every: int):
        self.total = total_steps
        self.every = log_every or max(1, math.ceil((total_steps - start_step) / self.LINES_PER_RUN))
        self.since = (start_step, 0.0, 0)  # (step, elapsed_s, tokens) at the last line
        self.shape = None  # (global batch, micro batch) at the last line: a change is shown once
        self.oom = False  # a window was taken again after an out-of-memory error since the last line
        # disable=None: no bar where stdout is no terminal
        self.bar = tqdm(total=total_steps, initial=start_step, unit="step", file=sys.stdout, disable=None,
                        dynamic_ncols=True, leave=False, bar_format="{n_fmt}/{total_fmt} {bar:24} {postfix}")

    def line(self, record: dict) -> str:
        step, tokens = record["step"], self.since[2] + record["tokens"]
        steps, seconds = step - self.since[0], record["elapsed_s"] - self.since[1]
        loss, grad_norm = record["loss"], record.get("grad_norm")  # None (not finite, or no norm) shows as nan
        parts = [f"step {step}/{self.total}", f"loss {math.nan if loss is None else loss:.4f}",
                 f"lr {record['lr']:.2e}", f"grad_norm {math.nan if grad_norm is None else grad_norm:.2f}"]
        if seconds > 0:
            parts += [f"{tqdm.format_sizeof(tokens / seconds)} tok/s",  # 41234.5 -> 41.2k
                      f"eta {_duration((self.total - step) * seconds / steps)}"]
        parts += [f"{name} {record[key]:{spec}}" for key, name, spec in (("mfu", "mfu", ".1%"),
                  ("grad_noise_scale", "gns", ".3g"), ("grad_sync_calls", "syncs", "")) if key in record]
        if record.get("step_skipped"):
            parts.append("skipped")
        shape = record["global_batch_size"], record["micro_batch_size"]
        if self.shape is not None and shape != self.shape:
            why = " after out of memory" if self.oom or record.get("oom_retries") else ""
            parts.append(f"batch {shape[0]} = micro {shape[1]}{why} x accum {record['grad_accum_steps']} x world "
                         f"{record['world_size']}")
        return " | ".join(parts)

    def evaluation(self, record: dict) -> None:
        """`eval 13/39 | loss 4.0507 | perplexity 57.43`: every evaluation gets its line."""
        parts = [f"{k.removeprefix('eval_')} {v:.4f}" for k, v in record.items() if k.startswith("eval_")]
        print0(" | ".join([f"eval {record['step']}/{self.total}", *parts]))

    def update(self, record: dict) -> None:
        step = record["step"]
        text = self.line(record)
        self.bar.set_postfix_str(text.partition(" | ")[2], refresh=False)
        self.bar.update(1)
        if step % self.every == 0 or step == self.total:
            print0(text)  # above a live bar
            self.since = (step, record["elapsed_s"], 0)
            self.shape, self.oom = (record["global_batch_size"], record["micro_batch_size"]), False
        else:
            self.since = (*self.since[:2], self.since[2] + record["tokens"])
            self.oom = self.oom or bool(record.get("oom_retries"))
        if step == self.total:
            self.bar.close()


def set_aside(path: Path, step: int) -> None:
    """Each step once in metrics.jsonl: records after `step` (0 for a fresh run) and lines a crash cut
    short move to metrics.dropped.jsonl (appended, never lost), with one line."""
    kept, dropped = [], []
    for line in path.read_text().splitlines() if path.is_file() else []:
        if not line.strip():
            continue
        try:
            keep = step > 0 and json.loads(line).get("step", 0) <= step
        except ValueError:
            keep = False
        (kept if keep else dropped).append(line + "\n")
    if not dropped:
        return
    aside = path.with_name("metrics.dropped.jsonl")
    with aside.open("a") as f:
        f.writelines(dropped)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(kept))
    tmp.replace(path)
    print0(f"note: {len(dropped)} record{'s' if len(dropped) > 1 else ''} of {path} after step {step} (logged "
           f"before the job stopped) moved to {aside}")


def append_line(path: Path, line: str) -> None:
    """Append `line` whole or not at all (a part written to a full disk is cut off); one line on failure."""
    data = (line + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        start = os.lseek(fd, 0, os.SEEK_END)
        written = 0
        while written < len(data):
            written += os.write(fd, data[written:])
    except OSError as err:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, start)
        raise JobFailed(f"could not write {path} ({err.strerror or type(err).__name__}); "
                        f"{after_a_failed_write(str(path.parent), err)}") from None
    finally:
        os.close(fd)


class Tracker:
    """Rank 0 writes (W&B through `accelerator`'s tracker where given); other ranks do nothing."""

    def __init__(self, cfg: TrainConfig, env: DistEnv, plan: BatchPlan, total_steps: int, start_step: int,
                 resumed: bool, accelerator=None):
        self.active, self.path = env.is_main_process, Path(cfg.output_dir) / "metrics.jsonl"
        self.wandb_run, self.start = None, time.perf_counter()
        self.last_elapsed = 0.0  # elapsed_s of the previous step record, for tokens_per_s
        if not self.active:
            return
        self.progress = Progress(total_steps, start_step, cfg.log_every)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        set_aside(self.path, start_step if resumed else 0)
        if cfg.report_to == "wandb":
            self.wandb_run = _init_wandb(cfg, env, plan, resumed, accelerator)

    def log(self, record: dict) -> None:
        """Append one record (a step or an evaluation), send it to W&B and move the progress line; a
        value that is not finite (a diverging loss) is written as null: the file stays strict JSON."""
        if not self.active:
            return
        record = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}
        check_held()
        append_line(self.path, json.dumps(record, allow_nan=False))
        if self.wandb_run is not None:
            self.wandb_run.log(self._wandb_record(record), step=record["step"])
        if "loss" in record:
            self.progress.update(record)
        elif "eval_loss" in record:
            self.progress.evaluation(record)

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
            if run.settings.mode == "offline":  # every job of the run (a resume writes a folder of its own)
                folders = sorted(Path(run.dir).parent.parent.glob(f"offline-run-*-{run.id}"))
                print0(f"W&B run saved offline in {run.dir}; upload it with: "
                       f"wandb sync {' '.join(shlex.quote(str(f)) for f in folders)}")


def _init_wandb(cfg: TrainConfig, env: DistEnv, plan: BatchPlan, resumed: bool, accelerator):
    """The W&B run; one that cannot reach its server logs offline instead, with one line."""
    import wandb

    id_file = Path(cfg.output_dir) / "wandb_run_id"
    run_id = id_file.read_text().strip() if resumed and id_file.is_file() else None
    slurm_job = os.environ.get("SLURM_JOB_ID")
    name = f"{env.num_nodes}x{env.world_size // env.num_nodes}-acc{plan.grad_accum_steps}-mb{plan.micro_batch_size}"
    run_config = {**cfg.to_dict(), "world_size": env.world_size, "num_nodes": env.num_nodes,
                  "grad_accum_steps": plan.grad_accum_steps, "global_batch_size": plan.global_batch_size,
                  "slurm_job_id": slurm_job}
    init = {"entity": cfg.wandb_entity or None, "name": os.environ.get("WANDB_NAME") or name,
            "group": os.environ.get("WANDB_RUN_GROUP") or slurm_job, "id": run_id,
            "resume": "allow" if run_id else None, "dir": None if os.environ.get("WANDB_DIR") else cfg.output_dir,
            "mode": os.environ.get("WANDB_MODE") or ("online" if _has_wandb_key() else "offline")}

    def start(init: dict):
        if accelerator is None:
            return wandb.init(project=cfg.wandb_project, config=run_config, **init)
        accelerator.init_trackers(cfg.wandb_project, config=run_config, init_kwargs={"wandb": init})
        return accelerator.get_tracker("wandb", unwrap=True)

    try:
        run = start(init)
    except wandb.errors.CommError as err:
        print0(f"note: W&B cannot reach its server ({first_line(err)}); this run logs offline instead")
        run = start({**init, "mode": "offline"})
    id_file.write_text(run.id)
    return run
