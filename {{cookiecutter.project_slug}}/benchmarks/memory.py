"""Memory: the peak of one optimizer step at global batch B made of k micro-batches of b = B/k
(b = B, B/2, B/4, B/8, one process), against a plain step of one micro-batch b.

Accumulation is what lets a big batch fit, so the peak must follow b, not B. Goal: b x k costs at
most 1.1 x the plain step at b (what it adds is the gradient kept between micro-steps). Peaks come
from `memory.peak_bytes`: torch.cuda.max_memory_allocated on a GPU; on CPU, memory.LiveBytes
(the bytes of live tensor storages). Parameters and optimizer state are counted, after one warm-up
step so that the optimizer state exists. Micro-batches are the worst case, max_seq_len real tokens
each (`memory.worst_case_batch`), not the data.

Sharded, the same window on 4 processes (each rank's peak, and the bytes of parameters, gradients
and optimizer state it holds): DDP, FSDP2 full_shard with each gradient-sync mode, and HSDP as 2
replicas x 2 shards, all at accumulation 4 (SHARDED_ACCUM).

The loss: one training step (SGD, fp32 or the precision given) of a one-layer model with a vocabulary of
65,536 at micro batch 8 x 512 packed tokens (2 x 512 with --quick), against the same model with the
tokenizer's own small vocabulary, each in a fresh process: the whole process's peak (VmHWM on CPU) of
the first over the second, in bytes of the logits. Goal: at most 2.5 (the logits and one gradient of their
size, nothing else of their size).

Sharded start (`--sharded_start`, on its own: minutes of CPU): train_pytorch --fsdp full_shard on
4 processes with a 270M-parameter Llama (hidden 1024 x 24 layers, intermediate 2304, tied), drawn
by `tiny`'s own init at that size, or read from a folder in several safetensors files; SGD, one
optimizer step and its sharded checkpoint. Each process's peak resident set (VmHWM, the file pages
it maps included) over its level after the imports, as a multiple of the model's fp32 bytes: each
process fills its own shards only, so it stays well under 1.

    python -m benchmarks.memory                                            # CPU: the tiny model
    python -m benchmarks.memory --model gpt2-small --mixed_precision bf16  # a GPU (4 for the sharded rows)
    python -m benchmarks.memory --sharded_start                            # CPU or 4 GPUs
"""

import json
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor
from transformers import LlamaConfig, LlamaForCausalLM

from {{ cookiecutter.project_slug }}.config import load_config
from {{ cookiecutter.project_slug }}.distributed import cleanup, dist_env, init_distributed, wrap_ddp
from {{ cookiecutter.project_slug }}.memory import MIB, peak_bytes, worst_case_batch
from {{ cookiecutter.project_slug }}.model import AMP_DTYPES, build_model, load_tokenizer, model_config
from {{ cookiecutter.project_slug }}.optim import build_optimizer
from {{ cookiecutter.project_slug }}.sharding import shard

from .common import ROOT, SLUG, free_port, parser, prepare_model, train_config, train_flags
from .harness import (
    figure,
    lacks_gpus,
    optimizer_step,
    print_table,
    save_figure,
    save_powers_of_two_plot,
    save_results,
    spawned_process,
)

GOAL = 1.1  # peak of b x k over the peak of a plain step at b
SHARDED_WORLD_SIZE, SHARDED_ACCUM = 4, 4
# (name, the config keys that choose it)
SHARDED_MODES = (("DDP", {"fsdp": "none"}),
                 ("full_shard micro_step", {"fsdp": "full_shard", "fsdp_grad_sync": "micro_step"}),
                 ("full_shard window", {"fsdp": "full_shard", "fsdp_grad_sync": "window"}),
                 ("hybrid_shard 2x2 micro_step", {"fsdp": "hybrid_shard", "fsdp_replicas": 2,
                                                  "fsdp_grad_sync": "micro_step"}))
LOSS_VOCAB, LOSS_GOAL = 65_536, 2.5  # the loss row: its vocabulary, and the goal in bytes of the logits


def measure(model, optimizer, cfg, config, device, micro_batch_size: int, grad_accum_steps: int) -> int:
    """Peak bytes of one optimizer step of `grad_accum_steps` micro-batches, after a warm-up step."""
    window = [worst_case_batch(cfg, config, micro_batch_size, device)] * grad_accum_steps
    step = partial(optimizer_step, model, window, optimizer, cfg, device)
    step()  # the optimizer state, kernels and workspaces exist before the measured step
    return peak_bytes(step, device, model, optimizer)


def measure_all(cfg, device, divisors: tuple[int, ...]) -> tuple[list[dict], int]:
    """A row per micro batch B / divisor (and the model's parameter bytes), on one model."""
    config = model_config(cfg, load_tokenizer(cfg))
    model = build_model(cfg, config).to(device)
    optimizer = build_optimizer(model, cfg, device)
    rows = []
    for k in divisors:
        b = cfg.global_batch_size // k
        peak = measure(model, optimizer, cfg, config, device, b, k)
        baseline = peak if k == 1 else measure(model, optimizer, cfg, config, device, b, 1)
        rows.append({"micro_batch_size": b, "grad_accum_steps": k, "peak_bytes": peak,
                     "baseline_peak_bytes": baseline, "ratio": round(peak / baseline, 4)})
    return rows, sum(p.numel() * p.element_size() for p in model.parameters())


def loss_step_peak(args, vocab_size: int, micro_batch_size: int) -> int:
    """In a process of its own: the whole process's peak bytes over two training steps (SGD) of a one-layer
    model of `vocab_size` (0: the tokenizer's) at `micro_batch_size` x 512 packed tokens. CPU: the resident
    set's high-water mark (VmHWM), reset before the steps (else it holds the import's, or the parent's
    from before the process started); GPU: torch.cuda.max_memory_allocated."""
    cfg = train_config(args, model_name_or_path="tiny", optimizer="sgd", max_seq_len=512)
    device = dist_env().device
    config = model_config(cfg, load_tokenizer(cfg))
    config.num_hidden_layers, config.vocab_size = 1, vocab_size or config.vocab_size
    model = build_model(cfg, config).to(device)
    optimizer = build_optimizer(model, cfg, device)
    window = [worst_case_batch(cfg, config, micro_batch_size, device)]
    if device.type == "cpu":
        Path("/proc/self/clear_refs").write_text("5")  # Linux: VmHWM starts again from the resident set now
    for _ in range(2):  # the second step as every later one
        optimizer_step(model, window, optimizer, cfg, device)
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return int(re.search(r"VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024


def loss_row(args) -> dict:
    """The loss's peak: a vocabulary of LOSS_VOCAB over the tokenizer's, each in a fresh process."""
    micro_batch_size = 2 if args.quick else 8
    peaks = []
    for vocab_size in (LOSS_VOCAB, 0):
        with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as process:
            peaks.append(process.submit(loss_step_peak, args, vocab_size, micro_batch_size).result())
    logits_bytes = micro_batch_size * 512 * LOSS_VOCAB * AMP_DTYPES.get(args.mixed_precision, torch.float32).itemsize
    return {"vocab_size": LOSS_VOCAB, "micro_batch_size": micro_batch_size, "max_seq_len": 512,
            "logits_bytes": logits_bytes, "peak_bytes": peaks[0], "twin_peak_bytes": peaks[1],
            "ratio": round((peaks[0] - peaks[1]) / logits_bytes, 3), "goal_ratio": LOSS_GOAL}


def local_bytes(tensors) -> int:
    """Bytes this process holds of `tensors` (of a sharded tensor, its own shard)."""
    return sum(t.to_local().nbytes if isinstance(t, DTensor) else t.nbytes for t in tensors if t is not None)


def sharded_worker(rank: int, port: int, flags: list[str], out: str) -> None:
    """One of the processes: each mode on a fresh model, a warm-up step, then the measured step;
    rank 0 writes the rows (each number the largest over the ranks)."""
    env = spawned_process(rank, SHARDED_WORLD_SIZE, port)
    base = load_config(flags)
    config = model_config(base, load_tokenizer(base))
    init_distributed(env, base.rendezvous_timeout_s, base.collective_timeout_s)
    micro_batch = base.global_batch_size // (SHARDED_WORLD_SIZE * SHARDED_ACCUM)
    window = [worst_case_batch(base, config, micro_batch, env.device)] * SHARDED_ACCUM
    rows = []
    for name, keys in SHARDED_MODES:
        cfg = replace(base, **keys)
        model = build_model(cfg, config).to(env.device)
        model = shard(model, cfg, env) if cfg.fsdp != "none" else model
        wrapped = wrap_ddp(model, env, cfg.ddp_bucket_cap_mb) if cfg.fsdp == "none" else model
        optimizer = build_optimizer(model, cfg, env.device)
        held = {}

        def count_gradients(model=model, held=held) -> None:
            held["gradient_bytes"] = local_bytes(p.grad for p in model.parameters())

        step = partial(optimizer_step, wrapped, window, optimizer, cfg, env.device, on_gradients=count_gradients)
        step()  # the optimizer state exists before the measured step
        held["peak_bytes"] = peak_bytes(step, env.device, model, optimizer)
        held["parameter_bytes"] = local_bytes(model.parameters())
        held["optimizer_bytes"] = local_bytes(t for state in optimizer.state.values() for t in state.values()
                                              if isinstance(t, torch.Tensor) and t.dim())
        largest = torch.tensor(list(held.values()), dtype=torch.float64, device=env.device)
        dist.all_reduce(largest, op=dist.ReduceOp.MAX)
        rows.append({"mode": name, "world_size": SHARDED_WORLD_SIZE, "grad_accum_steps": SHARDED_ACCUM,
                     "micro_batch_size": micro_batch, **dict(zip(held, map(int, largest.tolist()), strict=True))})
        del wrapped, model, optimizer
    if env.is_main_process:
        Path(out).write_text(json.dumps(rows))
    cleanup()


def sharded_rows(args) -> list[dict]:
    """Every sharded mode measured on SHARDED_WORLD_SIZE processes this command starts itself."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        mp.spawn(sharded_worker, args=(free_port(), train_flags(args), str(out)), nprocs=SHARDED_WORLD_SIZE)
        return json.loads(out.read_text())


START_WORLD_SIZE = 4
START_MODEL = {"hidden_size": 1024, "num_hidden_layers": 24, "intermediate_size": 2304, "num_attention_heads": 16,
               "num_key_value_heads": 16, "tie_word_embeddings": True}
# train_pytorch, each process writing its peak resident set (VmHWM) and its level after the imports;
# `tiny` made START_MODEL's size (its config otherwise), so that its own init draws the weights
START_PROCESS = """import json, os, sys
from pathlib import Path

def high_water():
    status = Path("/proc/self/status").read_text().split("VmHWM:")[1]
    return int(status.split()[0]) * 1024

out, after_imports = Path(sys.argv.pop(1)), None  # the rest are train_pytorch's flags
try:
    from {slug} import model, train_pytorch
    llama_config = model.LlamaConfig
    model.LlamaConfig = lambda **keys: llama_config(**dict(keys, **{sizes}))
    after_imports = high_water()
    train_pytorch.main()
finally:
    (out / (os.environ["RANK"] + ".json")).write_text(json.dumps([after_imports, high_water()]))
"""


def start_row(args, tmp: Path, source: str, name_or_path, model_bytes: int) -> dict:
    """train_pytorch's sharded start from `name_or_path` on START_WORLD_SIZE processes, one step, its
    checkpoint and final_model/: each process's peak over its level after the imports, over the fp32
    model's bytes."""
    out = tmp / f"peaks_{source}"
    out.mkdir()
    script = tmp / "start.py"
    script.write_text(START_PROCESS.format(slug=SLUG, sizes=START_MODEL))
    flags = train_flags(args, model_name_or_path=name_or_path, fsdp="full_shard", optimizer="sgd", micro_batch_size=1,
                        global_batch_size=START_WORLD_SIZE, max_steps=1, save_steps=1,
                        output_dir=tmp / f"run_{source}")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(START_WORLD_SIZE),
                           "--master_addr", "127.0.0.1", "--master_port", str(free_port()), str(script), str(out),
                           *flags], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")})
    if proc.returncode:
        raise SystemExit(f"sharded start: train_pytorch failed: {proc.stdout[-1500:]} {proc.stderr[-1500:]}")
    peaks = [json.loads((out / f"{rank}.json").read_text()) for rank in range(START_WORLD_SIZE)]
    ratios = [round((peak - after_imports) / model_bytes, 3) for after_imports, peak in peaks]
    return {"start": source, "world_size": START_WORLD_SIZE, "model_bytes": model_bytes, "ratios": ratios,
            "largest_ratio": max(ratios), "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_", "default")}


def start_rows(args) -> list[dict]:
    """The sharded start's rows: `tiny`'s own init at START_MODEL's size, and a folder of that model
    in several safetensors files; full_shard, SGD, one step, its checkpoint and final_model/."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "model"
        tokenizer = load_tokenizer(load_config(train_flags(args)))
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), **START_MODEL))
        model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        model.save_pretrained(folder, max_shard_size="300MB")
        tokenizer.save_pretrained(folder)
        del model
        return [start_row(args, Path(tmp), "tiny's init", "tiny", model_bytes),
                start_row(args, Path(tmp), "a folder, 4 files", folder, model_bytes)]


def report_start(args, rows: list[dict]) -> None:
    print_table(f"sharded start: train_pytorch on {START_WORLD_SIZE} processes, a {rows[0]['model_bytes'] / 4e6:.0f}M-"
                "parameter Llama, full_shard, SGD, one step, its checkpoint and final_model/; each process's peak "
                "resident set over its level after the imports",
                {"start": "{start}", "model MiB": "{model:.0f}", "peak / model, each process": "{ratios}",
                 "largest": "{largest_ratio:.3f}", "MALLOC_MMAP_THRESHOLD_": "{malloc_mmap_threshold}"},
                [{**row, "model": row["model_bytes"] / MIB} for row in rows])
    save_results(args, "memory_sharded_start", rows, {"method": "VmHWM over its level after the imports",
                                                      "model": START_MODEL})


def run(args) -> list[dict]:
    if getattr(args, "sharded_start", False):  # its own flag (python -m benchmarks runs the rest)
        rows = start_rows(args)
        report_start(args, rows)
        return rows
    prepare_model(args)
    cfg = train_config(args)
    device = dist_env().device
    rows, parameter_bytes = measure_all(cfg, device, (1, 2) if args.quick else (1, 2, 4, 8))
    if device.type == "cuda":  # the model is gone: the benchmarks after this one get its memory
        torch.cuda.empty_cache()
    method = ("torch.cuda.max_memory_allocated" if device.type == "cuda"
              else "memory.LiveBytes: live tensor storage bytes")
    settings = {"device": str(device), "method": method, "global_batch_size": cfg.global_batch_size,
                "max_seq_len": cfg.max_seq_len, "optimizer": cfg.optimizer, "goal_ratio": GOAL,
                "parameter_bytes": parameter_bytes}
    report(args, rows, settings)
    report_loss(args, loss_row(args), settings)
    if not lacks_gpus("memory, sharded", SHARDED_WORLD_SIZE):
        report_sharded(args, sharded_rows(args), settings)
    return rows


def report(args, rows: list[dict], settings: dict) -> None:
    table = [{**row, "peak": row["peak_bytes"] / MIB, "baseline": row["baseline_peak_bytes"] / MIB} for row in rows]
    print_table(f"memory: one optimizer step at global batch {settings['global_batch_size']}, "
                f"{settings['max_seq_len']} tokens each ({settings['method']}, {settings['device']})",
                {"micro batch": "{micro_batch_size}", "x accum": "{grad_accum_steps}", "peak MiB": "{peak:.2f}",
                 "plain step at b, MiB": "{baseline:.2f}", "ratio (goal <= 1.1)": "{ratio:.3f}"}, table)
    fig, ax = figure(f"Peak memory of one optimizer step, global batch {settings['global_batch_size']}",
                     "micro batch b (accumulation B / b)", "peak MiB")
    sizes = [row["micro_batch_size"] for row in rows]
    ax.plot(sizes, [row["peak"] for row in table], "o-", label="b x B/b micro-steps (accumulated)")
    ax.plot(sizes, [row["baseline"] for row in table], "s--", label="plain step at batch b")
    ax.plot(sizes, [GOAL * row["baseline"] for row in table], ":", color="gray", label=f"goal: {GOAL} x plain step")
    save_powers_of_two_plot(fig, ax, sizes, args.results.parent / "memory.png")
    save_results(args, "memory", rows, settings)


def report_loss(args, row: dict, settings: dict) -> None:
    method = "torch.cuda.max_memory_allocated" if settings["device"].startswith("cuda") else "VmHWM"
    print_table(f"memory: the loss, one-layer model, micro batch {row['micro_batch_size']} x 512, SGD ({method} of a "
                f"fresh process, {settings['device']})",
                {"vocabulary": "{vocab_size}", "logits MiB": "{logits:.1f}", "peak MiB": "{peak:.1f}",
                 "small-vocabulary twin MiB": "{twin:.1f}", f"above the twin, x logits (goal <= {LOSS_GOAL})":
                 "{ratio:.2f}"},
                [{**row, "logits": row["logits_bytes"] / MIB, "peak": row["peak_bytes"] / MIB,
                  "twin": row["twin_peak_bytes"] / MIB}])
    save_results(args, "memory_loss", [row], {**settings, "method": method})


def report_sharded(args, rows: list[dict], settings: dict) -> None:
    table = [{**row, **{key[:-6]: row[key] / MIB for key in row if key.endswith("_bytes")}} for row in rows]
    print_table(f"memory per process, sharded: {SHARDED_WORLD_SIZE} processes x accumulation {SHARDED_ACCUM}, "
                f"global batch {settings['global_batch_size']} ({settings['method']}, the largest rank)",
                {"mode": "{mode}", "peak MiB": "{peak:.2f}", "parameters MiB": "{parameter:.2f}",
                 "gradients MiB": "{gradient:.2f}", "optimizer MiB": "{optimizer:.2f}"}, table)
    fig, ax = figure(f"Memory per process, {SHARDED_WORLD_SIZE} processes x accumulation {SHARDED_ACCUM}",
                     "", "MiB")
    names = [row["mode"] for row in table]
    for i, (key, label) in enumerate((("peak", "peak of the step"), ("parameter", "parameters held"),
                                      ("gradient", "gradients at the step"), ("optimizer", "optimizer state"))):
        ax.bar([x + 0.2 * i for x in range(len(names))], [row[key] for row in table], width=0.2, label=label)
    ax.set_xticks([x + 0.3 for x in range(len(names))], names, fontsize=8)
    ax.legend(fontsize=8)
    save_figure(fig, args.results.parent / "memory_sharded.png")
    save_results(args, "memory_sharded", rows, {**settings, "world_size": SHARDED_WORLD_SIZE,
                                                "grad_accum_steps": SHARDED_ACCUM})


def main(argv: list[str] | None = None) -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--sharded_start", action="store_true",
                   help="only the sharded start's row: train_pytorch's FSDP2 start on 4 processes, a 270M model")
    run(p.parse_args(argv))


if __name__ == "__main__":
    main()
