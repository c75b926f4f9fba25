"""Weights & Biases from every entry point, read back from the offline run file: rank 0 only,
one row per optimizer step at W&B step = optimizer step, the same keys everywhere, the whole
config recorded, offline when no API key is set."""

import json
import shlex
import struct
from dataclasses import fields
from pathlib import Path

import pytest
from wandb.proto import wandb_internal_pb2

from {{ cookiecutter.project_slug }}.config import TrainConfig

from conftest import ENTRIES, TASK, free_port, run_entry, successful_run

TRAIN_KEYS = {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s", "train/grad_sync_calls",
              "train/global_batch_size", "train/micro_batch_size"}  # + train/grad_noise_scale once it exists
EVAL_KEYS = {"causal_lm": {"eval/loss", "eval/perplexity"},
             "sequence_classification": {"eval/loss", "eval/accuracy", "eval/f1"}}

pytestmark = pytest.mark.slow  # the fast tier (`make test`) leaves this module to `make test-all`


def wandb_records(path: Path) -> list:
    """The protobuf records of a .wandb file (W&B's LevelDB-style log: a 7-byte file header, then
    32 KiB blocks of chunks, each with a 7-byte header: crc32, length, type full/first/middle/last)."""
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, pending, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # full, or last chunk of a record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def history(records) -> dict[int, dict]:
    rows: dict[int, dict] = {}
    for record in records:
        if record.WhichOneof("record_type") == "history":
            items = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in record.history.item}
            rows.setdefault(record.history.step.num, {}).update(items)
    return rows


@pytest.mark.parametrize("entry", ENTRIES)
def test_offline_wandb_run(entry, env, tmp_path):
    wandb_dir = tmp_path / "wandb dir"  # a space: the printed `wandb sync` command must quote it
    wandb_dir.mkdir()
    # No WANDB_MODE and no API key anywhere (HOME has no .netrc): the run goes offline by itself.
    env = {k: v for k, v in env.items() if k not in ("WANDB_MODE", "WANDB_API_KEY")}
    env.update(WANDB_DIR=str(wandb_dir), HOME=str(tmp_path))
    flags = {"report_to": "wandb", "micro_batch_size": 2, "global_batch_size": 16, "max_steps": 3}
    run = successful_run(entry, 2, tmp_path / "out", env, flags)
    assert run.returncode == 0, run.stderr[-3000:]
    (run_file,) = wandb_dir.rglob("*.wandb")  # one run: rank 0 only
    assert run_file.parent.name.startswith("offline-run-")
    (sync,) = [line.partition("upload it with: ")[2] for line in run.stdout.splitlines() if "wandb sync" in line]
    assert shlex.split(sync) == ["wandb", "sync", str(run_file.parent)]
    records = wandb_records(run_file)

    (run_record,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run_record.display_name == "1x2-acc4-mb2"
    # the config arrives with the run (wandb.init) or in config records (Accelerate's tracker)
    updates = [*run_record.config.update,
               *(i for r in records if r.WhichOneof("record_type") == "config" for i in r.config.update)]
    config = {i.key: json.loads(i.value_json) for i in updates}
    assert {f.name for f in fields(TrainConfig)} <= set(config)
    assert (config["world_size"], config["grad_accum_steps"], config["global_batch_size"]) == (2, 4, 16)
    assert "slurm_job_id" in config

    rows = history(records)
    steps = {step: row for step, row in rows.items() if "train/loss" in row}
    assert sorted(steps) == [1, 2, 3]  # the W&B step is the optimizer step, one row each
    for step, row in steps.items():
        assert TRAIN_KEYS <= set(row), (entry, step, sorted(row))
        logged = run.steps[step - 1]
        noise = {"train/grad_noise_scale"} if "grad_noise_scale" in logged else set()
        assert {k for k in row if k.startswith("train/")} == TRAIN_KEYS | noise
        assert row.get("train/grad_noise_scale") == logged.get("grad_noise_scale")
        assert (row["train/loss"], row["train/lr"], row["train/grad_sync_calls"]) == (
            logged["loss"], logged["lr"], logged["grad_sync_calls"])
    evals = {step: row for step, row in rows.items() if "eval/loss" in row}
    assert sorted(evals) == [3]
    assert {k for k in evals[3] if k.startswith("eval/")} == EVAL_KEYS[TASK]


def test_a_resumed_offline_run_names_every_folder_to_sync(env, tmp_path):
    """A resume writes a second offline folder with the same run id: the printed command syncs both."""
    wandb_dir = tmp_path / "wandb_runs"
    wandb_dir.mkdir()
    env = {k: v for k, v in env.items() if k not in ("WANDB_MODE", "WANDB_API_KEY")}
    env.update(WANDB_DIR=str(wandb_dir), HOME=str(tmp_path))
    flags = {"report_to": "wandb", "micro_batch_size": 2, "global_batch_size": 16, "max_steps": 3}
    first = run_entry(ENTRIES[0], 1, tmp_path / "out", env, {**flags, "stop_after_steps": 2})
    assert first.returncode == 0, first.stderr[-3000:]
    second = run_entry(ENTRIES[0], 1, tmp_path / "out", env, {**flags, "resume_from_checkpoint": "auto"})
    assert second.returncode == 0, second.stderr[-3000:]
    folders = sorted(f.parent for f in wandb_dir.rglob("*.wandb"))
    assert len(folders) == 2 and len({f.name.rpartition("-")[2] for f in folders}) == 1  # one run id
    (sync,) = [line.partition("upload it with: ")[2] for line in second.stdout.splitlines() if "wandb sync" in line]
    assert shlex.split(sync) == ["wandb", "sync", *map(str, folders)]


def test_a_wandb_server_out_of_reach_means_an_offline_record_not_a_stopped_run(env, tmp_path):
    """A key but no way to W&B's server (here a closed port on this machine): one line, and the run
    trains to its end with its W&B record offline, ready for `wandb sync`."""
    env = {**env, "WANDB_MODE": "online", "WANDB_API_KEY": "local-" + "0" * 34, "WANDB_INIT_TIMEOUT": "3",
           "WANDB_BASE_URL": f"http://127.0.0.1:{free_port()}", "HOME": str(tmp_path)}
    run = run_entry(ENTRIES[0], 1, tmp_path / "out", env, {"report_to": "wandb", "micro_batch_size": 2,
                                                            "global_batch_size": 16, "max_steps": 2})
    assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr[-3000:]
    notes = [line for line in run.stdout.splitlines() if line.startswith("note: W&B cannot reach its server (")]
    assert len(notes) == 1 and notes[0].endswith("); this run logs offline instead"), run.stdout[-3000:]
    assert [r["step"] for r in run.steps] == [1, 2]
    assert len(list(Path(env["WANDB_DIR"]).rglob("offline-run-*/*.wandb"))) == 1
    assert any(line.startswith("W&B run saved offline in ") for line in run.stdout.splitlines())
