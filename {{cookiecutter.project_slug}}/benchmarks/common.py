"""What the benchmarks share: their flags, the model and training flags they run with, the
hand-written optimizer step they measure, the device clock, and results.json with its tables,
plots and the description of the machine.

Every benchmark runs from any folder, on the device the environment gives (a GPU when there is
one, else the CPU); `--model gpt2-small --mixed_precision bf16` is the GPU setting.
"""

import argparse
import atexit
import json
import os
import platform
import shutil
import socket
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from {{ cookiecutter.project_slug }}.config import TrainConfig, load_config
from {{ cookiecutter.project_slug }}.distributed import DistEnv, dist_env
from {{ cookiecutter.project_slug }}.model import autocast_for, count_targets, load_tokenizer, summed_loss
from {{ cookiecutter.project_slug }}.optim import clip_gradients

ROOT = Path(__file__).resolve().parents[1]
SLUG = "{{ cookiecutter.project_slug }}"
GPT2_SMALL = ROOT / "bench" / "models" / "gpt2-small"
# Training flags per benchmark model. tiny: the project's own test model. gpt2-small: GPT-2 small
# (124M parameters, 50257-token vocabulary, 1024 positions), random weights, written once to
# bench/models/ so that every entry point loads it with --model_name_or_path. The tiny model's
# gradients fit in one 25 MiB DDP bucket; 0.05 MiB buckets give it several, as a big model has.
MODELS = {
    "tiny": {"model_name_or_path": "tiny", "max_seq_len": 64, "ddp_bucket_cap_mb": 0.05},
    "gpt2-small": {"model_name_or_path": GPT2_SMALL, "max_seq_len": 1024, "global_batch_size": 32,
                   "micro_batch_size": 8, "ddp_bucket_cap_mb": 25},
}


def parser(description: str) -> argparse.ArgumentParser:
    """The flags of every benchmark (`python -m benchmarks` passes them to each)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model", choices=sorted(MODELS), default="tiny",
                   help="tiny (CPU, seconds) or gpt2-small (a GPU; random weights, no download)")
    p.add_argument("--mixed_precision", choices=("no", "bf16"), default="no",
                   help="bf16 autocasts the forward pass, as the entry points do (use it on GPUs)")
    p.add_argument("--results", type=Path, default=ROOT / "bench" / "results.json",
                   help="results file (its other benchmarks' keys are kept); the plots go beside it")
    p.add_argument("--quick", action="store_true", help="fewer variants and repeats (the tests use it)")
    p.add_argument("--bake_s", type=float, default=None,
                   help="seconds `cookiecutter --no-input` took to bake this project (start-up benchmark)")
    return p


def entry_points() -> list[str]:
    """The entry points this project was generated with."""
    return [e for e in ("pytorch", "accelerate", "trainer") if (ROOT / "src" / SLUG / f"train_{e}.py").exists()]


def data_cache() -> Path:
    """The benchmarks' own data_cache_dir, empty when they start (the start-up benchmark's first
    run prepares the data) and removed when they end."""
    if not _DATA_CACHE:
        _DATA_CACHE.append(Path(tempfile.mkdtemp(prefix=f"{SLUG}-bench-data-")))
        atexit.register(shutil.rmtree, _DATA_CACHE[0], True)
    return _DATA_CACHE[0]


_DATA_CACHE: list[Path] = []


def train_flags(args: argparse.Namespace, **overrides) -> list[str]:
    """The training flags of every benchmark run: the project's config, causal LM, no W&B, the
    benchmark model's settings and precision, then `overrides`."""
    values = {"config": ROOT / "configs" / "train.yaml", "task": "causal_lm", "report_to": "none",
              "mixed_precision": args.mixed_precision, "data_cache_dir": data_cache(), **MODELS[args.model],
              **overrides}
    return [arg for key, value in values.items() for arg in (f"--{key}", str(value))]


def train_config(args: argparse.Namespace, **overrides) -> TrainConfig:
    return load_config(train_flags(args, **overrides))


def prepare_model(args: argparse.Namespace) -> None:
    """Write the gpt2-small folder (config, random fp32 weights, the project's tokenizer) unless it
    is there. Dropout is 0, as in the tiny model."""
    if args.model != "gpt2-small" or (GPT2_SMALL / "config.json").is_file():
        return
    from transformers import AutoModelForCausalLM, GPT2Config

    tokenizer = load_tokenizer(train_config(args, model_name_or_path="tiny"))
    config = GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=tokenizer.bos_token_id,
                        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(GPT2_SMALL)
    tokenizer.save_pretrained(GPT2_SMALL)


def optimizer_step(model, window: list[dict], optimizer, cfg: TrainConfig, device: torch.device,
                   no_sync: bool = True, on_gradients=None) -> None:
    """One optimizer step over the micro-batches of `window`, written plainly: forward and backward
    of each (DDP's no_sync() on all but the last when `no_sync`, or FSDP2's, as cfg.fsdp_grad_sync says),
    `on_gradients()` if given, clip, step, zero_grad.

    Each micro-batch's summed loss is divided by the real targets of the window on this process
    (the entry points divide by those of all processes: the same work, another scale)."""
    num_targets = max(sum(count_targets(b["labels"], cfg.task) for b in window), 1)
    for micro_step, micro_batch in enumerate(window):
        batch = {key: value.to(device, non_blocking=True) for key, value in micro_batch.items()}
        labels = batch.pop("labels")
        skip_sync = no_sync and micro_step < len(window) - 1 and hasattr(model, "no_sync")  # one process: none
        with model.no_sync() if skip_sync else nullcontext():
            with autocast_for(cfg, device):
                logits = model(**batch).logits
            (summed_loss(logits, labels, cfg.task) / num_targets).backward()
    if on_gradients is not None:
        on_gradients()
    clip_gradients(model, cfg.max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def lacks_gpus(benchmark: str, processes: int) -> bool:
    """Whether this machine has GPUs but fewer than `processes` (nccl takes one GPU per process):
    then `benchmark` is skipped, and says so."""
    gpus = torch.cuda.device_count()
    if 0 < gpus < processes:
        print(f"{benchmark}: skipped, {processes} processes need {processes} GPUs (nccl); this machine has {gpus}")
    return 0 < gpus < processes


def clock(device: torch.device) -> float:
    """Seconds, once the device has finished the work queued so far (CUDA runs asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def subprocess_env() -> dict:
    """The environment of every process a benchmark starts: src/ on the path, offline, loopback,
    and one CPU thread per process unless OMP_NUM_THREADS says otherwise (several processes'
    threads spinning on few cores can slow a step a hundredfold)."""
    paths = [str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p),
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONUNBUFFERED": "1"}
    for key, value in {"OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo"}.items():
        env.setdefault(key, value)
    return env


def spawned_process(rank: int, world_size: int, port: int) -> DistEnv:
    """In a process that a benchmark spawned itself (torch.multiprocessing): torchrun's variables
    for `rank` of `world_size` on this machine, loopback and, as torchrun does, one CPU thread per
    process unless set. The process then joins with distributed.init_distributed."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_PORT=str(port))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
    return dist_env()


def _cpu_model() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def machine() -> dict:
    """What the numbers were measured on."""
    info = {"cpu": _cpu_model(), "cores": os.cpu_count(), "torch": torch.__version__,
            "python": platform.python_version(), "os": platform.platform()}
    if torch.cuda.is_available():
        info |= {"gpu": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(), "cuda": torch.version.cuda}
    return info


def save_results(args: argparse.Namespace, key: str, rows: list[dict], settings: dict) -> None:
    """Write `rows` as `key` of the results file, with how they were measured under
    settings[key] and the machine; the other benchmarks' keys stay."""
    path = args.results
    results = json.loads(path.read_text()) if path.is_file() else {}
    results[key] = rows
    results.setdefault("settings", {})[key] = {"model": args.model, "mixed_precision": args.mixed_precision,
                                               **settings}
    results["machine"] = machine()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2) + "\n")


def print_table(title: str, columns: dict[str, str], rows: list[dict]) -> None:
    """`rows` under `title`; `columns` maps each header to a format string applied to a row."""
    cells = [[fmt.format(**row) for fmt in columns.values()] for row in rows]
    widths = [max(len(header), *(len(line[i]) for line in cells)) for i, header in enumerate(columns)]
    print(f"\n{title}")
    print("  ".join(header.rjust(w) for header, w in zip(columns, widths, strict=True)))
    for line in cells:
        print("  ".join(cell.rjust(w) for cell, w in zip(line, widths, strict=True)))


def figure(title: str, xlabel: str, ylabel: str):
    """A new matplotlib figure and its axes (the Agg back end: files only, no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2), layout="constrained")
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.grid(alpha=0.3)
    return fig, ax


def save_powers_of_two_plot(fig, ax, xs: list[int], path: Path) -> None:
    """Finish a plot whose x values are powers of two (micro batches, micro-steps) and save it."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_ylim(bottom=0)
    ax.legend()
    save_figure(fig, path)


def save_figure(fig, path: Path) -> None:
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"plot: {path}")
