"""Sharded checkpoints, synchronous and asynchronous: how long training waits for a save, and what
a save still being written costs the optimizer steps that run meanwhile.

On 2 processes with FSDP2 (full_shard), each rank writing its shards with DCP: `dcp.save` blocks
until every shard is on disk; `async_checkpoint` (DCP's async_save on a gloo group of its own)
blocks only while the state is copied to host memory, and a thread writes it. Measured, in pairs
so that drift hits both alike: the blocking time of each kind of save, the time until the
asynchronous one is written, and an optimizer step with that write in flight against a step
without (ABAB). Micro-batches: the worst case, max_seq_len real tokens each.

    python -m benchmarks.checkpointing                                            # CPU: the tiny model
    python -m benchmarks.checkpointing --model gpt2-small --mixed_precision bf16  # 2 GPUs
"""

import json
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp

from {{ cookiecutter.project_slug }}.config import load_config
from {{ cookiecutter.project_slug }}.distributed import barrier, cleanup, init_distributed
from {{ cookiecutter.project_slug }}.memory import worst_case_batch
from {{ cookiecutter.project_slug }}.model import build_model, load_tokenizer, model_config
from {{ cookiecutter.project_slug }}.optim import build_optimizer
from {{ cookiecutter.project_slug }}.sharding import host_stager, save_sharded, shard

from .common import free_port, parser, prepare_model, train_flags
from .harness import clock, lacks_gpus, optimizer_step, print_table, save_results, spawned_process

WORLD_SIZE, ACCUM = 2, 4
PAIRS = 10


def worker(rank: int, port: int, flags: list[str], pairs: int, folder: str, out: str) -> None:
    """One of the processes: a sharded model, a warm-up step and save of each kind, then `pairs`
    rounds of (synchronous save; asynchronous save with a step while it is written; a plain step)."""
    env = spawned_process(rank, WORLD_SIZE, port)
    cfg = replace(load_config(flags), fsdp="full_shard")
    config = model_config(cfg, load_tokenizer(cfg))
    init_distributed(env, cfg.rendezvous_timeout_s, cfg.collective_timeout_s)
    background, stager = dist.new_group(backend="gloo"), host_stager()  # as a training run keeps them
    model = shard(build_model(cfg, config).to(env.device), cfg, env)
    optimizer = build_optimizer(model, cfg, env.device)
    micro_batch = max(cfg.global_batch_size // (WORLD_SIZE * ACCUM), 1)
    window = [worst_case_batch(cfg, config, micro_batch, env.device)] * ACCUM
    times: dict[str, list[float]] = {"sync_blocking_s": [], "async_blocking_s": [], "async_written_s": [],
                                     "step_in_flight_s": [], "step_s": []}

    def step() -> float:
        start = clock(env.device)
        optimizer_step(model, window, optimizer, cfg, env.device)
        return clock(env.device) - start

    for i in range(pairs + 1):  # the first round warms up
        barrier()
        start = time.perf_counter()
        save_sharded(model, optimizer, Path(folder) / f"sync_{i}")
        sync_blocking = time.perf_counter() - start
        barrier()
        start = time.perf_counter()
        written = save_sharded(model, optimizer, Path(folder) / f"async_{i}", background, stager)
        async_blocking = time.perf_counter() - start
        in_flight = step()
        written.result()
        async_written = time.perf_counter() - start
        plain = step()
        if i:
            for key, value in zip(times, (sync_blocking, async_blocking, async_written, in_flight, plain), strict=True):
                times[key].append(value)
    if env.is_main_process:
        medians = {key: round(statistics.median(values), 5) for key, values in times.items()}
        spread = {f"{key}_quartiles": [round(q, 5) for q in statistics.quantiles(values, n=4)]
                  for key, values in times.items()}
        checkpoint_bytes = sum(p.stat().st_size for p in (Path(folder) / "sync_1").rglob("*") if p.is_file())
        Path(out).write_text(json.dumps({**medians, **spread, "pairs": pairs, "checkpoint_bytes": checkpoint_bytes,
                                         "device": str(env.device), "micro_batch_size": micro_batch}))
    cleanup()


def run(args) -> list[dict]:
    if lacks_gpus("checkpointing", WORLD_SIZE):
        return []
    prepare_model(args)
    pairs = 3 if args.quick else PAIRS
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "row.json"
        mp.spawn(worker, args=(free_port(), train_flags(args), pairs, tmp, str(out)), nprocs=WORLD_SIZE)
        row = json.loads(out.read_text())
    ms = {key: row[key] * 1000 for key in row if key.endswith("_s")}
    print_table(f"checkpointing: FSDP2 full_shard on {WORLD_SIZE} processes, {row['checkpoint_bytes']:,} bytes per "
                f"checkpoint, medians of {pairs} rounds (rank 0, {row['device']})",
                {"save": "{save}", "training waits ms": "{blocking:.1f}", "written after ms": "{written:.1f}"},
                [{"save": "dcp.save", "blocking": ms["sync_blocking_s"], "written": ms["sync_blocking_s"]},
                 {"save": "async_save", "blocking": ms["async_blocking_s"], "written": ms["async_written_s"]}])
    print(f"an optimizer step ({ACCUM} micro-steps) with an asynchronous save in flight: "
          f"{ms['step_in_flight_s']:.1f} ms, without: {ms['step_s']:.1f} ms (ABAB)")
    settings = {key: row.pop(key) for key in ("pairs", "device", "micro_batch_size")}
    save_results(args, "checkpointing", [row], {**settings, "world_size": WORLD_SIZE, "grad_accum_steps": ACCUM})
    return [row]


def main(argv: list[str] | None = None) -> None:
    run(parser(__doc__.splitlines()[0]).parse_args(argv))


if __name__ == "__main__":
    main()
