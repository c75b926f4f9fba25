"""What a later job trusts: a finished run stays final (running the same command again, or a SLURM
requeue loop, changes no file), and a resume continues only a checkpoint that loads, of the same
training, from the same entry point."""

import json
import os
import shutil
from dataclasses import fields

import pytest
import torch

from {{ cookiecutter.project_slug }}.checkpoint import check_same_data, check_same_training, verify_checkpoint
from {{ cookiecutter.project_slug }}.config import ConfigError, TrainConfig, keys_where, load_config

from conftest import ACCUM, ENTRIES, ROOT, SLUG, TASK, Run, flag_args, one_error_line, run_entry, snapshot

CONFIG = str(ROOT / "configs" / "train.yaml")
# One process, 2 checkpoints: a run stopped after step 4 of 6 (checkpoints at steps 2 and 4).
STOPPED = {"micro_batch_size": 4, "global_batch_size": 16, "max_steps": 6, "save_steps": 2, "stop_after_steps": 4,
           "save_total_limit": 0}


def flags_of(values: dict) -> list[str]:
    return [arg for key, value in values.items() for arg in (f"--{key}", str(value))]


@pytest.mark.slow
@pytest.mark.parametrize("entry", ENTRIES)
def test_a_finished_run_is_final(env, entry, tmp_path):
    """A job that wrote its last checkpoint (step 4 of 4) but not its final model: the requeued job
    writes final_model from that checkpoint without another step (the Trainer used to train a 5th).
    Then the run is final: the same command again is refused; with --resume_from_checkpoint auto
    (what every sbatch script passes on each requeue) it is "already done", not one file changes;
    a changed training key is refused, naming it."""
    out, flags = tmp_path / "run", {**STOPPED, "max_steps": 4, "stop_after_steps": 0}
    first = run_entry(entry, 1, out, env, flags)
    assert first.returncode == 0, first.stderr[-3000:]
    model = (out / "final_model" / "model.safetensors").read_bytes()
    shutil.rmtree(out / "final_model")
    requeued = run_entry(entry, 1, out, env, {**flags, "resume_from_checkpoint": "auto"})
    assert requeued.returncode == 0, requeued.stderr[-3000:]
    assert (out / "final_model" / "model.safetensors").read_bytes() == model
    assert [r["step"] for r in Run(0, "", "", out).steps] == [1, 2, 3, 4]

    before = snapshot(out)
    one_error_line(run_entry(entry, 1, out, env, flags),
                   f"output_dir {out} holds a finished run ({out / 'final_model'}, step 4); to train it further "
                   f"start a new run from it (--model_name_or_path {out / 'final_model'} --output_dir NEW_DIR)")
    again = run_entry(entry, 1, out, env, {**flags, "resume_from_checkpoint": "auto", "eval_every": 3})
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.strip().splitlines()[-1] == f"already done at step 4: {out / 'final_model'} (nothing changed)"
    cases = [("seed", 7, "was trained with seed 42, this run has seed 7"),
             ("max_steps", 9, "was trained with max_steps 4, this run has max_steps 9")]
    for key, value, expected in cases if entry == ENTRIES[0] else cases[:1]:
        changed = run_entry(entry, 1, out, env, {**flags, "resume_from_checkpoint": "auto", key: value})
        one_error_line(changed, f"{out / 'final_model'} {expected}")
    assert snapshot(out) == before


@pytest.mark.slow
def test_a_finished_model_trains_further_in_a_new_run(runs, env, tmp_path):
    """What the refusal advises: a new run from final_model/ into a new folder starts from the
    trained weights (its first loss is the trained model's, well below a fresh model's)."""
    finished = runs(ENTRIES[0], 2, **ACCUM)
    further = run_entry(ENTRIES[0], 1, tmp_path / "further", env,
                        {**ACCUM, "max_steps": 2, "model_name_or_path": finished.output_dir / "final_model"})
    assert further.returncode == 0, further.stderr[-3000:]
    assert further.steps[0]["loss"] < finished.steps[0]["loss"] - 0.1


# an experiment overlay of keys a resume may change, given after configs/train.yaml
OVERLAY = "eval_every: 3\nlog_every: 1\n"


@pytest.fixture(scope="module")
def stopped(tmp_path_factory, runs):
    """A run of the first entry point stopped after step 4 of 6, with checkpoints at steps 2 and 4,
    its config merged from configs/train.yaml and OVERLAY."""
    out = tmp_path_factory.mktemp("stopped") / "run"
    (out.parent / "overlay.yaml").write_text(OVERLAY)
    proc = run_entry(ENTRIES[0], 1, out, runs.env, STOPPED, overlaid(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def overlaid(stopped) -> list[str]:
    return ["--config", CONFIG, "--config", str(stopped.parent / "overlay.yaml")]


def test_the_checkpoint_records_the_merged_config(stopped):
    state = verify_checkpoint(stopped / "checkpoints" / "step_4")
    merged = load_config([*overlaid(stopped), *flag_args(), *flags_of(STOPPED), "--output_dir", str(stopped)])
    assert (merged.eval_every, merged.log_every) == (3, 1)
    assert state["config"] == {**merged.to_dict(), "attn_implementation": "sdpa"}  # auto, as the tiny Llama resolves it


def test_a_resume_compares_against_the_merged_config(stopped, tmp_path):
    """Another overlay on resume is checked like a flag: one that changes a training key is refused."""
    checkpoint = stopped / "checkpoints" / "step_4"
    other = tmp_path / "seed.yaml"
    other.write_text("seed: 7\n")
    cfg = load_config([*overlaid(stopped), "--config", str(other), *flag_args(),
                       *flags_of({**STOPPED, "output_dir": stopped, "resume_from_checkpoint": "auto"})])
    with pytest.raises(ConfigError, match=f"^{checkpoint} was trained with seed 42, this run has seed 7"):
        check_same_training(verify_checkpoint(checkpoint), cfg, checkpoint)


BAKED_KEYS = {f.name for f in fields(TrainConfig)}  # the core's keys and the baked extras'
CHANGED = {"global_batch_size": 32, "seed": 7, "task": "sequence_classification", "model_name_or_path": "gpt2",
           "max_seq_len": 32, "optimizer": "sgd", "learning_rate": 0.01, "min_lr_ratio": 0.1,
           "lr_scheduler_type": "cosine", "warmup_steps": 1, "weight_decay": 0.5, "max_grad_norm": 0.5,
           "mixed_precision": "fp16", "packing": "true", "global_batch_size_schedule": "0:16,2:32",
           "lr_batch_scaling": "sqrt", "model_factory": "helpers.factory_models:gru", "lora_r": 4, "lora_alpha": 8,
           "lora_dropout": 0.1, "lora_target_modules": "q_proj"}
MAY_CHANGE = {"micro_batch_size": 2, "eval_every": 1, "save_steps": 3, "save_total_limit": 1, "stop_after_steps": 1,
              "report_to": "wandb", "wandb_project": "other", "ddp_bucket_cap_mb": 1, "memory_budget_mb": 5,
              "collective_timeout_s": 60, "gradient_checkpointing": "true"}
CHANGED, MAY_CHANGE = ({k: v for k, v in keys.items() if k in BAKED_KEYS} for keys in (CHANGED, MAY_CHANGE))


def config_with(stopped, **changes):
    """The config of a run resuming `stopped` with `changes`, as its command line gives it."""
    return load_config(["--config", CONFIG, *flag_args({**STOPPED, "output_dir": stopped,
                                                        "resume_from_checkpoint": "auto", **changes})])


def test_every_training_key_is_checked():
    assert set(CHANGED) | {"dataset"} == set(keys_where(resume="match"))  # dataset: by its content (check_same_data)


def test_the_dataset_is_compared_by_its_content_not_its_path(stopped, tmp_path):
    """The same examples staged to another folder continue; other examples of the same number, or
    another number of examples, are refused naming dataset; a checkpoint written before content
    fingerprints compares the path."""
    checkpoint = stopped / "checkpoints" / "step_4"
    state = verify_checkpoint(checkpoint)
    staged = config_with(stopped, dataset=str(tmp_path / "staged"))
    check_same_training(state, staged, checkpoint)
    check_same_data(state, staged, state["data_fingerprint"], state["num_train_examples"], checkpoint)
    with pytest.raises(ConfigError) as err:
        check_same_data(state, staged, "0" * 64, state["num_train_examples"], checkpoint)
    assert str(err.value) == (f"{checkpoint} was trained on other data than dataset {tmp_path / 'staged'} holds now "
                              f"(data_fingerprint {state['data_fingerprint']}, now {'0' * 64}): a run continues only "
                              "on the same training examples (the files may move) and labelling rule "
                              "(data.labels_for); restore them, or start a new run in another --output_dir")
    with pytest.raises(ConfigError, match=f"^{checkpoint} was trained on {state['num_train_examples']} training "
                                          f"examples, dataset {tmp_path / 'staged'} now has 3; "):
        check_same_data(state, staged, state["data_fingerprint"], 3, checkpoint)
    older = {key: value for key, value in state.items() if key != "data_fingerprint"}
    with pytest.raises(ConfigError, match=f"^{checkpoint} was trained with dataset 'builtin', this run has dataset "):
        check_same_training(older, staged, checkpoint)


@pytest.mark.parametrize("key", sorted(CHANGED))
def test_resume_refuses_a_changed_training_key(stopped, key):
    checkpoint = stopped / "checkpoints" / "step_4"
    state = verify_checkpoint(checkpoint)
    with pytest.raises(ConfigError) as err:
        check_same_training(state, config_with(stopped, **{key: CHANGED[key]}), checkpoint)
    before, now = state["config"][key], config_with(stopped, **{key: CHANGED[key]}).to_dict()[key]
    assert before != now
    assert str(err.value).startswith(f"{checkpoint} was trained with {key} {before!r}, this run has {key} {now!r}")


def test_resume_refuses_another_length_of_training(stopped):
    checkpoint = stopped / "checkpoints" / "step_4"
    for changes, expected in (({"max_steps": 9}, "max_steps 6, this run has max_steps 9"),
                              ({"max_steps": -1}, "max_steps 6, this run has max_steps -1")):
        with pytest.raises(ConfigError, match=expected):
            check_same_training(verify_checkpoint(checkpoint), config_with(stopped, **changes), checkpoint)


def test_resume_takes_the_keys_that_may_change(stopped):
    checkpoint = stopped / "checkpoints" / "step_4"
    check_same_training(verify_checkpoint(checkpoint), config_with(stopped, **MAY_CHANGE), checkpoint)


@pytest.mark.slow
def test_a_changed_key_on_resume_is_one_line_from_the_command_line(stopped, runs, tmp_path):
    out = tmp_path / "copy"
    shutil.copytree(stopped, out)
    proc = run_entry(ENTRIES[0], 1, out, runs.env,
                     {**STOPPED, "global_batch_size": 32, "resume_from_checkpoint": "auto"})
    one_error_line(proc, f"{out / 'checkpoints' / 'step_4'} was trained with global_batch_size 16, this run has "
                         "global_batch_size 32; a run continues only with the same global_batch_size")


@pytest.mark.slow
def test_a_resume_reads_the_same_examples_wherever_they_lie(stopped, runs, tmp_path):
    """The run's files staged to another folder (node-local disk) resume; the same number of other
    examples (the rows in another order) is one line naming dataset, and changes nothing."""
    source, out = ROOT / "src" / SLUG / "assets" / "data" / TASK, tmp_path / "copy"
    shutil.copytree(stopped, out)
    other = tmp_path / "other"
    shutil.copytree(source, other)
    rows = (other / "train.jsonl").read_text().splitlines()
    (other / "train.jsonl").write_text("\n".join(rows[1:] + rows[:1]) + "\n")
    resume = [*overlaid(stopped), *flags_of({**STOPPED, "stop_after_steps": 0}), "--resume_from_checkpoint", "auto"]
    before = snapshot(out)
    one_error_line(run_entry(ENTRIES[0], 1, out, runs.env, extra=[*resume, "--dataset", str(other)]),
                   f"{out / 'checkpoints' / 'step_4'} was trained on other data than dataset {other} holds now")
    assert snapshot(out) == before
    staged = shutil.copytree(source, tmp_path / "staged")
    resumed = run_entry(ENTRIES[0], 1, out, runs.env, extra=[*resume, "--dataset", str(staged)])
    assert resumed.returncode == 0 and "resuming after step 4" in resumed.stdout, resumed.stderr[-3000:]
    assert [r["step"] for r in Run(0, "", "", out).steps] == list(range(1, 7))


@pytest.mark.slow
@pytest.mark.skipif(len(ENTRIES) < 2, reason="one entry point generated")
def test_another_entry_points_checkpoint_is_one_line(stopped, runs, tmp_path):
    proc = run_entry(ENTRIES[1], 1, stopped, runs.env, {**STOPPED, "resume_from_checkpoint": "auto"})
    one_error_line(proc, f"{stopped / 'checkpoints' / 'step_4'} was written by train_{ENTRIES[0]}, not "
                         f"train_{ENTRIES[1]}: each entry point keeps its library's checkpoint format")


def damage(folder, how: str) -> str:
    """Cut the largest file of a checkpoint in half, zero 4 kB in its middle, put the older
    checkpoint's in its place (the same size), or remove the smallest file; the file, by name."""
    files = sorted((p for p in folder.iterdir() if p.is_file() and p.name != "state.json"),
                   key=lambda p: p.stat().st_size)
    if how == "truncated":
        os.truncate(files[-1], files[-1].stat().st_size // 2)
        return files[-1].name
    if how == "zeroed":
        with files[-1].open("r+b") as f:
            f.seek(files[-1].stat().st_size // 2)
            f.write(bytes(4096))
        return files[-1].name
    if how == "older":
        shutil.copyfile(folder.parent / "step_2" / files[-1].name, files[-1])
        return files[-1].name
    files[0].unlink()
    return files[0].name


@pytest.mark.slow
@pytest.mark.parametrize("how,expected", [("truncated", "bytes, {} were written"), ("missing", "is missing"),
                                          ("zeroed", "does not hold what was written (checksum)"),
                                          ("older", "does not hold what was written (checksum)")])
def test_a_damaged_checkpoint_is_one_line_naming_the_file_and_the_one_that_loads(stopped, runs, tmp_path, how,
                                                                                  expected):
    out = tmp_path / "copy"
    shutil.copytree(stopped, out)
    newest = out / "checkpoints" / "step_4"
    size = {p.name: p.stat().st_size for p in newest.iterdir()}
    name = damage(newest, how)
    proc = run_entry(ENTRIES[0], 1, out, runs.env, {**STOPPED, "resume_from_checkpoint": "auto"})
    line = one_error_line(proc, f"error: checkpoint {newest} cannot be loaded: {newest / name} ")
    assert expected.format(size[name]) in line
    assert line.endswith(f"the older checkpoint {out / 'checkpoints' / 'step_2'} loads: --resume_from_checkpoint "
                         f"{out / 'checkpoints' / 'step_2'}")


@pytest.mark.slow
def test_a_resume_under_other_library_versions_says_so_and_goes_on(stopped, runs, tmp_path):
    out = tmp_path / "copy"
    shutil.copytree(stopped, out)
    state_file = out / "checkpoints" / "step_4" / "state.json"
    state = json.loads(state_file.read_text())
    state["versions"]["torch"] = "1.0.0"
    state_file.write_text(json.dumps(state))
    proc = run_entry(ENTRIES[0], 1, out, runs.env, {**STOPPED, "stop_after_steps": 0, "resume_from_checkpoint": "auto"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    notes = [line for line in proc.stdout.splitlines() if line.startswith("note: ")]
    assert notes == [f"note: {state_file.parent} was written with other library versions "
                     f"(torch 1.0.0 -> {torch.__version__}); continuing"]
    assert (out / "final_model" / "state.json").is_file()
