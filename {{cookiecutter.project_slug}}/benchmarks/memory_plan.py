"""A memory plan: what one GPU holds for a model config under each back end and mode, computed, not measured.

Weights, gradients and optimizer state follow from the parameter shapes (a model built on the meta device);
logits and activations per micro-sample follow from what the forward keeps for the backward. The tests
check it against a built model (to the byte) and against `benchmarks.memory`'s measured peaks (within 20 %).

    python -m benchmarks.memory_plan     # the docs/memory.md table: an 8B Llama on 2 nodes x 8 GPUs
"""

import math
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

# Llama-3-8B's shape; random weights are enough to count bytes
LLAMA_8B = {"vocab_size": 128_256, "hidden_size": 4096, "num_hidden_layers": 32, "intermediate_size": 14_336,
            "num_attention_heads": 32, "num_key_value_heads": 8, "tie_word_embeddings": False}
NODES, GPUS_PER_NODE, SEQ_LEN = 2, 8, 4096
# (row name, back end, how it shards, fsdp_grad_sync); the entry point is train_pytorch but for DeepSpeed
MODES = (("DDP", "ddp", "none", ""),
         ("FSDP2 full_shard micro_step", "fsdp", "full_shard", "micro_step"),
         ("FSDP2 full_shard window", "fsdp", "full_shard", "window"),
         ("FSDP2 hybrid_shard micro_step", "fsdp", "hybrid_shard", "micro_step"),
         ("FSDP2 hybrid_shard window", "fsdp", "hybrid_shard", "window"),
         ("DeepSpeed ZeRO-1", "deepspeed", "1", ""),
         ("DeepSpeed ZeRO-2", "deepspeed", "2", ""),
         ("DeepSpeed ZeRO-3", "deepspeed", "3", ""))
GB = 1e9


@dataclass(frozen=True)
class Plan:
    """Bytes one GPU holds: the first three for the whole run, the last two per micro-sample of `seq_len` tokens."""

    weights: int
    gradients: int
    optimizer: int
    logits: int
    activations: int

    def peak(self, micro_batch_size: int, grad_accum_steps: int) -> int:
        """The step's peak: gradients are there from the second micro-step on (a plain step frees them first)."""
        gradients = self.gradients if grad_accum_steps > 1 else 0
        return self.weights + gradients + self.optimizer + micro_batch_size * (self.logits + self.activations)


def parameter_shapes(config) -> list[torch.Size]:
    """The shape of every parameter of the model `config` describes (tied ones once), nothing allocated."""
    with torch.device("meta"):
        return [p.shape for p in AutoModelForCausalLM.from_config(config).parameters()]


def shard_bytes(shapes, parts: int, itemsize: int) -> int:
    """Bytes the first (largest) shard holds when FSDP2 or ZeRO splits dim 0 of each tensor into `parts`."""
    return sum(-(-shape[0] // parts) * math.prod(shape[1:]) * itemsize for shape in shapes)


def plan(config, mode: tuple, world_size: int, gpus_per_node: int, mixed_precision: str, seq_len: int,
         shapes=None) -> Plan:
    """What one GPU holds training `config` with AdamW under `mode` (a MODES row) on `world_size` GPUs."""
    _, backend, sharding, grad_sync = mode
    shapes = parameter_shapes(config) if shapes is None else shapes
    whole = shard_bytes(shapes, 1, 4)  # fp32
    steps = 4 * len(shapes)  # AdamW's step count, one fp32 scalar per parameter tensor
    half = mixed_precision in ("bf16", "fp16")
    if backend == "deepspeed":  # bf16 weights; fp32 master weights and moments partitioned; fp32 accumulation
        parts = world_size
        weights = shard_bytes(shapes, parts if sharding == "3" else 1, 2)
        gradients = shard_bytes(shapes, 1 if sharding == "1" else parts, 4)
        optimizer, residual, logits = 3 * shard_bytes(shapes, parts, 4) + steps, 2, 2
    else:  # fp32 weights, gradients and moments; autocast computes in bf16 and keeps the residual stream fp32
        parts = {"none": 1, "full_shard": world_size, "hybrid_shard": gpus_per_node}[sharding]
        weights = shard_bytes(shapes, parts, 4)
        gradients = weights + (whole if grad_sync == "window" else 0)  # window: the whole model's, unsharded
        gradients += weights if backend == "ddp" and world_size > 1 else 0  # DDP's buckets: a second copy
        optimizer, residual, logits = 2 * weights + steps, 4, 2 if half else 4
    compute = 2 if half else 4
    return Plan(weights, gradients, optimizer, logits=2 * seq_len * config.vocab_size * logits,  # and their gradient
                activations=seq_len * activation_bytes_per_token(config, residual, compute))


def activation_bytes_per_token(config, residual: int, compute: int) -> int:
    """What a Llama-like decoder keeps for the backward per token (SDPA, no checkpointing), in bytes, plus the
    backward's working set of one MLP. `residual`: the residual stream's itemsize, `compute`: the matmuls'."""
    h, i, heads = config.hidden_size, config.intermediate_size, config.num_attention_heads
    kv = config.num_key_value_heads * h // heads
    norm = (4 + residual + compute) * h + 4  # fp32 input, the normalised values, the next matmul's input, 1/rms
    attention = compute * (2 * h + 2 * kv) + 4 * heads  # q, k, v, the output, fp32 log-sum-exp per head
    mlp = 4 * compute * i  # gate, up, silu(gate), their product
    layer = 2 * norm + attention + mlp
    rotary = 2 * residual * h // heads  # cos and sin
    return config.num_hidden_layers * layer + norm + 8 + rotary + 2 * compute * i  # final norm, int64 ids


def table(config=None, seq_len: int = SEQ_LEN) -> str:
    """The docs/memory.md table: each MODES row for `config` (Llama-3-8B's shape) on NODES x GPUS_PER_NODE, bf16."""
    config = config or LlamaConfig(**LLAMA_8B)
    shapes = parameter_shapes(config)
    lines = ["| back end and mode | weights | gradients | optimizer | total | logits per micro-sample "
             "| activations per micro-sample |", "|---|---|---|---|---|---|---|"]
    for mode in MODES:
        p = plan(config, mode, NODES * GPUS_PER_NODE, GPUS_PER_NODE, "bf16", seq_len, shapes)
        values = (p.weights, p.gradients, p.optimizer, p.weights + p.gradients + p.optimizer, p.logits, p.activations)
        lines.append(f"| {mode[0]} | " + " | ".join(f"{value / GB:.1f} GB" for value in values) + " |")
    return "\n".join(lines)


def main() -> None:
    print(table())


if __name__ == "__main__":
    main()
