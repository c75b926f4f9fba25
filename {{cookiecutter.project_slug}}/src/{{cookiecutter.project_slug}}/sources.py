"""The raw data: where it is (a folder of train/validation files, a save_to_disk() folder or a hub name), reading it,
and its checks: cheap ones up front (files exist, the first record has the task's columns), full-pass ones (every line
parses, texts are strings, labels 0..K-1, conversations have known roles and an answer) in the one reading.
"""

import contextlib
import csv
import json
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import transformers
from datasets import DatasetDict, concatenate_datasets, load_dataset, load_from_disk

from . import ASSETS
from .config import TrainConfig
from .errors import ConfigError, disk_full, first_line

SPLITS = ("train", "validation")
BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
SHARD = re.compile(r"^(?P<split>[a-z]+)(?:\.(?P<n>\d+)|-(?P<i>\d+)-of-(?P<total>\d+))(?P<suffix>\.[a-z]+)$")
ROLES = ("system", "user", "assistant")


def columns_of(task: str) -> tuple[str, ...]:
    return {"sequence_classification": ("text", "label"), "chat": ("messages",)}.get(task, ("text",))


def chat_problem(messages) -> str:
    """What keeps a chat record's `messages` from being a conversation to learn from; "" if nothing."""
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        return f"messages {_describe(messages)[:80]} is not a list of role/content objects"
    for turn, m in enumerate(messages, 1):
        if m.get("role") not in ROLES:
            return f"turn {turn} has role {_describe(m.get('role'))}, none of {', '.join(ROLES)}"
        if not isinstance(m.get("content"), str):
            return f"turn {turn} ({m['role']}) has content {_describe(m.get('content'))[:80]}, not a string"
    return "" if any(m["role"] == "assistant" for m in messages) else "no assistant turn, whose tokens the loss counts"


def place(where: str, index: int) -> str:
    """Example `index` of a part: its line in a JSON lines file (blank lines hold none), else its number."""
    path = Path(where)
    if path.suffix in (".jsonl", ".json") and path.is_file():
        text = path.read_text(errors="replace")
        if not text.lstrip().startswith("["):  # JSON lines, not one array
            lines = [number for number, line in enumerate(text.split("\n"), 1) if line.strip()]
            return f"line {lines[index]}"
    return f"example {index + 1}"


@dataclass(frozen=True)
class Source:
    """The raw data: a folder's files (each split's, in reading order), a save_to_disk() folder, or a hub name."""

    name: str
    files: dict[str, list[Path]] | None = None
    saved: Path | None = None


def split_files(folder: Path, split: str) -> list[Path]:
    """The files split `split` reads: `<split>.<ext>` alone, or numbered shards together in order (`<split>.00.jsonl`,
    ... or `<split>-00000-of-00004.parquet`, ..., without gaps); any other file named like the split is ambiguous."""
    named = (f"{split}.", f"{split}-")
    found = sorted(p for p in folder.iterdir() if p.suffix in BUILDERS and p.name.startswith(named))
    if [p.name for p in found] == [f"{split}{p.suffix}" for p in found[:1]]:
        return found
    shards = {p: SHARD.match(p.name) for p in found}
    styles = {(m["n"] is None, m["total"], m["suffix"]) for m in shards.values() if m and m["split"] == split}
    if len(styles) == 1 and all(m and m["split"] == split for m in shards.values()):
        number = {p: int(m["n"] or m["i"]) for p, m in shards.items()}
        ordered = sorted(found, key=number.get)
        numbers = [number[p] for p in ordered]
        total = shards[ordered[0]]["total"]  # "-00000-of-00004" numbers from 0; ".00", ".01" from the first
        expected = list(range(int(total)) if total is not None else range(numbers[0], numbers[0] + len(numbers)))
        if numbers == expected:
            return ordered
        twice, missing = [n for n in numbers if numbers.count(n) > 1], set(expected) - set(numbers)
        why = (f"shard {min(twice)} twice" if twice else f"shard {min(missing)} is missing" if missing
               else f"shard {max(numbers)} is beyond the {int(total)} its name counts")
        raise ConfigError(f"dataset {folder} has the {split} shards {', '.join(p.name for p in ordered)}, not numbered "
                          f"without gaps ({why}); add the missing shard, or renumber them")
    if found:
        raise ConfigError(f"dataset {folder} has {', '.join(p.name for p in found)} for split {split}: which to "
                          f"read is not clear; keep one {split}.jsonl/.json/.csv/.parquet, or numbered shards of one "
                          f"format ({split}.00.jsonl, {split}.01.jsonl, ...), and move the others away")
    return []


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
        files[split] = split_files(folder, split)
        if not files[split]:
            if split == "train":
                raise ConfigError(f"dataset folder {folder} has no train.jsonl/.json/.csv/.parquet file")
            raise ConfigError(f"dataset {folder} has no validation split (validation.jsonl/.json/.csv/.parquet)")
    if len({BUILDERS[p.suffix] for paths in files.values() for p in paths}) > 1:
        raise ConfigError(f"dataset {folder}: {files['train'][0].name} and {files['validation'][0].name} must have "
                          "one format")
    for split, path in ((split, p) for split, paths in files.items() for p in paths if p.stat().st_size == 0):
        raise ConfigError(f"dataset file {path} is empty: split {split} needs examples")
    return Source(cfg.dataset, files=files)


def check_source(source: Source, task: str) -> None:
    """The cheap checks, run by every process before any waits for the preparation: each file's first record (or header,
    or schema) has the task's columns. A warm start skips them: its data was checked whole when it was prepared."""
    for split in SPLITS if source.saved is not None else ():
        try:
            names = list(json.loads((source.saved / split / "dataset_info.json").read_text())["features"])
        except (OSError, ValueError, KeyError) as err:
            raise ConfigError(f"dataset {source.saved} split {split} is not a readable save_to_disk() "
                              f"folder ({err!r})") from None
        _check_columns(names, f"dataset {source.saved} split {split}", task)
    for split, paths in (source.files or {}).items():
        for path in paths:
            _check_first_record(path, split, task)


def _check_first_record(path: Path, split: str, task: str) -> None:
    if path.suffix == ".parquet":
        try:
            names = pq.read_schema(path).names
        except Exception as err:  # pyarrow's errors for a damaged file are several
            raise ConfigError(f"dataset file {path} is not a readable parquet file: {err}") from None
    elif path.suffix == ".csv":
        with path.open(newline="", encoding="utf-8-sig", errors="replace") as f:  # a BOM is no part of a name
            names = next(csv.reader(f), [])
    else:
        with path.open(errors="replace") as f:
            number, line = next(((n, text) for n, text in enumerate(f, 1) if text.strip()), (0, ""))
        if not number:
            raise ConfigError(f"dataset file {path} holds no examples: split {split} needs some")
        if path.suffix == ".json" and line.lstrip().startswith("["):
            return  # a JSON array: its records are checked when it is read
        names = list(_parse_json_line(path, number, line))
    _check_columns(names, f"dataset file {path}", task)


def _check_columns(names: list[str], where: str, task: str) -> None:
    if missing := [c for c in columns_of(task) if c not in names]:
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
        if line.strip() and "messages" in (record := _parse_json_line(path, number, line)):
            if problem := chat_problem(record["messages"]):  # mixed types: what the reader only names by row
                raise ConfigError(f"dataset file {path} line {number}: {problem}")


@contextlib.contextmanager
def quiet_datasets() -> Iterator[None]:
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


def read_raw(source: Source, cache_dir: Path | None) -> dict[str, list[tuple[str, object]]]:
    """The train and validation splits (Arrow tables under `cache_dir`), each as its parts: (where it was read, its
    rows). A folder's files are read one by one, each with its own column types and error; `join` joins them."""
    cache = cache_dir and str(cache_dir)
    with quiet_datasets():
        if source.saved is not None:
            raw = load_from_disk(str(source.saved))
        elif source.files is not None:
            return {split: [(str(path), _read_file(path, BUILDERS[path.suffix], cache)) for path in paths]
                    for split, paths in source.files.items()}
        else:
            try:
                raw = load_dataset(source.name, cache_dir=cache)
            except Exception as err:  # the hub's errors are many; the user needs the first line
                raise ConfigError(f"dataset {source.name} is no folder ({Path(source.name).absolute()} does not exist) "
                                  f"and cannot be loaded from the Hub: {first_line(err)}") from None
    if "validation" not in raw:
        raise ConfigError(f"dataset {source.name} has no validation split")
    return {split: [(f"{source.name} split {split}", raw[split])] for split in SPLITS}


def join(parts: dict[str, list[tuple[str, object]]]) -> DatasetDict:
    joined = {}
    for split, pieces in parts.items():
        try:
            joined[split] = concatenate_datasets([rows for _, rows in pieces]) if len(pieces) > 1 else pieces[0][1]
        except ValueError as err:
            raise ConfigError(f"dataset {pieces[0][0]} and the other {split} shards do not have the same columns "
                              f"and types ({first_line(err)}); give every shard the same columns") from None
    return DatasetDict(train=joined["train"], validation=joined["validation"])


def _read_file(path: Path, builder: str, cache_dir: str | None):
    try:
        return load_dataset(builder, data_files={"train": str(path)}, cache_dir=cache_dir)["train"]
    except Exception as err:  # pyarrow, pandas and datasets each raise their own
        if disk_full(err):
            raise  # not the file's fault: the preparation says so (prepare.py)
        if "corresponds to no data" in str(err):
            raise ConfigError(f"dataset file {path} holds no examples") from None
        if builder == "json":
            _first_bad_json(path)
        cause = err
        while cause.__cause__ or cause.__context__:
            cause = cause.__cause__ or cause.__context__
        if isinstance(cause, UnicodeDecodeError) or "Invalid UTF8" in str(cause):
            raw = path.read_bytes()
            if (bad := _not_utf8(raw)) is not None:  # the first line that is not UTF-8
                line = raw.count(b"\n", 0, bad[0]) + 1
                raise ConfigError(f"dataset file {path} line {line} is not UTF-8 text ({bad[1]}); save the file as "
                                  "UTF-8") from None
        raise ConfigError(f"dataset file {path} cannot be read: {first_line(cause)}") from None


def _not_utf8(raw: bytes) -> tuple[int, str] | None:
    """Where `raw` stops being UTF-8 and how it reads there ("byte 0xe9 after b'caf'"); None if it is."""
    try:
        raw.decode()
    except UnicodeDecodeError as bad:
        near = raw[max(0, bad.start - 20):bad.start].rpartition(b"\n")[2]
        return bad.start, f"byte 0x{raw[bad.start]:02x} after {near!r}"
    return None


def _value_type(feature) -> str:
    return getattr(feature, "dtype", type(feature).__name__)


def _describe(value) -> str:
    return f"{value!r} ({type(value).__name__})" if value is not None else "null"


def _first(split, column: str, bad) -> tuple[int, object]:
    """The first example whose `column` value is `bad(value)`: only run once a problem is known."""
    return next(((index, value) for index, value in enumerate(split[column]) if bad(value)), (-1, None))


def _check_texts(data, where: str, split: str, task: str) -> None:
    if len(data) == 0:
        raise ConfigError(f"dataset {where} holds no examples: split {split} needs some")
    for column in columns_of(task):
        if column not in data.column_names:
            raise ConfigError(f"dataset {where} lacks column {column} needed by task {task}")
    if task == "chat":
        for index, messages in enumerate(data["messages"]):
            if problem := chat_problem(messages):
                raise ConfigError(f"dataset {where} {place(where, index)}: {problem}")
        return
    column = data.data.column("text")
    if _value_type(data.features["text"]) not in ("string", "large_string") or column.null_count:
        index, value = _first(data, "text", lambda v: not isinstance(v, str))
        raise ConfigError(f"dataset {where} example {index + 1} has text {_describe(value)}: every text must be a "
                          "string")
    _check_utf8(column, where)


def _check_utf8(column, where: str) -> None:
    """Texts are UTF-8 (a reader may pass other bytes through, for the tokenizer to fail on)."""
    before = 0
    for chunk in column.chunks:
        try:
            chunk.validate(full=True)
        except pa.ArrowInvalid as err:
            found = re.search(r"Invalid UTF8 sequence at string index (\d+)", str(err))
            if not found:
                raise
            index = int(found[1])
            raw = chunk.view(pa.large_binary() if pa.types.is_large_string(chunk.type) else pa.binary())[index]
            raise ConfigError(f"dataset {where} example {before + index + 1} is not UTF-8 text "
                              f"({_not_utf8(raw.as_py())[1]}); save the file as UTF-8") from None
        before += len(chunk)


def _labels_of(data, where: str) -> set[int]:
    column = data.data.column("label")
    if not _value_type(data.features["label"]).startswith(("int", "uint")) or column.null_count:
        index, value = _first(data, "label", lambda v: type(v) is not int)
        raise ConfigError(f"dataset {where} example {index + 1} has label {_describe(value)}: labels must be whole "
                          "numbers 0, 1, ... (one per class)")
    low = pc.min(column).as_py()
    if low < 0:
        index = pc.index(column, low).as_py()
        raise ConfigError(f"dataset {where} example {index + 1} has label {low}: labels must be 0, 1, ...")
    return set(pc.unique(column).to_pylist())


def validate(parts: dict[str, list[tuple[str, object]]], source: Source, task: str) -> int:
    """Every check that needs the whole data, part by part (each file names itself); the number of labels, or 0."""
    for split in SPLITS:
        for part, data in parts[split]:
            _check_texts(data, part, split, task)
    if task != "sequence_classification":
        return 0
    train = parts["train"]
    where = train[0][0] if len(train) == 1 else f"{source.name} split train ({len(train)} shards)"
    labels = {split: set().union(*(_labels_of(data, part) for part, data in parts[split])) for split in SPLITS}
    classes = max(labels["train"]) + 1
    if classes < 2:
        raise ConfigError(f"dataset {where}: every training label is 0, one class; classification needs "
                          "at least two (labels 0 and 1), or train task causal_lm")
    if missing := sorted(set(range(classes)) - labels["train"]):
        shown = ", ".join(map(str, missing[:5])) + (", ..." if len(missing) > 5 else "")
        raise ConfigError(f"dataset {where}: training labels must be 0..{classes - 1} with every class "
                          f"present, but {len(missing)} of them have no example ({shown}); number the classes 0..K-1")
    for part, data in parts["validation"]:
        if unknown := sorted(set(pc.unique(data.data.column("label")).to_pylist()) - labels["train"]):
            index = pc.index(data.data.column("label"), unknown[0]).as_py()
            raise ConfigError(f"dataset {part} example {index + 1} has label {unknown[0]}, "
                              f"which no training example has (training labels are 0..{classes - 1})")
    return classes
