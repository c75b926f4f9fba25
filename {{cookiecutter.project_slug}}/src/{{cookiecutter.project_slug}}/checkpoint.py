"""Checkpoints and finished runs: `checkpoints/step_<N>/` and `final_model/`, written into a temporary folder
and renamed once every process is done, with a `state.json` (step, entry, config, versions, file sizes). A
resume checks config and files up front without loading them. docs/guarantees.md tells the story.
"""

import contextlib
import hashlib
import json
import os
import random
import re
import shlex
import shutil
import tempfile
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import numpy as np
import torch

from . import extras
from .config import TrainConfig, keys_where
from .data_cache import checksums, file_damage
from .distributed import DistEnv, barrier, print0, ranks_with
from .errors import ConfigError, JobFailed, disk_full, first_line

STATE_FILE = "state.json"
FINAL_DIR = "final_model"
LIBRARIES = ("torch", "transformers", "accelerate", "deepspeed")
ZERO_PARTS = re.compile(r"(?:^|/)(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_\d+_optim_states\.pt$")  # one per process
# With safe_checkpoints: why a checkpoint's file would not load safely (pickles, safetensors headers); without: ""
check_file = extras.plug("safe_checkpoints", "checkpoint_checks:check_file", default=lambda path: "")


def checkpoints_dir(output_dir: str) -> Path:
    return Path(output_dir) / "checkpoints"


def final_dir(output_dir: str) -> Path:
    return Path(output_dir) / FINAL_DIR


def complete_checkpoints(output_dir: str) -> list[Path]:
    root = checkpoints_dir(output_dir)
    found = [p for p in root.glob("step_*") if p.name[5:].isdigit() and (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: int(p.name[5:]))


def newest_checkpoint(output_dir: str) -> str:
    """What a job that stops on a failure says is left to continue from."""
    found = complete_checkpoints(output_dir)
    return f"the newest complete checkpoint is {found[-1]}" if found else "no checkpoint was completed before"


def after_a_failed_write(output_dir: str, err: BaseException | None) -> str:
    """What to do after a failed write: free space only where the disk is full; `err` None: another process failed."""
    then = "resume it with --resume_from_checkpoint auto" if complete_checkpoints(output_dir) else "start the run again"
    fix = "free space" if disk_full(err) else "fix what the error names" if err else "see the other process's error"
    return f"{newest_checkpoint(output_dir)}: {fix} and {then}"


def library_versions() -> dict[str, str]:
    found = {}
    for name in LIBRARIES:
        with contextlib.suppress(PackageNotFoundError):
            found[name] = version(name)
    return found


def read_state(path: Path) -> dict:
    """A checkpoint's (or finished run's) state.json; a missing or damaged one is a ConfigError."""
    try:
        state = json.loads((path / STATE_FILE).read_text())
        int(state["step"])
        dict(state["config"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ConfigError(f"checkpoint {path} is unreadable ({STATE_FILE}: {err!r}); "
                          "resume from another one or remove it") from None
    return state


def _damage(path: Path, state: dict) -> str:
    """What is wrong with checkpoint `path`, or "" (a checkpoint of an older version recorded sizes only)."""
    for name, expected in state.get("files", {}).items():
        if problem := file_damage(path / name, expected if isinstance(expected, dict) else {"size": expected}):
            return f"{path / name} {problem}"
    problems = (f"{file} {problem}" for file in sorted(p for p in path.rglob("*") if p.is_file())
                if (problem := check_file(file)))
    return next(problems, "")


def verify_checkpoint(path: Path) -> dict:
    """state.json of a checkpoint that loads; a damaged one is one line naming the file and an older one that loads."""
    state = read_state(path)
    if problem := _damage(path, state):
        raise ConfigError(f"checkpoint {path} cannot be loaded: {problem}; {older_that_loads(path)}")
    return state


def older_that_loads(path: Path) -> str:
    """The newest checkpoint of the same run older than `path` whose files load, as advice."""
    step = int(read_state(path)["step"])
    older = [p for p in reversed(complete_checkpoints(str(path.parent.parent))) if int(p.name[5:]) < step]
    loads = next((p for p in older if not _damage(p, read_state(p))), None)
    return (f"the older checkpoint {loads} loads: --resume_from_checkpoint {loads}" if loads
            else "no older checkpoint of this run loads")


def _length(config: dict) -> tuple[str, int]:
    """The key that fixes the run's total optimizer steps, and its value."""
    return ("max_steps", config["max_steps"]) if config["max_steps"] != -1 else ("num_epochs", config["num_epochs"])


def check_same_training(state: dict, cfg: TrainConfig, where: Path) -> None:
    """The keys declared resume="match" must be those `where` was trained with (ConfigError);
    `dataset` is compared by content (check_same_data); an unbaked extra's key must have been off."""
    old, new = state["config"], cfg.to_dict()
    extras.recorded_off(old)
    by_content = {"dataset"} if "data_fingerprint" in state else set()
    differences = [(key, old[key], new[key]) for key in keys_where(resume="match")
                   if key in old and old[key] != new[key] and key not in by_content]
    if {"max_steps", "num_epochs"} <= set(old) and _length(old) != _length(new):  # the keys declared "length"
        key = _length(old)[0] if _length(old)[0] == _length(new)[0] else "max_steps"
        differences.append((key, old[key], new[key]))
    if differences:
        key, before, now = differences[0]
        raise ConfigError(f"{where} was trained with {key} {before!r}, this run has {key} {now!r}; a run "
                          f"continues only with the same {key} (pass --{key} {shlex.quote(str(before))}), or start a "
                          "new run in another --output_dir")


def check_same_data(state: dict, cfg: TrainConfig, fingerprint: str, examples: int, where: Path) -> None:
    """A run continues only on the same training examples (their fingerprint), wherever they lie."""
    before = state.get("num_train_examples", examples)
    if before != examples:
        raise ConfigError(f"{where} was trained on {before} training examples, dataset {cfg.dataset} now has "
                          f"{examples}; a run continues only on the same data, or start a new run in another "
                          "--output_dir")
    if state.get("data_fingerprint", fingerprint) != fingerprint:
        raise ConfigError(f"{where} was trained on other data than dataset {cfg.dataset} holds now (data_fingerprint "
                          f"{state['data_fingerprint']}, now {fingerprint}): a run continues only on the same "
                          "training examples (the files may move) and labelling rule (data.labels_for); restore them, "
                          "or start a new run in another --output_dir")


def check_same_entry(state: dict, entry: str, backend: str, world_size: int, where: Path) -> None:
    """A checkpoint continues in the entry point and back end that wrote it (their formats differ); one with DeepSpeed
    ZeRO's optimizer state at the world size that wrote it (a file per process, which DeepSpeed cannot split anew)."""
    if state.get("entry", entry) != entry:
        raise ConfigError(f"{where} was written by train_{state['entry']}, not train_{entry}: each entry point "
                          f"keeps its library's checkpoint format; continue it with train_{state['entry']}, or start "
                          "a new run in another --output_dir")
    if state.get("backend", backend) != backend:
        raise ConfigError(f"{where} was written with {state['backend']}, this run uses {backend}; continue it with "
                          f"the same back end (--deepspeed), or start a new run in another --output_dir")
    split = {found[1] for name in state.get("files", {}) if (found := ZERO_PARTS.search(name))}
    if split and len(split) != world_size:
        raise ConfigError(f"{where} holds DeepSpeed ZeRO's optimizer state split for world size {len(split)}, this "
                          f"run's is {world_size}; continue it at world size {len(split)}, or start a new run in "
                          "another --output_dir")


def note_versions(state: dict, where: Path) -> None:
    """One line when the libraries differ from those that wrote the checkpoint (the run goes on)."""
    now = library_versions()
    if changed := [f"{name} {old} -> {now.get(name, 'none')}" for name, old in state.get("versions", {}).items()
                   if now.get(name) != old]:
        print0(f"note: {where} was written with other library versions ({', '.join(changed)}); continuing")


def resume_point(cfg: TrainConfig) -> Path | None:
    """The checkpoint to continue from (checked), or None to start fresh (never over a finished run or
    checkpoints); a finished run in output_dir is returned as its final_model folder (the caller stops)."""
    out, finished = Path(cfg.output_dir), final_dir(cfg.output_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"output_dir {out} is a file; choose a folder")
    done, found = (finished / STATE_FILE).is_file(), complete_checkpoints(cfg.output_dir)
    if cfg.resume_from_checkpoint == "" and done:
        raise ConfigError(f"output_dir {out} holds a finished run ({finished}, step {read_state(finished)['step']}); "
                          f"to train it further start a new run from it (--model_name_or_path {finished} --output_dir "
                          "NEW_DIR), or choose another --output_dir")
    if cfg.resume_from_checkpoint == "" and found:
        raise ConfigError(f"output_dir {out} already holds checkpoints ({found[-1].name}); pass "
                          "--resume_from_checkpoint auto to continue, or choose another --output_dir")
    if cfg.resume_from_checkpoint == "":
        return None
    if done:
        if cfg.resume_from_checkpoint != "auto":
            raise ConfigError(f"output_dir {out} holds a finished run ({finished}); resume "
                              f"{cfg.resume_from_checkpoint} into another --output_dir")
        return finished
    if cfg.resume_from_checkpoint == "auto":
        return found[-1] if found else None
    path = Path(cfg.resume_from_checkpoint)
    if not (path / STATE_FILE).is_file():
        raise ConfigError(f"resume_from_checkpoint {path} is not a complete checkpoint (no {STATE_FILE}); "
                          f"pass a checkpoints/step_<N> folder or 'auto'")
    return path


def rng_state(device: torch.device) -> dict:
    """This process's RNGs, its own GPU's only (a node with fewer GPUs can restore it); weights_only=True loads them."""
    kind, keys, *rest = np.random.get_state()
    return {"python": random.getstate(), "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), *rest],
            "torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}


def set_rng_state(state: dict, device: torch.device) -> None:
    random.setstate((state["python"][0], tuple(state["python"][1]), state["python"][2]))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    cuda = state["cuda"]  # older checkpoints: a list, every GPU the process saw, its own at its index
    if isinstance(cuda, list):
        cuda = cuda[device.index] if device.type == "cuda" and device.index < len(cuda) else None
    if cuda is not None and device.type == "cuda":
        torch.cuda.set_rng_state(cuda, device)


def save_rng(folder: Path, rank: int, device: torch.device) -> None:
    torch.save(rng_state(device), folder / f"rng_rank{rank}.pt")


def load_rng(path: Path, rank: int, device: torch.device) -> None:
    """Restore this rank's RNG states (rank 0's when the checkpoint had fewer ranks) on its own device."""
    own = path / f"rng_rank{rank}.pt"
    set_rng_state(torch.load(own if own.is_file() else path / "rng_rank0.pt", weights_only=True), device)


class WriteFailed(JobFailed):
    """A folder some process could not write, and why (`err`: None where this one wrote); raised on all."""

    def __init__(self, what: str, reason: str, output_dir: str, err: BaseException | None):
        super().__init__(f"could not write {what} ({reason}); {after_a_failed_write(output_dir, err)}", agreed=True)
        self.reason = reason


def _attempt(env: DistEnv, output_dir: str, what: str, action: Callable[[], None]) -> None:
    """Run `action` on every process; if it failed on any, all stop together with one line each."""
    error = None
    try:
        action()
    except Exception as err:  # a full disk (an OSError, or the serialiser's error around one), or any other
        error = err
    if failed := ranks_with(error is not None, env.device):
        reason = f"{type(error).__name__}: {first_line(error)}" if error else f"{failed} other process(es) failed"
        raise WriteFailed(what, reason, output_dir, error)


def write_atomically(cfg: TrainConfig, env: DistEnv, final: Path, write: Callable[[Path], object],
                     state: dict, finish: Callable | None = None):
    """`write(folder)` on every process into a temporary folder that `finish` (publish, or an extra's background
    write) makes `final`. A failed write stops every process with one line; `final` is untouched."""
    tmp = final.with_name(f".tmp_{final.name}")

    def make_tmp() -> None:
        if env.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)

    try:
        _attempt(env, cfg.output_dir, final.name, make_tmp)
        _attempt(env, cfg.output_dir, final.name, lambda: write(tmp))
        return (finish or publish)(cfg, env, tmp, final, state)
    except JobFailed:
        if env.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_final(cfg: TrainConfig, env: DistEnv, write: Callable[[Path], None], state: dict) -> None:
    """final_model/, as write_atomically writes it; where output_dir has no room, the model is kept
    whole on another file system (room_elsewhere) and the one line says where."""
    final = final_dir(cfg.output_dir)
    try:
        write_atomically(cfg, env, final, write, state)
    except WriteFailed as failed:
        elsewhere = room_elsewhere(cfg.output_dir)
        if ranks_with(elsewhere is None, env.device):
            raise
        try:
            kept = write_atomically(cfg, env, elsewhere, write, state)
        except WriteFailed:
            raise failed from None
        raise JobFailed(f"could not write {final} ({failed.reason}); the trained model is kept in {kept}: move it "
                        f"there once output_dir can hold it (mv {kept} {final})", agreed=True) from None


def room_elsewhere(output_dir: str) -> Path | None:
    """A folder for the final model in the first writable of tmp, home, /dev/shm on another file system."""
    out = Path(output_dir).resolve()
    device = os.stat(next(p for p in (out, *out.parents) if p.exists())).st_dev
    for base in (Path(tempfile.gettempdir()), Path.home(), Path("/dev/shm")):
        if base.is_dir() and os.access(base, os.W_OK) and base.stat().st_dev != device:
            return base / f"{out.name}-{hashlib.sha256(str(out).encode()).hexdigest()[:8]}-{FINAL_DIR}"
    return None


def publish(cfg: TrainConfig, env: DistEnv, written: Path, final: Path, state: dict) -> Path:
    """Once every process has written `written`, rank 0 marks it complete; then every process goes on."""
    barrier()
    _attempt(env, cfg.output_dir, final.name, lambda: env.is_main_process and mark_complete(cfg, written, final, state))
    barrier()
    return final


def mark_complete(cfg: TrainConfig, written: Path, final: Path, state: dict) -> None:
    """On one process: `written` gets its state.json (`state`, its files' checksums) and becomes `final`."""
    (written / "training_args.bin").unlink(missing_ok=True)  # the Trainer's pickle; nothing reads it
    (written / STATE_FILE).write_text(json.dumps({**state, "files": checksums(written, sampled=True)}, indent=2))
    shutil.rmtree(final, ignore_errors=True)
    written.rename(final)
    if final.parent == checkpoints_dir(cfg.output_dir):
        if cfg.save_total_limit:
            for old in complete_checkpoints(cfg.output_dir)[:-cfg.save_total_limit]:
                shutil.rmtree(old)
        print0(f"checkpoint: {final}")
