"""Run an entry point counting, per optimizer step, where the process waits on the device: reads of
a tensor's value on the host (`item`, `tolist`, `bool`/`int`/`float` of a tensor, copies to the
CPU) and blocking collectives, each by the place in the code that called it.

    python sync_counting.py OUT <module> [flags...]

Each process writes OUT.rank<r>.json after every optimizer step: a list, one entry per step, of
{"reads": {site: n}, "collectives": {site: n}}, a site being `path/to/file.py:function`. A step's
counts run from the previous step's record to its own (so they hold the step's stop decision and
the next window's loading). Asynchronous collectives (DDP's bucket all-reduces) are not counted.
"""

import importlib
import json
import os
import runpy
import sys
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy")
COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "all_gather_object",
               "reduce_scatter_tensor", "reduce", "gather", "scatter", "barrier", "broadcast_object_list",
               "all_to_all_single")


def site(depth: int = 2) -> str:
    code = sys._getframe(depth).f_code
    path = Path(code.co_filename).as_posix()
    for root in ("/site-packages/", "/src/"):
        path = path.split(root, 1)[-1]
    return f"{path}:{code.co_name}"


def count(reads: Counter, collectives: Counter) -> None:
    for name in READS:
        method = getattr(torch.Tensor, name)

        def counted(self, *args, _method=method, **kwargs):
            reads[site()] += 1
            return _method(self, *args, **kwargs)

        setattr(torch.Tensor, name, counted)
    for name in COLLECTIVES:
        function = getattr(c10d, name)

        def collective(*args, _function=function, **kwargs):
            if not kwargs.get("async_op", False):
                collectives[site()] += 1
            return _function(*args, **kwargs)

        setattr(dist, name, collective)
        setattr(c10d, name, collective)


def record_steps(out: str, package: str, reads: Counter, collectives: Counter) -> None:
    session = importlib.import_module(f"{package}.session").Session
    log_step, steps = session.log_step, []
    path = Path(f"{out}.rank{os.environ.get('RANK', '0')}.json")

    def counted_log_step(self, *args, **kwargs):
        steps.append({"reads": dict(reads), "collectives": dict(collectives)})
        reads.clear()
        collectives.clear()
        path.write_text(json.dumps(steps))
        return log_step(self, *args, **kwargs)

    session.log_step = counted_log_step


if __name__ == "__main__":
    out, module, *flags = sys.argv[1:]
    reads, collectives = Counter(), Counter()
    record_steps(out, module.split(".")[0], reads, collectives)
    count(reads, collectives)
    sys.argv = [module, *flags]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
