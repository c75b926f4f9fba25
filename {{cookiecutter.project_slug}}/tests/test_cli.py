"""Mistakes a user can make at launch: exit code 2 and one line on stderr from each process,
no traceback, before any process waits on another. Under torchrun the launcher reports the failed
workers with its own code (1) and each worker's line appears in its output; the project's own
launch (scripts/train_local.sh, through the torchrun module) ends with 2 and their line alone."""

import os
import signal
import subprocess
import sys
import time

import pytest

from {{ cookiecutter.project_slug }}.cli import run_cli
from {{ cookiecutter.project_slug }}.errors import Interrupted, RunFinished, interruptible

from conftest import ENTRIES, GPUS, ROOT, SLUG, error_lines, free_port, one_error_line, run_entry


def bad_inputs(tmp_path):
    file_in_the_way = tmp_path / "a_file"
    file_in_the_way.write_text("x")
    return [
        (["--max_stepz", "3"], "unknown flag(s) ['--max_stepz', '3']"),
        (["--learning_rate", "fast"], "argument --learning_rate: invalid float value: 'fast'"),
        (["--output_dir", str(file_in_the_way)], "is a file; choose a folder"),
        (["--config", "nope.yaml"], "config file nope.yaml not found"),
        (["--resume_from_checkpoint", str(tmp_path / "nothing")], "is not a complete checkpoint"),
        (["--dataset", str(tmp_path / "missing")], "is not a folder of train/validation files"),
        (["--model_name_or_path", "no-such-org/no-such-model"], "cannot load model 'no-such-org/no-such-model'"),
        (["--global_batch_size", "10", "--micro_batch_size", "4"],
         "global_batch_size 10 is not divisible by micro_batch_size 4 x world_size 1 = 4"),
        (["--attn_implementation", "flash_attention_2", "--mixed_precision", "bf16"],  # a GPU, then the package
         "attn_implementation flash_attention_2" + (" needs a CUDA GPU" if not GPUS else ": FlashAttention2 has been")),
    ]


@pytest.mark.parametrize("entry", ENTRIES)
def test_a_bad_input_exits_2_with_one_line(entry, env, tmp_path):
    args, message = bad_inputs(tmp_path)[ENTRIES.index(entry) % len(bad_inputs(tmp_path))]
    one_error_line(run_entry(entry, 1, tmp_path / "out", env, {"max_steps": 2}, args), message)


@pytest.mark.slow
def test_bad_inputs_found_at_each_stage_of_the_start_exit_2_with_one_line(env, tmp_path):
    """Every entry point runs the same start-up checks (startup.start), whose messages the
    in-process tests check one by one (test_config, test_inputs, test_continue): here one mistake
    found at each stage of the start-up (flags, output folder, resume, data, model) on the command
    line, each exit code 2 and one line."""
    for args, message in bad_inputs(tmp_path)[::2]:
        one_error_line(run_entry(ENTRIES[0], 1, tmp_path / "out", env, {"max_steps": 2}, args), message)


@pytest.mark.slow
@pytest.mark.parametrize("entry", [e for e in ENTRIES if e != "pytorch"])
def test_deepspeed_that_is_not_installed_is_one_line(entry, env, tmp_path):
    script = tmp_path / "without_deepspeed.py"
    script.write_text("import runpy, sys\n"
                      "sys.modules['deepspeed'] = None  # an import of it fails, as where it is not installed\n"
                      f"runpy.run_module('{SLUG}.train_' + sys.argv.pop(1), run_name='__main__')\n")
    path = tmp_path / "ds.json"
    path.write_text("{}")
    run = run_entry(entry, 1, tmp_path / "out", env, {"max_steps": 2, "deepspeed": path}, script=(script, entry))
    one_error_line(run, f"error: DeepSpeed config {path}: DeepSpeed is not installed; pip install -e '.[deepspeed]'",
                   exact=True)
    assert not (tmp_path / "out").exists()  # before the output folder and the data


@pytest.mark.slow
@pytest.mark.parametrize("entry", ENTRIES)
def test_workers_report_their_error_under_torchrun(entry, env, tmp_path):
    run = run_entry(entry, 2, tmp_path / "out", env, {"max_steps": 2, "global_batch_size": 16, "micro_batch_size": 3})
    expected = ("error: global_batch_size 16 is not divisible by micro_batch_size 3 x world_size 2 = 6; "
                "use a multiple of 6 or another micro_batch_size")
    one_error_line(run, expected, code=1, workers=2, exact=True)  # 1: torchrun's own code for failed workers
    assert "exitcode  : 2" in run.stdout + run.stderr


@pytest.mark.slow
def test_a_configuration_error_under_train_local_is_exit_2_and_the_workers_line_alone(env, tmp_path):
    proc = subprocess.run(["scripts/train_local.sh", "--global_batch_size", "16", "--micro_batch_size", "3",
                           "--report_to", "none", "--output_dir", str(tmp_path / "out")], cwd=ROOT, capture_output=True,
                          text=True, timeout=180, env={**env, "NPROC_PER_NODE": "2", "PYTHON": sys.executable})
    one_error_line(proc, "error: global_batch_size 16 is not divisible by micro_batch_size 3 x world_size 2", workers=2,
                   alone=True)


# A worker per rank: None sleeps (torchrun stops it once another failed); "killed" takes no SIGTERM and
# is killed (as torchrun does after its 30 s shutdown timeout; here by itself, after 1 s); a number is
# its exit code, after its line (SIGTERM ignored: torchrun, seeing the other fail first, cannot cut it short).
WORKER = """import os, signal, sys, time
code = CODES[int(os.environ["RANK"])]
if code is None:
    time.sleep(60)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
if code == "killed":
    time.sleep(1)
    os.kill(os.getpid(), signal.SIGKILL)
sys.stderr.write(f"error: rank {os.environ['RANK']} exits {code}\\n")  # one write: the lines do not mix
sys.exit(code)
"""


@pytest.mark.parametrize("codes,expected", [((2, 2), 2), ((None, 2), 2), ((2, "killed"), 2), ((1, None), 1)],
                         ids=["both_2", "one_2_one_stopped", "one_2_one_killed", "a_crash"])
def test_the_torchrun_module_ends_with_2_and_no_report_where_every_failed_worker_said_its_line(env, tmp_path, codes,
                                                                                             expected):
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER.replace("CODES", repr(codes)))
    proc = subprocess.run([sys.executable, "-m", f"{SLUG}.torchrun", "--nproc_per_node", "2", "--master_addr",
                           "127.0.0.1", "--master_port", str(free_port()), str(worker)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == expected, proc.stderr[-3000:]
    said = sorted(error_lines(proc.stderr))
    assert said == [f"error: rank {rank} exits {c}" for rank, c in enumerate(codes) if isinstance(c, int)], said
    if expected == 2:
        assert sorted(proc.stderr.strip().splitlines()) == said, proc.stderr[-3000:]
    else:  # a crash keeps torchrun's report
        assert "exitcode  : 1" in proc.stderr and "Traceback" in proc.stderr, proc.stderr[-3000:]


@pytest.mark.parametrize("rank", ["0", "1"])
def test_already_done_is_said_once_by_the_job(monkeypatch, capsys, rank):
    """Every rank finds the run finished and exits 0; only rank 0 says so."""
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setattr(sys, "argv", ["train", "--config", str(ROOT / "configs" / "train.yaml")])

    def finished(cfg):
        raise RunFinished("already done at step 4: runs/x/final_model (nothing changed)")

    with pytest.raises(SystemExit) as ended:
        run_cli(finished)
    said = capsys.readouterr()
    assert ended.value.code == 0 and said.err == ""
    assert said.out == ("already done at step 4: runs/x/final_model (nothing changed)\n" if rank == "0" else "")


def test_a_signal_in_an_interruptible_block_comes_out_as_interrupted_whatever_a_library_makes_of_it():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Interrupted) as caught, interruptible("while testing"):
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        finally:
            raise TimeoutError("a pool's clean-up that failed on the way out")
    assert caught.value.signum == signal.SIGTERM and str(caught.value) == "stopped by SIGTERM while testing"
    assert signal.getsignal(signal.SIGTERM) is before


def test_an_error_line_is_written_in_one_call(monkeypatch):
    """Unbuffered (PYTHONUNBUFFERED, as under the launchers) each write is a system call: a line in two
    writes could be split by another process's line on the same terminal."""
    from {{ cookiecutter.project_slug }} import cli

    writes = []
    monkeypatch.setattr(sys, "stderr", type("Stream", (), {"write": lambda self, text: writes.append(text),
                                                           "flush": lambda self: None})())
    cli.say("global_batch_size 7 is not divisible")
    assert writes == ["error: global_batch_size 7 is not divisible\n"]
