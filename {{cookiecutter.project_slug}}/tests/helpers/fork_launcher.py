"""A launcher for the suite's many short runs: one server process imports the entry points once,
and each run forks its processes from it, with the variables torchrun gives its workers. A run so
started executes the same code as under torchrun (one process per rank, gloo, the entry point run
as `__main__`, a normal interpreter exit) without each process's seconds of imports. What the
imports print is printed again by every process. Tests of launching itself use the real launchers.

The server reads one request per line on stdin (JSON: module, argv, env, cwd, nproc, stdout and
stderr paths) and answers each with the run's exit code on the file descriptor it is given.
"""

import json
import os
import runpy
import select
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path


def torchrun_variables(rank: int, nproc: int) -> dict[str, str]:
    """What torchrun (one node, a static rendezvous) sets for the worker of `rank`."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
            "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc), "ROLE_WORLD_SIZE": str(nproc),
            "GROUP_WORLD_SIZE": "1", "ROLE_NAME": "default", "TORCHELASTIC_RUN_ID": "none",
            "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0"}


def worker(request: dict, rank: int, preamble: str) -> None:
    """In a forked process: become the entry point's process of `rank`, exit the way it exits."""
    if request["nproc"] > 1:
        os.environ.update(torchrun_variables(rank, request["nproc"]))
    sys.stderr.write(preamble)
    sys.argv = [request["module"], *request["argv"]]
    sys.modules.pop(request["module"])  # its dependencies stay imported; itself runs anew as __main__
    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    raise SystemExit(0)


def job(request: dict, preamble: str) -> None:
    """In a forked process: start the run's processes; like torchrun, stop the others when one
    fails, and exit with the first failure's code."""
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    ranks = {}
    for rank in range(request["nproc"]):
        pid = os.fork()
        if pid == 0:
            worker(request, rank, preamble)
        ranks[pid] = rank
    code = 0
    while ranks:
        pid, status = os.wait()
        ranks.pop(pid)
        if os.waitstatus_to_exitcode(status) != 0 and code == 0:
            code = os.waitstatus_to_exitcode(status)
            for other in ranks:
                os.kill(other, signal.SIGTERM)
    if code < 0:  # ended by a signal: so does the job, as the one process `python -m` starts would
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)


def serve(modules: list[str], answers: int) -> None:
    sys.path[0] = os.getcwd()  # as `python -m` has it
    with tempfile.TemporaryFile("w+") as captured:
        saved = os.dup(2)
        os.dup2(captured.fileno(), 2)
        for module in modules:
            __import__(module)
        sys.stderr.flush()
        os.dup2(saved, 2)
        captured.seek(0)
        preamble = captured.read()
    # forking is safe only from a process with one thread: import no module that starts one
    assert threading.active_count() == 1, threading.enumerate()
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            job(request, preamble)
        _, status = os.waitpid(pid, 0)
        os.write(answers, f"{os.waitstatus_to_exitcode(status)}\n".encode())


class ForkLauncher:
    """The client: starts the server on first use, runs one request at a time."""

    def __init__(self, modules: list[str], env: dict, cwd: Path):
        self.modules, self.env, self.cwd = modules, env, cwd
        self.server = None

    def start(self) -> None:
        read, write = os.pipe()
        self.server = subprocess.Popen([sys.executable, __file__, str(write), *self.modules], cwd=self.cwd,
                                       env=self.env, stdin=subprocess.PIPE, text=True, pass_fds=(write,),
                                       start_new_session=True)
        os.close(write)
        self.answers = os.fdopen(read)

    def close(self) -> None:
        if self.server is not None and self.server.poll() is None:
            self.server.stdin.close()  # the server ends with its input
            self.server.wait(timeout=60)
            self.answers.close()

    def run(self, module: str, argv: list[str], nproc: int, env: dict, logs: Path,
            timeout: float) -> subprocess.CompletedProcess:
        """`python -m module *argv` on `nproc` processes, its output in `logs`.stdout and .stderr."""
        if self.server is None or self.server.poll() is not None:
            self.start()
        stdout, stderr = logs.with_suffix(".stdout"), logs.with_suffix(".stderr")
        request = {"module": module, "argv": argv, "env": env, "cwd": str(self.cwd), "nproc": nproc,
                   "stdout": str(stdout), "stderr": str(stderr)}
        self.server.stdin.write(json.dumps(request) + "\n")
        self.server.stdin.flush()
        ready, _, _ = select.select([self.answers], [], [], timeout)
        if not ready:
            os.killpg(self.server.pid, signal.SIGKILL)  # the server, the run and its processes
            raise subprocess.TimeoutExpired([module, *argv], timeout)
        code = int(self.answers.readline())
        return subprocess.CompletedProcess([module, *argv], code, stdout.read_text(), stderr.read_text())


if __name__ == "__main__":
    serve(sys.argv[2:], int(sys.argv[1]))
