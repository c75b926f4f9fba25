"""Data preparation: read the raw splits, check them, tokenise (and pack) them, once, into
data_cache_dir (data_cache.py). Cheap checks run up front; full-pass ones (every line parses, every
text is a string, labels 0..K-1) inside the one preparation, so a large dataset is read once.
docs/data.md tells the story.
"""

import contextlib
import csv
import json
import logging
import os
import shutil
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import transformers
from datasets import Dataset, DatasetDict, load_dataset, load_from_disk

from . import ASSETS
from .config import TrainConfig
from .data_cache import HEARTBEAT_S, META_FILE, PreparationLock, cache_folder
from .errors import ConfigError, first_line

SPLITS = ("train", "validation")
BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}


def columns_of(task: str) -> tuple[str, ...]:
    return ("text", "label") if task == "sequence_classification" else ("text",)


@dataclass(frozen=True)
class Source:
    """Where the raw data is: files of a folder (by split), a save_to_disk() folder, or a hub name."""

    name: str
    files: dict[str, Path] | None = None
    saved: Path | None = None

    @property
    def builder(self) -> str:
        return BUILDERS[next(iter(self.files.values())).suffix]


def find_source(cfg: TrainConfig) -> Source:
    """The dataset named by `cfg.dataset`: its files found, none of them read (see check_source)."""
    folder = ASSETS / "data" / cfg.task if cfg.dataset == "builtin" else Path(cfg.dataset)
    if cfg.dataset != "builtin" and not folder.is_dir():
        if folder.exists() or cfg.dataset.startswith((".", "/", "~")):
            raise ConfigError(f"dataset {cfg.dataset} is not a folder of train/validation files")
        return Source(cfg.dataset)  # a hub name: checked when it is loaded
    if (folder / "dataset_dict.json").is_file():
        for split in SPLITS:
            if not (folder / split).is_dir():
                raise ConfigError(f"dataset {folder} has no {split} split")
        return Source(cfg.dataset, saved=folder)
    files = {}
    for split in SPLITS:
        matches = [p for p in sorted(folder.glob(f"{split}.*")) if p.suffix in BUILDERS]
        if not matches:
            if split == "train":
                raise ConfigError(f"dataset folder {folder} has no train.jsonl/.json/.csv/.parquet file")
            raise ConfigError(f"dataset {folder} has no validation split (validation.jsonl/.json/.csv/.parquet)")
        files[split] = matches[0]
    if len({BUILDERS[p.suffix] for p in files.values()}) > 1:
        raise ConfigError(f"dataset {folder}: {files['train'].name} and {files['validation'].name} must have "
                          "one format")
    for split, path in files.items():
        if path.stat().st_size == 0:
            raise ConfigError(f"dataset file {path} is empty: split {split} needs examples")
    return Source(cfg.dataset, files=files)


def check_source(source: Source, task: str) -> None:
    """The cheap checks, run by every process before any waits for the preparation: each file's
    first record (or header, or schema) has the task's columns. A warm start skips them: its data
    was checked whole when it was prepared."""
    if source.saved is not None:
        _check_saved_columns(source, task)
    for split, path in (source.files or {}).items():
        _check_first_record(path, split, task)


def _check_first_record(path: Path, split: str, task: str) -> None:
    """The file's first record (or header, or schema) has the task's columns."""
    if path.suffix == ".parquet":
        try:
            names = pq.read_schema(path).names
        except Exception as err:  # pyarrow's errors for a damaged file are several
            raise ConfigError(f"dataset file {path} is not a readable parquet file: {err}") from None
    elif path.suffix == ".csv":
        with path.open(newline="", errors="replace") as f:
            names = next(csv.reader(f), [])
    else:
        with path.open(errors="replace") as f:
            number, line = next(((n, text) for n, text in enumerate(f, 1) if text.strip()), (0, ""))
        if not number:
            raise ConfigError(f"dataset file {path} holds no examples: split {split} needs some")
        if path.suffix == ".json" and line.lstrip().startswith("["):
            return  # a JSON array: its records are checked when it is read
        record = _parse_json_line(path, number, line)
        names = list(record)
    _check_columns(names, f"dataset file {path}", task)


def _check_saved_columns(source: Source, task: str) -> None:
    for split in SPLITS:
        try:
            info = json.loads((source.saved / split / "dataset_info.json").read_text())
            names = list(info["features"])
        except (OSError, ValueError, KeyError) as err:
            raise ConfigError(f"dataset {source.saved} split {split} is not a readable save_to_disk() "
                              f"folder ({err!r})") from None
        _check_columns(names, f"dataset {source.saved} split {split}", task)


def _check_columns(names: list[str], where: str, task: str) -> None:
    missing = [c for c in columns_of(task) if c not in names]
    if missing:
        raise ConfigError(f"{where} lacks column(s) {', '.join(missing)} needed by task {task} "
                          f"(it has {', '.join(map(str, names)) or 'none'})")


def _parse_json_line(path: Path, number: int, line: str) -> dict:
    try:
        record = json.loads(line)
    except ValueError as err:
        raise ConfigError(f"dataset file {path} line {number} is not valid JSON: {err}") from None
    if not isinstance(record, dict):
        raise ConfigError(f"dataset file {path} line {number} is not a JSON object: {line.strip()[:60]}")
    return record


def _first_bad_json(path: Path) -> None:
    """Raise for the first place of a JSON (array or lines) file that does not parse: the error path
    only, since a library's message for it names a block, not a line."""
    text = path.read_text(errors="replace")
    if text.lstrip().startswith("["):
        try:
            json.loads(text)
        except ValueError as err:
            raise ConfigError(f"dataset file {path} is not valid JSON at line {err.lineno}, column {err.colno}: "
                              f"{err.msg}") from None
        return
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip():
            _parse_json_line(path, number, line)


@contextlib.contextmanager
def _quiet_datasets() -> Iterator[None]:
    """datasets logs its own copy of every read error (and progress bars), the tokenizer warns of
    every document longer than its model (packing cuts them itself): we say what matters in a line."""
    levels = datasets.logging.get_verbosity(), transformers.logging.get_verbosity()
    datasets.logging.set_verbosity(logging.CRITICAL)
    transformers.logging.set_verbosity(logging.ERROR)
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        datasets.logging.set_verbosity(levels[0])
        transformers.logging.set_verbosity(levels[1])


def read_raw(source: Source, cache_dir: Path | None) -> DatasetDict:
    """The train and validation splits as Arrow tables (written under `cache_dir`). A folder's
    files are read one by one, so each has its own column types and its own error."""
    cache = cache_dir and str(cache_dir)
    with _quiet_datasets():
        if source.saved is not None:
            raw = load_from_disk(str(source.saved))
        elif source.files is not None:
            raw = {split: _read_file(path, source.builder, cache) for split, path in source.files.items()}
        else:
            try:
                raw = load_dataset(source.name, cache_dir=cache)
            except Exception as err:  # the hub's errors are many; the user needs the first line
                raise ConfigError(f"cannot load dataset {source.name!r}: {first_line(err)}") from None
    if "validation" not in raw:
        raise ConfigError(f"dataset {source.name} has no validation split")
    return DatasetDict(train=raw["train"], validation=raw["validation"])


def _read_file(path: Path, builder: str, cache_dir: str | None):
    try:
        return load_dataset(builder, data_files={"train": str(path)}, cache_dir=cache_dir)["train"]
    except Exception as err:  # pyarrow, pandas and datasets each raise their own
        if "corresponds to no data" in str(err):
            raise ConfigError(f"dataset file {path} holds no examples") from None
        if builder == "json":
            _first_bad_json(path)
        cause = err
        while cause.__cause__ or cause.__context__:
            cause = cause.__cause__ or cause.__context__
        raise ConfigError(f"dataset file {path} cannot be read: {first_line(cause)}") from None


def _value_type(feature) -> str:
    return getattr(feature, "dtype", type(feature).__name__)


def _describe(value) -> str:
    return f"{value!r} ({type(value).__name__})" if value is not None else "null"


def _first(split, column: str, bad) -> tuple[int, object]:
    """The first example whose `column` value is `bad(value)`: only run once a problem is known."""
    for index, value in enumerate(split[column]):
        if bad(value):
            return index, value
    return -1, None


def validate(raw: DatasetDict, source: Source, task: str) -> int:
    """Every check that needs the whole data; returns the number of labels (classification) or 0."""
    where = {split: str(source.files[split]) if source.files else f"{source.name} split {split}" for split in SPLITS}
    for split in SPLITS:
        data = raw[split]
        if len(data) == 0:
            raise ConfigError(f"dataset {where[split]} holds no examples: split {split} needs some")
        for column in columns_of(task):
            if column not in data.column_names:
                raise ConfigError(f"dataset {where[split]} lacks column {column} needed by task {task}")
        text = data.features["text"]
        if _value_type(text) not in ("string", "large_string"):
            index, value = _first(data, "text", lambda v: not isinstance(v, str))
            raise ConfigError(f"dataset {where[split]} example {index + 1} has text {_describe(value)}: every "
                              "text must be a string")
        if data.data.column("text").null_count:
            index = pc.index(pc.is_null(data.data.column("text")), True).as_py()
            raise ConfigError(f"dataset {where[split]} example {index + 1} has text null: every text must be a string")
    if task != "sequence_classification":
        return 0
    labels = {}
    for split in SPLITS:
        data, feature = raw[split], raw[split].features["label"]
        column = data.data.column("label")
        integer = _value_type(feature).startswith(("int", "uint"))
        if not integer or column.null_count:
            index, value = _first(data, "label", lambda v: type(v) is not int)
            raise ConfigError(f"dataset {where[split]} example {index + 1} has label {_describe(value)}: labels "
                              "must be whole numbers 0, 1, ... (one per class)")
        low = pc.min(column).as_py()
        if low < 0:
            index = pc.index(column, low).as_py()
            raise ConfigError(f"dataset {where[split]} example {index + 1} has label {low}: labels must be 0, 1, ...")
        labels[split] = set(pc.unique(column).to_pylist())
    classes = max(labels["train"]) + 1
    if classes < 2:
        raise ConfigError(f"dataset {where['train']}: every training label is 0, one class; classification needs "
                          "at least two (labels 0 and 1), or train task causal_lm")
    missing = sorted(set(range(classes)) - labels["train"])
    if missing:
        shown = ", ".join(map(str, missing[:5])) + (", ..." if len(missing) > 5 else "")
        raise ConfigError(f"dataset {where['train']}: training labels must be 0..{classes - 1} with every class "
                          f"present, but {len(missing)} of them have no example ({shown}); number the classes "
                          "0..K-1")
    unknown = sorted(labels["validation"] - labels["train"])
    if unknown:
        index = pc.index(raw["validation"].data.column("label"), unknown[0]).as_py()
        raise ConfigError(f"dataset {where['validation']} example {index + 1} has label {unknown[0]}, which no "
                          f"training example has (training labels are 0..{classes - 1})")
    return classes


def check_max_seq_len(cfg: TrainConfig, tokenizer) -> None:
    """Truncation must leave room for text beside the tokenizer's own special tokens."""
    special = tokenizer.num_special_tokens_to_add()
    if cfg.max_seq_len <= special:
        raise ConfigError(f"max_seq_len {cfg.max_seq_len} leaves no room for text: the tokenizer adds {special} "
                          f"special token(s) to each example; use max_seq_len >= {special + 1}")


def tokenize(raw: DatasetDict, tokenizer, cfg: TrainConfig, work: Path) -> DatasetDict:
    """input_ids per example, plus `label` for classification: truncated to max_seq_len, or whole
    documents when they are to be packed. Written under `work`, `num_proc` processes at a time."""
    keep = {"label"} if cfg.task == "sequence_classification" else set()
    num_proc = cfg.data_num_proc or (min(os.cpu_count() or 1, 8) if len(raw["train"]) >= 100_000 else 1)

    def encode(batch):
        ids = tokenizer(batch["text"], truncation=not cfg.packing, max_length=cfg.max_seq_len)["input_ids"]
        return {"input_ids": ids}

    with _quiet_datasets():
        return DatasetDict({
            split: ds.map(encode, batched=True, num_proc=num_proc if len(ds) >= 2 * num_proc else None,
                          cache_file_name=str(work / f"{split}.arrow"),
                          remove_columns=[c for c in ds.column_names if c not in keep])
            for split, ds in raw.items()
        })


def pack(documents, eos_id: int, block: int, path: Path):
    """Join the documents in order into one stream, one EOS between them (a document that ends in
    EOS gets none more), and cut it into blocks of `block` tokens; the remainder is dropped. The
    blocks do not depend on how the stream was read (num_proc, chunks): one pass, with a carry."""
    column = documents.data.column("input_ids")
    schema = pa.schema([("input_ids", pa.list_(pa.int32(), block))])
    carry = np.empty(0, dtype=np.int32)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        for chunk in column.chunks:
            offsets = chunk.offsets.to_numpy()
            if offsets[-1] == offsets[0]:
                continue
            tokens = chunk.values.to_numpy(zero_copy_only=False)[offsets[0]:offsets[-1]].astype(np.int32)
            ends = offsets[1:] - offsets[0]
            nonempty = ends > offsets[:-1] - offsets[0]
            without_eos = nonempty & (tokens[np.maximum(ends - 1, 0)] != eos_id)
            stream = np.concatenate([carry, np.insert(tokens, ends[without_eos], eos_id)])
            whole = len(stream) // block * block
            if whole:
                blocks = pa.FixedSizeListArray.from_arrays(pa.array(stream[:whole]), block)
                writer.write_batch(pa.record_batch([blocks], schema=schema))
            carry = stream[whole:]
    return Dataset.from_file(str(path))


def _prepare_into(folder: Path, source: Source, tokenizer, cfg: TrainConfig) -> None:
    """Read, check, tokenise (and pack) the data into `folder`, atomically: a temporary folder
    beside it is renamed once everything is written."""
    started = time.monotonic()
    work = folder.with_name(f".tmp-{folder.name}-{socket.gethostname()}-{os.getpid()}")
    shutil.rmtree(work, ignore_errors=True)
    try:
        raw = read_raw(source, work / "raw")
        num_labels = validate(raw, source, cfg.task)
        print(f"data: preparing {sum(map(len, raw.values())):,} examples of {source.name} in {folder} (once; "
              "other processes wait for it)", flush=True)
        data = tokenize(raw, tokenizer, cfg, work)
        if cfg.packing:
            data = DatasetDict({split: pack(ds, tokenizer.eos_token_id, cfg.max_seq_len, work / f"{split}_packed.arrow")
                                for split, ds in data.items()})
        with _quiet_datasets():
            data.save_to_disk(str(work / "prepared"))
        meta = {"num_labels": num_labels, "examples": {split: len(ds) for split, ds in data.items()},
                "packing": cfg.packing, "max_seq_len": cfg.max_seq_len, "source": source.name,
                "prepared_by": {"host": socket.gethostname(), "pid": os.getpid(), "rank": os.environ.get("RANK", "0")},
                "seconds": round(time.monotonic() - started, 3)}
        (work / "prepared" / META_FILE).write_text(json.dumps(meta, indent=2))
        try:
            (work / "prepared").rename(folder)
        except OSError:  # another process (whose lock looked stale) finished first: its copy is the same
            if not (folder / META_FILE).is_file():
                raise
        print(f"data: prepared {meta['examples']['train']:,} training and {meta['examples']['validation']:,} "
              f"validation {'blocks' if cfg.packing else 'examples'} in {meta['seconds']:.1f} s: {folder}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def prepared_folder(cfg: TrainConfig, source: Source, tokenizer) -> Path:
    """The prepared data's folder: found (a warm start reads nothing else), or prepared here, or
    prepared by the process that holds the lock while this one waits."""
    folder = cache_folder(cfg, source, tokenizer)
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"data_cache_dir {folder.parent} cannot be created ({err.strerror}); choose a folder "
                          "you can write to") from None
    if (folder / META_FILE).is_file():
        return folder
    check_source(source, cfg.task)
    lock, waiting_since, said = PreparationLock(folder), time.time(), False
    while not (folder / META_FILE).is_file():
        if lock.error.is_file() and lock.error.stat().st_mtime >= waiting_since - HEARTBEAT_S:
            raise ConfigError(lock.error.read_text())  # what the process that prepared it found
        if lock.acquire():
            try:
                _prepare_into(folder, source, tokenizer, cfg)
            except ConfigError as err:
                lock.release(error=str(err))
                raise
            finally:
                lock.release()
        elif lock.stale():
            lock.path.unlink(missing_ok=True)  # its holder died: the next loop takes over
        else:
            if not said and os.environ.get("RANK", "0") in ("0", ""):
                print(f"data: waiting for {lock.holder()} to prepare {folder}", flush=True)
                said = True
            time.sleep(0.2)
    return folder


@dataclass(frozen=True)
class Prepared:
    data: DatasetDict  # memory-mapped from the prepared folder
    num_labels: int  # classification: classes; 0 for causal_lm
    folder: Path


def prepare(cfg: TrainConfig, tokenizer) -> Prepared:
    """The tokenised (or packed) train and validation splits, every input check done: the cheap
    ones here, the full-pass ones inside the one preparation."""
    check_max_seq_len(cfg, tokenizer)
    folder = prepared_folder(cfg, find_source(cfg), tokenizer)
    meta = json.loads((folder / META_FILE).read_text())
    with _quiet_datasets():
        data = load_from_disk(str(folder))
    return Prepared(DatasetDict(train=data["train"], validation=data["validation"]), meta["num_labels"], folder)
