"""The one training config, read by all three entry points.
`configs/train.yaml` fills a `TrainConfig`; every field is also a flag that overrides it. Unknown keys
and flags, wrong types and out-of-range values raise `ConfigError` (exit code 2, one line).
"""

import argparse
import copy
import json
import math
import os
import re
import sys
import textwrap
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Literal

import yaml
from transformers import HfArgumentParser

from . import extras
from .errors import ConfigError
from .extras import key

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


@dataclass
class TrainConfig(*reversed([module.Keys for module in extras.modules()])):  # the extras' keys after the core's
    """Everything one training run needs: each field is a YAML key and a `--flag`; the baked extras add theirs."""

    task: Literal["causal_lm", "sequence_classification", "chat"] = key(
        "causal_lm (next-token prediction), sequence_classification, or chat (conversations rendered with the "
        "tokenizer's chat template, the loss on the assistant's tokens only).", "{{ cookiecutter.task }}",
        resume="match", data=True)
    model_name_or_path: str = key("'tiny' builds a small model from a config (no download); else a Hugging Face model "
                                  "name or local path.", "tiny", resume="match", data=True)
    model_factory: str = key(
        "Your own model: 'package.module:function', called with vocab_size, num_labels (None for causal_lm, chat) "
        "and cfg, returning an nn.Module whose forward(input_ids, attention_mask) gives logits; empty: the "
        "Hugging Face auto classes (model_name_or_path still names the tokenizer).", "", resume="match", data=False)
    dataset: str = key("'builtin' (the data shipped with this project for the task), a folder holding "
                       "train/validation .jsonl/.json/.csv/.parquet files or a save_to_disk() dataset, or a Hugging "
                       "Face dataset name.", "builtin", resume="match", data=True)
    max_seq_len: int = key("Longest sequence in tokens; longer examples are truncated (packed: the block length).",
                            64, resume="match", data=True)
    packing: bool = key("causal_lm and chat: join the documents (one EOS between them) into blocks of max_seq_len "
                        "tokens, no padding; attention then crosses document boundaries inside a block, as in HF's "
                        "run_clm.", False, resume="match", data=True)
    data_cache_dir: str = key("Where the tokenised data is prepared once and memory-mapped by every process and later "
                              "run on the same data and settings; on a cluster, a folder every node sees (else each "
                              "node prepares its own).", "data_cache", resume="free", data=False)
    data_num_proc: int = key("Processes that tokenise while the data is prepared; 0: up to 8 for 100k examples or "
                             "more, else 1.", 0, resume="free", data=False)

    output_dir: str = key("Folder for metrics.jsonl, checkpoints/ and final_model/.", "runs/default",
                          resume="free", data=False)
    seed: int = key("Seeds model initialisation and the data order.", 42, resume="match", data=False)
    max_steps: int = key("Optimizer steps to train; -1 trains num_epochs epochs.", -1, resume="length", data=False)
    num_epochs: int = key("Epochs to train when max_steps is -1.", 3, resume="length", data=False)

    micro_batch_size: whole_or_auto = key(
        "Examples per forward pass on each process; auto: the largest that fits in memory (from "
        "global_batch_size / world_size, halved until one micro-step fits).", {{ cookiecutter.micro_batch_size }},
        resume="free", data=False)
    global_batch_size: int = key("Examples per optimizer step, summed over processes.",
                                  {{ cookiecutter.global_batch_size }}, resume="match", data=False)

    optimizer: Literal["adamw", "sgd", "adafactor"] = key(
        "adamw, sgd (plain, no momentum) or adafactor; biases and norms get no weight decay.",
        "adamw", resume="match", data=False)
    learning_rate: float = key("Peak learning rate.", 1e-3, resume="match", data=False)
    lr_scheduler_type: Literal["linear", "cosine", "constant"] = key(
        "Schedule after warmup (constant still warms up).", "linear", resume="match", data=False)
    warmup_steps: int = key("Optimizer steps of linear warmup from 0.", 5, resume="match", data=False)
    min_lr_ratio: float = key("Linear and cosine decay end at min_lr_ratio x learning_rate, never below it.",
                              0.0, resume="match", data=False)
    weight_decay: float = key("Decoupled weight decay on matrices (not biases or norms).", 0.01,
                              resume="match", data=False)
    max_grad_norm: float = key("Clip the global gradient norm to this; 0 disables clipping.", 1.0,
                               resume="match", data=False)
    mixed_precision: Literal["no", "bf16", "fp16"] = key(
        "Autocast the forward pass in bf16 or fp16 (fp16 adds a gradient scaler).", "no", resume="match", data=False)
    fp16_init_scale: float = key(
        "fp16's first loss scale; halved (and the step skipped) on every overflow.", 65536.0, resume="free", data=False)
    gradient_checkpointing: bool = key("Recompute activations in the backward pass.", False, resume="free", data=False)
    compile: bool = key("torch.compile the model (inductor; automatic dynamic shapes), in every entry point.", False,
                        resume="free", data=False)
    tf32: bool = key("TF32 matmuls on CUDA (faster, 10-bit mantissa); false keeps them full fp32.", True,
                     resume="free", data=False)
    fused_adamw: bool = key("AdamW's fused CUDA kernel (optimizer adamw on CUDA).", True, resume="free", data=False)
    attn_implementation: Literal["auto", "sdpa", "eager", "flash_attention_2"] = key(
        "The model's attention: auto (sdpa where the model supports it, else eager; the run records which), sdpa, "
        "eager, or flash_attention_2 (needs flash-attn and bf16/fp16).", "auto", resume="free", data=False)
    dataloader_workers: int = key("Processes that collate the next micro-batches while the device computes; -1: 4 on "
                                  "CUDA (with pinned memory), 0 on CPU.", -1, resume="free", data=False)
    peak_tflops: float = key("The device's peak TFLOP/s for MFU; 0 takes it from a table of common GPUs (none on CPU: "
                             "no mfu).", 0.0, resume="free", data=False)

    eval_every: int = key("Evaluate every N optimizer steps (N beyond the run: once, at its end); 0 evaluates once "
                          "per epoch.", 0, resume="free", data=False)
    log_every: int = key("Print the progress line every N optimizer steps (and after the last); 0: about 30 lines per "
                         "run.", 0, resume="free", data=False)
    report_to: Literal["wandb", "none"] = key("wandb logs to Weights & Biases (offline when no API key is set); none "
                                              "disables it.", "wandb", resume="free", data=False)
    wandb_project: str = key("Weights & Biases project.", "{{ cookiecutter.wandb_project }}", resume="free", data=False)
    wandb_entity: str = key("Weights & Biases entity; empty for your default.",
                             "{{ cookiecutter.wandb_entity }}", resume="free", data=False)
    save_steps: int = key("Write checkpoints/step_<N>/ every N optimizer steps; 0 never.", 0, resume="free", data=False)
    save_total_limit: int = key("Keep the newest K checkpoints; 0 keeps all.", 2, resume="free", data=False)
    resume_from_checkpoint: str = key("'auto' continues from the newest complete checkpoint in output_dir (or starts "
                                      "fresh when there is none); a path continues from that checkpoint; empty starts "
                                      "fresh.", "", resume="free", data=False)
    stop_after_steps: int = key("End this job after N optimizer steps of this job with a checkpoint, as if preempted; "
                                "0 runs to the end. The schedule still spans max_steps.", 0, resume="free", data=False)
    max_nonfinite_steps: int = key(
        "A step whose loss or gradient norm is not finite is skipped (parameters, optimizer and schedule "
        "untouched); after this many in a row the job stops with exit code 3.", 3, resume="free", data=False)

    deepspeed: str = key("DeepSpeed JSON config (train_accelerate and train_trainer).", "", resume="free", data=False)
    ddp_no_sync: bool = key("Skip DDP's gradient all-reduce on all but the last micro-step of each optimizer step. "
                            "Turn off only to measure what it saves. Under FSDP fsdp_grad_sync decides instead "
                            "(Accelerate's FSDP ignores this key).", True, resume="free", data=False)
    ddp_bucket_cap_mb: float = key("DDP gradient bucket size in MiB.", 25.0, resume="free", data=False)
    ddp_find_unused_parameters: bool = key(
        "DDP also synchronises parameters that get no gradient in a micro-step (exact, one walk of the autograd "
        "graph per step); off, such a parameter is refused in one line at its first step.", False, resume="free",
        data=False)
    fsdp_grad_sync: Literal["micro_step", "window"] = key(
        "FSDP (every entry point's): reduce-scatter the gradients every micro-step (sharded, least memory) or once a "
        "window (unsharded gradients held across it: 4 bytes a parameter).", "micro_step", resume="free", data=False)
    rendezvous_timeout_s: float = key("Seconds to wait for every process to join the process group before giving up "
                                      "with one line.", 300.0, resume="free", data=False)
    collective_timeout_s: float = key(
        "Seconds a collective (all-reduce, barrier) may wait for the other processes: a process that "
        "stops responding fails the job after this long instead of hanging it.", 600.0, resume="free", data=False)

    def __post_init__(self) -> None:
        for name in PATHS:  # `~` as a shell expands it, also where no shell read the value (a YAML file)
            setattr(self, name, os.path.expanduser(getattr(self, name)))
        if not self.output_dir.strip():
            raise ConfigError("output_dir is empty; name the folder the run writes, e.g. runs/default")
        for f in fields(self):
            if f.type is float and not math.isfinite(getattr(self, f.name)):
                raise ConfigError(f"{f.name} must be a finite number, got {getattr(self, f.name)}")
        positive = ("max_seq_len", "num_epochs", "global_batch_size", "fp16_init_scale", "max_nonfinite_steps",
                    "rendezvous_timeout_s", "collective_timeout_s")
        non_negative = ("warmup_steps", "weight_decay", "max_grad_norm", "eval_every", "log_every", "data_num_proc",
                        "save_steps", "save_total_limit", "stop_after_steps", "peak_tflops")
        if self.micro_batch_size == "auto":
            extras.require("auto_batch", "micro_batch_size auto")
        elif self.micro_batch_size < 1:
            raise ConfigError(f"micro_batch_size must be >= 1 or auto, got {self.micro_batch_size}")
        for least, names in ((1, positive), (0, non_negative)):
            for name in (name for name in names if getattr(self, name) < least):
                raise ConfigError(f"{name} must be >= {least}, got {getattr(self, name)}")
        if not 0 <= self.seed < 2**32:  # numpy's seeds
            raise ConfigError(f"seed must be a whole number from 0 to {2**32 - 1}, got {self.seed}")
        if self.max_steps == 0 or self.max_steps < -1:
            raise ConfigError(f"max_steps must be -1 (train num_epochs) or >= 1, got {self.max_steps}")
        for name in (name for name in ("learning_rate", "ddp_bucket_cap_mb") if not getattr(self, name) > 0):
            raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.dataloader_workers < -1:
            raise ConfigError(f"dataloader_workers must be -1 (auto) or >= 0, got {self.dataloader_workers}")
        if self.attn_implementation == "flash_attention_2" and self.mixed_precision == "no":
            raise ConfigError("attn_implementation flash_attention_2 runs in bf16/fp16: set mixed_precision bf16/fp16")
        if self.packing and self.task == "sequence_classification":
            raise ConfigError(f"packing joins documents for causal_lm and chat; task {self.task} keeps one example per "
                              "sequence: set packing false")
        extras.check(self)

    def to_dict(self) -> dict:
        return asdict(self)


_FIELDS = {f.name: f for f in fields(TrainConfig)}


def keys_where(**declared) -> tuple[str, ...]:
    """The config keys declared (extras.key) with these values, e.g. resume="match" or data=True."""
    return tuple(name for name, f in _FIELDS.items() if all(f.metadata[k] == v for k, v in declared.items()))


def unknown_keys(names: list[str], where: str, text: str = "") -> ConfigError:
    """One line for keys (`where` says in which file) or flags (`text`: argparse's list) this project does
    not know; a key or flag of an extra it was baked without names the extra."""
    extra = next((name for name in names if extras.owner(name)), None)
    if extra is not None:
        return ConfigError(extras.not_baked(f"key {extra}{where}" if where else f"flag --{extra}", extras.owner(extra)))
    if where:
        return ConfigError(f"unknown key(s) {', '.join(names)}{where}; known keys: {', '.join(sorted(_FIELDS))}")
    return ConfigError(f"unknown flag(s) {text}; run with --help for the list")


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


def render_yaml(cfg: TrainConfig | None = None) -> str:
    """configs/train.yaml as TrainConfig defines it: every key with its default, under its help;
    given `cfg`, with its values instead (the merged config that a run with it records)."""
    lines = [YAML_HEADER.rstrip("\n")] if cfg is None else []
    own, extra = set(TrainConfig.__annotations__), None  # the core's keys first, then each extra's under its name
    for f in sorted(fields(TrainConfig), key=lambda f: f.name not in own):
        if f.name in SECTIONS:
            lines += ["", f"# == {SECTIONS[f.name]} =="]
        elif f.name not in own and extras.owner(f.name) != extra:
            extra = extras.owner(f.name)
            lines += ["", f"# == Extra {extra}: {extras.EXTRAS[extra][0]} =="]
        lines += [f"# {line}" for line in textwrap.wrap(f.metadata["help"], 98)]
        value = f.default if cfg is None else getattr(cfg, f.name)  # JSON's strings and booleans are YAML's
        lines.append(f"{f.name}: {json.dumps(value) if isinstance(value, (bool, str)) else repr(value)}")
    return "\n".join(lines).lstrip("\n") + "\n"


class _Parser(HfArgumentParser):
    """HfArgumentParser that raises ConfigError instead of printing usage and exiting, and takes no
    abbreviations (`--learning-rat 1` is an unknown flag, not `--learning_rate`: load_config)."""

    @staticmethod
    def _parse_dataclass_field(parser, field):
        # argparse takes each field's help; what else extras.key declares is ours
        shown = copy.copy(field)
        shown.metadata = {"help": field.metadata["help"]}
        HfArgumentParser._parse_dataclass_field(parser, shown)

    def error(self, message: str):
        # "argument --max_steps/--max-steps: ..." -> "argument --max_steps: ..."
        raise ConfigError(re.sub(r"(--\w+)/--[\w-]+", r"\1", message))


def _field_value(key: str, value) -> str:
    """A YAML value as the flag text argparse parses (and type-checks) like a typed flag."""
    if isinstance(value, (dict, list)):
        raise ConfigError(f"key {key!r} must be a single value, got {value!r}")
    if isinstance(value, bool) and _FIELDS[key].type is not bool:
        # YAML 1.1 reads an unquoted `no` as false: `mixed_precision: no` means "no"
        if value is False and "no" in getattr(_FIELDS[key].type, "__args__", ()):
            return "no"
        raise ConfigError(f"key {key!r} got the YAML boolean {str(value).lower()}; quote the value you mean")
    return str(value).lower() if isinstance(value, bool) else str(value)


def as_flags(values: dict) -> list[str]:
    return [arg for key, value in values.items() for arg in (f"--{key}", _field_value(key, value))]


def yaml_mapping(path: str, kind: str, advice: str, holds: str) -> dict:
    """A YAML file's mapping (of `holds`), else one line (ConfigError) naming it as `kind`, with `advice`."""
    if not Path(path).is_file():
        problem = "is a folder, not a file" if Path(path).is_dir() else "not found"
        raise ConfigError(f"{kind} {path} {problem}; {advice}")
    try:
        values = yaml.safe_load(Path(path).read_text()) or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"{kind} {path} is not valid YAML{where}: {problem}") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"{kind} {path} is not text (UTF-8): {err.reason}") from None
    if not isinstance(values, dict):
        raise ConfigError(f"{kind} {path} must hold a mapping of {holds}")
    return values


def _read_yaml(path: str) -> dict:
    values = yaml_mapping(path, "config file", "pass --config PATH to a YAML file", "keys to values")
    if unknown := sorted(set(map(str, values)) - set(_FIELDS)):
        raise unknown_keys(unknown, f" in {path}")
    if empty := sorted(str(key) for key, value in values.items() if value is None):
        raise ConfigError(f"key(s) {', '.join(empty)} in {path} have no value (YAML null); give one, or leave the "
                          "key out for its default")
    return values


def load_config(argv: list[str] | None = None) -> TrainConfig:
    """Read the `--config` files (default configs/train.yaml; given more than once, later files override earlier ones),
    then apply the command-line flags over them. `--help` lists every flag with the value the config files give it."""
    argv = sys.argv[1:] if argv is None else argv
    parser = _Parser(TrainConfig, description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--config", action="append", help="YAML file(s) with the defaults; later ones win.")
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--config", action="append")
    paths = pre.parse_known_args(argv)[0].config or [DEFAULT_CONFIG]
    values = {}
    for path in paths:
        file_values = _read_yaml(path)
        try:  # each file's values are checked as flags, so an error names its file
            parser.parse_args_into_dataclasses(as_flags({**values, **file_values}))
        except ConfigError as err:
            raise ConfigError(f"{path}: {err}") from None
        values.update(file_values)
    if {"-h", "--help"} & set(argv):
        parser.set_defaults(**{key: _field_value(key, value) for key, value in values.items()})  # what the files set
    try:
        config, _ = parser.parse_args_into_dataclasses(as_flags(values) + argv)
    except ValueError as err:
        unused = str(err).split(":", 1)[-1].strip()
        raise unknown_keys(re.findall(r"--(\w+)", unused), "", unused) from None
    return config


if __name__ == "__main__":
    from .cli import run_cli

    if len(sys.argv) > 1:  # --config files and flags: the merged config, as a run records it
        run_cli(lambda cfg: print(render_yaml(cfg), end=""))
    else:  # configs/train.yaml, from the defaults
        print(render_yaml(), end="")
