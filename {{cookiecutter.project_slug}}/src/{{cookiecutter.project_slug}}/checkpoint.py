"""Checkpoints: `output_dir/checkpoints/step_<N>/`, written atomically, newest K kept.

Every process writes its part into `checkpoints/.tmp_step_<N>/`; once all have finished, the main
process renames it to `step_<N>/`. A crash mid-write leaves only the temporary folder, which is
never read, so the previous checkpoint stays the newest complete one. `state.json` is written
last and marks a checkpoint complete.
"""

import json
import random
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from .config import ConfigError, TrainConfig
from .distributed import DistEnv, barrier, print0

STATE_FILE = "state.json"


def checkpoints_dir(output_dir: str) -> Path:
    return Path(output_dir) / "checkpoints"


def complete_checkpoints(output_dir: str) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = checkpoints_dir(output_dir)
    found = [p for p in root.glob("step_*") if p.name[5:].isdigit() and (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: int(p.name[5:]))


def resolve_resume(cfg: TrainConfig) -> Path | None:
    """The checkpoint to continue from, or None to start fresh; refuses to overwrite earlier work."""
    out = Path(cfg.output_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"output_dir {out} is a file; choose a folder")
    found = complete_checkpoints(cfg.output_dir)
    if cfg.resume_from_checkpoint == "":
        if found:
            raise ConfigError(
                f"output_dir {out} already holds checkpoints ({found[-1].name}); pass "
                "--resume_from_checkpoint auto to continue, or choose another --output_dir"
            )
        return None
    if cfg.resume_from_checkpoint == "auto":
        return found[-1] if found else None
    path = Path(cfg.resume_from_checkpoint)
    if not (path / STATE_FILE).is_file():
        raise ConfigError(
            f"resume_from_checkpoint {path} is not a complete checkpoint (no {STATE_FILE}); "
            f"pass a checkpoints/step_<N> folder or 'auto'"
        )
    return path


def read_state(path: Path) -> dict:
    """The checkpoint's state.json; a missing or damaged one is a ConfigError (one line, exit 2)."""
    try:
        state = json.loads((path / STATE_FILE).read_text())
        int(state["step"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ConfigError(f"checkpoint {path} is unreadable ({STATE_FILE}: {err!r}); "
                          "resume from another one or remove it") from None
    return state


def rng_state() -> dict:
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(cfg: TrainConfig, step: int, env: DistEnv, write: Callable[[Path], None]) -> Path:
    """Run `write(folder)` on every process into a temporary folder, then publish it."""
    tmp = checkpoints_dir(cfg.output_dir) / f".tmp_step_{step}"
    if env.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    write(tmp)
    return publish_checkpoint(cfg, step, env, tmp)


def publish_checkpoint(cfg: TrainConfig, step: int, env: DistEnv, written: Path) -> Path:
    """Once every process has finished writing `written`: mark it complete (state.json: the step,
    the world size and the config), rename it to step_<step> and keep the newest save_total_limit."""
    final = checkpoints_dir(cfg.output_dir) / f"step_{step}"
    barrier()
    if env.is_main_process:
        state = {"step": step, "world_size": env.world_size, "config": cfg.to_dict()}
        (written / STATE_FILE).write_text(json.dumps(state, indent=2))
        shutil.rmtree(final, ignore_errors=True)
        written.rename(final)
        if cfg.save_total_limit:
            for old in complete_checkpoints(cfg.output_dir)[:-cfg.save_total_limit]:
                shutil.rmtree(old)
        print0(f"checkpoint: {final}")
    barrier()
    return final


def save_rng(folder: Path, rank: int) -> None:
    torch.save(rng_state(), folder / f"rng_rank{rank}.pt")


def load_rng(path: Path, rank: int) -> None:
    """Restore this rank's RNG states (rank 0's when the checkpoint had fewer ranks)."""
    own = path / f"rng_rank{rank}.pt"
    set_rng_state(torch.load(own if own.is_file() else path / "rng_rank0.pt", weights_only=False))
