"""Where prepared data lives and who prepares it: a folder in data_cache_dir named by a hash of everything that changes
the prepared data, checksums that tell a damaged folder, the content's fingerprint, and a lock file so that one process
per filesystem prepares it while the others wait (prepare.py does the preparing).
"""

import contextlib
import hashlib
import importlib
import inspect
import json
import os
import socket
import threading
import time
import zlib
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .config import TrainConfig, keys_where
from .data import labels_for
from .errors import ConfigError
from .output_lock import is_mine, process_started, read_holder, running_here

CACHE_FORMAT = 3  # bump when what preparation writes changes: older caches are then not used
META_FILE = "prepared.json"
HEARTBEAT_S, STALE_S = 5.0, 60.0
PREPARING = ("prepare", "sources")  # the modules whose code prepares the data (with data.labels_for)
BLOCK = 1 << 20  # checksummed piece of a prepared file
CHECKED_BLOCKS = 64  # a warm start checks every piece of a file up to this many, else this many spread over it


def source_fingerprint(source) -> list:
    """What identifies the raw data without reading it: each file's path, size, modification and
    change time (an edit that keeps the size and puts the mtime back still changes the ctime)."""
    if source.files is not None:
        files = [p for paths in source.files.values() for p in paths]
    elif source.saved is not None:
        files = sorted(p for p in source.saved.rglob("*") if p.is_file())
    else:
        return [source.name]
    return [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns, p.stat().st_ctime_ns) for p in files]


def code_fingerprint() -> str:
    """The code that prepares the data, by its source (as `datasets` fingerprints a map function):
    an edit to how text is read, tokenised, packed or labelled prepares the data again."""
    modules = [importlib.import_module(f"{__package__}.{name}") for name in PREPARING]
    return hashlib.sha256("".join(map(inspect.getsource, [*modules, labels_for])).encode()).hexdigest()[:16]


def content_fingerprint(split) -> str:
    """A hash of a prepared split's examples (tokens, labels, targets) and of the labelling rule (data.labels_for's
    source), not of where they came from: the same corpus staged elsewhere, or tokenised by other processes, alike."""
    digest = hashlib.sha256(inspect.getsource(labels_for).encode())
    for name in sorted(split.column_names):
        lengths, values = hashlib.sha256(), hashlib.sha256()
        for chunk in split.data.column(name).chunks:
            if pa.types.is_list(chunk.type) or pa.types.is_fixed_size_list(chunk.type):
                lengths.update(pc.list_value_length(chunk).to_numpy(zero_copy_only=False).astype(np.int64).tobytes())
                chunk = pc.list_flatten(chunk)
            values.update(chunk.to_numpy(zero_copy_only=False).astype(np.int64).tobytes())
        digest.update(name.encode() + lengths.digest() + values.digest())
    return digest.hexdigest()[:32]


def _blocks(path: Path, wanted: list[int]) -> list[int]:
    with path.open("rb") as f:
        return [zlib.crc32(os.pread(f.fileno(), BLOCK, index * BLOCK)) for index in wanted]


def _wanted(size: int, sampled: bool = True) -> list[int]:
    """The pieces a check reads: all (not `sampled`, or up to CHECKED_BLOCKS), else that many spread over the file."""
    count = -(-size // BLOCK)
    return list(range(count)) if count <= CHECKED_BLOCKS or not sampled else sorted(
        {round(i * (count - 1) / (CHECKED_BLOCKS - 1)) for i in range(CHECKED_BLOCKS)})


def checksums(folder: Path, sampled: bool = False) -> dict:
    """Size and piecewise crc32 of every file under `folder` (`sampled`, a checkpoint: the pieces a check reads)."""
    return {p.relative_to(folder).as_posix(): {"size": p.stat().st_size,
                                               "crc32": _blocks(p, _wanted(p.stat().st_size, sampled))}
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != META_FILE}


def file_damage(path: Path, expected: dict) -> str:
    """What is wrong with a file that `checksums` recorded as `expected` (missing, resized, a changed piece), or ""."""
    if not path.is_file():
        return "is missing"
    if path.stat().st_size != expected["size"]:
        return f"has {path.stat().st_size} bytes, {expected['size']} were written"
    wanted, recorded = _wanted(expected["size"]), expected.get("crc32")
    if recorded is not None and len(recorded) != len(wanted):  # every piece recorded
        recorded = [recorded[i] for i in wanted]
    if recorded is not None and _blocks(path, wanted) != recorded:
        return "does not hold what was written (checksum)"
    return ""


def damage(folder: Path) -> str | None:
    """None where nothing is prepared in `folder`, "" where it is whole, else what is wrong with a file of it."""
    if not folder.is_dir():
        return None
    try:
        files = json.loads((folder / META_FILE).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"{META_FILE} is unreadable ({type(err).__name__})"
    return next((f"{name} {problem}" for name, expected in files.items()
                 if (problem := file_damage(folder / name, expected))), "")


def tokenizer_fingerprint(tokenizer) -> str:
    """The tokenizer as it encodes: a fast tokenizer's whole definition, else its vocabulary; its chat template."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    body = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    return body + repr(sorted(tokenizer.special_tokens_map.items())) + repr(tokenizer.chat_template)


def cache_folder(cfg: TrainConfig, source, tokenizer) -> Path:
    """The prepared data's folder in data_cache_dir, named by a hash of all that changes it: the keys declared
    data=True, the source files, the tokenizer and the preparing code (a sweep over one corpus shares it)."""
    values = {name: getattr(cfg, name) for name in keys_where(data=True)}
    values.update(dataset=source_fingerprint(source), model_name_or_path=tokenizer_fingerprint(tokenizer),
                  code=code_fingerprint())
    key = json.dumps([CACHE_FORMAT, values], sort_keys=True)
    name = Path(source.name).name
    return Path(cfg.data_cache_dir) / f"{cfg.task}-{name}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


class PreparationLock:
    """One process per filesystem prepares a dataset, the others wait: a file created exclusively (atomic on local and
    NFS filesystems), its heartbeat fresh while its holder works. A holder gone (at once on this host, else after
    STALE_S without a beat) is taken over; a data error it found is left in a file each waiting process reports."""

    def __init__(self, folder: Path):
        self.path, self.error = folder.with_name(folder.name + ".lock"), folder.with_name(folder.name + ".error")
        self.held = threading.Event()

    def acquire(self) -> bool:
        try:
            descriptor = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return False
        except OSError as err:
            raise ConfigError(f"data_cache_dir {self.path.parent} cannot be written to ({err.strerror}); choose a "
                              "folder you can write to") from None
        with os.fdopen(descriptor, "w") as f:
            json.dump({"host": socket.gethostname(), "pid": os.getpid(), "started": process_started(os.getpid())}, f)
        self.held.set()
        threading.Thread(target=self._beat, daemon=True).start()
        self.error.unlink(missing_ok=True)
        return True

    def _beat(self) -> None:
        while self.held.is_set():
            with contextlib.suppress(OSError):
                os.utime(self.path)
            time.sleep(HEARTBEAT_S)

    def release(self, error: str | None = None) -> None:
        """Leave the lock (and `error` for the waiting processes) unless another process took it over."""
        self.held.clear()
        if is_mine(read_holder(self.path)):
            if error is not None:
                self.error.write_text(error)
            self.path.unlink(missing_ok=True)

    def gone(self) -> dict | None:
        """The lock's holder where it died (at once on this host, elsewhere after STALE_S without a beat), else None."""
        holder = read_holder(self.path)
        here = running_here(holder) if "pid" in holder else None
        with contextlib.suppress(OSError):
            if here is False or here is None and time.time() - self.path.stat().st_mtime > STALE_S:
                return holder
        return None
