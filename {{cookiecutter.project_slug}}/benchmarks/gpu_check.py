"""The GPU check, on one GPU in about 5 minutes: what this project does where it is meant to run.

- tokens per second and MFU of each entry point beside the nanoGPT-style loop
  (benchmarks/bare_loop.py) on GPT-2 small's shape (124M parameters, random weights, no
  download), bf16, compile off and on, the same packed batches and optimizer;
- peak memory of a training step against the micro batch (torch.cuda.max_memory_allocated);
- `--micro_batch_size auto` without a budget: the largest micro batch found by real CUDA OOM;
- two processes on the one GPU (DIST_BACKEND=gloo: nccl refuses two ranks per device): the 2x4
  cell against 1x1, and DDP's all-reduces per optimizer step.

It writes bench/gpu_check.json and bench/gpu_check.md. Without a GPU it says so in one line and
exits 0. What stays exact on GPUs and what does not: docs/performance.md.

    python -m benchmarks.gpu_check            # make gpu-check
    python -m benchmarks.gpu_check --quick    # fewer steps (about 2 minutes)
"""

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from {{ cookiecutter.project_slug }}.config import load_config
from {{ cookiecutter.project_slug }}.memory import MIB, training_step_peak
from {{ cookiecutter.project_slug }}.model import build_model, load_tokenizer, model_config
from {{ cookiecutter.project_slug }}.speed import flops_per_token, peak_flops

from .common import GPT2_SMALL, ROOT, SLUG, entry_points, free_port, machine, parser, prepare_model, subprocess_env
from .data import write_corpus

TIMEOUT_S = 600
GPT2 = {"model_name_or_path": GPT2_SMALL, "max_seq_len": 1024, "packing": "true", "mixed_precision": "bf16",
        "micro_batch_size": 8, "global_batch_size": 32, "report_to": "none", "warmup_steps": 2,
        "eval_every": 100000, "log_every": 100000}


def flags(values: dict) -> list[str]:
    return [arg for key, value in values.items() for arg in (f"--{key}", str(value))]


def run(module: str, values: dict, out: Path, nproc: int = 1, env: dict | None = None) -> list[dict]:
    """`module` on `nproc` processes of this GPU; its step records."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr",
                "127.0.0.1", "--master_port", str(free_port()), "-m"] if nproc > 1 else [sys.executable, "-m"]
    cmd = [*launcher, module, *flags({**values, "output_dir": out})]
    proc = subprocess.run(cmd, cwd=ROOT, env={**subprocess_env(), **(env or {})}, capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(map(str, cmd))}:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
    (out / "log.txt").write_text(proc.stdout + proc.stderr)
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "tokens" in r]


def throughput(records: list[dict], skip: int) -> float:
    """Tokens per second after the first `skip` steps (compilation and warm-up)."""
    timed = records[skip:]
    return sum(r["tokens"] for r in timed[1:]) / (timed[-1]["elapsed_s"] - timed[0]["elapsed_s"])


def speed_rows(steps: int, tmp: Path, cache: Path, corpus: Path) -> list[dict]:
    cfg = load_config(["--config", str(ROOT / "configs" / "train.yaml"), *flags(GPT2)])
    tokenizer = load_tokenizer(cfg)
    per_token = flops_per_token(build_model(cfg, model_config(cfg, tokenizer)), cfg.max_seq_len)
    peak = peak_flops(cfg, torch.device("cuda", 0))
    rows = []
    for compiled in ("false", "true"):
        values = {**GPT2, "max_steps": steps, "compile": compiled, "data_cache_dir": cache, "dataset": corpus}
        for name in ("bare", *entry_points()):
            module = "benchmarks.bare_loop" if name == "bare" else f"{SLUG}.train_{name}"
            records = run(module, values, tmp / f"{name}_{compiled}")
            tokens_per_s = throughput(records, skip=steps // 3)
            rows.append({"loop": name, "compile": compiled == "true", "tokens_per_s": round(tokens_per_s),
                         "mfu": round(per_token * tokens_per_s / peak, 4) if peak else None})
    for row in rows:
        bare = next(r for r in rows if r["loop"] == "bare" and r["compile"] == row["compile"])
        row["vs_bare"] = round(row["tokens_per_s"] / bare["tokens_per_s"], 4)
    return rows


def memory_rows() -> list[dict]:
    cfg = load_config(["--config", str(ROOT / "configs" / "train.yaml"), *flags(GPT2)])
    config = model_config(cfg, load_tokenizer(cfg))
    rows = []
    for micro in (1, 2, 4, 8, 16):
        try:
            rows.append({"micro_batch_size": micro,
                         "peak_mib": round(training_step_peak(cfg, config, micro, torch.device("cuda", 0)) / MIB)})
        except torch.OutOfMemoryError:
            rows.append({"micro_batch_size": micro, "peak_mib": None})
        torch.cuda.empty_cache()
    return rows


def auto_micro_batch(tmp: Path, cache: Path, corpus: Path) -> str:
    """What --micro_batch_size auto chose on this GPU, with no budget (a real CUDA OOM decides)."""
    run(f"{SLUG}.train_pytorch", {**GPT2, "max_steps": 1, "global_batch_size": 256, "micro_batch_size": "auto",
                                  "data_cache_dir": cache, "dataset": corpus}, tmp / "auto")
    return next(line.strip() for line in (tmp / "auto" / "log.txt").read_text().splitlines() if "(auto:" in line)


def two_ranks_on_one_gpu(tmp: Path, cache: Path) -> dict:
    """The parity matrix's 2x4 cell against 1x1 (the tiny model, fp32), the two ranks on one GPU."""
    cell = {"report_to": "none", "max_seq_len": 48, "global_batch_size": 16, "max_steps": 8, "warmup_steps": 2,
            "lr_scheduler_type": "cosine", "ddp_bucket_cap_mb": 0.05, "data_cache_dir": cache, "tf32": "false"}
    one = run(f"{SLUG}.train_pytorch", {**cell, "micro_batch_size": 16}, tmp / "one")
    two = run(f"{SLUG}.train_pytorch", {**cell, "micro_batch_size": 2}, tmp / "two", nproc=2,
              env={"DIST_BACKEND": "gloo"})
    from safetensors.torch import load_file

    a, b = (load_file(tmp / name / "final_model" / "model.safetensors") for name in ("one", "two"))
    return {"max_param_diff": max((a[k] - b[k]).abs().max().item() for k in a),
            "max_loss_diff": max(abs(x["loss"] - y["loss"]) for x, y in zip(one, two, strict=True)),
            "grad_sync_calls": [r["grad_sync_calls"] for r in two], "micro_steps": two[0]["micro_steps"]}


def markdown(result: dict) -> str:
    lines = [f"# GPU check: {result['machine'].get('gpu')}", "",
             "| loop | compile | tokens/s | MFU | vs nanoGPT-style |", "|---|---|---|---|---|"]
    lines += [f"| {r['loop']} | {'on' if r['compile'] else 'off'} | {r['tokens_per_s']:,} | "
              f"{r['mfu']:.1%} | {r['vs_bare']:.3f} |" if r["mfu"] is not None else
              f"| {r['loop']} | {'on' if r['compile'] else 'off'} | {r['tokens_per_s']:,} | - | {r['vs_bare']:.3f} |"
              for r in result["speed"]]
    lines += ["", "| micro batch | peak MiB |", "|---|---|"]
    lines += [f"| {r['micro_batch_size']} | {r['peak_mib'] if r['peak_mib'] is not None else 'OOM'} |"
              for r in result["memory"]]
    parity = result["two_ranks_on_one_gpu"]
    lines += ["", f"micro_batch_size auto: `{result['auto_micro_batch']}`", "",
              f"2 ranks on one GPU (gloo), 2x4 vs 1x1: max |param diff| {parity['max_param_diff']:.3g}, "
              f"max |loss diff| {parity['max_loss_diff']:.3g}, all-reduces per step {parity['grad_sync_calls']}"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parser(__doc__.splitlines()[0]).parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check: no GPU here (torch.cuda.is_available() is False): nothing to measure")
        return 0
    args.model = "gpt2-small"
    prepare_model(args)
    steps = 15 if args.quick else 30
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        cache, corpus = tmp / "data_cache", tmp / "corpus"
        write_corpus(corpus, 60_000)  # about 4M tokens: 4k packed blocks of 1024, more than the steps take
        result = {"machine": machine(), "steps": steps, "speed": speed_rows(steps, tmp, cache, corpus),
                  "memory": memory_rows(), "auto_micro_batch": auto_micro_batch(tmp, cache, corpus),
                  "two_ranks_on_one_gpu": two_ranks_on_one_gpu(tmp, cache)}
    out = args.results.parent
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "gpu_check.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
