"""The one training config, read by all three entry points.

`configs/train.yaml` fills a `TrainConfig`; every field is also a command-line flag of the same
name that overrides it (`--learning_rate 3e-4`). Unknown keys, unknown flags, wrong types and
out-of-range values raise `ConfigError`, which the entry points turn into exit code 2 and one
line on stderr.
"""

import argparse
import json
import math
import os
import re
import sys
import textwrap
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Literal

import yaml
from transformers import HfArgumentParser

from .batch import parse_schedule
from .errors import ConfigError

DEFAULT_CONFIG = "configs/train.yaml"
PATHS = ("model_name_or_path", "dataset", "data_cache_dir", "output_dir", "resume_from_checkpoint", "deepspeed")


def whole_or_auto(value) -> int | str:
    """The type of micro_batch_size: a whole number, or "auto" (the largest that fits in memory)."""
    if str(value) == "auto":
        return "auto"
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid value {value!r}: a whole number or auto") from None


def _doc(text: str, default):
    """A field's one default and its help (the --help text and the comment in configs/train.yaml)."""
    return field(default=default, metadata={"help": text})


@dataclass
class TrainConfig:
    """Everything one training run needs. Each field is a YAML key and a `--flag`."""

    task: Literal["causal_lm", "sequence_classification"] = _doc(
        "causal_lm (next-token prediction) or sequence_classification.", "{{ cookiecutter.task }}")
    model_name_or_path: str = _doc(
        "'tiny' builds a small model from a config (no download); else a Hugging Face model name "
        "or local path.", "tiny")
    dataset: str = _doc(
        "'builtin' (the data shipped with this project for the task), a folder holding "
        "train/validation .jsonl/.json/.csv/.parquet files or a save_to_disk() dataset, or a "
        "Hugging Face dataset name.", "builtin")
    max_seq_len: int = _doc("Longest sequence in tokens; longer examples are truncated (packed: the block length).",
                            64)
    packing: bool = _doc(
        "causal_lm only: join the documents (one EOS between them) into blocks of max_seq_len tokens, no "
        "padding; attention then crosses document boundaries inside a block, as in HF's run_clm.", False)
    data_cache_dir: str = _doc(
        "Where the tokenised data is prepared once and memory-mapped by every process and later run on the "
        "same data and settings; on a cluster, a folder every node sees (else each node prepares its own).",
        "data_cache")
    data_num_proc: int = _doc(
        "Processes that tokenise while the data is prepared; 0: up to 8 for 100k examples or more, else 1.", 0)

    output_dir: str = _doc("Folder for metrics.jsonl, checkpoints/ and final_model/.", "runs/default")
    seed: int = _doc("Seeds model initialisation and the data order.", 42)
    max_steps: int = _doc("Optimizer steps to train; -1 trains num_epochs epochs.", -1)
    num_epochs: int = _doc("Epochs to train when max_steps is -1.", 3)

    micro_batch_size: whole_or_auto = _doc(
        "Examples per forward pass on each process; auto: the largest that fits in memory (from "
        "global_batch_size / world_size, halved until one micro-step fits).", {{ cookiecutter.micro_batch_size }})
    global_batch_size: int = _doc("Examples per optimizer step, summed over processes.",
                                  {{ cookiecutter.global_batch_size }})
    global_batch_size_schedule: str = _doc(
        "Grow the global batch during the run: \"0:32,20:64,50:128\" (from optimizer step 20 the global batch "
        "is 64, ...); the first size is global_batch_size, each one a multiple of the one before; the micro "
        "batch stays, the accumulation follows. Empty: global_batch_size throughout.", "")
    lr_batch_scaling: Literal["none", "sqrt", "linear"] = _doc(
        "With global_batch_size_schedule: scale the learning rate with the global batch (sqrt or linear in "
        "global batch / the first); none keeps the schedule's lr. No effect without a schedule.", "none")
    memory_budget_mb: float = _doc(
        "With micro_batch_size auto: the peak MiB one micro-step may use (0: the device's memory, "
        "found by trying; on CPU a budget is needed to search).", 0.0)

    optimizer: Literal["adamw", "sgd", "adafactor"] = _doc(
        "adamw, sgd (plain, no momentum) or adafactor; biases and norms get no weight decay.",
        "adamw")
    learning_rate: float = _doc("Peak learning rate.", 1e-3)
    lr_scheduler_type: Literal["linear", "cosine", "constant"] = _doc(
        "Schedule after warmup (constant still warms up).", "linear")
    warmup_steps: int = _doc("Optimizer steps of linear warmup from 0.", 5)
    weight_decay: float = _doc("Decoupled weight decay on matrices (not biases or norms).", 0.01)
    max_grad_norm: float = _doc("Clip the global gradient norm to this; 0 disables clipping.", 1.0)
    mixed_precision: Literal["no", "bf16", "fp16"] = _doc(
        "Autocast the forward pass in bf16 or fp16 (fp16 adds a gradient scaler).", "no")
    fp16_init_scale: float = _doc(
        "fp16's first loss scale; halved (and the step skipped) on every overflow.", 65536.0)
    gradient_checkpointing: bool = _doc("Recompute activations in the backward pass.", False)
    compile: bool = _doc("torch.compile the model (inductor; automatic dynamic shapes), in every entry point.", False)
    tf32: bool = _doc("TF32 matmuls on CUDA (faster, 10-bit mantissa); false keeps them full fp32.", True)
    fused_adamw: bool = _doc("AdamW's fused CUDA kernel (optimizer adamw on CUDA).", True)
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = _doc(
        "The model's attention kernel: sdpa (torch's scaled_dot_product_attention), eager, or "
        "flash_attention_2 (needs the flash-attn package).", "sdpa")
    dataloader_workers: int = _doc(
        "Processes that collate the next micro-batches while the device computes; -1: 4 on CUDA (with "
        "pinned memory), 0 on CPU.", -1)
    peak_tflops: float = _doc(
        "The device's peak TFLOP/s for MFU; 0 takes it from a table of common GPUs (none on CPU: no mfu).", 0.0)

    eval_every: int = _doc("Evaluate every N optimizer steps; 0 evaluates once per epoch.", 0)
    log_every: int = _doc(
        "Print the progress line every N optimizer steps (and after the last); 0: about 30 lines per run.", 0)
    report_to: Literal["wandb", "none"] = _doc(
        "wandb logs to Weights & Biases (offline when no API key is set); none disables it.",
        "wandb")
    wandb_project: str = _doc("Weights & Biases project.", "{{ cookiecutter.wandb_project }}")
    wandb_entity: str = _doc("Weights & Biases entity; empty for your default.",
                             "{{ cookiecutter.wandb_entity }}")
    save_steps: int = _doc("Write checkpoints/step_<N>/ every N optimizer steps; 0 never.", 0)
    save_total_limit: int = _doc("Keep the newest K checkpoints; 0 keeps all.", 2)
    resume_from_checkpoint: str = _doc(
        "'auto' continues from the newest complete checkpoint in output_dir (or starts fresh "
        "when there is none); a path continues from that checkpoint; empty starts fresh.", "")
    stop_after_steps: int = _doc(
        "End this job after N optimizer steps of this job with a checkpoint, as if preempted; "
        "0 runs to the end. The schedule still spans max_steps.", 0)
    max_nonfinite_steps: int = _doc(
        "A step whose loss or gradient norm is not finite is skipped (parameters, optimizer and schedule "
        "untouched); after this many in a row the job stops with exit code 3.", 3)

    deepspeed: str = _doc("DeepSpeed JSON config (train_accelerate and train_trainer).", "")
    ddp_no_sync: bool = _doc(
        "Skip DDP's gradient all-reduce on all but the last micro-step of each optimizer step. "
        "Turn off only to measure what it saves.", True)
    ddp_bucket_cap_mb: float = _doc("DDP gradient bucket size in MiB.", 25.0)
    fsdp: Literal["none", "full_shard", "hybrid_shard"] = _doc(
        "train_pytorch: shard parameters, gradients and optimizer state with FSDP2 (fully_shard) instead of DDP: "
        "full_shard over every process, hybrid_shard within each of fsdp_replicas groups (HSDP).", "none")
    fsdp_replicas: int = _doc(
        "hybrid_shard: replica groups of the mesh (replicate x shard); the world size must be a multiple.", 1)
    fsdp_grad_sync: Literal["micro_step", "window"] = _doc(
        "FSDP2: reduce-scatter the gradients every micro-step (sharded, least memory) or once per window "
        "(unsharded gradients held across it, fewer collectives).", "micro_step")
    async_checkpoint: bool = _doc(
        "FSDP2: write sharded checkpoints in the background while training continues.", False)
    rendezvous_timeout_s: float = _doc(
        "Seconds to wait for every process to join the process group before giving up with one line.", 300.0)
    collective_timeout_s: float = _doc(
        "Seconds a collective (all-reduce, barrier) may wait for the other processes: a process that "
        "stops responding fails the job after this long instead of hanging it.", 600.0)
    debug_distributed: bool = _doc(
        "Run with TORCH_DISTRIBUTED_DEBUG=DETAIL: every collective first checks that all ranks call it with "
        "the same shapes, so a mismatch fails at once with a description instead of hanging (slower: a "
        "check per collective). Either way a failed collective leaves output_dir/debug/rank_<r>.json.", False)

    def __post_init__(self) -> None:
        for name in PATHS:  # `~` as a shell expands it, also where no shell read the value (a YAML file)
            if getattr(self, name).startswith("~"):
                setattr(self, name, os.path.expanduser(getattr(self, name)))
        if not self.output_dir.strip():
            raise ConfigError("output_dir is empty; name the folder the run writes, e.g. runs/default")
        for f in fields(self):
            if f.type is float and not math.isfinite(getattr(self, f.name)):
                raise ConfigError(f"{f.name} must be a finite number, got {getattr(self, f.name)}")
        positive = ("max_seq_len", "num_epochs", "global_batch_size", "fp16_init_scale", "max_nonfinite_steps",
                    "rendezvous_timeout_s", "collective_timeout_s")
        if self.micro_batch_size != "auto" and self.micro_batch_size < 1:
            raise ConfigError(f"micro_batch_size must be >= 1 or auto, got {self.micro_batch_size}")
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        non_negative = ("warmup_steps", "weight_decay", "max_grad_norm", "eval_every", "log_every", "memory_budget_mb",
                        "data_num_proc", "save_steps", "save_total_limit", "stop_after_steps", "peak_tflops")
        for name in non_negative:
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.seed < 2**32:  # numpy's seeds
            raise ConfigError(f"seed must be a whole number from 0 to {2**32 - 1}, got {self.seed}")
        if self.max_steps == 0 or self.max_steps < -1:
            raise ConfigError(f"max_steps must be -1 (train num_epochs) or >= 1, got {self.max_steps}")
        if not self.learning_rate > 0:
            raise ConfigError(f"learning_rate must be > 0, got {self.learning_rate}")
        if self.dataloader_workers < -1:
            raise ConfigError(f"dataloader_workers must be -1 (auto) or >= 0, got {self.dataloader_workers}")
        if self.packing and self.task != "causal_lm":
            raise ConfigError(f"packing joins documents for causal_lm; task {self.task} keeps one example per "
                              "sequence: set packing false")
        parse_schedule(self.global_batch_size_schedule, self.global_batch_size)
        if self.ddp_bucket_cap_mb <= 0:
            raise ConfigError(f"ddp_bucket_cap_mb must be > 0, got {self.ddp_bucket_cap_mb}")
        if self.fsdp_replicas < 1:
            raise ConfigError(f"fsdp_replicas must be >= 1, got {self.fsdp_replicas}")
        if self.fsdp_replicas > 1 and self.fsdp != "hybrid_shard":
            raise ConfigError(f"fsdp_replicas {self.fsdp_replicas} needs fsdp hybrid_shard (replicas of a sharded "
                              f"model), got fsdp {self.fsdp}")

    def to_dict(self) -> dict:
        return asdict(self)


_FIELDS = {f.name: f for f in fields(TrainConfig)}
# The groups of keys in configs/train.yaml, each headed before its first key.
SECTIONS = {"task": "What to train on", "output_dir": "Where and how long",
            "micro_batch_size": "Batch maths: grad_accum_steps = global_batch_size / (micro_batch_size x world_size)",
            "optimizer": "Optimisation", "eval_every": "Evaluation, logging, checkpoints", "deepspeed": "Back ends"}
YAML_HEADER = """\
# The one config of this project: train_pytorch, train_accelerate and train_trainer all read it.
# Every key is also a flag of the same name that overrides it (--learning_rate 3e-4), and `--help`
# lists them with the values this file gives. More files may follow (--config A --config B: later
# ones win, e.g. an overlay of configs/experiments/), and
#   python -m {{ cookiecutter.project_slug }}.config --config A --config B
# prints the merged config that a run records. This file is written from the defaults in
# src/{{ cookiecutter.project_slug }}/config.py:
#   python -m {{ cookiecutter.project_slug }}.config > configs/train.yaml
"""


def _yaml_value(value) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return json.dumps(value) if isinstance(value, str) else repr(value)  # a JSON string is a YAML string


def render_yaml(cfg: TrainConfig | None = None) -> str:
    """configs/train.yaml as TrainConfig defines it: every key with its default, under its help;
    given `cfg`, with its values instead (the merged config that a run with it records)."""
    lines = [YAML_HEADER.rstrip("\n")] if cfg is None else []
    for f in fields(TrainConfig):
        if f.name in SECTIONS:
            lines += ["", f"# == {SECTIONS[f.name]} =="]
        lines += [f"# {line}" for line in textwrap.wrap(f.metadata["help"], 98)]
        lines.append(f"{f.name}: {_yaml_value(f.default if cfg is None else getattr(cfg, f.name))}")
    return "\n".join(lines).lstrip("\n") + "\n"


class _Parser(HfArgumentParser):
    """HfArgumentParser that raises ConfigError instead of printing usage and exiting, and takes no
    abbreviations (`--learning-rat 1` is an unknown flag, not `--learning_rate`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def error(self, message: str):
        # "argument --max_steps/--max-steps: ..." -> "argument --max_steps: ..."
        raise ConfigError(re.sub(r"(--\w+)/--[\w-]+", r"\1", message))


def _field_value(key: str, value) -> str:
    """A YAML value as the flag text argparse parses (and type-checks) like a typed flag."""
    if isinstance(value, (dict, list)):
        raise ConfigError(f"key {key!r} must be a single value, got {value!r}")
    if isinstance(value, bool):
        choices = getattr(_FIELDS[key].type, "__args__", ())
        if _FIELDS[key].type is not bool and not (value is False and "no" in choices):
            raise ConfigError(f"key {key!r} got the YAML boolean {str(value).lower()}; quote the value you mean")
        # YAML 1.1 reads an unquoted `no` as false: `mixed_precision: no` means "no"
        return "no" if _FIELDS[key].type is not bool else str(value).lower()
    return str(value)


def _as_flags(values: dict) -> list[str]:
    return [arg for key, value in values.items() for arg in (f"--{key}", _field_value(key, value))]


def _read_yaml(path: str) -> dict:
    config_file = Path(path)
    if config_file.is_dir():
        raise ConfigError(f"config file {path} is a folder; pass --config PATH to a YAML file in it")
    if not config_file.is_file():
        raise ConfigError(f"config file {path} not found; pass --config PATH to a YAML file")
    try:
        values = yaml.safe_load(config_file.read_text()) or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"config file {path} is not valid YAML{where}: {problem}") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"config file {path} is not text (UTF-8): {err.reason}") from None
    if not isinstance(values, dict):
        raise ConfigError(f"config file {path} must hold a mapping of keys to values")
    unknown = sorted(set(map(str, values)) - set(_FIELDS))
    if unknown:
        raise ConfigError(
            f"unknown key(s) {', '.join(unknown)} in {path}; known keys: {', '.join(sorted(_FIELDS))}"
        )
    empty = sorted(str(key) for key, value in values.items() if value is None)
    if empty:
        raise ConfigError(f"key(s) {', '.join(empty)} in {path} have no value (YAML null); give one, or leave the "
                          "key out for its default")
    return values


def load_config(argv: list[str] | None = None) -> TrainConfig:
    """Read the `--config` files (default configs/train.yaml; given more than once, later files
    override earlier ones), then apply the command-line flags over them. `--help` lists every flag
    with the value the config files give it."""
    argv = sys.argv[1:] if argv is None else argv
    parser = _Parser(TrainConfig, description=__doc__.splitlines()[0])
    parser.add_argument("--config", action="append", help="YAML file(s) with the defaults; later ones win.")
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--config", action="append")
    paths = pre.parse_known_args(argv)[0].config or [DEFAULT_CONFIG]
    values = {}
    for path in paths:
        file_values = _read_yaml(path)
        try:  # each file's values are checked as flags, so an error names its file
            parser.parse_args_into_dataclasses(_as_flags({**values, **file_values}))
        except ConfigError as err:
            raise ConfigError(f"{path}: {err}") from None
        values.update(file_values)
    if {"-h", "--help"} & set(argv):
        parser.set_defaults(**{key: _field_value(key, value) for key, value in values.items()})  # what the files set
    try:
        config, _ = parser.parse_args_into_dataclasses(_as_flags(values) + argv)
    except ValueError as err:
        unused = str(err).split(":", 1)[-1].strip()
        raise ConfigError(f"unknown flag(s) {unused}; run with --help for the list") from None
    return config


if __name__ == "__main__":
    from .cli import run_cli

    if len(sys.argv) > 1:  # --config files and flags: the merged config, as a run records it
        run_cli(lambda cfg: print(render_yaml(cfg), end=""))
    else:  # configs/train.yaml, from the defaults
        print(render_yaml(), end="")
