"""Run an entry point with out-of-memory errors injected, as a GPU would raise them: the tests'
stand-in for a device that fills up (this machine has none).

    python oom_injection.py RANK:ROWS:CALLS:LATER <module> [flags...]

On process RANK, a training forward pass (gradients on) of more than ROWS examples raises
torch.OutOfMemoryError; after CALLS such forward passes the bound drops to LATER (memory that
fragmentation or a longer batch took later in the run). Other processes run unchanged.
"""

import os
import runpy
import sys

import torch
from transformers.models.llama import modeling_llama


def inject(rank: int, rows: int, calls: int, later: int) -> None:
    if int(os.environ.get("RANK", "0")) != rank:
        return
    forward, seen = modeling_llama.LlamaModel.forward, [0]

    def bounded(self, input_ids=None, *args, **kwargs):
        if torch.is_grad_enabled() and input_ids is not None:
            bound = rows if seen[0] < calls else later
            seen[0] += 1
            if input_ids.shape[0] > bound:
                raise torch.OutOfMemoryError(f"injected: CUDA out of memory ({input_ids.shape[0]} rows > {bound})")
        return forward(self, input_ids, *args, **kwargs)

    modeling_llama.LlamaModel.forward = bounded


if __name__ == "__main__":
    spec, module, *flags = sys.argv[1:]
    inject(*map(int, spec.split(":")))
    sys.argv = [module, *flags]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
