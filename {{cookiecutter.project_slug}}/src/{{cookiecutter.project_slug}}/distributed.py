"""Process-group set-up shared by the entry points, and `print0`.

The rank, world size and device come from the launcher's environment (torchrun, accelerate
launch, srun via the sbatch scripts) *before* any process group exists, so configuration errors
are reported by every process before any process waits on another.
"""

import gc
import os
import signal
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


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


def dist_env() -> DistEnv:
    """Read this process's place in the job from the environment (1 process when unset)."""
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    return DistEnv(rank, local_rank, world_size, local_world_size, device)


def init_distributed(env: DistEnv) -> None:
    """Join the process group: nccl on GPUs, gloo on CPU. A single process joins nothing.

    Every entry point joins here, before Accelerate or the Trainer would (they use the group they
    find). The keys of this rendezvous are prefixed with torchrun's restart count: a job that
    torchrun restarts (--max_restarts) after a crash may get the crashed attempt's store, whose
    stale process addresses would otherwise be read back (measured: gloo then fails to connect).
    """
    if env.device.type == "cuda":
        torch.cuda.set_device(env.device)
    if env.world_size > 1 and not dist.is_initialized():
        timeout = timedelta(seconds=int(os.environ.get("DIST_TIMEOUT_S", 1800)))
        backend = "nccl" if env.device.type == "cuda" else "gloo"
        store, _, _ = next(dist.rendezvous("env://", env.rank, env.world_size, timeout=timeout))
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        dist.init_process_group(backend=backend, store=dist.PrefixStore(f"attempt_{attempt}/", store),
                                rank=env.rank, world_size=env.world_size, timeout=timeout)


def cleanup() -> None:
    """Destroy the process group once nothing uses it any more.

    DDP's reducer holds the group; a reducer still alive in a reference cycle (a Trainer and its
    callbacks) would be freed after the group and abort in gloo's destructor, hence the collect.
    """
    if dist.is_initialized():
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


class PreemptionSignal:
    """SIGUSR1 asks the job to stop at the next optimizer-step boundary with a checkpoint.

    The SLURM scripts ask SLURM for it before the time limit (`#SBATCH --signal=B:USR1@...`) and
    pass it on to every training process; the launchers in between (torchrun, accelerate launch)
    ignore it. The processes may get it on either side of a step boundary, so they agree at each
    boundary: one tiny all-reduce, and every rank stops after the same step.
    """

    def __init__(self) -> None:
        self.received = False
        signal.signal(signal.SIGUSR1, self._handle)

    def _handle(self, signum, frame) -> None:
        self.received = True

    def agreed(self, device: torch.device) -> bool:
        """True on every rank when any rank has received the signal."""
        return all_reduce_sum(torch.tensor(float(self.received), device=device)).item() > 0


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum a tensor over all processes in place (no-op for one process) and return it."""
    if dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_reduce_min(tensor: torch.Tensor) -> torch.Tensor:
    """The smallest value over all processes, in place (no-op for one process)."""
    if dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    return tensor


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def print0(*args, **kwargs) -> None:
    """print() on the main process only."""
    if int(os.environ.get("RANK", 0)) == 0:
        print(*args, **kwargs, flush=True)


class GradSyncCounter:
    """Counts DDP's gradient all-reduce calls (one per bucket per synchronised backward pass) and
    the bytes they send (each bucket's flat gradient buffer).

    Installed as a DDP communication hook that wraps the default all-reduce, so it counts what
    DDP really sends; `take()` returns the calls since its last call and resets them, and
    `take_bytes()` does the same for the bytes (the communication benchmark reads both).
    """

    def __init__(self, ddp_model) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        self.calls = 0
        self.bytes = 0
        self._allreduce = default_hooks.allreduce_hook

        def hook(state, bucket):
            buffer = bucket.buffer()
            self.calls += 1
            self.bytes += buffer.numel() * buffer.element_size()
            return self._allreduce(state, bucket)

        ddp_model.register_comm_hook(None, hook)

    def take(self) -> int:
        calls, self.calls = self.calls, 0
        return calls

    def take_bytes(self) -> int:
        sent, self.bytes = self.bytes, 0
        return sent
