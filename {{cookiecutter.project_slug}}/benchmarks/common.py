"""What the benchmarks share, gpu_check among them: their flags, the model and training flags
they run with, a synthetic corpus, the processes they start and the description of the machine.

Every benchmark runs from any folder, on the device the environment gives (a GPU when there is
one, else the CPU); `--model gpt2-small --mixed_precision bf16` is the GPU setting.
"""

import argparse
import atexit
import json
import os
import platform
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

from {{ cookiecutter.project_slug }}.config import TrainConfig, load_config
from {{ cookiecutter.project_slug }}.distributed import free_port  # noqa: F401 (the benchmarks' ports, from here)
from {{ cookiecutter.project_slug }}.model import load_tokenizer

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


def write_corpus(folder: Path, documents: int, seed: int = 0) -> int:
    """`documents` stories of 10 to 120 words from the shipped corpus's vocabulary, and a
    validation split of 1 %; returns the bytes written."""
    words = sorted({w for line in (ROOT / "src" / SLUG / "assets" / "data" / "causal_lm" / "train.jsonl")
                    .read_text().splitlines() for w in json.loads(line)["text"].split()})
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", documents), ("validation", max(100, documents // 100))):
        with (folder / f"{split}.jsonl").open("w") as f:
            for start in range(0, n, 10_000):
                count = min(10_000, n - start)
                lengths = rng.integers(10, 121, count)
                picks = np.array(words)[rng.integers(0, len(words), lengths.sum())]
                texts = np.split(picks, np.cumsum(lengths)[:-1])
                f.write("".join(json.dumps({"text": " ".join(t)}) + "\n" for t in texts))
    return sum(p.stat().st_size for p in folder.iterdir())


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


