"""The speed levers (compile, tf32, fused_adamw, attn_implementation, dataloader_workers: one key each, in all
three entry points) and how fast a step is: FLOPs as nanoGPT and PaLM count them, each step's `mfu`.
"""

import numpy as np
import torch

from .config import TrainConfig

COMPILE = {"backend": "inductor", "dynamic": True}  # torch.compile's arguments, in every entry point


def compiled_graphs() -> int:
    """Graphs torch.compile has built in this process so far (a recompile adds one)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


# Dense peak TFLOP/s per GPU model and the precision the matmuls run in (vendors' data sheets,
# without sparsity); unknown devices (and the CPU) have none: give --peak_tflops.
PEAK_TFLOPS = {
    "H100 SXM": {"bf16": 989, "fp16": 989, "tf32": 494, "fp32": 67},
    "H100 PCIe": {"bf16": 756, "fp16": 756, "tf32": 378, "fp32": 51},
    "H100 NVL": {"bf16": 835, "fp16": 835, "tf32": 418, "fp32": 60},
    "H200 SXM": {"bf16": 989, "fp16": 989, "tf32": 494, "fp32": 67},
    "H200 NVL": {"bf16": 835, "fp16": 835, "tf32": 418, "fp32": 60},
    "GH200": {"bf16": 989, "fp16": 989, "tf32": 494, "fp32": 67},
    "A100": {"bf16": 312, "fp16": 312, "tf32": 156, "fp32": 19.5},
    "L40S": {"bf16": 362, "fp16": 362, "tf32": 183, "fp32": 91.6},
    "L40": {"bf16": 181, "fp16": 181, "tf32": 90.5, "fp32": 90.5},
    "A10": {"bf16": 125, "fp16": 125, "tf32": 62.5, "fp32": 31.2},
    "L4": {"bf16": 121, "fp16": 121, "tf32": 60, "fp32": 30},
    "RTX 4090": {"bf16": 165, "fp16": 165, "tf32": 82.6, "fp32": 82.6},
    "V100 SXM": {"fp16": 125, "fp32": 15.7}, "V100 PCIe": {"fp16": 112, "fp32": 14}, "T4": {"fp16": 65, "fp32": 8.1},
}
# torch.cuda.get_device_name() as each model spells itself, matched whole: a name that only
# contains another's ("H100 NVL" holds "H100", "L40" starts like "L4") must not read its peak.
DEVICE_MODELS = {
    "NVIDIA H100 80GB HBM3": "H100 SXM", "NVIDIA H100 PCIe": "H100 PCIe", "NVIDIA H100 NVL": "H100 NVL",
    "NVIDIA H200": "H200 SXM", "NVIDIA H200 NVL": "H200 NVL", "NVIDIA GH200 480GB": "GH200",
    "NVIDIA A100-SXM4-80GB": "A100", "NVIDIA A100-SXM4-40GB": "A100", "NVIDIA A100-PCIE-40GB": "A100",
    "NVIDIA A100 80GB PCIe": "A100", "NVIDIA L40S": "L40S", "NVIDIA L40": "L40", "NVIDIA A10": "A10", "NVIDIA L4": "L4",
    "NVIDIA GeForce RTX 4090": "RTX 4090", "Tesla V100-SXM2-16GB": "V100 SXM", "Tesla V100-SXM2-32GB": "V100 SXM",
    "Tesla V100-PCIE-16GB": "V100 PCIe", "Tesla V100-PCIE-32GB": "V100 PCIe", "Tesla T4": "T4",
}


def peak_tflops_for(device_name: str, precision: str) -> float | None:
    """Dense TFLOP/s of the device so named for matmuls in `precision`; None where not in the table."""
    model = DEVICE_MODELS.get(" ".join(device_name.split()))
    return PEAK_TFLOPS[model].get(precision) if model else None


def set_tf32(cfg: TrainConfig, device: torch.device) -> None:
    """TF32 matmuls on CUDA when cfg.tf32 (their mantissa has 10 bits: fp32 ranges, faster)."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = cfg.tf32
        torch.backends.cudnn.allow_tf32 = cfg.tf32


def matmul_precision(cfg: TrainConfig, device: torch.device) -> str:
    if cfg.mixed_precision != "no":
        return cfg.mixed_precision
    return "tf32" if device.type == "cuda" and cfg.tf32 else "fp32"


def peak_flops(cfg: TrainConfig, device: torch.device) -> float:
    """The device's peak FLOP/s for this run's precision; 0 where unknown (the CPU)."""
    if cfg.peak_tflops:
        return cfg.peak_tflops * 1e12
    if device.type != "cuda":
        return 0.0
    return (peak_tflops_for(torch.cuda.get_device_name(device), matmul_precision(cfg, device)) or 0) * 1e12


def numel(parameter: torch.nn.Parameter) -> int:
    """A parameter's size, also where ZeRO-3 has partitioned it (its local tensor is then empty)."""
    return getattr(parameter, "ds_numel", None) or parameter.numel()


def flop_counts(model: torch.nn.Module) -> tuple[float, float] | None:
    """(`per_token`, `per_position`): a sequence of T tokens costs per_token·T + per_position·T² training
    FLOPs (nanoGPT, PaLM): 6 per weight but the input embedding, plus attention's 12·layers·heads·head
    dim; None for a model that is no Hugging Face transformer (a model_factory's): no mfu."""
    config = getattr(model, "config", None)
    needs = ("num_hidden_layers", "num_attention_heads", "hidden_size")
    if not hasattr(model, "get_input_embeddings") or not all(hasattr(config, key) for key in needs):
        return None
    tied = getattr(config, "tie_word_embeddings", False)  # the tied output projection is a real matmul
    weights = sum(map(numel, model.parameters())) - (0 if tied else numel(model.get_input_embeddings().weight))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 6 * weights, 12 * config.num_hidden_layers * config.num_attention_heads * head_dim


def training_flops(counts: tuple[float, float], lengths) -> float:
    """The training FLOPs of sequences of these lengths (attention grows with each one's own length)."""
    per_token, per_position = counts
    lengths = np.asarray(lengths, dtype=np.float64)
    return float(per_token * lengths.sum() + per_position * np.square(lengths).sum())


def flops_per_token(model: torch.nn.Module, seq_len: int) -> float:
    """Training FLOPs per token of sequences of seq_len tokens (the benchmarks' fixed-length blocks)."""
    return training_flops(flop_counts(model), [seq_len]) / seq_len
