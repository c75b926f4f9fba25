"""Careless input is caught before any process waits on another: a broken data file, a launch
variable that does not fit, an output folder that cannot be made. Each is exit code 2 and one line
on stderr naming what is wrong (the file and line or example, the variable), from every process."""

import json
import re
import socket
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

from {{ cookiecutter.project_slug }}.config import ConfigError, load_config
from {{ cookiecutter.project_slug }}.distributed import dist_env, init_distributed
from {{ cookiecutter.project_slug }}.errors import JobFailed
from {{ cookiecutter.project_slug }}.extras import BAKED
from {{ cookiecutter.project_slug }}.model import load_tokenizer
from {{ cookiecutter.project_slug }}.prepare import prepare

from conftest import (
    ENTRIES,
    ROOT,
    free_port,
    one_error_line,
    run_entry,
)

CONFIG = str(ROOT / "configs" / "train.yaml")


def rows(n: int, label=lambda i: i % 2) -> list[dict]:
    return [{"text": f"the cat sat on mat {i}", "label": label(i)} for i in range(n)]


def jsonl(records: list) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


GOOD_TRAIN, GOOD_VALIDATION = jsonl(rows(12)), jsonl(rows(4))
# (case, files of the dataset folder, what the one line must say). {d} is the folder.
BROKEN = [
    ("one_class", {"train.jsonl": jsonl(rows(12, label=lambda i: 0)), "validation.jsonl": jsonl(rows(4, lambda i: 0))},
     "dataset {d}/train.jsonl: every training label is 0, one class; classification needs at least two"),
    ("malformed_json_line", {"train.jsonl": GOOD_TRAIN + '{"text": "a", "label": 1\n' + GOOD_TRAIN},
     "dataset file {d}/train.jsonl line 13 is not valid JSON"),
    ("first_line_not_json", {"train.jsonl": "text,label\n"}, "dataset file {d}/train.jsonl line 1 is not valid JSON"),
    ("line_not_an_object", {"train.jsonl": "[1, 2]\n"}, "dataset file {d}/train.jsonl line 1 is not a JSON object"),
    ("empty_train_file", {"train.jsonl": ""}, "dataset file {d}/train.jsonl is empty"),
    ("blank_train_file", {"train.jsonl": "\n\n"}, "dataset file {d}/train.jsonl holds no examples"),
    ("null_text", {"train.jsonl": GOOD_TRAIN + jsonl([{"text": None, "label": 0}])},
     "example 13 has text null: every text must be a string"),
    ("numeric_text", {"train.jsonl": jsonl(rows(3) + [{"text": 7, "label": 1}])},
     "example 4 has text 7 (int)"),  # the whole line: null_text
    ("only_numbers_as_text", {"train.jsonl": jsonl([{"text": i, "label": i % 2} for i in range(4)])},
     "example 1 has text 0 (int)"),
    ("string_label", {"train.jsonl": jsonl(rows(3) + [{"text": "x", "label": "positive"}])},
     "example 4 has label 'positive' (str): labels must be whole numbers"),
    ("negative_label", {"train.jsonl": jsonl(rows(5) + [{"text": "x", "label": -1}])},
     "example 6 has label -1"),  # the whole line: string_label
    ("bool_labels", {"train.jsonl": jsonl(rows(4, label=lambda i: i % 2 == 1))},
     "example 1 has label False (bool)"),
    ("float_labels", {"train.jsonl": jsonl(rows(4, label=lambda i: i % 2 + 0.0))},
     "example 1 has label 0.0 (float)"),
    ("null_label", {"train.jsonl": jsonl(rows(2) + [{"text": "x", "label": None}])},
     "example 3 has label null"),
    ("label_of_a_million", {"train.jsonl": jsonl(rows(6) + [{"text": "x", "label": 1_000_000}])},
     "training labels must be 0..1000000 with every class present, but 999998 of them have no example"),
    ("class_missing", {"train.jsonl": jsonl(rows(6, label=lambda i: 2 * (i % 2)))},
     "training labels must be 0..2 with every class present, but 1 of them have no example (1)"),
    ("validation_label_unseen", {"validation.jsonl": jsonl(rows(2) + [{"text": "x", "label": 5}])},
     "dataset {d}/validation.jsonl example 3 has label 5, which no training example has"),
    ("no_label_column", {"train.jsonl": jsonl([{"text": "a b"}] * 4)},
     "dataset file {d}/train.jsonl lacks column(s) label needed by task sequence_classification"),
    ("csv_row_too_long", {"train.csv": "text,label\na b,1\nc d,0,9\n", "validation.csv": "text,label\na,1\n"},
     "dataset file {d}/train.csv cannot be read: Error tokenizing data. C error: Expected 2 fields in line 3"),
    ("parquet_damaged", {"train.parquet": "PAR1 not really", "validation.parquet": "PAR1"},
     "dataset file {d}/train.parquet is not a readable parquet file"),
    ("json_array_cut_short", {"train.json": '[{"text": "a", "label": 0},\n {"text": "b", "label"',
                              "validation.json": '[{"text": "a", "label": 0}]'},
     "dataset file {d}/train.json is not valid JSON at line 2, column"),
    ("two_formats", {"train.csv": "text,label\na,1\nb,0\n"}, "train.csv and validation.jsonl must have one format"),
    ("no_validation_file", {"validation.jsonl": None}, "has no validation split"),
    ("latin1_text", {"train.jsonl": GOOD_TRAIN.encode() + b'{"text": "caf\xe9 au lait", "label": 1}\n'},
     "dataset {d}/train.jsonl example 13 is not UTF-8 text (byte 0xe9 after b'caf'); save the file as UTF-8"),
    ("latin1_csv", {"train.csv": b"text,label\na,1\ncaf\xe9,0\n", "validation.csv": "text,label\na,1\n"},
     "dataset file {d}/train.csv line 3 is not UTF-8 text"),  # the whole line: latin1_text
]


@pytest.mark.parametrize("case,files,expected", BROKEN, ids=[case for case, _, _ in BROKEN])
def test_broken_data_is_one_line_naming_the_place(tmp_path, case, files, expected):
    folder = tmp_path / case
    folder.mkdir()
    contents = {"train.jsonl": GOOD_TRAIN, "validation.jsonl": GOOD_VALIDATION, **files}
    for split in ("train", "validation"):  # a file of another format replaces the split's .jsonl
        if any(name.startswith(f"{split}.") and name != f"{split}.jsonl" for name in files):
            contents.pop(f"{split}.jsonl", None)
    for name, text in contents.items():
        if text is not None:
            (folder / name).write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ConfigError) as err:
        prepare_folder(folder, tmp_path)
    assert expected.format(d=folder) in str(err.value)
    assert "\n" not in str(err.value)


def prepare_folder(folder, tmp_path):
    cfg = load_config(["--config", CONFIG, "--task", "sequence_classification", "--dataset", str(folder),
                       "--output_dir", str(tmp_path / "out"), "--data_cache_dir", str(tmp_path / "cache")])
    return prepare(cfg, load_tokenizer(cfg))


def test_a_csv_saved_with_a_byte_order_mark_reads_its_columns(tmp_path):
    """Spreadsheet programs start a UTF-8 CSV with a BOM: it is no part of the first column's name."""
    for split, text in (("train", "text,label\nthe cat,0\nthe dog,1\n"), ("validation", "text,label\na cat,0\n")):
        (tmp_path / f"{split}.csv").write_bytes(b"\xef\xbb\xbf" + text.encode())
    prepared = prepare_folder(tmp_path, tmp_path)
    assert prepared.num_labels == 2 and len(prepared.data["train"]) == 2


@pytest.mark.parametrize("flags,expected", [
    (["--global_batch_size", "16"], "global_batch_size 16 is larger than the training set of dataset {d}: 12 "
                                    "examples; use a global batch of at most 12, or more data"),
    pytest.param(["--global_batch_size", "4", "--global_batch_size_schedule", "0:4,2:8,3:32"],
                 "global_batch_size_schedule '0:4,2:8,3:32' reaches 32, which is larger than the training set of "
                 "dataset {d}: 12 examples",
                 marks=pytest.mark.skipif("batch_schedule" not in BAKED, reason="the batch_schedule extra's key")),
])
def test_a_global_batch_larger_than_the_training_set_is_one_line(tmp_path, flags, expected):
    from {{ cookiecutter.project_slug }}.startup import start

    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "train.jsonl").write_text(GOOD_TRAIN)
    (folder / "validation.jsonl").write_text(GOOD_VALIDATION)
    cfg = load_config(["--config", CONFIG, "--task", "sequence_classification", "--dataset", str(folder),
                       "--micro_batch_size", "4", "--output_dir", str(tmp_path / "out"),
                       "--data_cache_dir", str(tmp_path / "cache"), *flags])
    with pytest.raises(ConfigError) as err:
        start(cfg, "pytorch")
    assert str(err.value).startswith(expected.format(d=folder))


def test_a_classification_head_of_other_classes_is_one_line(tmp_path):
    from transformers import AutoModelForSequenceClassification

    from {{ cookiecutter.project_slug }}.model import model_config

    cfg = load_config(["--config", CONFIG, "--task", "sequence_classification"])
    tokenizer = load_tokenizer(cfg)
    AutoModelForSequenceClassification.from_config(model_config(cfg, tokenizer, 2)).save_pretrained(tmp_path / "m")
    cfg.model_name_or_path = str(tmp_path / "m")
    assert model_config(cfg, tokenizer, 2).num_labels == 2
    with pytest.raises(ConfigError, match=f"^model {tmp_path / 'm'} has a classification head of 2 classes, the "
                                          "data has 3; use data with the model's classes"):
        model_config(cfg, tokenizer, 3)


def test_attention_auto_trains_a_model_without_sdpa_and_records_eager(runs, tmp_path):
    """Gemma2 supports no SDPA: auto picks eager, which the banner and the run's record name; sdpa
    asked for is one line. A local checkpoint of random weights with the shipped tokenizer."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    tokenizer, folder = load_tokenizer(load_config(["--config", CONFIG])), tmp_path / "gemma2"
    config = Gemma2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, head_dim=16,
                          num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)
    Gemma2ForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    flags = {"task": "causal_lm", "model_name_or_path": folder, "max_steps": 1, "global_batch_size": 8,
             "micro_batch_size": 4}
    run = run_entry(ENTRIES[0], 1, tmp_path / "out", runs.env, flags)  # the session's entry point, already imported
    assert run.returncode == 0, run.stderr[-2000:]
    assert "eager attention" in run.stdout
    assert json.loads((run.output_dir / "final_model" / "state.json").read_text())["config"]["attn_implementation"] \
        == "eager"
    one_error_line(run_entry(ENTRIES[0], 1, tmp_path / "sdpa", runs.env, {**flags, "attn_implementation": "sdpa"}),
                   "attn_implementation sdpa: Gemma2ForCausalLM does not support an attention implementation through")


def test_flash_attention_in_fp32_and_an_encoder_decoder_for_causal_lm_are_one_line(tmp_path):
    """flash_attention_2 without mixed precision is refused with the config, before the GPU and package
    checks; T5 has no causal LM class."""
    from transformers import T5Config, T5ForConditionalGeneration

    from {{ cookiecutter.project_slug }}.model import model_config

    with pytest.raises(ConfigError, match="^attn_implementation flash_attention_2 runs in bf16/fp16: set mixed_precis"):
        load_config(["--config", CONFIG, "--attn_implementation", "flash_attention_2", "--mixed_precision", "no"])
    cfg = load_config(["--config", CONFIG, "--task", "causal_lm", "--model_name_or_path", str(tmp_path / "t5")])
    tokenizer = load_tokenizer(load_config(["--config", CONFIG]))
    T5ForConditionalGeneration(T5Config(vocab_size=len(tokenizer), d_model=32, d_ff=64, num_layers=1, num_heads=2,
                                        d_kv=16)).save_pretrained(tmp_path / "t5")
    tokenizer.save_pretrained(tmp_path / "t5")
    with pytest.raises(ConfigError, match=f"^model {tmp_path / 't5'} is a t5 model, which AutoModelForCausalLM"
                                          r" cannot build \(for causal_lm a decoder-only model, not an encoder-"):
        model_config(cfg, load_tokenizer(cfg))


@pytest.mark.parametrize("given,finished", [("run", True), ("run/checkpoints", True), ("run/checkpoints/step_2", True),
                                            ("run/checkpoints/step_2", False)],
                         ids=["run", "checkpoints", "checkpoint", "checkpoint_of_an_unfinished_run"])
def test_a_run_or_checkpoint_given_as_the_model_names_its_final_model_and_the_resume(tmp_path, given, finished):
    run = tmp_path / "run"
    (run / "checkpoints" / "step_2").mkdir(parents=True)
    (run / "checkpoints" / "step_2" / "state.json").write_text("{}")
    if finished:
        (run / "final_model").mkdir()
    cfg = load_config(["--config", CONFIG, "--model_name_or_path", str(tmp_path / given)])
    resume = str(tmp_path / given) if given.endswith("step_2") else "auto"
    with pytest.raises(ConfigError) as err:
        load_tokenizer(cfg)
    assert str(err.value) == (f"{str(tmp_path / given)!r} is the output of a training run, not a model: use its "
                              f"final model (model_name_or_path {run / 'final_model'}, once the run is finished), or "
                              f"continue the run with --output_dir {run} --resume_from_checkpoint {resume}")


@pytest.mark.parametrize("given", ["/no/such/folder", "./no_such_folder", "~/no_such_folder", "models/no/such"])
def test_a_missing_local_folder_as_the_model_is_named_as_a_folder_not_a_hub_name(given):
    cfg = load_config(["--config", CONFIG, "--model_name_or_path", given])
    with pytest.raises(ConfigError) as err:
        load_tokenizer(cfg)
    assert str(err.value) == (f"model folder {cfg.model_name_or_path!r} does not exist; use model_name_or_path: tiny, "
                              "a local folder, or a hub name such as org/model")


def test_a_folder_without_a_saved_model_is_named_as_such(tmp_path):
    (tmp_path / "notes.txt").write_text("not a model")
    cfg = load_config(["--config", CONFIG, "--model_name_or_path", str(tmp_path)])
    with pytest.raises(ConfigError) as err:
        load_tokenizer(cfg)
    assert str(err.value) == (f"model folder {str(tmp_path)!r} holds no config.json or tokenizer files: it is no "
                              "save_pretrained() folder; use model_name_or_path: tiny, a saved model's folder, or a "
                              "hub name")


def test_max_seq_len_must_leave_room_for_text():
    cfg = load_config(["--config", CONFIG, "--max_seq_len", "2"])
    with pytest.raises(ConfigError, match="max_seq_len 2 leaves no room for text: the tokenizer adds 2 special"):
        prepare(cfg, load_tokenizer(cfg))


def test_bad_validation_label_stops_every_process_before_training(env, tmp_path):
    """The case that used to crash at the first evaluation, after a whole epoch: now each of the 2
    processes reports it at start-up, before the process group exists."""
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "train.jsonl").write_text(GOOD_TRAIN)
    (folder / "validation.jsonl").write_text(jsonl(rows(3) + [{"text": "x", "label": 2}]))
    run = run_entry(ENTRIES[0], 2, tmp_path / "out", env, {"task": "sequence_classification", "dataset": folder,
                                                            "micro_batch_size": 2, "global_batch_size": 8})
    assert "exitcode  : 2" in run.stderr, run.stderr[-3000:]
    one_error_line(run, f"error: dataset {folder}/validation.jsonl example 4 has label 2, which no training example "
                   "has", code=1, workers=2)
    assert "optimizer steps" not in run.stdout  # no banner: nothing was built, nothing trained
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


LAUNCH = [
    ({"WORLD_SIZE": "2"}, "RANK is not set, but WORLD_SIZE is 2"),
    ({"RANK": "abc"}, "RANK='abc' is not a whole number"),
    ({"WORLD_SIZE": "two"}, "WORLD_SIZE='two' is not a whole number"),
    ({"RANK": "5", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "29500"}, "RANK=5 is outside 0..1"),
    ({"RANK": "1", "LOCAL_RANK": "3", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_PORT": "29500"},
     "LOCAL_RANK=3 and LOCAL_WORLD_SIZE=2 do not fit WORLD_SIZE=2"),
    ({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "70000"}, "MASTER_PORT=70000 is not a port"),
    ({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": ""}, "MASTER_ADDR is not set"),
]


@pytest.mark.parametrize("variables,expected", LAUNCH, ids=[e.split(" ")[0] for _, e in LAUNCH])
def test_launch_variables_are_checked(monkeypatch, variables, expected):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=re.escape(expected)):
        dist_env()


INTERFACES = [
    ({"GLOO_SOCKET_IFNAME": "eht9"}, "GLOO_SOCKET_IFNAME=eht9 names 'eht9', which host "),
    ({"GLOO_SOCKET_IFNAME": "lo,eht9"}, "GLOO_SOCKET_IFNAME=lo,eht9 names 'eht9', which"),  # gloo uses each one
    ({"DIST_BACKEND": "nccl", "NCCL_SOCKET_IFNAME": "eht9,ibx9"}, "NCCL_SOCKET_IFNAME=eht9,ibx9 names 'eht9', 'ibx9'"),
    ({"DIST_BACKEND": "nccl", "NCCL_SOCKET_IFNAME": "=l"}, "NCCL_SOCKET_IFNAME==l names 'l', which host "),
    ({"DIST_BACKEND": "nccl", "NCCL_SOCKET_IFNAME": "l,eht9"}, None),  # a prefix of lo: NCCL uses any that matches
    ({"DIST_BACKEND": "nccl", "NCCL_SOCKET_IFNAME": "^eht9"}, None),  # the interfaces NCCL leaves out
    ({"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "eht9"}, None),  # gloo's job: NCCL's variable is not read
    ({"DIST_BACKEND": "nccl", "GLOO_SOCKET_IFNAME": "eht9"}, "GLOO_SOCKET_IFNAME=eht9 names 'eht9', which host "),
]
BACK_END = {"DIST_BACKEND": "gloo"}  # where no case names one (on GPUs too)


@pytest.mark.parametrize("variables,expected", INTERFACES, ids=[" ".join(f"{k}={v}" for k, v in variables.items())
                                                                for variables, _ in INTERFACES])
def test_an_interface_the_host_lacks_is_one_line_naming_those_it_has(monkeypatch, variables, expected):
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "DIST_BACKEND"):
        monkeypatch.delenv(name, raising=False)
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", **BACK_END, **variables}.items():
        monkeypatch.setenv(name, value)
    if expected is None:
        assert dist_env().world_size == 2
        return
    with pytest.raises(ConfigError) as err:
        dist_env()
    have = ", ".join(name for _, name in socket.if_nameindex())
    assert str(err.value).startswith(expected), err
    assert f"lacks; it has {have}: name one of them, or unset {expected.split('=')[0]}" in str(err.value)


@pytest.mark.slow
def test_an_interface_the_host_lacks_under_train_local_is_one_line_per_process_and_exit_2(env, tmp_path):
    variables = {"NPROC_PER_NODE": "2", "PYTHON": sys.executable, "GLOO_SOCKET_IFNAME": "eht9", **BACK_END}
    proc = subprocess.run(["scripts/train_local.sh", "--report_to", "none", "--output_dir", str(tmp_path / "o")],
                          cwd=ROOT, env={**env, **variables}, capture_output=True, text=True, timeout=180)
    one_error_line(proc, "error: GLOO_SOCKET_IFNAME=eht9 names 'eht9', which host ", workers=2, alone=True)
    assert not (tmp_path / "o").exists()  # refused before the run folder is made


def test_a_process_late_for_the_group_is_one_line_naming_the_wait_that_ran_out(monkeypatch):
    """Under torchrun the store is the agent's, up at once: the wait that runs out is the process
    group's, bounded by collective_timeout_s (2 s here, not rendezvous_timeout_s's 300)."""
    port = free_port()
    agent_store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)  # noqa: F841 (kept open)
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "True",
                        "TORCHELASTIC_RESTART_COUNT": "0", "DIST_BACKEND": "gloo"}.items():
        monkeypatch.setenv(name, value)
    start = time.monotonic()
    with pytest.raises(JobFailed) as err:
        init_distributed(dist_env(), 300, 2)
    assert time.monotonic() - start < 60 and not dist.is_initialized()
    assert str(err.value).startswith(f"rank 0 waited 2 s for the 2 processes of this job at 127.0.0.1:{port} ("), err
    assert str(err.value).endswith("or raise --collective_timeout_s"), err


@pytest.mark.slow
def test_a_bad_launch_variable_is_one_line_before_any_waiting(env, tmp_path):
    proc = run_entry(ENTRIES[0], 1, tmp_path / "o", {**env, "WORLD_SIZE": "2"})
    one_error_line(proc, "RANK is not set, but WORLD_SIZE is 2: start the processes with torchrun")


@pytest.mark.slow
@pytest.mark.parametrize("rank", [0, 1])
def test_missing_processes_end_with_one_line_after_the_rendezvous_timeout(env, tmp_path, rank):
    """WORLD_SIZE=2 but only rank 0 (or only rank 1, whose rank 0 never holds the store) started: it
    waits --rendezvous_timeout_s (3 s), not the collective timeout, and says what it waited for in
    its only line (no C++ stack dump of torch's retries before it)."""
    port = free_port()
    env = {**env, "RANK": str(rank), "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": str(port)}
    proc = run_entry(ENTRIES[0], 1, tmp_path / "o", env, {"rendezvous_timeout_s": 3})
    one_error_line(proc, f"error: rank {rank} waited 3 s for the 2 processes of this job at 127.0.0.1:{port}", code=1,
                   alone=True)


@pytest.mark.slow
def test_output_dir_that_cannot_be_made_is_found_by_every_process_first(env, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    run = run_entry(ENTRIES[0], 2, blocker / "out", env, {"max_steps": 1})
    assert "exitcode  : 2" in run.stderr, run.stderr[-3000:]
    one_error_line(run, f"error: output_dir {blocker / 'out'} cannot be created (Not a directory)", code=1, workers=2)
