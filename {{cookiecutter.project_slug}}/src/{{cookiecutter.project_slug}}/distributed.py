"""The process group, its collectives (sum_and_read: a step's values in one all-reduce), `print0`, the preemption
signals (PreemptionSignal) and DDP's gradient-sync counter (GradSyncCounter). Rank, world size and device come from
the launcher's environment, checked before any group exists (a wrong launch is a ConfigError).
"""

import gc
import inspect
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

from .errors import ConfigError, JobFailed, first_line
from .extras import plug

# torch 2.13 renamed DDP's broadcast_buffers to forward_sync_buffers; Accelerate and the Trainer pass
# the old name (same effect): startup.start() leaves its deprecation warning out.
NO_BUFFER_SYNC = ({"forward_sync_buffers": False} if "forward_sync_buffers" in inspect.signature(DDP).parameters
                  else {"broadcast_buffers": False})
FLIGHT_RECORDER_ENTRIES = "2000"  # torch's Flight Recorder: the latest collectives of each process


@dataclass(frozen=True)
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device

    @property
    def is_main_process(self) -> bool:
        return self.rank == 0

    @property
    def num_nodes(self) -> int:
        return max(1, self.world_size // self.local_world_size)

    @property
    def backend(self) -> str:  # DIST_BACKEND overrides: nccl refuses two ranks on one GPU, gloo (slower) does not
        return os.environ.get("DIST_BACKEND") or ("nccl" if self.device.type == "cuda" else "gloo")


def _env_int(name: str, default: int | None = None) -> int:
    if not (value := os.environ.get(name)):
        if default is None:
            raise ConfigError(f"{name} is not set, but WORLD_SIZE is {os.environ['WORLD_SIZE']}: start the "
                              "processes with torchrun (or accelerate launch, srun), which sets it for each one")
        return default
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not a whole number; unset it, or start the processes with "
                          "torchrun, which sets it") from None


def dist_env() -> DistEnv:
    """This process's place in the job, from the launcher's environment (1 process when unset),
    checked up front: numbers, ranges, the rendezvous address and the network interface."""
    world_size = _env_int("WORLD_SIZE", 1)
    if world_size < 1:
        raise ConfigError(f"WORLD_SIZE={world_size} must be >= 1")
    several = world_size > 1
    rank = _env_int("RANK", None if several else 0)
    local_world_size = _env_int("LOCAL_WORLD_SIZE", world_size)
    local_rank = _env_int("LOCAL_RANK", None if several else 0)
    if not 0 <= rank < world_size:
        raise ConfigError(f"RANK={rank} is outside 0..{world_size - 1} (WORLD_SIZE={world_size})")
    if not 1 <= local_world_size <= world_size or not 0 <= local_rank < local_world_size:
        raise ConfigError(f"LOCAL_RANK={local_rank} and LOCAL_WORLD_SIZE={local_world_size} do not fit "
                          f"WORLD_SIZE={world_size}: LOCAL_RANK must be in 0..LOCAL_WORLD_SIZE-1 <= WORLD_SIZE-1")
    if several:
        if not os.environ.get("MASTER_ADDR"):
            raise ConfigError("MASTER_ADDR is not set: the processes cannot find each other (torchrun sets it)")
        port = _env_int("MASTER_PORT", None)
        if not 0 < port < 65536:
            raise ConfigError(f"MASTER_PORT={port} is not a port (1..65535)")
    device = torch.device("cpu")
    if torch.cuda.is_available():
        gpus = torch.cuda.device_count()
        if local_rank >= gpus and not os.environ.get("DIST_BACKEND"):
            raise ConfigError(f"LOCAL_RANK={local_rank} but this node has {gpus} GPU(s): start at most one "
                              "process per GPU (--nproc_per_node), or share them with DIST_BACKEND=gloo")
        device = torch.device("cuda", local_rank % gpus)
    env = DistEnv(rank, local_rank, world_size, local_world_size, device)
    # GLOO_SOCKET_IFNAME: names, each used (under nccl too: checkpoints' gloo group); NCCL's: prefixes (=: names), any
    for backend in dict.fromkeys((env.backend, "gloo")):
        value = os.environ.get(name := f"{backend.upper()}_SOCKET_IFNAME", "") if several else ""
        have, whole = [interface for _, interface in socket.if_nameindex()], backend == "gloo" or value[:1] == "="
        lacks = [w for w in value.lstrip("=").split(",") if not any(h == w if whole else h.startswith(w) for h in have)]
        if value[:1] not in ("", "^") and (lacks if backend == "gloo" else len(lacks) > value.count(",")):
            raise ConfigError(f"{name}={value} names {', '.join(map(repr, lacks))}, which host {socket.gethostname()} "
                              f"lacks; it has {', '.join(have)}: name one of them, or unset {name}")
    return env


def keep_flight_recorder(env: DistEnv, output_dir: str) -> None:
    """Under nccl, a collective that times out or fails makes torch dump each process's Flight Recorder (its
    latest collectives) to output_dir/debug/flight_recorder/rank_<r>, which `python -m
    torch.distributed.flight_recorder.fr_trace <folder>` reads; variables already set win."""
    if env.backend == "nccl":
        (folder := Path(output_dir).resolve() / "debug" / "flight_recorder").mkdir(parents=True, exist_ok=True)
        for name, value in (("TORCH_FR_BUFFER_SIZE", FLIGHT_RECORDER_ENTRIES), ("TORCH_NCCL_DUMP_ON_TIMEOUT", "1"),
                            ("TORCH_FR_DUMP_TEMP_FILE", str(folder / "rank_"))):
            os.environ.setdefault(name, value)


def init_distributed(env: DistEnv, rendezvous_timeout_s: float, collective_timeout_s: float,
                     alone_too: bool = False) -> None:
    """Join the process group (nccl on GPUs, gloo on CPU, or DIST_BACKEND) before Accelerate or the
    Trainer would; one process joins only with `alone_too` (DeepSpeed needs a group). Both waits are
    bounded; keys carry torchrun's restart count (a restart may find the crashed attempt's store)."""
    if env.device.type == "cuda":
        torch.cuda.set_device(env.device)
    if (env.world_size == 1 and not alone_too) or dist.is_initialized():
        return
    if env.world_size == 1:  # started without a launcher: a group of one on a free local port
        for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1"),
                            ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(free_port()))):
            os.environ.setdefault(name, value)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    waited = ("rendezvous_timeout_s", rendezvous_timeout_s)
    try:
        if env.rank and not listening(rendezvous_timeout_s):  # else torch's own retries print C++ stack dumps
            raise dist.DistNetworkError(f"nothing listened at {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}")
        store, _, _ = next(dist.rendezvous("env://", env.rank, env.world_size,
                                           timeout=timedelta(seconds=rendezvous_timeout_s)))
        waited = ("collective_timeout_s", collective_timeout_s)  # torchrun's store is up at once: the group waits
        # nccl bound to this rank's GPU at once (device_id): no guessing the device at the first collective
        dist.init_process_group(backend=env.backend, store=dist.PrefixStore(f"attempt_{attempt}/", store),
                                rank=env.rank, world_size=env.world_size,
                                timeout=timedelta(seconds=collective_timeout_s),
                                device_id=env.device if env.backend == "nccl" else None)
    except dist.DistError as err:
        raise JobFailed(f"rank {env.rank} waited {waited[1]:g} s for the {env.world_size} processes of this job at "
                        f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']} ({first_line(err)}); start all of "
                        f"them (torchrun --nproc_per_node, one agent per node), or raise --{waited[0]}") from None


def listening(timeout_s: float) -> bool:
    """Whether the rendezvous address (rank 0's store, or torchrun's) takes a connection within `timeout_s`."""
    if not {"MASTER_ADDR", "MASTER_PORT"} <= os.environ.keys():
        return True  # torch's rendezvous names what is missing
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])), timeout=1).close()
            return True
        except OSError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cleanup() -> None:
    """Destroy the process group; collect first, as a DDP reducer in a reference cycle (a Trainer's
    callbacks) freed after the group aborts in gloo's destructor."""
    if dist.is_initialized():
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


def lost_contact(err: BaseException) -> bool:
    """Whether `err` says another process of the job is gone or not answering (gloo, nccl)."""
    return dist.is_initialized() and (isinstance(err, dist.DistError) or any(
        sign in str(err) for sign in ("Timed out waiting", "Connection closed by peer", "Connection reset by peer",
                                  "NCCL communicator was aborted", "Watchdog caught collective operation timeout")))


class PreemptionSignal:
    """SIGUSR1 (SLURM's warning before the time limit) or SIGTERM (an eviction, a preemption) asks the job to
    stop at the next optimizer-step boundary with a checkpoint; the ranks agree on it in the step's one all-reduce
    (Session.read_step). SIGTERM exits 143 so that a Job restarts it, SIGUSR1 0. docs/launching.md tells the story."""

    def __init__(self) -> None:
        self.received, self.terminated = False, False  # SIGUSR1 or SIGTERM; SIGTERM
        for signum in (signal.SIGUSR1, signal.SIGTERM):
            signal.signal(signum, self._handle)

    def _handle(self, signum, frame) -> None:
        self.received = True
        self.terminated |= signum == signal.SIGTERM

    def exit_code(self) -> int:
        return 128 + signal.SIGTERM if self.terminated else 0


def ranks_with(flag: bool, device: torch.device) -> int:
    """On every rank: how many ranks have `flag` set (one tiny all-reduce; 0 or 1 for one process)."""
    return int(all_reduce_sum(torch.tensor(float(flag), device=device)).item())


def full_norm(norm: torch.Tensor) -> torch.Tensor:
    """A gradient norm as a plain tensor (under FSDP2 a sharded DTensor, whose full tensor is the whole norm)."""
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def sum_and_read(summed: list, kept: list) -> list[float]:
    """The values of `summed` summed over the ranks, then those of `kept` (this rank's), as floats:
    one all-reduce and one device read. A number goes to the device as a fill (a host copy waits)."""
    device = next((v.device for v in summed + kept if isinstance(v, torch.Tensor)), torch.device("cpu"))

    def scalar(value) -> torch.Tensor:
        if isinstance(value, torch.Tensor):
            return full_norm(value).to(device, torch.float64).reshape(())
        return torch.full((), float(value), dtype=torch.float64, device=device)

    return torch.cat([all_reduce_sum(torch.stack([scalar(v) for v in summed])),
                      torch.stack([scalar(v) for v in kept])]).tolist()


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def print0(text: str) -> None:
    """A line on the main process's stdout (through tqdm, which keeps a live progress bar below it)."""
    if os.environ.get("RANK", "0") in ("0", ""):
        tqdm.write(text, file=sys.stdout)
        sys.stdout.flush()


def wrap_ddp(model: torch.nn.Module, env: DistEnv, bucket_cap_mb: float, find_unused_parameters: bool = False) -> DDP:
    """`model` in DDP without a buffer broadcast in every forward (a collective per micro-step for rotary inv_freq)."""
    return DDP(model, device_ids=[env.device.index] if env.device.type == "cuda" else None,
               bucket_cap_mb=bucket_cap_mb, find_unused_parameters=find_unused_parameters, **NO_BUFFER_SYNC)


def sync_counter_for(model) -> "GradSyncCounter | None":
    """A GradSyncCounter on a prepared model's DDP module (under torch.compile too; with the
    batch_schedule extra, one that also reads the noise scale's squared norms); None without DDP."""
    counter = plug("batch_schedule", "noise:NoisyGradSyncCounter", default=GradSyncCounter)
    ddp = getattr(model, "_orig_mod", model)
    return counter(ddp) if isinstance(ddp, DDP) else None


class GradSyncCounter:
    """A DDP communication hook around the default all-reduce (DDP takes one): counts the all-reduce calls DDP
    really makes (`take()` returns and resets). Unless DDP looks for unused parameters, a synchronising backward
    that leaves a trainable parameter without a gradient is refused at its end (ConfigError), before any optimizer
    step: DDP would never reduce that parameter's bucket, and the step would apply gradients that differ by rank."""

    def __init__(self, ddp_model) -> None:
        self.calls = 0
        ddp_model.register_comm_hook(None, self.hook)
        if not ddp_model.find_unused_parameters:
            self._refuse_unused(ddp_model)

    @staticmethod
    def _refuse_unused(ddp_model) -> None:
        names = {param: name for name, param in ddp_model.module.named_parameters() if param.requires_grad}
        got: set = set()

        def at_backward_end():
            missing = [name for param, name in names.items() if param not in got]
            got.clear()
            if missing and ddp_model.require_backward_grad_sync:
                raise ConfigError(
                    f"{', '.join(missing[:3])}{f' and {len(missing) - 3} more' if len(missing) > 3 else ''} got "
                    "no gradient in a micro-step where DDP synchronises, so DDP would leave it unsynchronised; "
                    "set ddp_find_unused_parameters: true, or freeze the parameters the forward does not use")

        def got_grad(param):
            if not got:  # the backward's first gradient: check once it has ended
                torch.autograd.Variable._execution_engine.queue_callback(at_backward_end)
            got.add(param)

        for param in names:
            param.register_post_accumulate_grad_hook(got_grad)

    def hook(self, state, bucket):
        self.calls += 1
        return allreduce_hook(state, bucket)

    def take(self) -> int:
        calls, self.calls = self.calls, 0
        return calls

    def record(self) -> dict:
        return {"grad_sync_calls": self.take()}
