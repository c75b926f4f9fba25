"""Communication: DDP's gradient all-reduce calls and bytes per optimizer step, with and without
`no_sync()` on the micro-steps before the last, for k = 1, 2, 4, 8 micro-steps, on 2 processes,
and the time of each step.

Goal: with no_sync, exactly one gradient's worth of bytes per optimizer step whatever k is;
without it, k times that. The counts come from `distributed.GradSyncCounter`, a DDP
communication hook that sees every bucket DDP sends. Also measured: what the gradient noise
scale's statistics (read in that hook) cost per optimizer step (goal: under 2 %), steps with and
without them alternating (ABAB). Each variant warms up for 2 optimizer steps
first (DDP lays its buckets out again after the first), then counts the next ones. One command
runs every variant: it starts the 2 processes itself (gloo on 127.0.0.1 on CPU; nccl where there
are 2 GPUs). Micro-batches: the worst case, max_seq_len real tokens each.

    python -m benchmarks.communication                                            # CPU: the tiny model
    python -m benchmarks.communication --model gpt2-small --mixed_precision bf16  # 2 GPUs
"""

import json
import statistics
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp

from {{ cookiecutter.project_slug }}.config import load_config
from {{ cookiecutter.project_slug }}.distributed import cleanup, init_distributed, wrap_ddp
from {{ cookiecutter.project_slug }}.memory import worst_case_batch
from {{ cookiecutter.project_slug }}.model import build_model, load_tokenizer, model_config
from {{ cookiecutter.project_slug }}.noise import NoiseScale, NoisyGradSyncCounter, read_norms
from {{ cookiecutter.project_slug }}.optim import build_optimizer

from .common import free_port, parser, prepare_model, train_flags
from .harness import (
    clock,
    figure,
    lacks_gpus,
    optimizer_step,
    print_table,
    save_powers_of_two_plot,
    save_results,
    spawned_process,
)

WORLD_SIZE = 2
WARMUP_STEPS, MEASURED_STEPS = 2, 10
NOISE_PAIRS = 40


class ByteCounter(NoisyGradSyncCounter):
    """The training's counter (distributed.sync_counter_for's) that also counts the bytes DDP sends;
    `take_bytes()` returns and resets."""

    bytes = 0

    def hook(self, state, bucket):
        buffer = bucket.buffer()
        self.bytes += buffer.numel() * buffer.element_size()
        return super().hook(state, bucket)

    def take_bytes(self) -> int:
        sent, self.bytes = self.bytes, 0
        return sent


def measure(model, cfg, env, config, grad_accum_steps: int, no_sync: bool, steps: int) -> dict:
    """All-reduce calls, bytes and median seconds per optimizer step of one variant, on this rank."""
    ddp_model = wrap_ddp(model, env, cfg.ddp_bucket_cap_mb)  # as train_pytorch wraps it
    counter = ByteCounter(ddp_model)
    optimizer = build_optimizer(model, cfg, env.device)
    window = [worst_case_batch(cfg, config, cfg.micro_batch_size, env.device)] * grad_accum_steps
    for _ in range(WARMUP_STEPS):
        optimizer_step(ddp_model, window, optimizer, cfg, env.device, no_sync)
    counter.take(), counter.take_bytes()  # drop what the warm-up sent
    seconds = []
    for _ in range(steps):
        start = clock(env.device)
        optimizer_step(ddp_model, window, optimizer, cfg, env.device, no_sync)
        seconds.append(clock(env.device) - start)
    return {"grad_accum_steps": grad_accum_steps, "no_sync": no_sync,
            "allreduce_calls_per_step": counter.take() / steps, "bytes_per_step": counter.take_bytes() / steps,
            "step_s": round(statistics.median(seconds), 5)}


def noise_cost(model, cfg, env, config, pairs: int) -> dict:
    """What the gradient noise scale costs: optimizer steps of 4 micro-steps (no_sync), alternately
    with and without its statistics (the hook's two squared norms per bucket, then
    noise.read_norms' all-reduce and the estimate; in training the sum rides in the step's one
    all-reduce), ABAB so that drift hits both alike; median seconds."""
    ddp_model = wrap_ddp(model, env, cfg.ddp_bucket_cap_mb)
    counter, noise = NoisyGradSyncCounter(ddp_model), NoiseScale()
    optimizer = build_optimizer(model, cfg, env.device)
    window = [worst_case_batch(cfg, config, cfg.micro_batch_size, env.device)] * 4
    for _ in range(WARMUP_STEPS):
        optimizer_step(ddp_model, window, optimizer, cfg, env.device)
    seconds: dict[bool, list[float]] = {True: [], False: []}
    for i in range(2 * pairs):
        counter.noise = on = i % 2 == 0
        start = clock(env.device)
        optimizer_step(ddp_model, window, optimizer, cfg, env.device)
        if on:
            examples = cfg.micro_batch_size * len(window) * WORLD_SIZE
            noise.update(*read_norms(*counter.take_norms(), WORLD_SIZE), examples, WORLD_SIZE)
        seconds[on].append(clock(env.device) - start)
    with_it, without = statistics.median(seconds[True]), statistics.median(seconds[False])
    return {"grad_accum_steps": len(window), "with_s": round(with_it, 5), "without_s": round(without, 5),
            "cost": round(with_it / without - 1, 4), "pairs": pairs}


def worker(rank: int, port: int, flags: list[str], variants: list[tuple[int, bool]], steps: int, out: str) -> None:
    """One of the 2 processes: every variant in turn, each on a fresh model; rank 0 writes the rows
    and the settings. Loopback and, as torchrun does, one CPU thread per process unless set."""
    env = spawned_process(rank, WORLD_SIZE, port)
    cfg = load_config(flags)
    config = model_config(cfg, load_tokenizer(cfg))
    init_distributed(env, cfg.rendezvous_timeout_s, cfg.collective_timeout_s)
    rows = []
    for k, no_sync in variants:
        model = build_model(cfg, config).to(env.device)
        rows.append(measure(model, cfg, env, config, k, no_sync, steps))
    noise = noise_cost(build_model(cfg, config).to(env.device), cfg, env, config, NOISE_PAIRS if steps > 1 else 2)
    if env.is_main_process:
        settings = {"device": str(env.device), "backend": torch.distributed.get_backend(),
                    "world_size": WORLD_SIZE, "micro_batch_size": cfg.micro_batch_size,
                    "max_seq_len": cfg.max_seq_len, "ddp_bucket_cap_mb": cfg.ddp_bucket_cap_mb,
                    "gradient_bytes": sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad),
                    "measured_steps": steps, "warmup_steps": WARMUP_STEPS}
        Path(out).write_text(json.dumps({"rows": rows, "noise": noise, "settings": settings}))
    cleanup()


def run(args) -> list[dict]:
    if lacks_gpus("communication", WORLD_SIZE):
        return []
    prepare_model(args)
    flags = train_flags(args)
    variants = [(k, no_sync) for k in ((1, 4) if args.quick else (1, 2, 4, 8)) for no_sync in (True, False)]
    steps = 1 if args.quick else MEASURED_STEPS
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        mp.spawn(worker, args=(free_port(), flags, variants, steps, str(out)), nprocs=WORLD_SIZE)
        result = json.loads(out.read_text())
    report(args, result["rows"], result["settings"])
    noise = result["noise"]
    print(f"gradient noise scale: {noise['with_s'] * 1000:.1f} ms per optimizer step with its statistics, "
          f"{noise['without_s'] * 1000:.1f} ms without ({noise['pairs']} ABAB pairs, k {noise['grad_accum_steps']}): "
          f"cost {noise['cost']:+.2%} of a step (goal: under 2 %)")
    save_results(args, "noise_scale", [noise], result["settings"])
    return result["rows"]


def report(args, rows: list[dict], settings: dict) -> None:
    gradient = settings["gradient_bytes"]
    table = [{**row, "gradients": row["bytes_per_step"] / gradient, "ms": row["step_s"] * 1000} for row in rows]
    print_table(f"communication: {WORLD_SIZE} processes ({settings['backend']}), micro batch "
                f"{settings['micro_batch_size']} x {settings['max_seq_len']} tokens, "
                f"one gradient = {gradient:,} bytes, buckets of {settings['ddp_bucket_cap_mb']} MiB",
                {"accum k": "{grad_accum_steps}", "no_sync": "{no_sync}",
                 "all-reduces/step": "{allreduce_calls_per_step:g}", "bytes/step": "{bytes_per_step:,.0f}",
                 "gradients/step": "{gradients:g}", "step ms": "{ms:.1f}"}, table)
    fig, ax = figure(f"Gradient bytes all-reduced per optimizer step ({WORLD_SIZE} processes)",
                     "micro-steps per optimizer step k", "MiB per optimizer step")
    for no_sync, style in ((True, "o-"), (False, "s--")):
        mine = [row for row in rows if row["no_sync"] == no_sync]
        ax.plot([row["grad_accum_steps"] for row in mine], [row["bytes_per_step"] / 2**20 for row in mine], style,
                label="with no_sync() (goal: one gradient)" if no_sync else "without no_sync() (k gradients)")
    ks = sorted({row["grad_accum_steps"] for row in rows})
    save_powers_of_two_plot(fig, ax, ks, args.results.parent / "communication.png")
    save_results(args, "communication", rows, settings)


def main(argv: list[str] | None = None) -> None:
    run(parser(__doc__.splitlines()[0]).parse_args(argv))


if __name__ == "__main__":
    main()
