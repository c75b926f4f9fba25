"""Run an entry point counting, per optimizer step, where the process waits on the device: reads of
a tensor's value on the host (`item`, `tolist`, `bool`/`int`/`float` of a tensor, copies to the
CPU), indexing a device tensor with a Python list (the list goes to the device in a copy that waits:
the site ends in LIST_INDEX), blocking copies between host and device (`.to()`, `.cuda()` or
`.copy_()` without non_blocking: BLOCKING_COPY) and blocking collectives, each by the place in the
code that called it. Without a GPU the tensors a DataLoader yields stand for host tensors and every
other tensor for a device tensor, as the reads count a CPU tensor's `item()`: a list index of a
non-host tensor and a blocking `.to(device)` of a host tensor are counted.

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
from torch.utils._pytree import tree_leaves
from torch.utils.data.dataloader import _BaseDataLoaderIter
from torch.utils.weak import WeakIdKeyDictionary

READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy")
LIST_INDEX, BLOCKING_COPY = " [list index]", " [blocking copy]"
COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "all_gather_object",
               "reduce_scatter_tensor", "reduce", "gather", "scatter", "barrier", "broadcast_object_list",
               "all_to_all_single")


def site(depth: int = 2) -> str:
    code = sys._getframe(depth).f_code
    path = Path(code.co_filename).as_posix()
    for root in ("/site-packages/", "/src/"):
        path = path.split(root, 1)[-1]
    return f"{path}:{code.co_name}"


HOST = WeakIdKeyDictionary()  # without a GPU: the tensors DataLoaders yielded (on a GPU run, in host memory)


def on_host(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cpu" and (torch.cuda.is_available() or tensor in HOST)


def has_list(index) -> bool:
    return isinstance(index, list) or isinstance(index, tuple) and any(isinstance(i, list) for i in index)


def count(reads: Counter, collectives: Counter, patch=setattr) -> None:
    """Count into `reads` and `collectives` from now on (`patch`: how each torch function is replaced)."""
    next_batch = _BaseDataLoaderIter.__next__

    def yielded(self):
        batch = next_batch(self)
        HOST.update((t, True) for t in tree_leaves(batch) if isinstance(t, torch.Tensor))
        return batch

    patch(_BaseDataLoaderIter, "__next__", yielded)
    for name in READS:
        method = getattr(torch.Tensor, name)

        def counted(self, *args, _method=method, **kwargs):
            reads[site()] += 1
            return _method(self, *args, **kwargs)

        patch(torch.Tensor, name, counted)
    for name in ("__getitem__", "__setitem__"):
        method = getattr(torch.Tensor, name)

        def indexed(self, index, *args, _method=method):
            if has_list(index) and not on_host(self):
                reads[site() + LIST_INDEX] += 1
            return _method(self, index, *args)

        patch(torch.Tensor, name, indexed)
    to, cuda, copy_ = torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.copy_

    def counted_to(self, *args, **kwargs):
        device, _, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)
        to_host = device is not None and device.type == "cpu" and torch.cuda.is_available()
        if not non_blocking and device is not None and on_host(self) != to_host:
            reads[site() + BLOCKING_COPY] += 1
        return to(self, *args, **kwargs)

    def counted_cuda(self, *args, non_blocking=False, **kwargs):
        if not non_blocking and self.device.type == "cpu":
            reads[site() + BLOCKING_COPY] += 1
        return cuda(self, *args, non_blocking=non_blocking, **kwargs)

    def counted_copy_(self, src, non_blocking=False):
        if not non_blocking and (self.device.type == "cpu") != (src.device.type == "cpu"):
            reads[site() + BLOCKING_COPY] += 1
        return copy_(self, src, non_blocking)

    patch(torch.Tensor, "to", counted_to)
    patch(torch.Tensor, "cuda", counted_cuda)
    patch(torch.Tensor, "copy_", counted_copy_)
    for name in COLLECTIVES:
        function = getattr(c10d, name)

        def collective(*args, _function=function, **kwargs):
            if not kwargs.get("async_op", False):
                collectives[site()] += 1
            return _function(*args, **kwargs)

        patch(dist, name, collective)
        patch(c10d, name, collective)


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
