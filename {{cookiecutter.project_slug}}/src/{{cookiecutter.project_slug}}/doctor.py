"""Whether the processes of a job can train together, checked before it trains. Launched exactly
like training, it joins the process group, prints one table of every rank's host, device, network
interface, rendezvous address, library versions and free memory, and times a checked all-reduce
(and checks one on a gloo group of its own, as background checkpoints write through).

    make doctor                                       # 2 processes on this machine (every GPU)
    ENTRY=doctor scripts/train_local.sh               # any launch script: the doctor, not training
    torchrun --nproc_per_node 2 -m {{ cookiecutter.project_slug }}.doctor --rendezvous_timeout_s 60

Exit code 0 when every rank agrees and the all-reduce sums exactly; 2 and one line naming the rank
otherwise: another library version, CUDA, interface or rendezvous address, a wrong sum, or ranks
that did not join within rendezvous_timeout_s (docs/launching.md, "The doctor"); a world size that
training refuses (the batch, fsdp_replicas) is its one line, before the ranks meet.
"""

import fcntl
import importlib.metadata
import os
import re
import socket
import statistics
import struct
import time

import torch
import torch.distributed as dist

from .cli import run_cli
from .config import TrainConfig
from .distributed import DistEnv, dist_env, init_distributed, print0
from .errors import JobFailed
from .launch import check_sharding, launch_of
from .startup import schedule_of
from .windows import plan_batches

LIBRARIES = ("torch", "transformers", "accelerate", "deepspeed")
# What must be the same on every rank, in the table's order; host, device and free memory may differ.
AGREED = ("interface", "rendezvous", *LIBRARIES, "cuda", "nccl")
ALL_REDUCE_MIB = 4
REPEATS = 5
SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


def version(library: str) -> str:
    try:
        return importlib.metadata.version(library)
    except importlib.metadata.PackageNotFoundError:
        return "-"


def interface(env: DistEnv) -> str:
    """The network interface this rank talks through: the one the back end is told to use
    (NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME), else the one whose address routes to MASTER_ADDR
    (the local address of a UDP socket connected there; no packet is sent). Its address where no
    IPv4 interface has it."""
    setting = os.environ.get(f"{env.backend.upper()}_SOCKET_IFNAME")  # checked by dist_env against the host's
    if setting:
        return setting
    family, _, _, _, where = socket.getaddrinfo(os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"],
                                                type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as udp:
        udp.connect(where)
        local = udp.getsockname()[0]
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(udp.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address (or an IPv6 socket)
                continue
            if socket.inet_ntoa(packed[20:24]) == local:
                return name
    return local


def free_memory(device: torch.device) -> int:
    """Bytes free on the GPU, or the host's available memory on CPU."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as meminfo:
        return next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemAvailable:"))


def facts(env: DistEnv) -> dict[str, str]:
    """This rank's row of the table."""
    cuda = env.device.type == "cuda"
    return {"rank": str(env.rank), "host": socket.gethostname(),
            "device": f"{env.device} {torch.cuda.get_device_name(env.device)}" if cuda else "cpu",
            "interface": interface(env), "rendezvous": f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
            **{library: version(library) for library in LIBRARIES}, "cuda": torch.version.cuda or "-",
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else "-",
            "free memory": f"{free_memory(env.device) / 2**30:.1f} GiB"}


def differences(rows: list[dict[str, str]]) -> str | None:
    """Each agreed fact that some rank has otherwise than rank 0: the first such rank, in one line."""
    said = []
    for key in AGREED:
        other = next((row for row in rows if row[key] != rows[0][key]), None)
        if other:
            has = f"no {key}" if other[key] == "-" else f"{key} {other[key]}"
            said.append(f"rank {other['rank']} (host {other['host']}) has {has}, rank 0 has "
                        f"{'none' if rows[0][key] == '-' else rows[0][key]}")
    return "; ".join(said) or None


def rank_sum(world_size: int) -> float:
    """What the all-reduce adds up to: rank + 1 over the ranks, n(n+1)/2 (exact in float32 below
    5,793 ranks)."""
    return world_size * (world_size + 1) / 2


def timed_all_reduce(env: DistEnv) -> tuple[float, float | None]:
    """All-reduce ALL_REDUCE_MIB of float32 in which every rank holds rank + 1: the median seconds
    of REPEATS after a warm-up, and the first wrong value this rank received (None: every value is
    rank_sum)."""
    numel = ALL_REDUCE_MIB * 2**20 // 4
    expected = rank_sum(env.world_size)
    seconds, wrong = [], None
    for _ in range(REPEATS + 1):
        tensor = torch.full((numel,), env.rank + 1.0, device=env.device)
        start = time.perf_counter()
        dist.all_reduce(tensor)
        if env.device.type == "cuda":
            torch.cuda.synchronize(env.device)
        seconds.append(time.perf_counter() - start)
        off = (tensor != expected).nonzero()
        if wrong is None and len(off):
            wrong = tensor[off[0, 0]].item()
    return statistics.median(seconds[1:]), wrong


def gloo_group_sum(env: DistEnv) -> float | None:
    """One all-reduce of rank + 1 on a new gloo group, as a background checkpoint writes through (under nccl
    too: it connects through GLOO_SOCKET_IFNAME's interface, not NCCL's); the wrong value received, or None."""
    group = dist.new_group(backend="gloo")
    tensor = torch.tensor([env.rank + 1.0])
    dist.all_reduce(tensor, group=group)
    dist.destroy_process_group(group)
    return None if tensor.item() == rank_sum(env.world_size) else tensor.item()


def wrong_sum(rows: list[dict[str, str]], results: list[tuple[float, float | None]]) -> str | None:
    """The first rank that received a wrong all-reduce result, in one line."""
    bad = next((rank for rank, (_, value) in enumerate(results) if value is not None), None)
    if bad is None:
        return None
    return (f"rank {bad} (host {rows[bad]['host']}) received {results[bad][1]:g} from the all-reduce, not "
            f"{rank_sum(len(rows)):g} (the sum of rank + 1 over {len(rows)} ranks): its link or device returns "
            "wrong data")


def gathered(value) -> list:
    """`value` from every rank, in rank order, on every rank."""
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def table(rows: list[dict[str, str]]) -> str:
    keys = list(rows[0])
    widths = [max(len(key), *(len(row[key]) for row in rows)) for key in keys]
    lines = [keys, *([row[key] for key in keys] for row in rows)]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
                     for line in lines)


def missing(err: JobFailed, env: DistEnv) -> str:
    """Which ranks a rendezvous that timed out lacked, as far as this rank can tell: rank 0 holds
    the rendezvous and counts who joined it; another rank sees whether rank 0 answered at all."""
    joined = re.search(r"(\d+)/\d+ clients joined", str(err))
    if joined and int(joined[1]) == 1:
        absent = "rank 1" if env.world_size == 2 else f"ranks 1-{env.world_size - 1}"
        return f"only rank 0 of {env.world_size} joined, {absent} {'is' if env.world_size == 2 else 'are'} missing"
    if joined:
        return f"{joined[1]} of {env.world_size} ranks joined, {env.world_size - int(joined[1])} missing"
    if "trying to connect" in str(err):
        return "rank 0, which holds the rendezvous, did not answer"
    return "not every rank joined"


def check_world_size(cfg: TrainConfig, env: DistEnv) -> None:
    """Training's own checks of this launch's world size (ConfigError): the batch plan (a global
    batch the processes cannot share; an automatic micro batch is measured by training) and FSDP's
    mesh. The doctor cannot tell the entry point: train_pytorch's, the one with FSDP."""
    if cfg.micro_batch_size != "auto":
        schedule_of(cfg, launch_of(cfg, "pytorch"))
        plan_batches(cfg.global_batch_size, cfg.micro_batch_size, env.world_size)
    check_sharding(cfg, env, "pytorch")


def doctor(cfg: TrainConfig) -> int | None:
    env = dist_env()
    check_world_size(cfg, env)  # before the ranks meet: each says it, as training would
    try:
        init_distributed(env, cfg.rendezvous_timeout_s, cfg.collective_timeout_s, alone_too=True)
    except JobFailed as err:
        raise JobFailed(f"{missing(err, env)}; {err}", exit_code=2) from None
    rows = gathered(facts(env))
    problem = differences(rows)
    if not problem:
        results = gathered(timed_all_reduce(env))
        problem = wrong_sum(rows, results) or wrong_sum(rows, [(0, value) for value in gathered(gloo_group_sum(env))])
    if problem:  # every rank knows it; rank 0 says it in one line (run_cli), and all exit with 2
        if env.is_main_process:
            raise JobFailed(problem, exit_code=2, agreed=True)
        return 2
    n, slowest = env.world_size, max(s for s, _ in results)  # the collective ends with its slowest rank
    # bus bandwidth (as nccl-tests reports it): each rank sends and receives 2 (n - 1) / n of the buffer
    bandwidth = 2 * (n - 1) / n * ALL_REDUCE_MIB * 2**20 / slowest / 1e9
    print0(table(rows))
    print0(f"all-reduce: {ALL_REDUCE_MIB} MiB float32 on {n} rank{'s' if n > 1 else ''}, the exact sum on every "
           f"rank, median of {REPEATS} {slowest * 1e3:.2f} ms (slowest rank), bus bandwidth {bandwidth:.2f} GB/s")
    print0("gloo group (background checkpoints): connected, the exact sum on every rank")


def main() -> None:
    run_cli(doctor)


if __name__ == "__main__":
    main()
