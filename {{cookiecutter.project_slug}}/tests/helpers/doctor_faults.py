"""Run the doctor with one process made to differ: the tests' stand-in for a node with other
software or a link that corrupts data (this machine has neither).

    python doctor_faults.py RANK FAULT [doctor flags...]

FAULT `LIBRARY=VERSION`: on process RANK, importlib.metadata reports that version of LIBRARY
(`-`: not installed). FAULT `all_reduce`: on process RANK, every all-reduce result is off by one.
Other processes run unchanged.
"""

import importlib.metadata
import os
import runpy
import sys

import torch.distributed as dist


def inject(rank: int, fault: str) -> None:
    if int(os.environ.get("RANK", "0")) != rank:
        return
    if fault == "all_reduce":
        all_reduce = dist.all_reduce

        def off_by_one(tensor, *args, **kwargs):
            work = all_reduce(tensor, *args, **kwargs)
            tensor += 1
            return work

        dist.all_reduce = off_by_one
        return
    library, reported = fault.split("=")
    version = importlib.metadata.version

    def other_version(name: str) -> str:
        if name != library:
            return version(name)
        if reported == "-":
            raise importlib.metadata.PackageNotFoundError(name)
        return reported

    importlib.metadata.version = other_version


if __name__ == "__main__":
    rank, fault, *flags = sys.argv[1:]
    inject(int(rank), fault)
    module = "{{ cookiecutter.project_slug }}.doctor"
    sys.argv = [module, *flags]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
