"""Sweeps (src/{{ cookiecutter.project_slug }}/sweep.py): the rows in file order (the grid's last key fastest),
each checked as a run checks its config, every refusal one line; sweep.sbatch runs the array task's
row; sweep_local.sh trains the rows one after another, each as the plain run with its flags would,
and a stopped row resumes while an edited sweep file is refused by the resume check. (The template's
own tests run sweep.sbatch as a job array on a real SLURM cluster.)"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_wandb import wandb_records

from {{ cookiecutter.project_slug }} import sweep

from conftest import DATA_CACHE, GPUS, MIXED_PRECISION, ROOT, TOL, error_lines, one_error_line, successful_run

SWEEP_SBATCH = ROOT / "scripts" / "slurm" / "sweep.sbatch"
ENTRY = "{{ 'pytorch' if cookiecutter.entry_points == 'all' else cookiecutter.entry_points }}"  # the scripts' default


def listing(capsys, path: Path, *flags: str) -> list[list[str]]:
    sweep.main([str(path), *flags])
    return [line.split("\t") for line in capsys.readouterr().out.splitlines()]


def refused(capsys, *argv: str) -> subprocess.CompletedProcess:
    """A sweep that cannot run, as a finished process: its exit code and what it said."""
    with pytest.raises(SystemExit) as stop:
        sweep.main(list(argv))
    said = capsys.readouterr()
    return subprocess.CompletedProcess(argv, stop.value.code, said.out, said.err)


def sweep_file(tmp_path: Path, text: str, name: str = "s.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_the_example_lists_every_learning_rate_and_warmup_in_order(capsys):
    rows = listing(capsys, ROOT / "configs" / "sweeps" / "lr.yaml")
    values = [(lr, warmup) for lr in ("0.0003", "0.001", "0.003") for warmup in ("0", "5")]  # last key fastest
    assert rows == [[str(i), f"runs/lr/learning_rate={lr},warmup_steps={warmup}",
                     f"--learning_rate {lr} --warmup_steps {warmup}"] for i, (lr, warmup) in enumerate(values)]


def test_rows_by_the_grid_are_numbered_row_first_and_the_grid_last_key_fastest(capsys, tmp_path):
    path = sweep_file(tmp_path, "rows:\n  - {seed: 7}\n  - {seed: 3, optimizer: sgd}\n"
                                "grid:\n  warmup_steps: [0, 2]\n  weight_decay: [0.0, 0.1]\n"
                                "output_root: out/sw\n")
    rows = listing(capsys, path, "--max_steps", "5")  # a flag for every row: checked, not listed
    combos = [(w, d) for w in ("0", "2") for d in ("0.0", "0.1")]
    expected = [(row, w, d) for row in ("seed=7", "seed=3,optimizer=sgd") for w, d in combos]
    assert [r[0] for r in rows] == [str(i) for i in range(8)]
    assert [r[1] for r in rows] == [f"out/sw/{row},warmup_steps={w},weight_decay={d}" for row, w, d in expected]
    assert rows[5][2] == "--seed 3 --optimizer sgd --warmup_steps 0 --weight_decay 0.1"


def test_the_row_of_an_array_task_is_one_argument_a_line(capsys, tmp_path):
    path = sweep_file(tmp_path, "configs: [configs/train.yaml, configs/experiments/long_context.yaml]\n"
                                "rows: [{learning_rate: 0.01}, {learning_rate: 0.02, report_to: none}]\n")
    sweep.main(["--row", "1", str(path)])
    assert capsys.readouterr().out.splitlines() == [
        f"runs/{path.stem}/learning_rate=0.02,report_to=none", "configs/train.yaml", "--config",
        "configs/experiments/long_context.yaml", "--learning_rate", "0.02", "--report_to", "none"]


REFUSED = {
    "neither": ("configs: [configs/train.yaml]\n", [], "{path} holds neither rows nor grid"),
    "grid_value_not_a_list": ("grid: {learning_rate: 0.1}\n", [],
                              "{path}: grid key learning_rate must be a list of the values to sweep, got 0.1"),
    "output_dir": ("rows: [{seed: 1}, {output_dir: x}]\n", [], "{path}: row 1, key output_dir: a sweep cannot set it"),
    "resume_from_checkpoint": ("grid: {resume_from_checkpoint: [auto]}\n", [],
                               "{path}: grid, key resume_from_checkpoint: a sweep cannot set it"),
    "config": ("rows: [{config: a.yaml}]\n", [], "{path}: row 0, key config: a sweep cannot set it"),
    "output_dir_flag": ("rows: [{seed: 1}]\n", ["--output_dir", "x"], "flag --output_dir: a sweep cannot set it"),
    "bad_value": ("rows: [{learning_rate: 0.1}, {seed: 2, learning_rate: -1}]\n", [],
                  "{path}: row 1, key learning_rate: learning_rate must be > 0, got -1.0"),
    "bad_type": ("grid: {max_steps: [5, many]}\n", [], "{path}: row 1, key max_steps: argument --max_steps: invalid "
                                                       "int value: 'many'"),
    "unknown_key": ("rows: [{learning_rat: 0.1}]\n", [], "unknown key(s) learning_rat in {path} row 0; known keys:"),
    "one_folder": ("rows: [{learning_rate: 0.1}, {seed: 1}, {learning_rate: '0.1'}]\n", [],
                   "{path}: rows 0 and 2 both train into runs/s/learning_rate=0.1; make their values differ"),
    "row_and_grid": ("rows: [{seed: 1}]\ngrid: {seed: [2]}\n", [], "{path}: key seed is in both a row and the grid"),
    "bad_flag": ("rows: [{seed: 1}]\n", ["--max_steps", "0"], "max_steps must be -1 (train num_epochs) or >= 1"),
}


@pytest.mark.parametrize("text,flags,expected", REFUSED.values(), ids=REFUSED)
def test_a_sweep_that_cannot_run_is_one_line(capsys, tmp_path, text, flags, expected):
    path = sweep_file(tmp_path, text)
    one_error_line(refused(capsys, str(path), *flags), f"error: {expected.format(path=path)}", alone=True)


def test_an_array_index_beyond_the_rows_or_none_is_one_line(capsys, tmp_path):
    path = sweep_file(tmp_path, "grid: {seed: [1, 2, 3]}\n")
    submit = f"submit with sbatch --array=0-2 scripts/slurm/sweep.sbatch {path}"
    one_error_line(refused(capsys, "--row", "3", str(path)), f"error: row 3 is beyond the 3 rows of {path} (0-2); "
                   f"{submit}", exact=True, alone=True)
    one_error_line(refused(capsys, "--row", "", str(path)), "error: no row index: a sweep runs as a job array, one "
                   f"task a row; {submit}", alone=True)


def sbatch_dry_run(env, *args: str, **variables) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SWEEP_SBATCH), *args], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**env, "DRY_RUN": "1", "SLURM_NNODES": "2", "NPROC_PER_NODE": "1",
                               "PYTHON": sys.executable, **variables})


@pytest.mark.skipif(not SWEEP_SBATCH.is_file(), reason="a project generated without the SLURM scripts")
def test_sweep_sbatch_runs_the_array_tasks_row_on_every_node(env):
    proc = sbatch_dry_run(env, "configs/sweeps/lr.yaml", "--max_steps", "3", SLURM_JOB_ID="100",
                          SLURM_ARRAY_JOB_ID="100", SLURM_ARRAY_TASK_ID="3")
    assert proc.returncode == 0, proc.stderr
    folder = "runs/lr/learning_rate=0.001,warmup_steps=5"
    assert proc.stdout.startswith(f"job 100_3 (restart 0): 2 nodes x 1 process, head node0:20100, output {folder}\n")
    nodes = [line for line in proc.stdout.splitlines() if line.startswith("node")]
    command = (r"--config configs/train.yaml --output_dir runs/lr/learning_rate=0.001\,warmup_steps=5 "
               "--resume_from_checkpoint auto --learning_rate 0.001 --warmup_steps 5 --max_steps 3")
    assert len(nodes) == 2 and all(f" --rdzv_id 100_3 -m {{ cookiecutter.project_slug }}.train_{ENTRY} " in line
                                   and line.endswith(command) for line in nodes), nodes
    torchrun = [line for line in (ROOT / "scripts" / "slurm" / "torchrun.sbatch").read_text().splitlines()
                if line.startswith("#SBATCH")]
    assert [line for line in SWEEP_SBATCH.read_text().splitlines() if line.startswith("#SBATCH")] == torchrun


@pytest.mark.skipif(not SWEEP_SBATCH.is_file(), reason="a project generated without the SLURM scripts")
@pytest.mark.parametrize("args,variables,expected", [
    ([], {"SLURM_ARRAY_TASK_ID": "0"}, "error: name the sweep file first: sbatch --array=0-<rows - 1> "
                                       "scripts/slurm/sweep.sbatch configs/sweeps/<name>.yaml"),
    (["configs/sweeps/lr.yaml"], {}, "error: no row index: a sweep runs as a job array, one task a row; submit "
                                     "with sbatch --array=0-5 scripts/slurm/sweep.sbatch configs/sweeps/lr.yaml"),
    (["configs/sweeps/lr.yaml"], {"SLURM_ARRAY_TASK_ID": "6", "SLURM_ARRAY_JOB_ID": "9"},
     "error: row 6 is beyond the 6 rows of configs/sweeps/lr.yaml (0-5)"),
    (["configs/sweeps/lr.yaml"], {"SLURM_ARRAY_TASK_ID": "0", "NPROC_PER_NODE": "0"},
     "error: NPROC_PER_NODE=0 is not a whole number")],
    ids=["no_file", "no_array", "beyond", "bad_variable"])
def test_sweep_sbatch_that_cannot_run_is_one_line(env, args, variables, expected):
    proc = sbatch_dry_run(env, *args, **variables)
    one_error_line(proc, expected, alone=True)


def sweep_local(env, path: Path, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(["scripts/sweep_local.sh", str(path), *flags], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env={**env, "PYTHON": sys.executable, "NPROC_PER_NODE": "2"})


TIMING = ("elapsed_s", "mfu")  # what a run measures of its machine


def assert_same_records(row: list[dict], plain: list[dict]) -> None:
    """Every record but its timing, bitwise on CPU; on GPUs (atomic adds) the steps, the losses within TOL."""
    row, plain = ([{k: v for k, v in r.items() if k not in TIMING} for r in records] for records in (row, plain))
    if not GPUS:
        assert row == plain
        return
    assert [r["step"] for r in row] == [r["step"] for r in plain]
    assert all(abs(a["loss"] - b["loss"]) <= TOL.loss for a, b in zip(row, plain, strict=True) if "loss" in a)


@pytest.mark.slow
@pytest.mark.timeout(900)  # five launches of the training processes, with the sweep file read before each
def test_sweep_local_trains_each_row_as_its_plain_run_and_resumes_a_stopped_row(env, tmp_path):
    """Two rows stopped after 2 of 4 steps, with a checkpoint; the sweep file then edited (an overlay
    config that changes warmup_steps, a key a resume must keep) is refused by the first row's resume
    check; the file as it was resumes both rows, each a W&B run named by its folder in the group named
    after the sweep file. Each row's metrics.jsonl then equals the plain run's with its flags (bitwise
    on CPU)."""
    if 0 < GPUS < 2:
        pytest.skip(f"2 processes need 2 GPUs; this machine has {GPUS}")
    flags = ["--mixed_precision", MIXED_PRECISION, "--max_seq_len", "48", "--micro_batch_size", "2",
             "--global_batch_size", "8", "--max_steps", "4", "--warmup_steps", "0", "--data_cache_dir", str(DATA_CACHE)]
    path = sweep_file(tmp_path, f"output_root: {tmp_path}/runs\ngrid:\n  learning_rate: [0.002, 0.02]\n", "lrs.yaml")
    wandb_dir = tmp_path / "wandb"
    env = {**env, "WANDB_DIR": str(wandb_dir)}
    stopped = sweep_local(env, path, *flags, "--stop_after_steps", "2", "--report_to", "none")
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    folders = [tmp_path / "runs" / f"learning_rate={lr}" for lr in ("0.002", "0.02")]
    assert [(f / "checkpoints" / "step_2").is_dir() and not (f / "final_model").exists() for f in folders] == [True] * 2

    overlay = sweep_file(tmp_path, "warmup_steps: 1\n", "overlay.yaml")
    edited = sweep_file(tmp_path, path.read_text() + f"configs: [configs/train.yaml, {overlay}]\n", "lrs.yaml")
    refused = sweep_local(env, edited, *flags[:-4], "--data_cache_dir", str(DATA_CACHE), "--report_to", "none")
    assert refused.returncode != 0
    assert any("was trained with warmup_steps 0, this run has warmup_steps 1" in line
               for line in error_lines(refused.stderr)), refused.stderr[-3000:]

    path.write_text(path.read_text().replace(f"configs: [configs/train.yaml, {overlay}]\n", ""))
    resumed = sweep_local(env, path, *flags, "--report_to", "wandb")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed.stdout.count("resuming after step 2") == 2, resumed.stdout[-3000:]
    for folder, lr in zip(folders, ("0.002", "0.02"), strict=True):
        plain = successful_run(ENTRY, 2, tmp_path / f"plain_{lr}", env,
                               {"micro_batch_size": 2, "global_batch_size": 8, "max_steps": 4, "learning_rate": lr})
        assert plain.returncode == 0, plain.stderr[-3000:]
        records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4]
        assert_same_records(records, plain.records)
    runs = [next(r.run for r in wandb_records(run_file) if r.WhichOneof("record_type") == "run")
            for run_file in sorted(wandb_dir.rglob("*.wandb"))]
    assert sorted((run.display_name, run.run_group) for run in runs) == [("learning_rate=0.002", "lrs"),
                                                                          ("learning_rate=0.02", "lrs")]
