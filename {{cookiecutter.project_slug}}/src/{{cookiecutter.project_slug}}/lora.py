"""The peft extra: LoRA adapters trained on a frozen model (lora_r > 0), for causal_lm and chat in every
entry point. The wrapped model's state_dict() holds its adapters only, so each entry point's checkpoints
keep the adapters and their optimizer state, never the frozen base; final_model/ is a PEFT adapter folder.
`python -m {{ cookiecutter.project_slug }}.lora merge FINAL_MODEL OUT` writes the merged model (docs/extending.md).
"""

import argparse
import copy
import os
import shutil
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

from .errors import ConfigError
from .extras import key

BASE_DIR = "base_model"  # in output_dir: the frozen base of a `tiny` model, which final_model/ points to


@dataclass
class Keys:
    lora_r: int = key("LoRA: the rank of the adapters trained on the frozen model (causal_lm, chat); 0: train the "
                      "whole model.", 0, resume="match", data=False)
    lora_alpha: int = key("LoRA: the adapters' output is scaled by lora_alpha / lora_r.", 16, resume="match",
                          data=False)
    lora_dropout: float = key("LoRA: dropout on the adapters' input, in [0, 1) (0: the entry points train alike).",
                              0.0, resume="match", data=False)
    lora_target_modules: str = key(
        "LoRA: the linear layers to adapt, by the last parts of their names, comma-separated (e.g. q_proj,v_proj); "
        "empty: every linear layer of the blocks (all but the output layer). Recorded as the names it became.", "",
        resume="match", data=False)


def check(cfg) -> None:
    """The LoRA keys' ranges and what cannot go with them; an empty lora_target_modules becomes the names of
    every linear layer of the blocks, and named ones must each match a linear layer of the model."""
    if cfg.lora_r < 0:
        raise ConfigError(f"lora_r must be >= 0 (0: no LoRA, the whole model trains), got {cfg.lora_r}")
    if cfg.lora_alpha <= 0:
        raise ConfigError(f"lora_alpha must be > 0 (the adapters' scale is lora_alpha / lora_r), got {cfg.lora_alpha}")
    if not 0 <= cfg.lora_dropout < 1:
        raise ConfigError(f"lora_dropout must be in [0, 1), got {cfg.lora_dropout}")
    if not cfg.lora_r:
        return
    if cfg.model_factory:
        raise ConfigError(f"lora_r {cfg.lora_r} adapts a Hugging Face model; model_factory {cfg.model_factory!r} "
                          "trains whole: set lora_r 0, or leave model_factory empty")
    if cfg.task == "sequence_classification":
        raise ConfigError(f"lora_r {cfg.lora_r} trains adapters for causal_lm and chat; sequence_classification "
                          "trains its new head whole: set lora_r 0, or task causal_lm or chat")
    found = linear_layers(cfg)
    leaves = sorted({layer.rsplit(".", 1)[-1] for layer in found})
    names = [name.strip() for name in cfg.lora_target_modules.split(",") if name.strip()]
    for name in names:
        if not any(layer == name or layer.endswith(f".{name}") for layer in found):
            raise ConfigError(f"lora_target_modules {name!r} matches no linear layer of {cfg.model_name_or_path}; "
                              f"use names among {','.join(leaves)}")
    cfg.lora_target_modules = ",".join(names or leaves)


_LAYERS: dict[tuple, list[str]] = {}


def linear_layers(cfg) -> list[str]:
    """The names of the model's linear layers but its output layer, from the model built on the meta device
    (nothing allocated; once a model and task per process)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights
    from transformers.pytorch_utils import Conv1D

    from .model import load_tokenizer, model_config

    if (cfg.model_name_or_path, cfg.task) not in _LAYERS:
        config = model_config(copy.copy(cfg), load_tokenizer(cfg))
        with torch.device("meta"), no_init_weights():
            model = AutoModelForCausalLM.from_config(config)
        output = model.get_output_embeddings()
        _LAYERS[cfg.model_name_or_path, cfg.task] = [
            name for name, module in model.named_modules()
            if isinstance(module, (torch.nn.Linear, Conv1D)) and module is not output]
    return _LAYERS[cfg.model_name_or_path, cfg.task]


def adapt(cfg, model):
    """`model` with LoRA adapters on lora_target_modules, its base frozen, where lora_r > 0; its state_dict() then
    holds the adapters alone, and a load_state_dict() misses none of the frozen weights. A `tiny` base is saved
    by rank 0 under output_dir/base_model/, where final_model/'s adapter config points."""
    if not cfg.lora_r:
        return model
    from peft import LoraConfig, TaskType, get_peft_model

    from .distributed import dist_env
    from .model import TINY, load_tokenizer

    # what final_model/'s adapter config names as its base: a hub name as it is, a folder by its absolute path
    if cfg.model_name_or_path == TINY:
        base = Path(cfg.output_dir, BASE_DIR)
        save_base(model, load_tokenizer(cfg), base, dist_env().is_main_process)
        model.name_or_path = str(base.resolve())
    elif Path(cfg.model_name_or_path).is_dir():
        model.name_or_path = str(Path(cfg.model_name_or_path).resolve())
    with warnings.catch_warnings():  # peft reads transformers' deprecated is_gradient_checkpointing
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
        model = get_peft_model(model, LoraConfig(
            task_type=TaskType.CAUSAL_LM, r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
            target_modules=cfg.lora_target_modules.split(",")))
    model.register_state_dict_post_hook(_adapters_only)
    model.register_load_state_dict_post_hook(_frozen_not_missing)
    return model


def save_base(model, tokenizer, folder: Path, is_main_process: bool) -> None:
    """The base model, whole (under ZeRO-3 every rank gathers its partitions), and its tokenizer, written by
    rank 0: a folder that model_name_or_path may also name."""
    from peft.utils.integrations import gather_params_ctx

    with gather_params_ctx(list(model.parameters()), modifier_rank=None):  # a no-op unless ZeRO-3 partitioned them
        if is_main_process:
            tmp = folder.with_name(f".tmp_{folder.name}")
            shutil.rmtree(tmp, ignore_errors=True)
            model.save_pretrained(tmp, state_dict=model.state_dict())  # the gathered weights
            tokenizer.save_pretrained(tmp)
            shutil.rmtree(folder, ignore_errors=True)
            os.replace(tmp, folder)


def _adapters_only(module, state_dict: dict, prefix: str, local_metadata) -> None:
    for name, param in module.named_parameters(remove_duplicate=False):
        if not param.requires_grad:
            state_dict.pop(prefix + name, None)


def _frozen_not_missing(module, incompatible_keys) -> None:
    # the missing names carry the prefix of whatever wraps the model (DDP's "module.")
    frozen = {name for name, param in module.named_parameters(remove_duplicate=False) if not param.requires_grad}
    incompatible_keys.missing_keys[:] = [
        name for name in incompatible_keys.missing_keys
        if not any(".".join(name.split(".")[i:]) in frozen for i in range(name.count(".") + 1))]


def merge(adapters: str, out: str) -> None:
    """The adapter folder's base with the adapters merged into its weights, saved as a plain Hugging Face model
    (with the tokenizer) in `out`."""
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoTokenizer

    model = AutoPeftModelForCausalLM.from_pretrained(adapters)
    model.merge_and_unload().save_pretrained(out)
    AutoTokenizer.from_pretrained(adapters).save_pretrained(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {__package__}.lora", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    merging = commands.add_parser("merge", help="write the merged model as a plain Hugging Face folder")
    merging.add_argument("adapters", help="a LoRA run's final_model/ (a PEFT adapter folder)")
    merging.add_argument("out", help="the folder for the merged model")
    args = parser.parse_args(argv)
    if not (Path(args.adapters) / "adapter_config.json").is_file():
        print(f"error: {args.adapters} is not a PEFT adapter folder (no adapter_config.json); give a LoRA run's "
              "final_model/", file=sys.stderr)
        return 2
    merge(args.adapters, args.out)
    print(f"merged {args.adapters} into {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
