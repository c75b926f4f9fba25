#!/usr/bin/env python3
"""pre-commit's guard (standard library only): refuse W&B keys, run folders and large files.

    scripts/check_commit.py FILE ...          # what pre-commit passes: the files of the commit
    scripts/check_commit.py --max-kb 500 FILE ...

Exit 1 with one line per refused file.
"""

import argparse
import re
import sys
from pathlib import Path

# what a training run writes: never source (runs/ holds checkpoints, wandb/ offline runs and keys' traces)
RUN_FOLDERS = ("runs", "wandb", "data_cache", "bench/models", ".venv")
RUN_FILES = ("training_state.pt", "model.safetensors")
# a W&B API key (40 hex digits, or a newer prefixed one) given to a key-like name
KEY = re.compile(r"(?i)(wandb_api_key|api_key|wandb\.login\s*\(\s*key)\s*[=:,]?\s*[\"']?([a-z]+-)?[0-9a-f]{40}")


def problem(path: Path, max_bytes: int) -> str | None:
    parts = path.as_posix()
    folder = next((f for f in RUN_FOLDERS if parts == f or parts.startswith(f"{f}/") or f"/{f}/" in parts), None)
    if folder:
        return f"{path}: inside {folder}/, which a run writes (see .gitignore)"
    if path.name in RUN_FILES:
        return f"{path}: a run's file ({path.name})"
    if path.name == ".netrc":
        return f"{path}: a .netrc holds credentials (`wandb login` writes its API key there)"
    if not path.is_file():
        return None
    size = path.stat().st_size
    if size > max_bytes:
        return f"{path}: {size / 1024:,.0f} KiB, over {max_bytes // 1024:,} KiB (data belongs in data/, outside git)"
    text = path.read_bytes().decode("utf-8", "replace")
    match = KEY.search(text)
    if match:
        line = text.count("\n", 0, match.start()) + 1
        return f"{path}:{line}: looks like a W&B API key; use `wandb login` or WANDB_API_KEY in the environment"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-kb", type=int, default=1024, help="largest file allowed, KiB (default 1024)")
    parser.add_argument("files", nargs="*", type=Path)
    args = parser.parse_args(argv)
    problems = [p for p in (problem(path, args.max_kb * 1024) for path in args.files) if p]
    for line in problems:
        print(line)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
