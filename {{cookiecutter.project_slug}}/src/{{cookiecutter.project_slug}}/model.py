"""Tokenizer, model and the loss, for every task: `tiny` builds a 2-layer Llama from a config with
the tokenizer that ships in assets/ (no download, dropout 0), anything else loads with
`from_pretrained`. The loss is a *sum* over real targets (labels != -100): each loop divides by the
real targets of the whole global batch, so accumulation is exact however the padding falls.
"""

import importlib
import json
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate.utils import FullyShardedDataParallelPlugin
from safetensors.torch import load_model, save_file, save_model
from torch.autograd.function import once_differentiable
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer
from transformers.configuration_utils import PretrainedConfig
from transformers.initialization import no_init_weights
from transformers.integrations import is_deepspeed_zero3_enabled
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_outputs import CausalLMOutput, SequenceClassifierOutput
from transformers.modeling_utils import AttentionInterface
from transformers.models.llama import LlamaConfig

from . import ASSETS
from .checkpoint import FINAL_DIR
from .config import TrainConfig
from .data import IGNORE_INDEX
from .errors import ConfigError, first_line
from .extras import plug
from .launch import Launch, launch_of

TINY = "tiny"
FACTORY_FILE = "model_factory.json"  # in final_model/ beside model.safetensors: what rebuilds the model
AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
adapt = plug("peft", "lora:adapt", default=lambda cfg, model: model)  # LoRA adapters on the frozen model (peft)
PLAIN_CAUSAL = "sdpa_causal"  # SDPA without a mask (plain_causal)


def _hub_error(name: str, err: Exception) -> ConfigError:
    p = Path(name)  # a run's folder, its checkpoints/ or a checkpoint in it: not a model
    run = p.parent.parent if p.parent.name == "checkpoints" else p.parent if p.name == "checkpoints" else p
    if (run / "checkpoints").is_dir() or (run / FINAL_DIR).is_dir():
        return ConfigError(f"{name!r} is the output of a training run, not a model: use its final model (model_name_or_"
                           f"path {run / FINAL_DIR}, once the run is finished), or continue the run with --output_dir "
                           f"{run} --resume_from_checkpoint {name if run == p.parent.parent else 'auto'}")
    if not p.expanduser().exists() and (name.startswith(("/", ".", "~")) or name.count("/") > 1):  # no hub name
        return ConfigError(f"model folder {name!r} does not exist; use model_name_or_path: tiny, a local folder, or a "
                           "hub name such as org/model")
    if p.is_dir() and not any((p / f).is_file() for f in ("config.json", "tokenizer.json", "tokenizer_config.json")):
        return ConfigError(f"model folder {name!r} holds no config.json or tokenizer files: it is no save_pretrained() "
                           "folder; use model_name_or_path: tiny, a saved model's folder, or a hub name")
    where = "local path" if p.exists() else "model"
    return ConfigError(f"cannot load {where} {name!r} ({first_line(err)}); use model_name_or_path: tiny, a local path, "
                       "or a hub name while the hub is reachable")


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
    """The model's config (an up-front check, errors.ConfigError), its attention resolved in it and in `cfg`
    (with_attention); a model_factory's names the sizes its factory is called with."""
    if cfg.model_factory:
        model_factory(cfg.model_factory)
        config = PretrainedConfig(vocab_size=len(tokenizer))
    elif cfg.model_name_or_path == TINY:
        config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                             max_position_embeddings=max(128, cfg.max_seq_len), attention_dropout=0.0)
    else:
        try:
            config = AutoConfig.from_pretrained(cfg.model_name_or_path)
        except (OSError, ValueError) as err:
            raise _hub_error(cfg.model_name_or_path, err) from None
    for special in ("pad_token_id", "bos_token_id", "eos_token_id"):
        setattr(config, special, getattr(tokenizer, special))
    if cfg.task == "sequence_classification":
        head = any(name.endswith("ForSequenceClassification") for name in config.architectures or [])
        if head and config.num_labels != num_labels:
            raise ConfigError(f"model {cfg.model_name_or_path} has a classification head of {config.num_labels} "
                              f"classes, the data has {num_labels}; use data with the model's classes, or a model "
                              "without a classification head")
        config.num_labels = num_labels
    return config if cfg.model_factory else with_attention(cfg, config)


def with_attention(cfg: TrainConfig, config):
    """`config` and `cfg` set to the attention the model runs, as its constructor decides (auto: sdpa, else eager)."""
    auto = AutoModelForCausalLM if cfg.task != "sequence_classification" else AutoModelForSequenceClassification
    if type(config) not in auto._model_mapping:  # e.g. T5 for causal_lm
        raise ConfigError(f"model {cfg.model_name_or_path} is a {config.model_type} model, which {auto.__name__} "
                          "cannot build (for causal_lm a decoder-only model, not an encoder-decoder); use one it can")
    config._attn_implementation = None if cfg.attn_implementation == "auto" else cfg.attn_implementation
    try:
        with torch.device("meta"), no_init_weights():  # transformers' own check, nothing allocated
            cfg.attn_implementation = auto.from_config(config).config._attn_implementation
    except (ValueError, ImportError) as err:  # the model does not support the kernel asked for, or it is missing
        raise ConfigError(f"attn_implementation {cfg.attn_implementation}: {first_line(err).split('. ')[0].rstrip('.')}"
                          "; use attn_implementation auto (sdpa where the model supports it, else eager)") from None
    return config


def model_factory(spec: str):
    """The function `package.module:function` names (ConfigError: one line saying what is wrong)."""
    module_name, _, name = spec.partition(":")
    if not module_name or not name:
        raise ConfigError(f"model_factory {spec!r} is not 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # whatever the module raises while it imports
        raise ConfigError(f"model_factory {spec!r}: cannot import {module_name} "
                          f"({type(err).__name__}: {first_line(err)})") from None
    factory = getattr(module, name, None)
    if not callable(factory):
        raise ConfigError(f"model_factory {spec!r}: {module_name} has no function {name}")
    return factory


def _as_output(module, args, output):
    """A forward hook: the factory model's logits (a tensor, or an object with `.logits`) as the
    ModelOutput the loops, the evaluation and the Trainer read `.logits` from."""
    logits = getattr(output, "logits", output)
    return (CausalLMOutput if logits.dim() == 3 else SequenceClassifierOutput)(logits=logits)


def factory_arguments(cfg: TrainConfig, config) -> dict:
    """The sizes the factory is called with (with `cfg`), also recorded in FACTORY_FILE."""
    classes = config.num_labels if cfg.task == "sequence_classification" else None
    return {"vocab_size": config.vocab_size, "num_labels": classes}


def build_factory_model(cfg: TrainConfig, vocab_size: int, num_labels: int | None) -> torch.nn.Module:
    """The model_factory's model, checked before the first collective (every rank finds the same mistake)
    with one forward of two tokens in eval mode: logits of `num_labels`, or `vocab_size` per token. What an
    option needs and it lacks is refused here; the forward hook gives the `.logits` every loop reads."""
    where = f"model_factory {cfg.model_factory!r}"
    try:
        model = model_factory(cfg.model_factory)(vocab_size=vocab_size, num_labels=num_labels, cfg=cfg)
    except Exception as err:
        raise ConfigError(f"{where}(vocab_size=..., num_labels=..., cfg=...) failed ({type(err).__name__}: "
                          f"{first_line(err)})") from None
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"{where} returned a {type(model).__name__}, not a torch.nn.Module")
    model.eval()
    tokens = torch.zeros(1, 2, dtype=torch.long, device=next(model.parameters(), torch.empty(0)).device)
    try:
        with torch.no_grad():
            logits = _as_output(model, (), model(tokens, attention_mask=torch.ones_like(tokens))).logits
    except Exception as err:
        raise ConfigError(f"{where}: its forward(input_ids, attention_mask) failed ({type(err).__name__}: "
                          f"{first_line(err)})") from None
    want = (1, 2, vocab_size) if num_labels is None else (1, num_labels)
    if tuple(logits.shape) != want:
        raise ConfigError(f"{where}: logits of shape {list(logits.shape)} for 1 sequence of 2 tokens, expected "
                          f"{list(want)} (the last size is {'vocab_size' if num_labels is None else 'num_labels'})")
    model.train()
    if launch_of(cfg, "").fsdp and not getattr(model, "_no_split_modules", None):  # Accelerate's FSDP
        raise ConfigError(f"fsdp: the {where} model has no _no_split_modules (the class names of its layers, each "
                          "an FSDP unit); add it, or train without FSDP")
    if cfg.gradient_checkpointing:
        if not hasattr(model, "gradient_checkpointing_enable"):
            raise ConfigError(f"gradient_checkpointing: the {where} model has no gradient_checkpointing_enable(); "
                              "add one or set gradient_checkpointing: false")
        model.gradient_checkpointing_enable()
    model.register_forward_hook(_as_output)
    return model


def build_model(cfg: TrainConfig, config) -> torch.nn.Module:
    """The model in fp32 with the attention `config` names (with_attention), initialised from `cfg.seed`
    (tiny) or the pretrained weights; or the model_factory's."""
    torch.manual_seed(cfg.seed)
    if cfg.model_factory:
        return build_factory_model(cfg, **factory_arguments(cfg, config))
    auto = AutoModelForCausalLM if cfg.task != "sequence_classification" else AutoModelForSequenceClassification
    if cfg.model_name_or_path == TINY:
        # Drawn once, by the model's own init, not first by each layer's constructor: the weights ZeRO-3 draws
        # for a model it builds partitioned (it skips the constructors'), so that both starts train the same
        zero3 = is_deepspeed_zero3_enabled()
        with nullcontext() if zero3 else no_init_weights():
            model = auto.from_config(config, dtype=torch.float32)
        if not zero3:
            model.init_weights()
    else:
        model = auto.from_pretrained(cfg.model_name_or_path, config=config, dtype=torch.float32)
    if cfg.gradient_checkpointing:
        # Non-reentrant checkpointing works with DDP's no_sync and with unused parameters.
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    return adapt(cfg, plain_causal(model) if cfg.task != "sequence_classification" else model)


def plain_causal(model: torch.nn.Module) -> torch.nn.Module:
    """A causal LM on SDPA of plain causal attention (no sliding window, no ALiBi) under a name transformers builds
    no mask for: no packed-sequence check of the position ids (a host sync per forward; compiled, a dense [B,1,T,T]
    mask), SDPA's causal kernel. The loops give no padding mask (data.Collator) and position ids 0..T-1."""
    config = model.config
    layers = getattr(config, "layer_types", None) or ["sliding" if getattr(config, "sliding_window", None) else "full"]
    if (config._attn_implementation == "sdpa" and set(layers) <= {"full", "full_attention"}
            and getattr(config, "is_causal", True) and not getattr(config, "alibi", False)):
        AttentionInterface.register(PLAIN_CAUSAL, sdpa_attention_forward)
        config._attn_implementation = PLAIN_CAUSAL
    return model


def save_weights(model: torch.nn.Module, folder: Path, cfg: TrainConfig, config, state_dict: dict | None = None,
                 **save_pretrained_kwargs) -> None:
    """final_model/'s (and the Trainer's checkpoints') weights: save_pretrained, or a model_factory
    model's weights as model.safetensors (tied weights once) beside FACTORY_FILE, which names the
    factory and its arguments (rebuild_model); `state_dict`: a sharded model's ({}: in `folder` already)."""
    if not cfg.model_factory:
        model.save_pretrained(folder, state_dict=state_dict, **save_pretrained_kwargs)
    elif save_pretrained_kwargs.get("is_main_process", True):
        if state_dict is None:
            save_model(model, str(Path(folder) / "model.safetensors"))
        elif state_dict:  # tied weights once, under the first of their names, as save_model keeps them
            first = {}
            for name in sorted(state_dict):
                first.setdefault((state_dict[name].data_ptr(), state_dict[name].shape), name)
            save_file({name: state_dict[name].contiguous() for name in first.values()},
                      str(Path(folder) / "model.safetensors"))
        recipe = {"model_factory": cfg.model_factory, **factory_arguments(cfg, config), "cfg": cfg.to_dict()}
        (Path(folder) / FACTORY_FILE).write_text(json.dumps(recipe, indent=2) + "\n")


def rebuild_model(folder: Path) -> torch.nn.Module:
    """A model_factory model from its final_model/ folder: the factory called as in training, the weights loaded."""
    recipe = json.loads((Path(folder) / FACTORY_FILE).read_text())
    model = model_factory(recipe["model_factory"])(vocab_size=recipe["vocab_size"], num_labels=recipe["num_labels"],
                                                   cfg=TrainConfig(**recipe["cfg"]))
    load_model(model, str(Path(folder) / "model.safetensors"))
    return model


def fsdp_mixed_precision(cfg: TrainConfig) -> dict | None:
    """FSDP2's precision policy under mixed precision: the forward in bf16/fp16, gradients reduced
    in fp32, which is also where FSDP2 accumulates a window's unsynchronised micro-steps (its
    default, the forward's dtype, would sum them in bf16). None in fp32."""
    dtype = AMP_DTYPES.get(cfg.mixed_precision)
    return {"param_dtype": dtype, "reduce_dtype": torch.float32, "output_dtype": dtype} if dtype else None


def accelerate_fsdp_plugin(cfg: TrainConfig, launch: Launch) -> FullyShardedDataParallelPlugin | None:
    """Accelerate's FSDP with fsdp_mixed_precision's policy (Accelerate's own reduces in bf16/fp16), or its default."""
    policy = fsdp_mixed_precision(cfg)
    return FullyShardedDataParallelPlugin(mixed_precision_policy=policy) if launch.fsdp and policy else None


def autocast_for(cfg: TrainConfig, device: torch.device):
    """The forward pass's autocast for `mixed_precision` (a no-op context for "no"). The weights,
    gradients and optimizer state stay fp32; the loss is computed in fp32 (summed_loss)."""
    dtype = AMP_DTYPES.get(cfg.mixed_precision)
    return torch.autocast(device_type=device.type, dtype=dtype) if dtype else nullcontext()


def count_targets(labels: torch.Tensor, task: str) -> int:
    """Real targets in a batch: labelled next tokens (causal_lm, chat) or labelled examples."""
    target = labels[:, 1:] if task != "sequence_classification" else labels
    return int((target != IGNORE_INDEX).sum())


class SummedCrossEntropy(torch.autograd.Function):
    """Cross-entropy of rows of logits summed over the targets that are not IGNORE_INDEX, in fp32. The forward
    also computes the gradient, a chunk of rows at a time, into the one tensor of the logits' size it keeps (no
    fp32 copy of the logits, no softmax kept); the backward scales it in place (so it runs once)."""

    CHUNK_ELEMENTS = 2**26  # 256 MiB in fp32: what a chunk may hold besides the logits and their gradient

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, with_grad: bool) -> torch.Tensor:
        ctx.grad = grad = torch.empty_like(logits) if with_grad else None
        total = torch.zeros((), device=logits.device)
        rows = max(1, SummedCrossEntropy.CHUNK_ELEMENTS // logits.shape[-1])
        for start in range(0, len(logits), rows):
            x, t = logits[start:start + rows].float(), targets[start:start + rows]  # fp32 logits: x is a view
            g = grad[start:start + rows] if with_grad else None
            valid = t != IGNORE_INDEX
            t = t.where(valid, 0)[:, None]
            # each row minus its largest logit: into the gradient if that is fp32, else into x if x is a copy
            out = g if with_grad and g.dtype == x.dtype else x if x.dtype != logits.dtype else None
            z = torch.sub(x, x.amax(-1, keepdim=True), out=out)
            picked = z.gather(1, t).squeeze(1)
            sums = z.exp_().sum(-1)
            total += torch.where(valid, sums.log() - picked, 0).sum()  # log-sum-exp minus the target's logit
            if with_grad:  # softmax minus the one-hot target, zero where there is no target
                g.copy_(z.div_(sums[:, None]).scatter_add_(1, t, torch.full_like(z[:, :1], -1)).mul_(valid[:, None]))
        return total

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output: torch.Tensor):
        return ctx.grad.mul_(grad_output), None, None


def summed_loss(logits: torch.Tensor, labels: torch.Tensor, task: str) -> torch.Tensor:
    """Cross-entropy summed (not averaged) over the real targets of the batch, in fp32 (SummedCrossEntropy)."""
    if task != "sequence_classification":  # position t predicts token t+1: the labels move, not the logits
        labels = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    return SummedCrossEntropy.apply(logits.flatten(0, -2), labels.flatten(),
                                    torch.is_grad_enabled() and logits.requires_grad)
