"""Where prepared data lives and who prepares it: a folder in data_cache_dir named by a hash of
everything that changes the prepared data, and a lock file so that one process per filesystem
prepares it while the others wait (prepare.py does the preparing).
"""

import contextlib
import hashlib
import json
import os
import socket
import threading
import time
from pathlib import Path

from .config import TrainConfig

CACHE_FORMAT = 1  # bump when what preparation writes changes: older caches are then not used
META_FILE = "prepared.json"
HEARTBEAT_S, STALE_S = 5.0, 60.0


def source_fingerprint(source) -> list:
    """What identifies the raw data without reading it: each file's path, size and mtime."""
    if source.files is not None:
        files = list(source.files.values())
    elif source.saved is not None:
        files = sorted(p for p in source.saved.rglob("*") if p.is_file())
    else:
        return [source.name]
    return [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in files]


def tokenizer_fingerprint(tokenizer) -> str:
    """The tokenizer as it encodes: a fast tokenizer's whole definition, else its vocabulary."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    body = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    return body + repr(sorted(tokenizer.special_tokens_map.items()))


def cache_folder(cfg: TrainConfig, source, tokenizer) -> Path:
    """The prepared data's folder in data_cache_dir: its name holds a hash of everything that
    changes it (source files, tokenizer, max_seq_len, task, packing), so a sweep over one corpus
    shares it whatever the output_dir, and a changed file or setting prepares anew."""
    key = json.dumps([CACHE_FORMAT, source_fingerprint(source), tokenizer_fingerprint(tokenizer), cfg.max_seq_len,
                      cfg.task, cfg.packing])
    name = Path(source.name).name
    return Path(cfg.data_cache_dir) / f"{cfg.task}-{name}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"



class PreparationLock:
    """One process per filesystem prepares a dataset; the others (on every node that shares
    data_cache_dir) wait for it. The lock is a file created exclusively (atomic on local and NFS
    filesystems), kept fresh by a heartbeat while its holder works: one older than STALE_S
    belonged to a process that died, and the next process takes over. A data error the holder
    finds is left in an error file, which each waiting process reports as its own one line."""

    def __init__(self, folder: Path):
        self.path, self.error = folder.with_name(folder.name + ".lock"), folder.with_name(folder.name + ".error")
        self.held = threading.Event()

    def acquire(self) -> bool:
        try:
            descriptor = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return False
        with os.fdopen(descriptor, "w") as f:
            f.write(json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))
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
        if error is not None:
            self.error.write_text(error)
        self.held.clear()
        self.path.unlink(missing_ok=True)

    def holder(self) -> str:
        with contextlib.suppress(OSError, ValueError):
            who = json.loads(self.path.read_text())
            return f"{who['host']}:{who['pid']}"
        return "another process"

    def stale(self) -> bool:
        with contextlib.suppress(OSError):
            return time.time() - self.path.stat().st_mtime > STALE_S
        return False
