"""Tokenizer, model and the loss, for both tasks: `tiny` builds a 2-layer Llama from a config with
the tokenizer that ships in assets/ (no download, dropout 0), anything else loads with
`from_pretrained`. The loss is a *sum* over real targets (labels != -100): each loop divides by the
real targets of the whole global batch, so accumulation is exact however the padding falls.
"""

from contextlib import nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    LlamaConfig,
)
from transformers.initialization import no_init_weights
from transformers.integrations import is_deepspeed_zero3_enabled

from . import ASSETS
from .config import TrainConfig
from .data import IGNORE_INDEX
from .errors import ConfigError, first_line

TINY = "tiny"
AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _hub_error(name: str, err: Exception) -> ConfigError:
    reason = first_line(err)
    where = "local path" if Path(name).exists() else "model"
    return ConfigError(
        f"cannot load {where} {name!r} ({reason}); use model_name_or_path: tiny, a local path, "
        "or a hub name while the hub is reachable"
    )


def load_tokenizer(cfg: TrainConfig):
    name = str(ASSETS / "tokenizer") if cfg.model_name_or_path == TINY else cfg.model_name_or_path
    try:
        tokenizer = AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as err:
        raise _hub_error(cfg.model_name_or_path, err) from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "right"
    return tokenizer


def model_config(cfg: TrainConfig, tokenizer, num_labels: int = 2):
    """The model's config (an up-front check, errors.ConfigError)."""
    if cfg.model_name_or_path == TINY:
        config = LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=max(128, cfg.max_seq_len),
            tie_word_embeddings=True,
            attention_dropout=0.0,
        )
    else:
        try:
            config = AutoConfig.from_pretrained(cfg.model_name_or_path)
        except (OSError, ValueError) as err:
            raise _hub_error(cfg.model_name_or_path, err) from None
    config.pad_token_id = tokenizer.pad_token_id
    config.bos_token_id = tokenizer.bos_token_id
    config.eos_token_id = tokenizer.eos_token_id
    if cfg.task == "sequence_classification":
        head = any(name.endswith("ForSequenceClassification") for name in config.architectures or [])
        if head and config.num_labels != num_labels:
            raise ConfigError(f"model {cfg.model_name_or_path} has a classification head of {config.num_labels} "
                              f"classes, the data has {num_labels}; use data with the model's classes, or a model "
                              "without a classification head")
        config.num_labels = num_labels
    return config


def build_model(cfg: TrainConfig, config) -> torch.nn.Module:
    """The model in fp32 with `attn_implementation` attention, initialised from `cfg.seed` (tiny)
    or the pretrained weights."""
    auto = AutoModelForCausalLM if cfg.task == "causal_lm" else AutoModelForSequenceClassification
    torch.manual_seed(cfg.seed)
    if cfg.model_name_or_path == TINY:
        # Drawn once, by the model's own init, not first by each layer's constructor: the weights
        # ZeRO-3 draws for a model it builds partitioned (it skips the constructors'), so that a
        # partitioned start and a whole one train the same
        zero3 = is_deepspeed_zero3_enabled()
        with nullcontext() if zero3 else no_init_weights():
            model = auto.from_config(config, dtype=torch.float32, attn_implementation=cfg.attn_implementation)
        if not zero3:
            model.init_weights()
    else:
        model = auto.from_pretrained(cfg.model_name_or_path, config=config, dtype=torch.float32,
                                     attn_implementation=cfg.attn_implementation)
    if cfg.gradient_checkpointing:
        # Non-reentrant checkpointing works with DDP's no_sync and with unused parameters.
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    return model


def fsdp_mixed_precision(cfg: TrainConfig) -> dict | None:
    """FSDP2's precision policy under mixed precision: the forward in bf16/fp16, gradients reduced
    in fp32, which is also where FSDP2 accumulates a window's unsynchronised micro-steps (its
    default, the forward's dtype, would sum them in bf16). None in fp32."""
    if cfg.mixed_precision == "no":
        return None
    dtype = AMP_DTYPES[cfg.mixed_precision]
    return {"param_dtype": dtype, "reduce_dtype": torch.float32, "output_dtype": dtype}


def autocast_for(cfg: TrainConfig, device: torch.device):
    """The forward pass's autocast for `mixed_precision` (a no-op context for "no"). The weights,
    gradients and optimizer state stay fp32; the loss is computed in fp32 (summed_loss)."""
    if cfg.mixed_precision == "no":
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=AMP_DTYPES[cfg.mixed_precision])


def _targets(logits: torch.Tensor, labels: torch.Tensor, task: str):
    if task == "causal_lm":  # position t predicts token t+1
        return logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten()
    return logits, labels


def count_targets(labels: torch.Tensor, task: str) -> int:
    """Real targets in a batch: non-padding next tokens (causal_lm) or labelled examples."""
    target = labels[:, 1:] if task == "causal_lm" else labels
    return int((target != IGNORE_INDEX).sum())


def summed_loss(logits: torch.Tensor, labels: torch.Tensor, task: str) -> torch.Tensor:
    """Cross-entropy summed (not averaged) over the real targets of the batch, in fp32."""
    flat_logits, flat_labels = _targets(logits, labels, task)
    return F.cross_entropy(flat_logits.float(), flat_labels, ignore_index=IGNORE_INDEX, reduction="sum")
