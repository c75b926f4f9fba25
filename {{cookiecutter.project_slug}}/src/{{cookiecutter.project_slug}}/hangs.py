"""What each process was doing when a collective failed, for a job that would otherwise hang.

A collective that times out (collective_timeout_s), loses a peer, or that the ranks disagree on
(debug_distributed: TORCH_DISTRIBUTED_DEBUG=DETAIL compares each collective's shapes first) ends
the job. Each rank then writes output_dir/debug/rank_<r>.json, posts what it was in to the
rendezvous store, reads what the others posted, and says in its one line (cli.run_cli) who did
not arrive or who disagreed. docs/launching.md, "When a job hangs", shows the files and lines.
The doctor's extra plugs these into the core (cli.py, session.py: extras.plug).
"""

import json
import os
import re
import socket
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from .distributed import FLIGHT_RECORDER_ENTRIES
from .errors import ConfigError
from .extras import key

MAX_WAIT_S = 10.0  # for the other ranks' word, after this rank's collective failed
_step = [0]  # the optimizer step in progress on this rank (Session.windows); 0 before the first


@dataclass
class Keys:
    """The doctor extra's key."""

    debug_distributed: bool = key(
        "Run with TORCH_DISTRIBUTED_DEBUG=DETAIL: every collective first checks that all ranks call it with "
        "the same shapes, so a mismatch fails at once with a description instead of hanging (slower: a "
        "check per collective). Either way a failed collective leaves output_dir/debug/rank_<r>.json.", False,
        resume="free", data=False)


def check(cfg) -> None:
    """debug_distributed where torch cannot run it: DDP on gloo (several processes, no GPU or
    DIST_BACKEND=gloo), whose constructor crashes the process under DETAIL (torch 2.13)."""
    several = os.environ.get("WORLD_SIZE", "1").strip() not in ("", "0", "1")
    gloo = os.environ.get("DIST_BACKEND") == "gloo" or not (os.environ.get("DIST_BACKEND") or torch.cuda.is_available())
    if cfg.debug_distributed and several and gloo and getattr(cfg, "fsdp", "none") == "none":
        raise ConfigError(f"debug_distributed with DDP on gloo (no GPU here, or DIST_BACKEND=gloo): torch "
                          f"{torch.__version__}'s DDP crashes under TORCH_DISTRIBUTED_DEBUG=DETAIL on gloo; drop "
                          "--debug_distributed, or use it on GPUs (nccl)")


def watch(cfg) -> None:
    """Before the process group exists: keep a Flight Recorder buffer (unless TORCH_FR_BUFFER_SIZE
    says otherwise), and with `debug_distributed` check every collective's shapes across ranks."""
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", FLIGHT_RECORDER_ENTRIES)
    if cfg.debug_distributed:
        os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
        dist.set_debug_level_from_env()  # torch read the variable when it was imported


def at_step(step: int) -> None:
    _step[0] = step


def disagreement(err: BaseException) -> str | None:
    """What TORCH_DISTRIBUTED_DEBUG=DETAIL found the ranks to differ in; None for other errors."""
    text = str(err)
    if "Detected mismatch between collectives" not in text:
        return None
    found = re.search(r"Collectives differ in the following aspects:\s*(.+)", text)
    return re.sub(r"\s+", " ", found[1]).strip() if found else "their collectives differ"


def _collective(err: BaseException, trace: dict) -> dict:
    """The collective this rank was in: the torch.distributed call in the error's stack (its
    tensor's shape and dtype), else the Flight Recorder's latest entry (DDP's bucket all-reduce)."""
    tb, call = err.__traceback__, None
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_filename.endswith("distributed_c10d.py") and not frame.f_code.co_name.startswith("_"):
            call = frame
        tb = tb.tb_next
    if call is not None and call.f_code.co_name != "wrapper":
        tensor = next((v for v in call.f_locals.values() if isinstance(v, torch.Tensor)), None)
        return {"name": call.f_code.co_name, "shape": list(tensor.shape) if tensor is not None else None,
                "dtype": str(tensor.dtype).removeprefix("torch.") if tensor is not None else None}
    entries = trace.get("entries") or []
    if entries:
        last = max(entries, key=lambda e: e.get("record_id", 0))
        return {"name": last["profiling_name"].split(":")[-1], "shape": (last.get("input_sizes") or [None])[0],
                "dtype": (last.get("input_dtypes") or [None])[0]}
    return {"name": "a collective", "shape": None, "dtype": None}


def _flight_recorder() -> dict:
    """The Flight Recorder's buffer as JSON (nccl's own on GPUs), or why there is none."""
    c10d = torch._C._distributed_c10d
    nccl = dist.get_backend() == "nccl"
    dump = getattr(c10d, "_dump_nccl_trace_json" if nccl else "_dump_fr_trace_json", None)
    if dump is None:
        return {"unavailable": "this torch build has no Flight Recorder dump for this back end"}
    try:
        return json.loads(dump())
    except Exception as err:  # a dump is evidence, not a requirement
        return {"unavailable": f"{type(err).__name__}: {err}"}


def describe(c: dict) -> str:
    """`all_reduce of float64[4]`, as far as it is known."""
    shape = "x".join(map(str, c["shape"])) if c.get("shape") is not None else ""
    return c["name"] + (f" of {c['dtype']}[{shape}]" if c.get("dtype") else "")


def _exchange(report: dict, rank: int, world_size: int, wait_s: float) -> dict[int, dict]:
    """Post this rank's report to the rendezvous store and read the others' (those that answer
    within `wait_s`: a rank that is gone or stuck elsewhere posts nothing)."""
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set_timeout(timedelta(seconds=max(wait_s, 1.0)))
        store.set(f"debug/rank_{rank}", json.dumps(report))
    except Exception:  # the store itself is gone (its host died): nobody can be asked
        return {}
    keys = {q: f"debug/rank_{q}" for q in range(world_size) if q != rank}
    deadline, others = time.monotonic() + wait_s, {}
    while keys and time.monotonic() < deadline:
        for q, name in list(keys.items()):
            try:
                if store.check([name]):
                    others[q] = json.loads(store.get(name))
                    del keys[q]
            except Exception:
                return others
        time.sleep(0.2)
    return others


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def explain(err: BaseException, cfg) -> str:
    """Write this rank's debug file and return what its one line adds (": rank 1 was in ..."): what
    this rank was in, at which step, and what each other rank said (or that it said nothing)."""
    output_dir, collective_timeout_s = cfg.output_dir, cfg.collective_timeout_s
    rank, world_size = dist.get_rank(), dist.get_world_size()
    trace = _flight_recorder()
    mine = _collective(err, trace)
    report = {"rank": rank, "step": _step[0], "collective": mine}
    others = _exchange(report, rank, world_size, min(MAX_WAIT_S, collective_timeout_s))
    path = Path(output_dir) / "debug" / f"rank_{rank}.json"
    record = {**report, "host": socket.gethostname(), "pid": os.getpid(), "error": str(err),
              "debug_level": dist.get_debug_level().name,
              "others": {str(q): others.get(q, "no word") for q in range(world_size) if q != rank},
              "stack": traceback.format_exception(err), "flight_recorder": trace}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=1, default=str) + "\n")
        where = f"what each rank was doing: {path.parent / 'rank_<r>.json'}"
    except OSError as write_err:
        where = f"no debug file ({write_err.strerror})"
    step = f" (step {_step[0]})" if _step[0] else ""
    text = f"rank {rank} was in {describe(mine)}{step}"
    silent = [q for q in range(world_size) if q != rank and q not in others]
    differ = {q: r for q, r in others.items() if (r["collective"], r["step"]) != (mine, _step[0])}
    if differ:
        text += "; " + ", ".join(f"rank {q} in {describe(r['collective'])}" + (f" (step {r['step']})" if r["step"]
                                 else "") for q, r in sorted(differ.items()))
    if silent:
        text += f"; {_ranks(silent)} did not arrive (no word within {min(MAX_WAIT_S, collective_timeout_s):g} s)"
    elif not differ:
        text += "; so was every other rank"
    return f": {text}; {where}"

