"""Data preparation: the raw splits (sources.py) read and checked, tokenised (and packed), once, into data_cache_dir
(data_cache.py), where every later run on the same data and settings finds it memory-mapped. Before a job (on a CPU
node, say), with the training flags; docs/data.md tells the story:

    python -m {{ cookiecutter.project_slug }}.prepare --config configs/train.yaml --dataset data/my_corpus
"""

import contextlib
import ctypes
import functools
import json
import os
import re
import shutil
import signal
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from datasets import Dataset, DatasetDict, load_from_disk

from .config import TrainConfig
from .data import ASSISTANT, TARGETS, labels_for
from .data_cache import HEARTBEAT_S, META_FILE, PreparationLock, cache_folder, checksums, content_fingerprint, damage
from .errors import ConfigError, JobFailed, disk_full, interruptible
from .model import count_targets, load_tokenizer
from .output_lock import is_mine, read_holder
from .sources import Source, check_source, find_source, join, place, quiet_datasets, read_raw, validate

UNKNOWN_NOTED = 0.05  # a share of unknown training tokens that gets a note
PR_SET_PDEATHSIG = 1  # prctl(2)
_PARENT: int | None = None  # the preparing process, while it prepares (children_end_with_this_process)


def tokenize(raw: DatasetDict, tokenizer, cfg: TrainConfig, work: Path) -> DatasetDict:
    """input_ids per example, plus `label` for classification and the ASSISTANT mask for chat (the tokenizer's chat
    template marks the assistant's tokens): truncated to max_seq_len, or whole documents when they are to be packed."""
    keep = {"label"} if cfg.task == "sequence_classification" else set()
    num_proc = cfg.data_num_proc or (min(os.cpu_count() or 1, 8) if len(raw["train"]) >= 100_000 else 1)

    def encode(batch):
        if cfg.task == "chat":
            out = tokenizer.apply_chat_template(batch["messages"], return_dict=True, return_assistant_tokens_mask=True,
                                                truncation=not cfg.packing, max_length=cfg.max_seq_len)
            return {"input_ids": out["input_ids"], ASSISTANT: out["assistant_masks"]}
        ids = tokenizer(batch["text"], truncation=not cfg.packing, max_length=cfg.max_seq_len)["input_ids"]
        return {"input_ids": ids}

    with quiet_datasets():
        return DatasetDict({split: ds.map(encode, batched=True, num_proc=num_proc if len(ds) >= 2 * num_proc else None,
                                          cache_file_name=str(work / f"{split}.arrow"),
                                          remove_columns=[c for c in ds.column_names if c not in keep])
                            for split, ds in raw.items()})


@contextlib.contextmanager
def children_end_with_this_process():
    """The processes forked within the block (tokenising workers, the pool's manager) end with this one, also on SIGKILL
    (a parent-death signal each child asks for); they leave Ctrl-C to it and end quietly on the pool's SIGTERM."""
    global _PARENT
    _watch_forks()
    _PARENT = os.getpid()
    try:
        yield
    finally:
        _PARENT = None


def _end_with_parent() -> None:
    global _PARENT
    parent, _PARENT = _PARENT, None  # a child's own children are its business
    if parent is None:
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before the signal was asked for
        os._exit(1)


_watch_forks = functools.cache(lambda: os.register_at_fork(after_in_child=_end_with_parent))  # once: hooks stay


def pack(documents, eos_id: int, block: int, path: Path):
    """Join the documents in order into one stream, one EOS between them (none more after a document ending in EOS),
    and cut it into blocks of `block` tokens, dropping the remainder: one pass with a carry, so the blocks do not depend
    on how the stream was read (num_proc, chunks). A chat's ASSISTANT mask is cut alongside, 0 on an added EOS."""
    names = [name for name in ("input_ids", ASSISTANT) if name in documents.column_names]
    schema = pa.schema([(name, pa.list_(pa.int32(), block)) for name in names])
    carry = [np.empty(0, dtype=np.int32)] * len(names)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        for batch in documents.data.table.select(names).to_batches():
            values = [pc.list_flatten(c).to_numpy(zero_copy_only=False).astype(np.int32) for c in batch.columns]
            lengths = pc.list_value_length(batch.column(0)).to_numpy(zero_copy_only=False)
            if not lengths.sum():
                continue
            tokens, ends = values[0], np.cumsum(lengths)
            without_eos = (lengths > 0) & (tokens[np.maximum(ends - 1, 0)] != eos_id)
            streams = [np.concatenate([kept, np.insert(column, ends[without_eos], fill)])
                       for kept, column, fill in zip(carry, values, (eos_id, 0)[:len(names)], strict=True)]
            whole = len(streams[0]) // block * block
            if whole:
                writer.write_batch(pa.record_batch([pa.FixedSizeListArray.from_arrays(pa.array(stream[:whole]), block)
                                                    for stream in streams], schema=schema))
            carry = [stream[whole:] for stream in streams]
    return Dataset.from_file(str(path))


def work_folder(folder: Path, preparer: dict) -> Path:
    """Where `preparer` (host, pid) writes `folder` before renaming it."""
    return folder.with_name(f".tmp-{folder.name}-{preparer.get('host')}-{preparer.get('pid')}")


def check_unknown(train, tokenizer, cfg: TrainConfig, source: Source) -> None:
    """The share of the training text's tokens (the special ones aside) the tokenizer does not know:
    above half, the text is lost (ConfigError, one line); above UNKNOWN_NOTED, a note."""
    if tokenizer.unk_token_id is None:  # byte-level: every text has tokens
        return
    tokens = pc.list_flatten(train.data.column("input_ids"))
    specials = pa.array(sorted(set(tokenizer.all_special_ids) - {tokenizer.unk_token_id}), pa.int64())
    tokens = pc.filter(tokens, pc.invert(pc.is_in(pc.cast(tokens, pa.int64()), specials)))
    share = pc.sum(pc.equal(tokens, tokenizer.unk_token_id)).as_py() / max(len(tokens), 1)
    said = (f"{share:.1%} of the training tokens of {source.name} are unknown to the tokenizer of "
            f"model_name_or_path {cfg.model_name_or_path} ({tokenizer.unk_token})")
    if share > 0.5:
        raise ConfigError(f"{said}: the model would not see the text; use a model whose tokenizer covers it")
    if share > UNKNOWN_NOTED:
        print(f"note: {said}", flush=True)


def _prepare_into(folder: Path, source: Source, tokenizer, cfg: TrainConfig) -> None:
    """Read, check, tokenise (and pack) the data into `folder`, atomically: written beside it, renamed once whole."""
    started = time.monotonic()
    work = work_folder(folder, {"host": socket.gethostname(), "pid": os.getpid()})
    shutil.rmtree(work, ignore_errors=True)
    try:
        parts = read_raw(source, work / "raw")
        num_labels = validate(parts, source, cfg.task)
        raw = join(parts)
        print(f"data: preparing {sum(map(len, raw.values())):,} examples of {source.name} in {folder} (once; "
              "other processes wait for it)", flush=True)
        data = tokenize(raw, tokenizer, cfg, work)
        check_unknown(data["train"], tokenizer, cfg, source)
        for split, ds in data.items() if cfg.task == "chat" else ():  # every conversation keeps something to learn
            index = next((i for i, mask in enumerate(ds[ASSISTANT]) if not any(mask[1:])), None)
            for where, rows in parts[split] if index is not None else ():  # the file (shard) and line it is in
                if index < len(rows):
                    raise ConfigError(f"dataset {where} {place(where, index)}: no assistant token within max_seq_len "
                                      f"{cfg.max_seq_len}; raise max_seq_len, or shorten the turns before the answer")
                index -= len(rows)
        if cfg.packing:
            data = DatasetDict({split: pack(ds, tokenizer.eos_token_id, cfg.max_seq_len, work / f"{split}_packed.arrow")
                                for split, ds in data.items()})
        # each training example's targets (TARGETS), counted once here: a step's divisor is read, not computed
        targets = [count_targets(labels_for(example, cfg.task)[None], cfg.task) for example in data["train"]]
        data["train"] = data["train"].add_column(TARGETS, np.asarray(targets, dtype=np.int64))
        with quiet_datasets():
            data.save_to_disk(str(work / "prepared"))
        meta = {"num_labels": num_labels, "examples": {split: len(ds) for split, ds in data.items()},
                "packing": cfg.packing, "max_seq_len": cfg.max_seq_len, "source": source.name,
                "data_fingerprint": content_fingerprint(data["train"]),
                "prepared_by": {"host": socket.gethostname(), "pid": os.getpid(), "rank": os.environ.get("RANK", "0")},
                "seconds": round(time.monotonic() - started, 3), "files": checksums(work / "prepared")}
        (work / "prepared" / META_FILE).write_text(json.dumps(meta, indent=2))
        try:
            (work / "prepared").rename(folder)
        except OSError:  # another process (whose lock looked stale) finished first: its copy is the same
            if not (folder / META_FILE).is_file():
                raise
        print(f"data: prepared {meta['examples']['train']:,} training and {meta['examples']['validation']:,} "
              f"validation {'blocks' if cfg.packing else 'examples'} in {meta['seconds']:.1f} s: {folder}", flush=True)
    except Exception as err:
        if (full := disk_full(err)) is None:
            raise
        raise ConfigError(f"data_cache_dir {folder.parent} has no room to prepare {source.name} ({full.strerror}); "
                          "free space there, or give --data_cache_dir a folder on a disk with room") from None
    finally:
        shutil.rmtree(work, ignore_errors=True)


def taken_over(folder: Path, lock: PreparationLock) -> None:
    """This process was stopped while preparing (its heartbeat stale), another took the preparation
    over and removed what it had written: use the other's data where it is whole, else one line."""
    who = read_holder(lock.path)
    if damage(folder) != "":
        raise JobFailed(f"the preparation of {folder} was taken over by {who.get('host')}:{who.get('pid')} while "
                        "this process was stopped; start this job again once it has prepared the data")
    print(f"data: {folder} was prepared by {who.get('host')}:{who.get('pid')}, which took the preparation over "
          "while this process was stopped; using it", flush=True)


def prepared_folder(cfg: TrainConfig, source: Source, tokenizer) -> Path:
    """The prepared data's folder: found whole (a warm start reads only it, checking its checksums), prepared here
    (again, with one line, where it is damaged), or by the process that holds the lock while this one waits."""
    folder = cache_folder(cfg, source, tokenizer)
    try:
        folder.parent.resolve().mkdir(parents=True, exist_ok=True)  # a link to a folder not yet made: makes it
    except OSError as err:
        raise ConfigError(f"data_cache_dir {folder.parent} cannot be created ({err.strerror}); choose a folder "
                          "you can write to") from None
    if damage(folder) == "":
        return folder
    check_source(source, cfg.task)
    lock, waiting_since, said, checked = PreparationLock(folder), time.time(), False, None

    def whole() -> bool:  # checked once per written prepared.json, not at every look while waiting
        nonlocal checked
        with contextlib.suppress(OSError):
            written = (folder / META_FILE).stat().st_mtime_ns
            if checked != written:
                checked = written if damage(folder) == "" else None
            return checked == written
        return False

    with interruptible(f"while preparing {folder}: nothing half written is left; the next start prepares it"):
        while not whole():
            if lock.error.is_file() and lock.error.stat().st_mtime >= waiting_since - HEARTBEAT_S:
                raise ConfigError(lock.error.read_text())  # what the process that prepared it found
            if lock.acquire():
                try:
                    if problem := damage(folder):  # again, holding the lock: another process may have just prepared it
                        print(f"data: the prepared data in {folder} is damaged ({problem}); preparing it again",
                              flush=True)
                        shutil.rmtree(folder)
                    if problem != "":
                        with children_end_with_this_process():
                            try:
                                _prepare_into(folder, source, tokenizer, cfg)
                            except Exception:
                                if is_mine(read_holder(lock.path)):
                                    raise
                                taken_over(folder, lock)
                except ConfigError as err:
                    lock.release(error=str(err))
                    raise
                finally:
                    lock.release()
            elif (holder := lock.gone()) is not None:  # its lock removed, with what it left half written
                work = work_folder(folder, holder)
                size = sum(p.stat().st_size for p in work.rglob("*") if p.is_file()) if work.is_dir() else 0
                shutil.rmtree(work, ignore_errors=True)
                lock.path.unlink(missing_ok=True)  # the next look takes the lock
                left = f", removing the {size / 2**20:.1f} MB it left in {work}" if size else ""
                print(f"data: the process that was preparing {folder} is gone (host {holder.get('host', '?')}, pid "
                      f"{holder.get('pid', '?')}){left}; taking over", flush=True)
            else:
                if not said and os.environ.get("RANK", "0") in ("0", ""):
                    who = read_holder(lock.path)
                    print(f"data: waiting for {who.get('host', 'another process')}:{who.get('pid', '?')} to prepare "
                          f"{folder}", flush=True)
                    said = True
                time.sleep(0.2)
    return folder


@dataclass(frozen=True)
class Prepared:
    data: DatasetDict  # memory-mapped from the prepared folder
    num_labels: int  # classification: classes; 0 for causal_lm
    folder: Path
    fingerprint: str  # of the training examples' content (data_cache.content_fingerprint)


def prepare(cfg: TrainConfig, tokenizer) -> Prepared:
    """The tokenised (or packed) splits, checked: the cheap checks here, the full-pass ones in the one preparation."""
    if cfg.max_seq_len <= (special := tokenizer.num_special_tokens_to_add()):  # no room for text beside them
        raise ConfigError(f"max_seq_len {cfg.max_seq_len} leaves no room for text: the tokenizer adds {special} "
                          f"special token(s) to each example; use max_seq_len >= {special + 1}")
    if cfg.task == "chat" and not re.search(r"\{\%-?\s*generation\b", str(tokenizer.chat_template or "")):
        what = ("chat template of {} has no generation blocks" if tokenizer.chat_template
                else "tokenizer of {} has no chat template").format(cfg.model_name_or_path)
        raise ConfigError(f"task chat: the {what}; give its folder a chat_template.jinja whose generation blocks "
                          "mark the assistant's turns (what the loss counts), as this project's assets/tokenizer/ has")
    folder = prepared_folder(cfg, find_source(cfg), tokenizer)
    meta = json.loads((folder / META_FILE).read_text())
    with quiet_datasets():
        data = load_from_disk(str(folder))
    return Prepared(data, meta["num_labels"], folder, meta["data_fingerprint"])


def prepare_data(cfg: TrainConfig) -> None:
    """`python -m ...prepare`: the data prepared (or found), then one line saying what is ready."""
    data = (prepared := prepare(cfg, load_tokenizer(cfg))).data
    print(f"ready: {len(data['train']):,} training and {len(data['validation']):,} validation "
          f"{'blocks' if cfg.packing else 'examples'} in {prepared.folder}")


if __name__ == "__main__":
    from .cli import run_cli

    run_cli(prepare_data)
