"""Run an entry point in which one process all-reduces a tensor of another shape once: the tests'
stand-in for a bug that makes the ranks disagree on a collective (a hang without a timeout).

    python collective_mismatch.py RANK:STEP <module> [flags...]

On process RANK, the step's one all-reduce (Session.read_step) of the job's optimizer step STEP
sums one value more than on the other processes. Other processes and steps run unchanged.
"""

import os
import runpy
import sys

from {{ cookiecutter.project_slug }} import session


def inject(rank: int, step: int) -> None:
    if int(os.environ.get("RANK", "0")) != rank:
        return
    sum_and_read, calls = session.sum_and_read, [0]

    def one_more(summed: list, kept: list) -> list[float]:
        calls[0] += 1
        if calls[0] == step:
            return sum_and_read([*summed, 0.0], kept)
        return sum_and_read(summed, kept)

    session.sum_and_read = one_more


if __name__ == "__main__":
    spec, module, *flags = sys.argv[1:]
    inject(*map(int, spec.split(":")))
    sys.argv = [module, *flags]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
