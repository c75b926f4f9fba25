"""Whether a checkpoint's files load safely, read without loading them: safetensors headers that
match their file's size, and pickles (torch.save, a sharded checkpoint's index) that name nothing but
tensors, containers and the few classes the libraries' own state holds — a checkpoint from a shared
folder must run no code.
"""

import json
import pickle
import pickletools
import struct
import zipfile
from pathlib import Path

# What the pickles in a checkpoint may name: tensors and their storages, containers, numpy arrays
# (RNG states), and the classes DeepSpeed's own state holds. Anything else could run code on load.
SAFE_GLOBALS = {
    ("collections", "OrderedDict"), ("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_parameter"),
    ("torch._tensor", "_rebuild_from_type_v2"), ("torch", "Tensor"), ("torch", "Size"), ("torch", "device"),
    ("_codecs", "encode"), ("numpy", "dtype"), ("numpy", "ndarray"), ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"), ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "scalar"),
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"), ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"), ("deepspeed.utils.tensor_fragment", "fragment_address"),
}
PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".pkl")
# A sharded checkpoint's index (torch.distributed.checkpoint's `.metadata`, which it reads with a
# plain pickle.load) may name its own record classes, paths, sizes, dtypes and layouts; the shards
# themselves DCP reads with weights_only=True.
DCP_METADATA = ".metadata"
DCP_GLOBALS = {
    *(("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "ChunkStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("pathlib", "PosixPath"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    *(("torch", name) for name in ("float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8",
                                   "uint8", "bool")),
}


# Opcodes that leave the pickle machine's stack as it is (framing, memo writes).
NEUTRAL_OPS = {"PROTO", "FRAME", "PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"}


def _pickle_globals(data: bytes) -> set[tuple[str, str]]:
    """The (module, name) pairs a pickle would import, read from its opcodes without running it. A
    STACK_GLOBAL imports the two values on top of the stack: they are known only when the two
    opcodes that pushed last (framing and memo writes aside) each pushed a string, read directly
    or from the memo; otherwise it comes back as ("?", "?"), which no rule allows."""
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
    dcp_index = path.name == DCP_METADATA
    if path.suffix not in PICKLE_SUFFIXES and not dcp_index:
        return ""
    try:
        if zipfile.is_zipfile(path) and not dcp_index:  # DCP reads its index as one plain pickle
            with zipfile.ZipFile(path) as archive:
                pickles = [archive.read(n) for n in archive.namelist() if n.endswith(".pkl")]
        else:
            pickles = [path.read_bytes()]
        unsafe = set().union(*map(_pickle_globals, pickles)) - SAFE_GLOBALS - (DCP_GLOBALS if dcp_index else set())
    except (zipfile.BadZipFile, ValueError, EOFError, UnicodeDecodeError) as err:
        return f"is damaged ({type(err).__name__}: {err})"
    unsafe = {(m, n) for m, n in unsafe if not (m == "torch" and n.endswith("Storage"))}
    if unsafe:
        names = ", ".join(sorted("an import it hides" if (m, n) == ("?", "?") else f"{m}.{n}" for m, n in unsafe))
        return f"would run code when loaded (its pickle names {names}); only load checkpoints you made"
    if dcp_index and not _is_dcp_index(pickles[0]):
        return "is not the index of a sharded checkpoint"
    return ""


def _is_dcp_index(data: bytes) -> bool:
    """Whether an index, whose pickle names only DCP's own classes (so unpickling it runs nothing
    else), holds DCP's Metadata."""
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        return isinstance(pickle.loads(data), Metadata)
    except Exception:  # a pickle that breaks off, or builds its classes wrongly
        return False
