"""FSDP2 for train_pytorch: parameters, gradients and optimizer state sharded over the processes
(`fully_shard` on each decoder layer and the root), or HSDP (replica groups x shards); its
`no_sync()` for the micro-steps of a window; the collectives each step counted; sharded checkpoints
(DCP), written in the background with async_checkpoint, that load into any world size, mesh or an
unsharded model. docs/memory.md says which mode to pick.

A sharded start: the model is built on the meta device and sharded, then each process fills its
own shards only (no process ever holds the whole model): from the safetensors files, each tensor's
slice read alone, or with the values the unsharded start draws, each tensor drawn whole one at a
time by the model's own init (the same random stream, so both starts are bitwise the same).
"""

import copy
import json
import shutil
import threading
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property, partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from torch.distributed.checkpoint._hf_utils import SHARDED_DIR_NAME
from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from transformers import PreTrainedModel
from transformers.core_model_loading import revert_weight_conversion

from .checkpoint import _attempt, mark_complete, older_that_loads, publish, write_atomically
from .config import TrainConfig
from .distributed import DistEnv, init_distributed
from .errors import ConfigError, JobFailed, first_line
from .model import TINY, build_model, fsdp_mixed_precision
from .speed import COMPILE

DCP_DIR = "dcp"  # a sharded checkpoint's folder inside checkpoints/step_<N>/
MAX_WEIGHTS_FILE_BYTES = 50 * 10**9  # save_pretrained's default max_shard_size ("50GB")
# FSDP2's own reduce-scatter (torch 2.13 renamed reduce_scatter_tensor)
REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def layer_classes(model: torch.nn.Module, cfg: TrainConfig) -> set[str]:
    """The class names of the modules that become FSDP units of their own: fsdp_layer_classes, else the
    model's `_no_split_modules`. ConfigError where a name given, or every name, is no module's class:
    FSDP2 would shard the root alone, gathering the whole model at once."""
    given = {name.strip() for name in cfg.fsdp_layer_classes.split(",")} - {""}
    names = given or set(getattr(model, "_no_split_modules", None) or ())
    present = {type(module).__name__ for module in model.modules()}
    if given - present or not names & present:
        what = (f"has no module of a class fsdp_layer_classes names ({', '.join(sorted(given - present))})" if given
                else f"has no module of a class its _no_split_modules names ({', '.join(sorted(names))})" if names
                else "names no _no_split_modules")
        blocks = {type(block).__name__ for module in model.modules() if isinstance(module, torch.nn.ModuleList)
                  for block in module}  # its layers, most likely
        raise ConfigError(f"fsdp: {type(model).__name__} {what}, so FSDP2 would shard only the whole model; set "
                          "fsdp_layer_classes to the class names of its layers (its repeated blocks: "
                          f"{', '.join(sorted(blocks)) or 'none'})")
    return names & present


def shard(model: torch.nn.Module, cfg: TrainConfig, env: DistEnv) -> FSDPModule:
    """`model` sharded in place: each of its decoder layers (layer_classes: fsdp_layer_classes or
    `_no_split_modules`) a unit of its own, then the root (embeddings, final norm, head). Under
    mixed precision the forward runs in bf16/fp16 and gradients are reduced and accumulated in fp32.
    With `compile`, each layer is compiled on its own, before it is sharded (FSDP2's hooks stay
    outside the compiled graphs). Its `no_sync()` is DDP's, for FSDP2 (no_sync below)."""
    if cfg.fsdp == "hybrid_shard":
        mesh = init_device_mesh(env.device.type, (cfg.fsdp_replicas, env.world_size // cfg.fsdp_replicas),
                                mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(env.device.type, (env.world_size,), mesh_dim_names=("shard",))
    policy = MixedPrecisionPolicy(**(fsdp_mixed_precision(cfg) or {}))
    layers = layer_classes(model, cfg)
    for module in list(model.modules()):
        if type(module).__name__ in layers:
            if cfg.compile:
                module.compile(**COMPILE)
            fully_shard(module, mesh=mesh, mp_policy=policy)
    sharded = fully_shard(model, mesh=mesh, mp_policy=policy)
    sharded.no_sync = partial(no_sync, sharded, cfg.fsdp_grad_sync)
    return sharded


@contextmanager
def no_sync(model: FSDPModule, fsdp_grad_sync: str):
    """DDP's no_sync() for FSDP2, around each micro-step of a window but its last: a reduce-scatter
    still every micro-step (fsdp_grad_sync micro_step) or none (window: the last does it); HSDP's
    all-reduce across replicas on the last only, in either mode."""
    switch = model.set_requires_gradient_sync if fsdp_grad_sync == "window" else model.set_requires_all_reduce
    switch(False)
    try:
        yield
    finally:
        switch(True)


class CollectiveCounter:
    """Counts FSDP2's gradient collectives on this rank: reduce-scatters (it stands in for FSDP2's
    own, calling the same `reduce_scatter_tensor`) and, under HSDP, the all-reduces across
    replicas (the hook FSDP2 calls after each). `record()` gives those since its last call."""

    def __init__(self, model: torch.nn.Module, hybrid: bool):
        self.reduce_scatters = self.all_reduces = 0
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_custom_reduce_scatter(self)
                if hybrid:
                    module.set_all_reduce_hook(self._all_reduced)

    @staticmethod
    def allocate(size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        self.reduce_scatters += 1
        return REDUCE_SCATTER(output_tensor, input_tensor, op=op, group=group, async_op=async_op)

    def _all_reduced(self, reduced: torch.Tensor) -> None:
        self.all_reduces += 1

    def record(self) -> dict:
        counts = {"reduce_scatters": self.reduce_scatters, "all_reduces": self.all_reduces}
        self.reduce_scatters = self.all_reduces = 0
        return counts

    @staticmethod
    def take_norms() -> tuple[None, None]:
        return None, None  # the gradient noise scale reads DDP's buckets (noise.NoisyGradSyncCounter)


class Sharded:
    """train_pytorch's model sharded with FSDP2 in DDP's stead: the process group (joined by one
    process too), its scaler, its collective counter, its checkpoints and its whole weights at the
    end; built sharded (Sharded.__init__). `sharded(run)` gives it where cfg.fsdp asks for it."""

    GradScaler = ShardedGradScaler  # fp16: the overflow check of each rank's shards, agreed by all

    def __init__(self, run):
        cfg, env = run.cfg, run.env
        whole = run.resume / "model.safetensors" if run.resume is not None else None
        if whole is not None and whole.is_file():
            files = [whole]
        elif cfg.model_factory or cfg.model_name_or_path == TINY:
            files = []
        else:
            files = safetensors_files(Path(cfg.model_name_or_path))
        # a sharded start, but for a model_factory's model (its own code), LoRA's adapters (peft draws them,
        # not the model's init) and a model whose weights are not in local safetensors files (a hub name,
        # .bin files): built whole, as the unsharded start
        self.lora = bool(getattr(cfg, "lora_r", 0))
        on_meta = files is not None and not cfg.model_factory and not self.lora
        model = build_on_meta(cfg, run.model_config) if on_meta else None
        if on_meta and files and not held_by(files, model):  # names transformers converts on load: built whole
            on_meta = False
        if not on_meta:
            model = build_model(cfg, run.model_config).to(env.device)
        layer_classes(model, cfg)  # a refusal before any process waits on another
        init_distributed(env, cfg.rendezvous_timeout_s, cfg.collective_timeout_s, alone_too=True)
        self.model = shard(model, cfg, env)
        if on_meta:
            self.model.to_empty(device=env.device)
        load_slices(self.model, files or [])
        if on_meta:
            initialize_shards(self.model)
        self.counter = CollectiveCounter(self.model, hybrid=cfg.fsdp == "hybrid_shard")
        self.env = env
        self.background = dist.new_group(backend="gloo") if cfg.async_checkpoint else None  # save_sharded's

    @cached_property
    def stager(self) -> DefaultStager:
        return host_stager()  # one for the run

    def save(self, optimizer, folder: Path, training: dict) -> Future | None:
        """Each rank writes its shards (in the background: their Future, published once written);
        rank 0 the rest of the training state."""
        written = save_sharded(self.model, optimizer, folder, self.background, self.stager if self.background else None)
        if self.env.is_main_process:
            torch.save(training, folder / "training_state.pt")
        return written

    def write_weights(self, folder: Path, write: Callable[[Path, dict], None]) -> None:
        """final_model/, on every process: `write` (rank 0's save_pretrained) given the whole state
        gathered, for LoRA's adapters and weights that save_pretrained renames; else given none ({}:
        first, as it clears numbered weight files from its folder), the weights then written by every
        process, no process holding the whole model."""
        if self.lora or not saved_under_own_names(self.model, self.model.state_dict()):
            write(folder, whole_model_state(self.model))
        else:
            write(folder, {})
            save_whole_weights(self.model, folder, self.env)


def sharded(run) -> Sharded | None:
    """The model, built sharded (a sharded start), where cfg.fsdp asks for it, or None (DDP)."""
    return Sharded(run) if run.cfg.fsdp != "none" else None


def build_on_meta(cfg: TrainConfig, config) -> torch.nn.Module:
    """build_model's model on the meta device (no memory): built from its config, as `tiny` is, with
    its ties, its seed drawn and nothing else; its weights come later, shard by shard."""
    from_config = copy.copy(cfg)
    from_config.model_name_or_path = TINY  # the architecture is `config`'s
    with torch.device("meta"):
        return build_model(from_config, config)


def safetensors_files(folder: Path) -> list[Path] | None:
    """A pretrained folder's safetensors files: those its index names (a sharded checkpoint), or its
    one file; None where it has neither (a hub name, .bin files)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return [folder / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    return [folder / "model.safetensors"] if (folder / "model.safetensors").is_file() else None


def local_slice(tensor: torch.Tensor) -> tuple[slice, ...]:
    """Where this process's shard of `tensor` (a DTensor) lies in the whole tensor; all of it for a plain one."""
    if not isinstance(tensor, DTensor):
        return tuple(slice(0, size) for size in tensor.shape)
    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return tuple(slice(start, start + size) for start, size in zip(offset, shape, strict=True))


def file_names(model: torch.nn.Module, name: str) -> list[str]:
    """The names a parameter or buffer may have in a checkpoint: its own, and without (or with) the
    prefix of the base model (a checkpoint of the base model, or of a model with a head)."""
    prefix = getattr(model, "base_model_prefix", "") + "."
    return [name, name.removeprefix(prefix) if name.startswith(prefix) else prefix + name]


def named_tensors(model: torch.nn.Module) -> dict:
    """Each parameter and persistent buffer of `model`, by id: the tensor and every name a checkpoint may
    give it (tied ones: several)."""
    tensors = {}
    for name, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        if attr not in module._non_persistent_buffers_set:
            tensors.setdefault(id(tensor), (tensor, []))[1].extend(file_names(model, name))
    return tensors


def held_by(files: list[Path], model: torch.nn.Module) -> bool:
    """Whether `files` hold every parameter and persistent buffer of `model` under a name load_slices
    reads. Some families' files name or fuse weights otherwise (GPT-NeoX's head, Qwen3-MoE's experts;
    a new classification head is in none): transformers converts those as it loads the whole model."""
    keys = set()
    for path in files:
        with safe_open(path, framework="pt") as f:
            keys |= set(f.keys())
    return all(any(name in keys for name in names) for _, names in named_tensors(model).values())


def load_slices(model: torch.nn.Module, files: list[Path]) -> None:
    """Each process's shards of the parameters (and the persistent buffers) that `files` hold, each
    read alone as its slice of the tensor in the file (converted to the model's dtype), one file open
    at a time. What is loaded is marked initialised (initialize_shards leaves it)."""
    tensors = named_tensors(model)
    for path in files:
        with safe_open(path, framework="pt") as f:
            keys = set(f.keys())
            for tensor, names in list(tensors.values()):
                key = next((name for name in names if name in keys), None)
                if key is None:
                    continue
                where = local_slice(tensor)
                local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
                if local.numel():
                    with torch.no_grad():
                        local.copy_(f.get_slice(key)[where].to(local.dtype))
                tensor._is_hf_initialized = True
                del tensors[id(tensor)]


def initialize_shards(model: torch.nn.Module) -> None:
    """The model's own init (`initialize_weights`: the modules in its order, each one's `_init_weights`)
    on its shards: for each module, its parameters not yet initialised stand in whole (drawn whole,
    one module at a time), then each process keeps its slice. Every process draws the same numbers,
    in the unsharded model's order: its values and the random state after it are the unsharded
    start's. A tied head draws too, and drops it (the unsharded model ties it after its init, to
    the embedding's values). Buffers (rotary frequencies, embedding scales) are the module's own."""
    names = {id(module): name for name, module in model.named_modules()}
    tied = {target for target, source in getattr(model, "all_tied_weights_keys", {}).items()
            if model.get_parameter(target) is model.get_parameter(source)}

    def on_shards(initialize, module, *args):
        shards = {name: param for name, param in module._parameters.items()
                  if isinstance(param, DTensor) and not getattr(param, "_is_hf_initialized", False)}
        for name, param in shards.items():
            whole = torch.empty(param.shape, dtype=param.dtype)
            module._parameters[name] = torch.nn.Parameter(whole, requires_grad=param.requires_grad)
        try:
            initialize(module, *args)
        finally:
            for name, param in shards.items():
                whole = module._parameters[name].detach()
                module._parameters[name] = param
                if f"{names[id(module)]}.{name}".lstrip(".") not in tied:
                    with torch.no_grad():
                        param.to_local().copy_(distribute_tensor(whole, param.device_mesh, param.placements,
                                                                 src_data_rank=None).to_local())

    models = [module for module in model.modules() if isinstance(module, PreTrainedModel)]
    for each in models:
        each._initialize_weights = partial(on_shards, each._initialize_weights)
    try:
        model.initialize_weights()
    finally:
        for each in models:
            del each._initialize_weights


def training_state(model: torch.nn.Module, optimizer) -> dict:
    """The model's and optimizer's state as DCP saves and loads it: sharded tensors under FSDP2,
    whole ones otherwise, keyed by parameter name either way (so one loads into the other)."""
    return {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}


def host_stager() -> DefaultStager:
    """What copies a background save's state to host memory. Keep one for the run: every save then copies
    into the host buffers of the first (pinned on GPUs) instead of allocating new ones."""
    on_gpu = torch.cuda.is_available()
    return DefaultStager(StagingOptions(use_pinned_memory=on_gpu, use_shared_memory=False, use_async_staging=False,
                                        use_non_blocking_copy=on_gpu))


def save_sharded(model: torch.nn.Module, optimizer, folder: Path, background=None, stager=None):
    """Each rank writes its shards of the model and optimizer into `folder`. With `background` (a
    gloo group of its own: on the training group the writer's collectives would interleave with
    training's and hang) the state is copied to host memory by `stager` (into the buffers of its
    last save, which the caller has waited for), written by a thread while training goes on, and its
    Future returned."""
    state = training_state(model, optimizer)
    try:
        if background is None:
            dcp.save(state, checkpoint_id=folder / DCP_DIR)
            return None
        return dcp.async_save(state, checkpoint_id=folder / DCP_DIR, process_group=background, async_stager=stager)
    except dcp.CheckpointException as err:  # a full disk on some rank: checkpoint._attempt's one line
        raise failure(err) from None


def failure(err: BaseException) -> BaseException:
    """The error of the first rank that failed, from DCP's CheckpointException (a BaseException,
    raised on every rank alike, that no `except Exception` catches); any other error as it is."""
    failures = getattr(err, "failures", None)
    return next(iter(failures.values()))[0] if failures else err


def written(future: Future) -> None:
    """Wait for a write in the background; its failure as failure() gives it."""
    try:
        future.result()
    except dcp.CheckpointException as err:
        raise failure(err) from None


def load_sharded(model: torch.nn.Module, optimizer, folder: Path) -> None:
    """Load a sharded checkpoint's model and optimizer, resharded to this run's world size and
    mesh, or gathered whole for an unsharded model."""
    state = training_state(model, optimizer)
    try:
        dcp.load(state, checkpoint_id=folder / DCP_DIR, no_dist=not dist.is_initialized())
    except (Exception, dcp.CheckpointException) as err:  # a shard damaged in place (its size kept)
        reason = failure(err)
        raise JobFailed(f"checkpoint {folder} cannot be loaded: a shard in {folder / DCP_DIR} is damaged "
                        f"({type(reason).__name__}: {first_line(reason)}); {older_that_loads(folder)}",
                        exit_code=2, agreed=True) from None
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optimizer"])


def load_training_state(model: torch.nn.Module, optimizer, folder: Path, state: dict) -> None:
    """A checkpoint's optimizer state (and a sharded checkpoint's model): resharded from a sharded
    one, sharded from a whole one, or DDP's own."""
    if (folder / DCP_DIR).is_dir():
        load_sharded(model, optimizer, folder)
    elif isinstance(model, FSDPModule):
        load_whole_optimizer(model, optimizer, state["optimizer"])
    else:
        optimizer.load_state_dict(state["optimizer"])


def load_whole_optimizer(model: FSDPModule, optimizer, state: dict) -> None:
    """An unsharded run's optimizer state (torch's own, numbered in parameter order) into the
    optimizer of the sharded model, which has the same parameters in the same order."""
    names = {id(p): name for name, p in model.named_parameters()}
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    by_name = {"state": {order[i]: values for i, values in state["state"].items()},
               "param_groups": [{**group, "params": [order[i] for i in group["params"]]}
                                for group in state["param_groups"]]}
    set_optimizer_state_dict(model, optimizer, by_name, options=StateDictOptions(full_state_dict=True))


def untied(model: torch.nn.Module, state: dict) -> dict:
    """`state` with a tied parameter (the head that is the embedding) once, as save_pretrained writes it."""
    tied = {name for name, _ in model.named_parameters(remove_duplicate=False)} - dict(model.named_parameters()).keys()
    return {name: value for name, value in state.items() if name not in tied}


def whole_model_state(model: torch.nn.Module) -> dict:
    """The whole model's parameters on rank 0's CPU, gathered one tensor at a time (every rank takes
    part; the others get none)."""
    return untied(model, get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)))


def saved_under_own_names(model: torch.nn.Module, state: dict) -> bool:
    """Whether save_pretrained writes these weights under the model's own names: it does not where
    transformers converts a checkpoint's weights on load (fused experts, renamed heads)."""
    if not isinstance(model, PreTrainedModel):
        return True
    shapes = {name: torch.empty(value.shape, dtype=value.dtype, device="meta") for name, value in state.items()}
    return revert_weight_conversion(model, dict(shapes)).keys() == shapes.keys()


def save_whole_weights(model: torch.nn.Module, folder: Path, env: DistEnv) -> None:
    """The sharded model's weights in save_pretrained's files (model.safetensors; over
    MAX_WEIGHTS_FILE_BYTES, numbered files and their index), written by every process with no
    process holding the whole model: each writes its own shards into folder/sharded/, then rank 0
    joins them one tensor at a time (torch's HuggingFace writer) and removes them."""
    state = untied(model, model.state_dict())
    file_of, files, size = {}, 1, 0
    for name, value in state.items():
        nbytes = value.numel() * value.element_size()
        if size and size + nbytes > MAX_WEIGHTS_FILE_BYTES:
            files, size = files + 1, 0
        file_of[name], size = files, size + nbytes
    dcp.save(state, storage_writer=HuggingFaceStorageWriter(str(folder), fqn_to_index_mapping=file_of,
                                                           save_distributed=True, enable_consolidation=True))
    if env.is_main_process:
        shutil.rmtree(folder / SHARDED_DIR_NAME)
        if files == 1:  # one file: named as save_pretrained names it, without an index
            (folder / "model-00001-of-00001.safetensors").rename(folder / "model.safetensors")
            (folder / "model.safetensors.index.json").unlink()


@dataclass
class PendingWrite:
    """A folder whose files are still being written in the background (an asynchronous checkpoint),
    published as soon as they are: by rank 0's writer thread, when its write is done (DCP finishes
    it only after every rank's write, writing the index of them all), with no collective of
    training's. `finish()` (the next save, the end) waits for it on every process; a failed write
    is then every process's one line. If the job dies first, the newest complete checkpoint is
    the one before."""

    cfg: TrainConfig
    env: DistEnv
    tmp: Path
    final: Path
    state: dict
    written: Future
    marked: threading.Event = field(default_factory=threading.Event)  # rank 0's thread is done with it
    error: Exception | None = None  # what rank 0's thread met marking it complete

    def __post_init__(self):
        if self.env.is_main_process:
            self.written.add_done_callback(self._mark_complete)

    def _mark_complete(self, future: Future) -> None:
        try:
            if future.exception() is None:  # else finish() says why, on every process
                mark_complete(self.cfg, self.tmp, self.final, self.state)
        except Exception as err:  # a full disk: finish() says it
            self.error = err
        finally:
            self.marked.set()

    def finish(self) -> Path:
        def wait() -> None:
            written(self.written)
            if self.env.is_main_process:
                self.marked.wait()
                if self.error is not None:
                    raise self.error

        try:
            _attempt(self.env, self.cfg.output_dir, self.final.name, wait)
            return self.final
        except JobFailed:
            if self.env.is_main_process:
                shutil.rmtree(self.tmp, ignore_errors=True)
            raise


def write_in_background(cfg: TrainConfig, env: DistEnv, final: Path, write: Callable, state: dict):
    """checkpoint.write_atomically, where a `write` that returns a Future (its files still being
    written) gives a PendingWrite, to finish later (Session.save_checkpoint)."""
    started = []

    def finish(*publishing):  # cfg, env, the written folder, final, state
        # a Future: the files are still being written (Accelerate's save_state returns its folder)
        return PendingWrite(*publishing, started[0]) if isinstance(started[0], Future) else publish(*publishing)

    return write_atomically(cfg, env, final, lambda folder: started.append(write(folder)), state, finish)
