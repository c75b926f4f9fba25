"""Collation: padding on the right and masked out of the loss (model.py's, checked against the textbook
cross-entropy), evaluation shards that count every example once; and the data's preparation: once per
data and settings, shared by every process and later run, packed into blocks when asked. (The data
order, each step's window of the epoch: tests/test_batch.py.)"""

import errno
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from datasets import Dataset, concatenate_datasets
from transformers import AutoModelForCausalLM, MistralConfig, masking_utils

from {{ cookiecutter.project_slug }} import data as data_module
from {{ cookiecutter.project_slug }} import data_cache as data_cache_module
from {{ cookiecutter.project_slug }} import prepare as prepare_module
from {{ cookiecutter.project_slug }} import sources as sources_module
from {{ cookiecutter.project_slug }}.config import ConfigError, load_config
from {{ cookiecutter.project_slug }}.data import IGNORE_INDEX, TARGETS, Collator, eval_dataloader
from {{ cookiecutter.project_slug }}.data_cache import STALE_S, cache_folder
from {{ cookiecutter.project_slug }}.model import (
    PLAIN_CAUSAL,
    SummedCrossEntropy,
    build_model,
    count_targets,
    load_tokenizer,
    model_config,
    plain_causal,
    summed_loss,
)
from {{ cookiecutter.project_slug }}.prepare import pack, prepare
from {{ cookiecutter.project_slug }}.sources import check_source, find_source, read_raw

from conftest import (
    DATA_CACHE,
    ENTRIES,
    IGNORING_USR1,
    LAUNCH_TIMEOUT_S,
    ROOT,
    Run,
    children_of,
    flag_args,
    one_error_line,
    read_logs,
    run_entry,
    successful_run,
)

CONFIG = str(ROOT / "configs" / "train.yaml")


@pytest.fixture(scope="module")
def lm():
    cfg = load_config(["--config", CONFIG, "--task", "causal_lm", "--data_cache_dir", str(DATA_CACHE)])
    tokenizer = load_tokenizer(cfg)
    return cfg, tokenizer, prepare(cfg, tokenizer).data


def test_collator_pads_right_and_masks_padding_and_fillers(lm):
    cfg, tokenizer, data = lm
    rows = [{**data["train"][i], "real": True} for i in range(6)] + [{**data["train"][6], "real": False}]
    batch = Collator(tokenizer, "causal_lm")(rows)
    lengths = [len(r["input_ids"]) for r in rows]
    assert batch["input_ids"].shape == (7, max(lengths))
    assert "attention_mask" not in batch  # a causal LM needs none (Collator)
    for row, n in enumerate(lengths[:6]):
        assert (batch["input_ids"][row, n:] == tokenizer.pad_token_id).all()
        assert (batch["labels"][row, n:] == IGNORE_INDEX).all()
        assert batch["labels"][row, :n].tolist() == batch["input_ids"][row, :n].tolist()
    assert (batch["labels"][6] == IGNORE_INDEX).all()  # filler: no targets at all
    assert count_targets(batch["labels"], "causal_lm") == sum(n - 1 for n in lengths[:6])
    classification = Collator(tokenizer, "sequence_classification")([{**r, "label": 1} for r in rows])
    for row, n in enumerate(lengths[:6]):  # a model that may attend both ways is told where the padding is
        assert classification["attention_mask"][row].tolist() == [1] * n + [0] * (max(lengths) - n)


@pytest.mark.parametrize("packing", ["false", "true"])
def test_a_causal_lm_without_the_mask_computes_the_same_and_its_attention_gets_none(packing):
    """Right padding (or none, packed): causal attention never lets a real token see a pad on its
    right, so without the mask every real target's loss and every gradient are the same, and the
    attention receives no mask at all (SDPA's causal path)."""
    cfg = load_config(["--config", CONFIG, "--task", "causal_lm", "--max_seq_len", "48", "--packing", packing,
                       "--data_cache_dir", str(DATA_CACHE)])
    tokenizer = load_tokenizer(cfg)
    rows = [{**prepare(cfg, tokenizer).data["train"][i], "real": True} for i in range(8)]
    batch = Collator(tokenizer, "causal_lm")(rows)
    lengths = torch.tensor([len(r["input_ids"]) for r in rows])
    mask = (torch.arange(batch["input_ids"].shape[1]) < lengths[:, None]).long()
    assert (packing == "true") == bool(mask.all())  # packed blocks are full; otherwise padding to mask
    model = build_model(cfg, model_config(cfg, tokenizer))
    received = []
    model.model.layers[0].self_attn.register_forward_pre_hook(
        lambda module, args, kwargs: received.append(kwargs.get("attention_mask")), with_kwargs=True)
    results = []
    for attention_mask in (mask, None):
        model.zero_grad()
        # with a padding mask, transformers' own SDPA, which applies it; without, the model as built (plain_causal)
        model.config._attn_implementation = "sdpa" if attention_mask is not None else PLAIN_CAUSAL
        extra = {} if attention_mask is None else {"attention_mask": attention_mask}
        logits = model(input_ids=batch["input_ids"], **extra).logits
        loss = summed_loss(logits, batch["labels"], "causal_lm") / count_targets(batch["labels"], "causal_lm")
        loss.backward()
        results.append((loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (with_mask, grads_with), (without, grads_without) = results
    assert abs(with_mask - without) <= 1e-6
    assert max((grads_with[n] - grads_without[n]).abs().max().item() for n in grads_with) <= 1e-6
    assert received[-1] is None


@pytest.mark.parametrize("compiled", [False, True])
def test_plain_causal_attention_gets_no_mask_and_no_packed_sequence_check(compiled, monkeypatch):
    """The causal LM as built: every attention call gets no mask and is_causal, eagerly and under torch.compile,
    and its position ids are never checked for packed sequences (eagerly a host sync per forward). The same
    model under transformers' own "sdpa" is checked, and compiled gets a dense mask; a sliding-window model keeps
    its mask (eagerly)."""
    calls, checks = [], []
    sdpa, find = torch.nn.functional.scaled_dot_product_attention, masking_utils.find_packed_sequence_indices

    def spy(*args, attn_mask=None, is_causal=False, **kwargs):
        calls.append((attn_mask is None, is_causal))
        return sdpa(*args, attn_mask=attn_mask, is_causal=is_causal, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", lambda ids: checks.append(ids) or find(ids))
    cfg = load_config(["--config", CONFIG, "--task", "causal_lm", "--max_seq_len", "32"])
    tokenizer = load_tokenizer(cfg)
    input_ids = torch.randint(0, len(tokenizer), (2, 32))

    def attention_of(model) -> tuple[set, int]:
        calls.clear()
        checks.clear()
        run = torch.compile(model, backend="eager") if compiled else model  # dynamo's tracing, no code generated
        run(input_ids=input_ids).logits.sum().backward()
        return set(calls), len(checks)

    model = build_model(cfg, model_config(cfg, tokenizer))
    assert attention_of(model) == ({(True, True)}, 0)
    model.config._attn_implementation = "sdpa"
    own, checked = attention_of(model)
    assert own == ({(False, False)} if compiled else {(True, True)}) and checked > 0
    if compiled:
        return
    sliding = MistralConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                            num_attention_heads=2, num_key_value_heads=1, sliding_window=8, attn_implementation="sdpa")
    mistral = plain_causal(AutoModelForCausalLM.from_config(sliding))
    assert mistral.config._attn_implementation == "sdpa" and attention_of(mistral)[0] == {(False, False)}


@pytest.mark.parametrize("task", ["causal_lm", "sequence_classification"])
@pytest.mark.parametrize("rows_per_chunk", [1, 5, None])
def test_the_loss_is_the_textbook_cross_entropy_without_a_copy_of_the_logits(task, rows_per_chunk, monkeypatch):
    """summed_loss shifts the labels, not the logits, and computes the gradient in its forward a chunk of
    rows at a time: in fp32 its value and its gradient equal the textbook cross-entropy of the shifted
    logits (today's formula, a copy of them made fp32) to 1e-6, with or without gradients; bf16 logits
    get a bf16 gradient."""
    if rows_per_chunk:
        monkeypatch.setattr(SummedCrossEntropy, "CHUNK_ELEMENTS", rows_per_chunk * 300)
    generator = torch.Generator().manual_seed(0)
    shape = (3, 17, 300) if task == "causal_lm" else (7, 300)
    logits = (3 * torch.randn(shape, generator=generator)).requires_grad_()
    labels = torch.randint(0, 300, shape[:-1], generator=generator)
    labels[1] = IGNORE_INDEX  # a filler row
    if task == "causal_lm":
        labels[0, :4] = labels[-1, -2:] = IGNORE_INDEX  # a prompt, padding
        reference = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                                                      reduction="sum")
    else:
        reference = torch.nn.functional.cross_entropy(logits.float(), labels, reduction="sum")
    targets = count_targets(labels, task)
    (expected,) = torch.autograd.grad(reference / targets, logits)
    loss = summed_loss(logits, labels, task)
    (loss / targets).backward()
    assert abs(loss.item() - reference.item()) <= 1e-6 * reference.item()
    assert (logits.grad - expected).abs().max().item() <= 1e-6
    with torch.no_grad():
        assert abs(summed_loss(logits, labels, task).item() - reference.item()) <= 1e-6 * reference.item()
    half = logits.detach().bfloat16().requires_grad_()
    (summed_loss(half, labels, task) / targets).backward()
    assert half.grad.dtype == torch.bfloat16 and (half.grad.float() - expected).abs().max().item() <= 1e-2 / targets


@pytest.mark.parametrize("world_size,batch_size", [(3, 8), (3, 1), (8, 1), (2, 7)])
def test_eval_shards_count_every_example_once(lm, world_size, batch_size):
    """Each example once over all ranks, and the same number of batches on every rank (ZeRO-3 and
    FSDP forwards are collectives): a rank with a smaller share runs filler batches."""
    cfg, tokenizer, data = lm
    collator = Collator(tokenizer, "causal_lm")
    total, batches = 0, []
    for rank in range(world_size):
        loader = list(eval_dataloader(data["validation"], rank, world_size, batch_size, collator))
        batches.append(len(loader))
        total += sum(int((batch["labels"][:, 0] != IGNORE_INDEX).sum()) for batch in loader)
    assert total == len(data["validation"])
    assert len(set(batches)) == 1


def test_classification_labels(tmp_path):
    cfg = load_config(["--config", CONFIG, "--task", "sequence_classification", "--data_cache_dir", str(DATA_CACHE)])
    tokenizer = load_tokenizer(cfg)
    data = prepare(cfg, tokenizer).data
    rows = [{**data["train"][i], "real": i != 2} for i in range(4)]
    batch = Collator(tokenizer, "sequence_classification")(rows)
    assert batch["labels"].tolist() == [r["label"] if r["real"] else IGNORE_INDEX for r in rows]
    assert set(data["train"]["label"]) == {0, 1}


def test_dataset_errors(tmp_path):
    with pytest.raises(ConfigError, match="is not a folder of train/validation files"):
        find_source(load_config(["--config", CONFIG, "--dataset", str(tmp_path / "none")]))
    (tmp_path / "train.jsonl").write_text('{"text": "a b"}\n')
    with pytest.raises(ConfigError, match="has no validation split"):
        find_source(load_config(["--config", CONFIG, "--dataset", str(tmp_path)]))
    (tmp_path / "validation.jsonl").write_text('{"text": "a b"}\n')
    with pytest.raises(ConfigError, match=r"lacks column\(s\) label"):
        check_source(find_source(load_config(["--config", CONFIG, "--dataset", str(tmp_path),
                                              "--task", "sequence_classification"])), "sequence_classification")


def test_a_relative_folder_that_is_missing_is_named_as_a_folder_and_as_a_hub_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    source = find_source(load_config(["--config", CONFIG, "--dataset", "data/my_corpus"]))
    with pytest.raises(ConfigError) as err:
        read_raw(source, tmp_path / "raw")
    assert str(err.value).startswith(f"dataset data/my_corpus is no folder ({tmp_path}/data/my_corpus does not exist) "
                                     "and cannot be loaded from the Hub: ")


def documents(*docs: list[int], chunks: int = 1):
    """A tokenised dataset of `docs` (input_ids), stored in `chunks` Arrow chunks, in order."""
    size = math.ceil(len(docs) / chunks)
    return concatenate_datasets([Dataset.from_dict({"input_ids": list(docs[i:i + size])})
                                 for i in range(0, len(docs), size)])


def test_packing_joins_documents_with_one_eos_and_cuts_blocks(tmp_path):
    eos = 3
    docs = [[2, 10, 11, eos], [2, 12, eos], [2, 13, 14, 15, 16, eos], [20, 21]]  # the last lacks an EOS
    blocks = pack(documents(*docs), eos, 4, tmp_path / "p.arrow")["input_ids"]
    stream = [t for d in docs for t in (d if d[-1] == eos else [*d, eos])]
    assert stream.count(eos) == len(docs)  # one EOS after each document, never two
    assert blocks == [stream[i:i + 4] for i in range(0, len(stream) - len(stream) % 4, 4)]  # the rest dropped


@pytest.mark.parametrize("chunks", [2, 3])
def test_packed_blocks_do_not_depend_on_how_the_documents_are_stored(tmp_path, chunks):
    docs = [[2, *range(10, 10 + n), 3] for n in (5, 1, 9, 3, 7, 2, 11, 4)]
    one = pack(documents(*docs), 3, 6, tmp_path / "one.arrow")["input_ids"]
    assert pack(documents(*docs, chunks=chunks), 3, 6, tmp_path / "many.arrow")["input_ids"] == one


def test_packed_data_is_the_same_whatever_the_number_of_tokenising_processes(tmp_path):
    def blocks(num_proc: int) -> list:
        cfg = load_config(["--config", CONFIG, "--task", "causal_lm", "--packing", "true", "--max_seq_len", "32",
                           "--data_num_proc", str(num_proc), "--data_cache_dir", str(tmp_path / f"cache{num_proc}")])
        return prepare(cfg, load_tokenizer(cfg)).data["train"]["input_ids"]

    one, two = blocks(1), blocks(2)
    assert one == two and len(one) > 100 and {len(b) for b in one} == {32}


def prepare_in(folder, cache, *flags):
    cfg = load_config(["--config", CONFIG, "--task", "causal_lm", "--dataset", str(folder),
                       "--data_cache_dir", str(cache), *flags])
    return prepare(cfg, load_tokenizer(cfg))


@pytest.fixture
def corpus(tmp_path):
    folder = tmp_path / "corpus"
    shutil.copytree(ROOT / "src" / "{{ cookiecutter.project_slug }}" / "assets" / "data" / "causal_lm", folder)
    return folder


def test_a_warm_start_reads_only_the_prepared_data(corpus, tmp_path, monkeypatch):
    """The second start finds the prepared folder by the raw files' size and times, checks the
    folder's own checksums and reads nothing else: neither the raw files' check nor their reading runs."""
    first = prepare_in(corpus, tmp_path / "cache")
    meta = (first.folder / "prepared.json").stat().st_mtime_ns

    def unexpected(*args, **kwargs):
        raise AssertionError("a warm start read the raw files")

    monkeypatch.setattr(prepare_module, "check_source", unexpected)
    monkeypatch.setattr(prepare_module, "read_raw", unexpected)
    second = prepare_in(corpus, tmp_path / "cache")
    assert second.folder == first.folder and (second.folder / "prepared.json").stat().st_mtime_ns == meta
    assert second.data["train"]["input_ids"] == first.data["train"]["input_ids"]
    assert second.fingerprint == first.fingerprint


def test_an_edit_that_keeps_the_size_and_the_mtime_prepares_anew(corpus, tmp_path):
    """Other words of the same length, the modification time put back: the change time still moves,
    so the edit is prepared, not the old tokens trusted."""
    first = prepare_in(corpus, tmp_path / "cache")
    train = corpus / "train.jsonl"
    stat, text = train.stat(), train.read_text()
    train.write_text(text.replace("the", "cat", 1))
    os.utime(train, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert (train.stat().st_size, train.stat().st_mtime_ns) == (stat.st_size, stat.st_mtime_ns)
    second = prepare_in(corpus, tmp_path / "cache")
    assert second.folder != first.folder and second.fingerprint != first.fingerprint
    assert second.data["train"]["input_ids"] != first.data["train"]["input_ids"]


def _zero_the_middle(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2:len(data) // 2 + 64] = bytes(64)
    path.write_bytes(bytes(data))


DAMAGE = {"zeroed_bytes": _zero_the_middle,
          "truncated": lambda p: p.write_bytes(p.read_bytes()[:len(p.read_bytes()) // 3]),
          "garbage": lambda p: p.write_bytes(os.urandom(p.stat().st_size)), "missing": lambda p: p.unlink()}


@pytest.mark.parametrize("how", [*DAMAGE, "meta"])
def test_a_damaged_cache_is_prepared_again_with_one_line(corpus, tmp_path, capsys, how):
    first = prepare_in(corpus, tmp_path / "cache")
    tokens = list(first.data["train"]["input_ids"])  # read now: the folder is memory-mapped
    (arrow,) = (first.folder / "train").glob("*.arrow")
    if how == "meta":
        (first.folder / "prepared.json").write_text("{not json")
    else:
        DAMAGE[how](arrow)
    capsys.readouterr()
    second = prepare_in(corpus, tmp_path / "cache")
    lines = capsys.readouterr().out.splitlines()
    damaged = [line for line in lines if "is damaged" in line]
    assert len(damaged) == 1 and damaged[0].startswith(f"data: the prepared data in {first.folder} is damaged ("), lines
    assert damaged[0].endswith("; preparing it again")
    assert second.folder == first.folder and list(second.data["train"]["input_ids"]) == tokens
    assert second.fingerprint == first.fingerprint


def test_the_fingerprint_is_of_the_content_not_the_place(corpus, tmp_path):
    """The same files staged to another folder (a node's local disk) fingerprint alike, however many
    processes tokenised them; other texts of the same number of examples do not."""
    first = prepare_in(corpus, tmp_path / "cache")
    staged = tmp_path / "staged"
    shutil.copytree(corpus, staged)
    again = prepare_in(staged, tmp_path / "cache", "--data_num_proc", "2")
    assert again.folder != first.folder and again.fingerprint == first.fingerprint
    lines = (corpus / "train.jsonl").read_text().splitlines()
    (staged / "train.jsonl").write_text("\n".join(lines[1:] + lines[:1]) + "\n")  # the same rows, another order
    other = prepare_in(staged, tmp_path / "cache")
    assert len(other.data["train"]) == len(first.data["train"]) and other.fingerprint != first.fingerprint


def _shard(corpus, names):
    """train.jsonl cut into len(names) consecutive shards of the given names."""
    lines = (corpus / "train.jsonl").read_text().splitlines(keepends=True)
    (corpus / "train.jsonl").unlink()
    size = math.ceil(len(lines) / len(names))
    for index, name in enumerate(names):
        (corpus / name).write_text("".join(lines[index * size:(index + 1) * size]))


@pytest.mark.parametrize("names", [["train.00.jsonl", "train.01.jsonl"],
                                   [f"train.{i}.jsonl" for i in range(1, 11)],
                                   [f"train-{i:05d}-of-00004.jsonl" for i in range(4)]])
def test_numbered_shards_are_read_together_in_order(corpus, tmp_path, names):
    whole = prepare_in(corpus, tmp_path / "cache")
    _shard(corpus, names)
    sharded = prepare_in(corpus, tmp_path / "cache")
    assert len(sharded.data["train"]) == 800 and sharded.fingerprint == whole.fingerprint
    assert sharded.data["train"]["input_ids"] == whole.data["train"]["input_ids"]


@pytest.mark.parametrize("names,expected", [
    (["train.jsonl", "train.backup.jsonl"], "has train.backup.jsonl, train.jsonl for split train: which to read is "
                                            "not clear; keep one train.jsonl/.json/.csv/.parquet, or numbered shards"),
    (["train.jsonl", "train.00.jsonl"], "has train.00.jsonl, train.jsonl for split train: which to read is not clear"),
    (["train.00.jsonl", "train.00.csv"], "has train.00.csv, train.00.jsonl for split train"),
    (["train.backup.jsonl"], "has train.backup.jsonl for split train: which to read is not clear"),
    (["train.00.jsonl", "train.02.jsonl"], "has the train shards train.00.jsonl, train.02.jsonl, not numbered "
                                           "without gaps (shard 1 is missing)"),
    (["train-00000-of-00003.jsonl", "train-00001-of-00003.jsonl"], "(shard 2 is missing)"),
    ([f"train-{i:05d}-of-00002.jsonl" for i in range(3)], "(shard 2 is beyond the 2 its name counts)"),
    (["train.1.jsonl", "train.01.jsonl", "train.2.jsonl"], "(shard 1 twice)"),
])
def test_an_ambiguous_split_is_one_line_naming_its_files(corpus, tmp_path, names, expected):
    text = (corpus / "train.jsonl").read_text()
    (corpus / "train.jsonl").unlink()
    for name in names:
        (corpus / name).write_text(text)
    with pytest.raises(ConfigError) as err:
        prepare_in(corpus, tmp_path / "cache")
    assert f"dataset {corpus} " in str(err.value) and expected in str(err.value) and "\n" not in str(err.value)


def test_a_bad_line_in_a_shard_names_the_shard_and_its_line(corpus, tmp_path):
    _shard(corpus, ["train.00.jsonl", "train.01.jsonl"])
    with (corpus / "train.01.jsonl").open("a") as f:
        f.write('{"text": 5}\n')
    with pytest.raises(ConfigError, match=f"^dataset {corpus / 'train.01.jsonl'} example 401 has text 5 \\(int\\)"):
        prepare_in(corpus, tmp_path / "cache")


@pytest.mark.parametrize("change", ["file", "max_seq_len", "packing"])
def test_what_changes_the_data_prepares_it_anew(corpus, tmp_path, change):
    first = prepare_in(corpus, tmp_path / "cache").folder
    flags = {"max_seq_len": ["--max_seq_len", "32"], "packing": ["--packing", "true"]}.get(change, [])
    if change == "file":
        with (corpus / "train.jsonl").open("a") as f:
            f.write('{"text": "one more story"}\n')
    second = prepare_in(corpus, tmp_path / "cache", *flags)
    assert second.folder != first and (first / "prepared.json").is_file()


def prompt_mask(example: dict, task: str) -> torch.Tensor:
    """data.labels_for with a prompt mask of each example's first 3 tokens, as docs/extending.md shows."""
    labels = torch.tensor(example["input_ids"], dtype=torch.long)
    labels[:3] = IGNORE_INDEX
    return labels


def test_an_edit_to_the_preparing_code_prepares_anew(corpus, tmp_path, monkeypatch):
    """The preparing modules' source is part of the cache key (a comment added to prepare.py: a new
    folder, the same content), and so is the labelling rule, whose targets the Collator and the
    prepared counts then agree on, with a new data_fingerprint (a resume on it is refused)."""
    first = prepare_in(corpus, tmp_path / "cache")
    edited = tmp_path / "prepare.py"
    edited.write_text(Path(prepare_module.__file__).read_text() + "# an edit\n")
    monkeypatch.setattr(prepare_module, "__file__", str(edited))
    second = prepare_in(corpus, tmp_path / "cache")
    assert second.folder != first.folder and second.fingerprint == first.fingerprint
    monkeypatch.undo()
    for module in (data_module, data_cache_module, prepare_module):
        monkeypatch.setattr(module, "labels_for", prompt_mask)
    masked = prepare_in(corpus, tmp_path / "cache")
    assert masked.folder not in (first.folder, second.folder) and masked.fingerprint != first.fingerprint
    train = masked.data["train"]
    lengths = [len(ids) for ids in train["input_ids"]]
    assert first.data["train"][TARGETS] == [max(n - 1, 0) for n in lengths]
    assert train[TARGETS] == [max(n - 3, 0) for n in lengths]
    batch = Collator(load_tokenizer(load_config(["--config", CONFIG])), "causal_lm")([train[i] for i in range(6)])
    assert count_targets(batch["labels"], "causal_lm") == sum(train[TARGETS][:6])


def test_a_lock_left_by_a_dead_preparer_is_taken_over(corpus, tmp_path):
    cfg = load_config(["--config", CONFIG, "--task", "causal_lm", "--dataset", str(corpus),
                       "--data_cache_dir", str(tmp_path / "cache")])
    tokenizer = load_tokenizer(cfg)
    folder = cache_folder(cfg, find_source(cfg), tokenizer)
    folder.parent.mkdir(parents=True)
    lock = folder.with_name(folder.name + ".lock")
    lock.write_text('{"host": "gone", "pid": 1}')
    os.utime(lock, (time.time() - 120, time.time() - 120))  # no heartbeat for two minutes
    assert prepare(cfg, tokenizer).folder == folder and not lock.exists()


@pytest.mark.slow
def test_two_processes_prepare_the_data_once_and_a_second_start_reuses_it(env, corpus, tmp_path):
    flags = {"dataset": corpus, "data_cache_dir": tmp_path / "cache", "micro_batch_size": 2, "global_batch_size": 8,
             "max_steps": 2}
    first = successful_run(ENTRIES[0], 2, tmp_path / "first", env, flags)
    assert first.returncode == 0, first.stderr[-3000:]
    output = first.stdout + first.stderr
    assert output.count("data: preparing ") == 1 and output.count("data: prepared ") == 1, output[-3000:]
    (folder,) = (tmp_path / "cache").glob("causal_lm-corpus-*")
    meta = json.loads((folder / "prepared.json").read_text())
    assert meta["prepared_by"]["rank"] in ("0", "1") and meta["examples"]["train"] == 800
    second = successful_run(ENTRIES[0], 2, tmp_path / "second", env, flags)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "data: prepar" not in second.stdout + second.stderr
    assert json.loads((folder / "prepared.json").read_text()) == meta
    assert [r["loss"] for r in second.steps] == [r["loss"] for r in first.steps]


@pytest.mark.slow
def test_the_data_can_be_prepared_before_the_job(env, corpus, tmp_path):
    cache = tmp_path / "cache"
    flags = {"dataset": corpus, "data_cache_dir": cache, "packing": "true"}
    proc = subprocess.run([sys.executable, "-m", "{{ cookiecutter.project_slug }}.prepare", *flag_args(flags)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("ready: ") and "training and" in proc.stdout
    run = run_entry(ENTRIES[0], 1, tmp_path / "out", env, {**flags, "max_steps": 1})
    assert run.returncode == 0 and "data: prepar" not in run.stdout + run.stderr, run.stderr[-3000:]


def test_a_lock_whose_holder_on_this_host_is_gone_is_taken_over_at_once(corpus, tmp_path, capsys):
    """A preparer killed on this host: its fresh lock is taken over at once (its pid runs no more),
    and what it left half written is removed, in one line."""
    cfg = load_config(["--config", CONFIG, "--task", "causal_lm", "--dataset", str(corpus),
                       "--data_cache_dir", str(tmp_path / "cache")])
    tokenizer = load_tokenizer(cfg)
    folder = cache_folder(cfg, find_source(cfg), tokenizer)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    holder = {"host": socket.gethostname(), "pid": gone.pid}
    left = prepare_module.work_folder(folder, holder)
    (left / "raw").mkdir(parents=True)
    (left / "raw" / "part.arrow").write_bytes(b"\0" * 3 * 2**20)
    folder.with_name(folder.name + ".lock").write_text(json.dumps(holder))
    started = time.monotonic()
    assert prepare(cfg, tokenizer).folder == folder and time.monotonic() - started < STALE_S
    assert sorted(p.name for p in folder.parent.iterdir()) == [folder.name]
    said = [line for line in capsys.readouterr().out.splitlines() if "is gone" in line]
    assert said == [f"data: the process that was preparing {folder} is gone (host {holder['host']}, pid {gone.pid}), "
                    f"removing the 3.0 MB it left in {left}; taking over"]


@pytest.fixture(scope="module")
def long_corpus(tmp_path_factory) -> Path:
    """32,000 training documents (the shipped 800, over and over): a few seconds of tokenising in
    2 processes, long enough for a signal to come meanwhile."""
    folder = tmp_path_factory.mktemp("long_corpus")
    source = ROOT / "src" / "{{ cookiecutter.project_slug }}" / "assets" / "data" / "causal_lm"
    (folder / "train.jsonl").write_text((source / "train.jsonl").read_text() * 40)
    shutil.copy(source / "validation.jsonl", folder / "validation.jsonl")
    return folder


def running(pid: int) -> bool:
    """Whether `pid` still runs (a zombie waits only for its parent to read its exit)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] not in "ZX"
    except OSError:
        return False


def signalled_while_preparing(corpus: Path, cache: Path, out: Path, env: dict, signum: int,
                              shell_ignores: bool = False) -> tuple[Run, int, list]:
    """One process preparing `corpus` with 2 tokenising workers, given `signum` half a second into
    the tokenising: its exit, its pid and its children then (workers, the pool's manager).
    `shell_ignores`: started as the sbatch scripts start it, from a shell that ignores SIGUSR1."""
    flags = {"dataset": corpus, "data_cache_dir": cache, "data_num_proc": 2, "max_steps": 3}
    with run_entry(ENTRIES[0], 1, out, env, flags, under=IGNORING_USR1 if shell_ignores else (),
                   background=True) as proc:
        deadline = time.monotonic() + LAUNCH_TIMEOUT_S
        while "data: preparing" not in read_logs(out)[0]:
            assert proc.poll() is None and time.monotonic() < deadline, read_logs(out)[1][-3000:]
            time.sleep(0.05)
        time.sleep(0.5)
        children = children_of().get(proc.pid, [])
        os.kill(proc.pid, signum)
    return Run(proc.returncode, *read_logs(out), out), proc.pid, children


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_while_preparing_is_one_line_and_leaves_nothing_behind(long_corpus, env, tmp_path, signum):
    cache = tmp_path / "cache"
    proc, _, children = signalled_while_preparing(long_corpus, cache, tmp_path / "out", env, signum)
    line = one_error_line(proc, f"error: stopped by {signal.Signals(signum).name} while preparing {cache}/causal_lm-",
                          code=128 + signum)
    assert line.endswith(": nothing half written is left; the next start prepares it")
    assert list(cache.iterdir()) == []  # neither the half-written folder nor the lock
    assert len(children) >= 3 and not [pid for pid in children if running(pid)]
    assert not (tmp_path / "out" / ".lock").exists()


@pytest.mark.slow
def test_a_killed_preparer_leaves_no_process_and_the_next_start_takes_over_at_once(long_corpus, env, tmp_path):
    cache = tmp_path / "cache"
    killed, pid, children = signalled_while_preparing(long_corpus, cache, tmp_path / "out", env, signal.SIGKILL)
    assert killed.returncode == -signal.SIGKILL and len(children) >= 3
    deadline = time.monotonic() + 5
    while [child for child in children if running(child)]:  # Linux's parent-death signal ends them
        assert time.monotonic() < deadline, [child for child in children if running(child)]
        time.sleep(0.05)
    assert any(p.name.startswith(".tmp-") for p in cache.iterdir()) and list(cache.glob("*.lock"))
    started = time.monotonic()
    again = run_entry(ENTRIES[0], 1, tmp_path / "out", env, {"dataset": long_corpus, "data_cache_dir": cache,
                                                              "data_num_proc": 2, "max_steps": 1})
    assert again.returncode == 0 and time.monotonic() - started < STALE_S, again.stderr[-3000:]
    (folder,) = cache.glob("causal_lm-*")
    taking_over = [line for line in again.stdout.splitlines() if line.startswith("data: the process that was")]
    assert len(taking_over) == 1 and f"(host {socket.gethostname()}, pid {pid}), removing the " in taking_over[0]
    left = prepare_module.work_folder(folder, {"host": socket.gethostname(), "pid": pid})
    assert taking_over[0].endswith(f" MB it left in {left}; taking over")
    assert [p.name for p in cache.iterdir()] == [folder.name]  # nothing half written, no lock


@pytest.mark.slow
def test_the_preemption_signal_while_preparing_stops_the_run_at_its_first_step(long_corpus, env, tmp_path):
    """As the sbatch scripts start it (from a shell that ignores SIGUSR1): remembered, and honoured
    at the first step boundary with a checkpoint."""
    proc, _, _ = signalled_while_preparing(long_corpus, tmp_path / "cache", tmp_path / "out", env, signal.SIGUSR1,
                                           shell_ignores=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "(step 1 of 3), on preemption signal (SIGUSR1)" in proc.stdout
    assert (tmp_path / "out" / "checkpoints" / "step_1").is_dir()


@pytest.mark.parametrize("where", ["reading", "tokenising"])
def test_a_full_disk_while_preparing_is_one_line_about_the_disk_not_the_data(corpus, tmp_path, monkeypatch, where):
    def full(*args, **kwargs):
        raise RuntimeError("a library's own error around it") from OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(*((sources_module, "load_dataset") if where == "reading" else (prepare_module, "tokenize")),
                        full)
    with pytest.raises(ConfigError) as err:
        prepare_in(corpus, tmp_path / "cache")
    assert str(err.value) == (f"data_cache_dir {tmp_path / 'cache'} has no room to prepare {corpus} (No space left on "
                              "device); free space there, or give --data_cache_dir a folder on a disk with room")
    assert not [p.name for p in (tmp_path / "cache").iterdir() if p.name.startswith(".tmp-") or p.suffix == ".lock"]


def test_a_data_cache_dir_that_links_to_a_folder_not_yet_made_makes_it(corpus, tmp_path):
    """As the image's data_cache does: a link into a volume mounted empty."""
    (tmp_path / "data_cache").symlink_to(tmp_path / "volume" / "data")
    folder = prepare_in(corpus, tmp_path / "data_cache").folder
    assert folder.parent == tmp_path / "data_cache" and (tmp_path / "volume" / "data" / folder.name).is_dir()


def test_a_data_cache_dir_that_cannot_be_written_to_is_one_line(corpus, tmp_path, monkeypatch):
    """As for a folder of another user (root, who runs this suite in CI, may write anywhere)."""
    opened = os.open

    def refused(path, *args, **kwargs):
        if str(path).endswith(".lock"):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return opened(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", refused)
    with pytest.raises(ConfigError) as err:
        prepare_in(corpus, tmp_path / "cache")
    # the whole line of the family: the full disk's, above
    assert str(err.value).startswith(f"data_cache_dir {tmp_path / 'cache'} cannot be written to (Permission denied)")


@pytest.mark.parametrize("text", ["训练数据只有中文", "The quick brown fox jumps over a lazy dog", ""])
def test_text_the_tokenizer_does_not_know_is_one_line_or_a_note(corpus, tmp_path, capsys, text):
    """Unknown tokens measured as the data is prepared: over half of the training tokens, one line
    naming the share and the model; a few, a note; none (the shipped data), nothing."""
    train = corpus / "train.jsonl"
    lines = train.read_text().splitlines()
    if text:
        train.write_text("\n".join(json.dumps({"text": text}) for _ in lines) + "\n")
    else:  # three unknown words after each document: about a tenth of the tokens
        train.write_text("\n".join(json.dumps({"text": json.loads(line)["text"] + " zyzzyva quixotic xylem"})
                                   for line in lines) + "\n")
    if text:
        with pytest.raises(ConfigError, match=r"^\d+\.\d% of the training tokens of .* are unknown to the tokenizer of "
                           r"model_name_or_path tiny \(\[UNK\]\): the model would not see the text; use a model whose "
                           "tokenizer covers it$") as refused:
            prepare_in(corpus, tmp_path / "cache")
        assert float(str(refused.value).split("%")[0]) > 50
        return
    prepare_in(corpus, tmp_path / "cache")
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note: ")]
    assert len(said) == 1 and re.match(r"note: [0-9.]+% of the training tokens", said[0]), said
    prepare_in(ROOT / "src" / "{{ cookiecutter.project_slug }}" / "assets" / "data" / "causal_lm", tmp_path / "cache2")
    assert "unknown" not in capsys.readouterr().out


@pytest.mark.parametrize("finished", [True, False])
def test_a_preparer_whose_preparation_was_taken_over_uses_the_data_or_says_so(corpus, tmp_path, capsys, monkeypatch,
                                                                              finished):
    """Stopped past the stale time while preparing (a suspended job), its lock taken over by another
    host's process, which removed its work: on waking its writes fail. It uses the other's data once
    that is whole, else ends in one line; it leaves the other's lock as it is."""
    from {{ cookiecutter.project_slug }}.errors import JobFailed

    real = prepare_module._prepare_into
    other = {"host": "node-7", "pid": 1, "started": ""}

    def stopped_and_taken_over(folder, source, tokenizer, cfg):
        if finished:
            real(folder, source, tokenizer, cfg)  # as the other process did, meanwhile
        folder.with_name(folder.name + ".lock").write_text(json.dumps(other))
        raise FileNotFoundError(2, "No such file or directory")  # this process's removed work folder

    monkeypatch.setattr(prepare_module, "_prepare_into", stopped_and_taken_over)
    if finished:
        prepared = prepare_in(corpus, tmp_path / "cache")
        assert "which took the preparation over while this process was stopped; using it" in capsys.readouterr().out
    else:
        with pytest.raises(JobFailed, match=r"^the preparation of .* was taken over by node-7:1 while this process was "
                                            "stopped; start this job again once it has prepared the data$"):
            prepare_in(corpus, tmp_path / "cache")
    lock = next((tmp_path / "cache").glob("*.lock"))
    assert json.loads(lock.read_text()) == other and not list((tmp_path / "cache").glob("*.error"))
    if finished:
        assert prepared.folder.is_dir() and len(prepared.data["train"]) > 0
