"""One job per run folder: `output_dir/.lock` names the job that writes there (host, pid, job identity, start time,
heartbeat). A second job is refused with one line naming the holder; the same job restarted (a SLURM requeue, a torchrun
restart) takes over at once, and so does any job once the holder is gone (same host: its pid; another host: a heartbeat
older than a minute). A job of several nodes checks that they all see the folder.
"""

import atexit
import contextlib
import json
import os
import secrets
import socket
import threading
import time
from datetime import datetime
from pathlib import Path

import torch

from .distributed import DistEnv, all_reduce_sum, print0, ranks_with
from .errors import ConfigError, JobFailed, disk_full

LOCK_FILE = ".lock"
HEARTBEAT_S, STALE_S = 15.0, 60.0
HELD: list["OutputLock"] = []  # the locks this process holds, released at its exit (release_held)


def job_identity() -> str:
    """What stays the same when this job restarts and differs between jobs (SLURM job and step,
    torchrun's run id or rendezvous address); "" for a process started alone."""
    if os.environ.get("SLURM_JOB_ID"):
        cluster = f" on {os.environ['SLURM_CLUSTER_NAME']}" if os.environ.get("SLURM_CLUSTER_NAME") else ""
        return f"slurm job {os.environ['SLURM_JOB_ID']} step {os.environ.get('SLURM_STEP_ID', 'batch')}{cluster}"
    if os.environ.get("TORCHELASTIC_RUN_ID", "none") != "none":
        return f"torchrun run {os.environ['TORCHELASTIC_RUN_ID']}"
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a loopback address is every host's: the host tells the jobs apart
        addr = os.environ.get("MASTER_ADDR", "")
        host = f" on {socket.gethostname()}" if addr in ("", "localhost", "::1") or addr.startswith("127.") else ""
        return f"torchrun at {addr}:{os.environ.get('MASTER_PORT')}{host}"
    return ""


def process_started(pid: int) -> str:
    """When process `pid` started (ticks since boot; "" where unknown): a reused pid is not the holder."""
    with contextlib.suppress(OSError, IndexError):
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[19]
    return ""


def running_here(holder: dict) -> bool | None:
    """Whether the process a lock file names still runs; None on another host (only a heartbeat tells)."""
    if holder.get("host") != socket.gethostname():
        return None
    try:
        os.kill(int(holder["pid"]), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return not holder.get("started") or process_started(int(holder["pid"])) in ("", holder["started"])


def read_holder(path: Path) -> dict:
    """Who a lock file names ({} where nobody does, or the file is unreadable)."""
    with contextlib.suppress(OSError, ValueError):
        holder = json.loads(path.read_text())
        return holder if isinstance(holder, dict) else {}
    return {}


def is_mine(holder: dict | None) -> bool:
    return (holder or {}).get("host") == socket.gethostname() and (holder or {}).get("pid") == os.getpid()


def describe(holder: dict) -> str:
    since = datetime.fromtimestamp(float(holder.get("since", 0))).strftime("%Y-%m-%d %H:%M:%S")
    job = f", {holder['job']}" if holder.get("job") else ""
    beat = max(0, round(time.time() - float(holder.get("heartbeat", 0))))
    return f"host {holder.get('host')}, pid {holder.get('pid')}{job}, since {since} (heartbeat {beat} s ago)"


class OutputLock:
    """The lock of one run folder, held by this job's rank 0 (every rank checks it first)."""

    def __init__(self, output_dir: str):
        self.path = Path(output_dir) / LOCK_FILE
        self.mine = {"host": socket.gethostname(), "pid": os.getpid(), "job": job_identity(), "since": time.time(),
                     "started": process_started(os.getpid())}
        self.held, self.stop, self.writing = False, threading.Event(), threading.Lock()
        self.beat_at, self.lost = time.monotonic(), None  # the last beat; the job that took the folder over

    def holder(self) -> dict | None:
        """Who holds the folder now; None where nobody does (or the lock file is unreadable)."""
        return read_holder(self.path) or None

    def check(self) -> dict | None:
        """ConfigError where another running job holds the folder; else the gone holder to take over, or None."""
        return self._judge(self.holder())

    def _judge(self, holder: dict | None) -> dict | None:
        if holder is None or is_mine(holder) or self.mine["job"] and holder.get("job") == self.mine["job"]:
            return None
        here = running_here(holder)  # still running? On this host its pid says, elsewhere its heartbeat
        if here or here is None and time.time() - float(holder.get("heartbeat", 0)) <= STALE_S:
            raise ConfigError(f"output_dir {self.path.parent} is in use by another job ({describe(holder)}); wait "
                              "for it to end, or choose another --output_dir")
        return holder

    def take(self, env: DistEnv) -> None:
        """Every rank checks; rank 0 writes the lock and beats until the process ends (or `release`)."""
        holder = self.holder()
        gone = self._judge(holder)
        if not env.is_main_process:
            return
        try:
            self._write(exclusive=holder is None)
        except FileExistsError:  # another job wrote its lock since the check: it holds the folder now
            gone = self.check()
            self._write()
        except OSError as err:  # the run's first write: a full disk (quota, file size limit) is one line
            raise ConfigError(f"output_dir {self.path.parent}: cannot write {LOCK_FILE} ({err.strerror or err}); "
                              + ("free space there" if disk_full(err) else "choose a folder to write to")) from None
        if gone is not None:
            print0(f"note: output_dir {self.path.parent} was held by a job that is gone ({describe(gone)}); "
                   "taking it over")
        self.held = True
        threading.Thread(target=self._beat, daemon=True).start()
        HELD.append(self)

    def _write(self, exclusive: bool = False) -> None:
        """The lock file written whole; `exclusive`: only where there is none (FileExistsError)."""
        tmp = self.path.with_name(f"{LOCK_FILE}.{os.getpid()}")
        try:
            tmp.write_text(json.dumps({**self.mine, "heartbeat": time.time()}))
            (os.link if exclusive else os.replace)(tmp, self.path)
        finally:
            tmp.unlink(missing_ok=True)

    def _taken_over(self) -> dict | None:
        holder = self.holder()
        return None if holder is None or is_mine(holder) else holder

    def _beat(self) -> None:
        while not self.stop.wait(HEARTBEAT_S):
            with self.writing, contextlib.suppress(OSError):
                if (lost := self._taken_over()) is not None:
                    self.lost = lost
                    return
                if not self.stop.is_set():
                    self._write()
                    self.beat_at = time.monotonic()

    def check_held(self) -> None:
        """JobFailed where another job took the folder over while this one was paused (as a suspended
        SLURM job is) past the stale time: read again only when the last beat is older than two beats."""
        if self.lost is None and time.monotonic() - self.beat_at > 2 * HEARTBEAT_S:
            self.lost = self._taken_over()
        if self.lost is not None:
            self.held = False  # the lock is the other job's now
            raise JobFailed(f"output_dir {self.path.parent} was taken over by another job ({describe(self.lost)}) "
                            "while this one was paused; this job stops and leaves the folder to it")

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        with self.writing:
            self.stop.set()
            if is_mine(self.holder()):
                self.path.unlink(missing_ok=True)


def check_shared(output_dir: str, env: DistEnv, wait_s: float = 10.0) -> None:
    """A job of several nodes writes one run folder from all of them: rank 0 puts a file there that every rank must see
    within `wait_s` (listing the folder, which a network file system revalidates); else ConfigError on all ranks."""
    if env.num_nodes < 2:
        return
    token = torch.tensor(secrets.randbits(62) if env.is_main_process else 0, device=env.device)
    if env.is_main_process:
        (Path(output_dir) / f".shared_{int(token)}").touch()
    mark = Path(output_dir) / f".shared_{int(all_reduce_sum(token).item())}"  # every rank gets here after the touch
    deadline = time.monotonic() + wait_s
    while mark.name not in os.listdir(output_dir) and time.monotonic() < deadline:
        time.sleep(0.5)
    unseen = ranks_with(mark.name not in os.listdir(output_dir), env.device)
    if env.is_main_process:
        mark.unlink(missing_ok=True)
    if unseen:
        raise ConfigError(f"output_dir {output_dir} is not shared between the nodes of this job: {unseen} of "
                          f"{env.world_size} processes do not see rank 0's files in it; use a folder on a file "
                          "system every node mounts")


def check_held() -> None:
    """Before this process writes a record or a checkpoint: JobFailed where its folder was taken over."""
    for lock in HELD:
        lock.check_held()


@atexit.register
def release_held() -> None:
    """Remove every lock this process holds: at exit, and before an os._exit (which runs no atexit)."""
    while HELD:
        HELD.pop().release()
