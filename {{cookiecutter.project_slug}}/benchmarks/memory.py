"""Memory: the peak of one optimizer step at global batch B made of k micro-batches of b = B/k
(b = B, B/2, B/4, B/8, one process), against a plain step of one micro-batch b.

Accumulation is what lets a big batch fit, so the peak must follow b, not B. Goal: b x k costs at
most 1.1 x the plain step at b (what it adds is the gradient kept between micro-steps). Peaks come
from `memory.peak_bytes`: torch.cuda.max_memory_allocated on a GPU; on CPU, memory.LiveBytes
(the bytes of live tensor storages). Parameters and optimizer state are counted, after one warm-up
step so that the optimizer state exists. Micro-batches are the worst case, max_seq_len real tokens
each (`memory.worst_case_batch`), not the data.

    python -m benchmarks.memory                                            # CPU: the tiny model
    python -m benchmarks.memory --model gpt2-small --mixed_precision bf16  # a GPU
"""

from functools import partial

import torch

from {{ cookiecutter.project_slug }}.distributed import dist_env
from {{ cookiecutter.project_slug }}.memory import MIB, peak_bytes, worst_case_batch
from {{ cookiecutter.project_slug }}.model import build_model, load_tokenizer, model_config
from {{ cookiecutter.project_slug }}.optim import build_optimizer

from .common import (
    figure,
    optimizer_step,
    parser,
    prepare_model,
    print_table,
    save_powers_of_two_plot,
    save_results,
    train_config,
)

GOAL = 1.1  # peak of b x k over the peak of a plain step at b


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


def run(args) -> list[dict]:
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


def main(argv: list[str] | None = None) -> None:
    run(parser(__doc__.splitlines()[0]).parse_args(argv))


if __name__ == "__main__":
    main()
