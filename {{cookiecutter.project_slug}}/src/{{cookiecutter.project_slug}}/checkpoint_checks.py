"""The safe_checkpoints extra: before a resume loads a checkpoint, every file's structure is read
without running it (checkpoint.verify_checkpoint): safetensors headers whole, and no pickle that names
anything but tensors, containers and the few classes the libraries' state holds (it could run code
when loaded). docs/guarantees.md tells the story.
"""

import json
import pickletools
import struct
import zipfile
from pathlib import Path

from . import extras

# What the pickles in a checkpoint may name: tensors and their storages, containers, numpy arrays
# (RNG states), and the classes DeepSpeed's own state holds. Anything else could run code on load.
SAFE_GLOBALS = {
    ("collections", "OrderedDict"), ("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_parameter"),
    ("torch._tensor", "_rebuild_from_type_v2"), ("torch", "Tensor"), ("torch", "Size"), ("torch", "device"),
    ("_codecs", "encode"), ("numpy", "dtype"), ("numpy", "ndarray"),
    *((f"numpy{core}.multiarray", name) for core in (".core", "._core") for name in ("_reconstruct", "scalar")),
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"), ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"), ("deepspeed.utils.tensor_fragment", "fragment_address"),
}
PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".pkl")
# An extra's pickled non-torch files (a sharded index): name -> (extra names allowed, its own check)
PICKLED_INDEXES = extras.plug("fsdp", "fsdp:PICKLED_INDEXES", default={})
# Opcodes that leave the pickle machine's stack as it is (framing, memo writes).
NEUTRAL_OPS = {"PROTO", "FRAME", "PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"}


def _pickle_globals(data: bytes) -> set[tuple[str, str]]:
    """The (module, name) pairs a pickle would import, read from its opcodes without running it; a
    STACK_GLOBAL whose two strings were not the last pushed (directly or from the memo) is ("?", "?")."""
    found, pushed, memo = set(), [], {}  # pushed: the strings the latest opcodes pushed, in order
    for op, arg, _ in pickletools.genops(data):
        name = op.name
        if name in NEUTRAL_OPS:
            if name != "PROTO" and name != "FRAME":
                memo[len(memo) if name == "MEMOIZE" else arg] = pushed[-1] if pushed else None
            continue
        if name.endswith(("UNICODE", "STRING", "UNICODE8")):
            pushed.append(arg if isinstance(arg, str) else None)
            continue
        if name.endswith("GET"):
            pushed.append(memo.get(arg))
            continue
        if name in ("GLOBAL", "INST"):
            found.add(tuple(arg.split(" ", 1)))
        elif name == "STACK_GLOBAL":
            found.add(tuple(pushed[-2:]) if len(pushed) >= 2 and None not in pushed[-2:] else ("?", "?"))
        elif name in ("EXT1", "EXT2", "EXT4"):
            found.add(("copyreg extension", str(arg)))
        pushed = []  # any other opcode changes the stack in a way not followed here
    return found


def check_file(path: Path) -> str:
    """Why `path` would not load safely, or "" (its structure only: the bytes are the loader's)."""
    with path.open("rb") as f:
        head = f.read(8)
    if path.suffix == ".safetensors":
        size = path.stat().st_size
        if len(head) < 8:
            return "is truncated (no safetensors header)"
        length = struct.unpack("<Q", head)[0]
        try:
            with path.open("rb") as f:
                header = json.loads(f.read(8 + length)[8:])
            end = max([0, *(t["data_offsets"][1] for k, t in header.items() if k != "__metadata__")])
        except (ValueError, KeyError, TypeError, IndexError):
            return "has a damaged safetensors header"
        return "" if 8 + length + end == size else f"is {size} bytes where its header needs {8 + length + end}"
    allowed, index_problem = PICKLED_INDEXES.get(path.name, (set(), None))
    if path.suffix not in PICKLE_SUFFIXES and not index_problem:
        return ""
    try:
        if zipfile.is_zipfile(path) and not index_problem:  # an index is one plain pickle
            with zipfile.ZipFile(path) as archive:
                pickles = [archive.read(n) for n in archive.namelist() if n.endswith(".pkl")]
        else:
            pickles = [path.read_bytes()]
        unsafe = set().union(*map(_pickle_globals, pickles)) - SAFE_GLOBALS - allowed
    except (zipfile.BadZipFile, ValueError, EOFError, UnicodeDecodeError) as err:
        return f"is damaged ({type(err).__name__}: {err})"
    unsafe = {(m, n) for m, n in unsafe if not (m == "torch" and n.endswith("Storage"))}
    if unsafe:
        names = ", ".join(sorted("an import it hides" if (m, n) == ("?", "?") else f"{m}.{n}" for m, n in unsafe))
        return f"would run code when loaded (its pickle names {names}); only load checkpoints you made"
    return index_problem(pickles[0]) if index_problem else ""
