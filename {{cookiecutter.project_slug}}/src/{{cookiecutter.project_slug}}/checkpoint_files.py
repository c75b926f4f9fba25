"""Whether a checkpoint's files load safely, read without loading them: safetensors headers that
match their file's size, and pickles (torch.save, a sharded checkpoint's index) that name nothing but
tensors, containers and the few classes the libraries' own state holds — a checkpoint from a shared
folder must run no code.
"""

import json
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


def _pickle_globals(data: bytes) -> set[tuple[str, str]]:
    """The (module, name) pairs a pickle would import, read from its opcodes without running it. A
    STACK_GLOBAL whose names are not plain strings on the stack comes back as ("?", "?")."""
    found, strings, memo = set(), [], {}
    for op, arg, _ in pickletools.genops(data):
        if op.name in ("GLOBAL", "INST"):
            found.add(tuple(arg.split(" ", 1)))
        elif op.name == "STACK_GLOBAL":
            found.add(tuple(strings[-2:]) if len(strings) >= 2 and None not in strings[-2:] else ("?", "?"))
        elif op.name in ("EXT1", "EXT2", "EXT4"):
            found.add(("copyreg extension", str(arg)))
        if op.name.endswith(("UNICODE", "STRING", "UNICODE8")):
            strings.append(arg if isinstance(arg, str) else None)
        elif op.name.endswith("GET"):
            strings.append(memo.get(arg))
        elif op.name.endswith("PUT"):
            memo[arg] = strings[-1] if strings else None
        elif op.name == "MEMOIZE":
            memo[len(memo)] = strings[-1] if strings else None
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
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as archive:
                pickles = [archive.read(n) for n in archive.namelist() if n.endswith(".pkl")]
        else:
            pickles = [path.read_bytes()]
        unsafe = set().union(*map(_pickle_globals, pickles)) - SAFE_GLOBALS - (DCP_GLOBALS if dcp_index else set())
    except (zipfile.BadZipFile, ValueError, EOFError, UnicodeDecodeError) as err:
        return f"is damaged ({type(err).__name__}: {err})"
    unsafe = {(m, n) for m, n in unsafe if not (m == "torch" and n.endswith("Storage"))}
    if unsafe:
        names = ", ".join(sorted(f"{m}.{n}" for m, n in unsafe))
        return f"would run code when loaded (its pickle names {names}); only load checkpoints you made"
    return ""
