"""checkpoint.format=sharded: one torch.distributed.checkpoint (DCP) folder per checkpoint, each rank writing its
own shards, loadable at any world size and layout (DCP reads each rank's part of every tensor).

A folder (`last.dcp/`, `best.dcp/`, `epoch_NNNN.dcp/`) holds DCP's files for the tensors, under the full model's
names:

- `model.NAME`: the model's parameters and buffers (DTensor shards under fsdp, zero2 and tensor parallel; a
  pipeline stage writes the names it owns; replicated tensors are written once);
- `optim.NAME.KEY`: the optimizer's per-parameter tensors (`optim.fc.weight.exp_avg`), sharded the same way
  (zero1: each rank its own partition's);

and `state.pt`, the non-tensor rest, written by rank 0 and loadable with torch.load(weights_only=True): what a
`.pt` checkpoint holds besides `model` and `optimizer` (epoch, step, scheduler, rng, config, ...) plus
`optimizer_groups` (the optimizer's param_groups with parameter names) and `format`.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddpkit.atomicio import atomic_write, os_cause
from ddpkit.checkpoint import dcp_io
from ddpkit.checkpoint import state_dict as sd_mod
from ddpkit.checkpoint.state_dict import GROUPS, PARAMS, STATE
from ddpkit.checkpoint.unreadable import unreadable_reason
from ddpkit.distributed.collectives import broadcast_object
from ddpkit.errors import UserError

FORMAT = "ddpkit.sharded/1"
SIDE = "state.pt"
MODEL, OPTIM = "model.", "optim."


def is_sharded(path: str | os.PathLike) -> bool:
    """True when `path` is a DCP checkpoint folder (it holds .metadata or ddpkit's state.pt)."""
    p = Path(path)
    return p.is_dir() and ((p / dcp_io.METADATA).is_file() or (p / SIDE).is_file())


def model_sd_names(keys: Any) -> list[str]:
    """The model's tensor names among a folder's keys (`model.NAME`)."""
    return [k[len(MODEL) :] for k in keys if k.startswith(MODEL)]


def _no_dist() -> bool:
    return not (dist.is_available() and dist.is_initialized())


def _zero_local(module: nn.Module, optimizer: Any) -> dict:
    """ZeroRedundancyOptimizer: this rank's partition's state, by parameter name (no gathering)."""
    names = {id(p): n for n, p in module.named_parameters()}
    return {names[id(p)]: dict(s) for p, s in optimizer.optim.state.items()}


def _optimizer_parts(module: nn.Module, optimizer: Any) -> tuple[dict, list]:
    """(this rank's {name: {key: value}} optimizer state, the name-keyed param_groups of all ranks). Collective."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    if sd_mod._is_zero(optimizer):
        return _zero_local(module, optimizer), sd_mod.named_groups(module, optimizer)
    osd = get_optimizer_state_dict(module, optimizer)
    groups = osd[GROUPS]
    if sd_mod.stages_differ(module):
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, {STATE: {}, GROUPS: groups})
        groups = sd_mod._union_optim(parts)[GROUPS]
    return osd[STATE], groups


def _savable(value: torch.Tensor) -> torch.Tensor:
    """`value` as DCP can write it: a DTensor's pending (Partial) sums reduced first, so its placements are only
    Shard and Replicate. Collective over the DTensor's mesh; any other tensor is returned as it is."""
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(value, DTensor) or not any(p.is_partial() for p in value.placements):
        return value
    placements = [Replicate() if p.is_partial() else p for p in value.placements]
    return value.redistribute(value.device_mesh, placements)


def state_tensors(module: nn.Module, optimizer: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(this rank's tensors for DCP, the non-tensor optimizer entries for state.pt). Collective."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    tensors = {MODEL + k: _savable(v) for k, v in get_model_state_dict(module).items()}
    if optimizer is None:
        return tensors, {}
    state, groups = _optimizer_parts(module, optimizer)
    values: dict[str, dict] = {}
    for name, entries in state.items():
        for key, value in entries.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{OPTIM}{name}.{key}"] = _savable(value)
            else:
                values.setdefault(name, {})[key] = value
    return tensors, {"optimizer_groups": groups, "optimizer_values": values}


def write(target: Path, tensors: dict[str, torch.Tensor], side: dict[str, Any], is_main: bool) -> None:
    """Every rank writes its shards into a temporary folder; rank 0 adds state.pt and renames it to `target`.
    Collective; rank 0 returns once the folder is in place."""
    import torch.distributed.checkpoint as dcp

    tmp, side_bytes = _begin(target, side, is_main)
    with _named_errors(target), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process, no group
        dcp.save(tensors, storage_writer=dcp.FileSystemWriter(tmp, sync_files=True), no_dist=_no_dist())
    if is_main:
        place(tmp, target, side_bytes)


def write_in_background(
    target: Path,
    tensors: dict[str, torch.Tensor],
    side: dict[str, Any],
    is_main: bool,
    group: Any,
    stager: Any,
    later: frozenset[str] = frozenset(),
) -> tuple[Future, Callable[[], None], Callable[[], None]]:
    """The same write with torch.distributed.checkpoint.async_save: every tensor but those named in `later` is
    copied before this returns, and `stager` (a torch DefaultStager) copies the tensors again, into copies it keeps
    between saves, in a thread of its own; every rank's shards are then written by a background thread whose
    collectives run over `group` (a gloo group of their own, apart from training's). `later`: tensors that only
    an optimizer step changes (changed_by_step), which must not change before `staged` is done.
    Returns (`staged`, `wait`, `place`): once wait() returns, every rank's shards and DCP's .metadata are durable
    (it raises the write's error); place() then puts the folder in place on rank 0 (state.pt, fsync, rename) as
    write() does. Collective."""
    import torch.distributed.checkpoint as dcp

    tmp, side_bytes = _begin(target, side, is_main)
    now = {k: v if k in later else v.detach().clone() for k, v in tensors.items()}
    if any(v.device.type != "cpu" for v in now.values()):
        torch.accelerator.synchronize()  # the stager's stream reads what this step and the copies wrote
    # one process: DCP's thread warns that it assumes so (a filter of this thread cannot reach it)
    if _no_dist():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", module=dcp.__name__)
    response = dcp.async_save(
        now,
        storage_writer=dcp.FileSystemWriter(tmp, sync_files=True),
        process_group=group,
        async_stager=stager,
        no_dist=_no_dist(),
    )

    def wait() -> None:
        with _named_errors(target):
            response.upload_completion.result()

    def place_it() -> None:
        if is_main:
            place(tmp, target, side_bytes)

    return response.staging_completion, wait, place_it


def changed_by_step(tensors: dict[str, torch.Tensor], optimizer: Any) -> frozenset[str]:
    """The names among `tensors` that only an optimizer step changes: the optimizer's state (`optim.*`) and the
    model tensors that share memory with a parameter the optimizer updates. Any other tensor (a buffer such as
    batch norm's running statistics, which a forward pass changes) is not among them."""
    from torch.distributed.tensor import DTensor

    def storage(t: torch.Tensor) -> int:
        local = t._local_tensor if isinstance(t, DTensor) else t
        return local.untyped_storage().data_ptr() if local.numel() else 0

    params = {storage(p) for g in getattr(optimizer, "param_groups", ()) for p in g[PARAMS]} - {0}
    return frozenset(k for k, v in tensors.items() if k.startswith(OPTIM) or storage(v) in params)


def _begin(target: Path, side: dict[str, Any], is_main: bool) -> tuple[Path, bytes]:
    """(the temporary folder rank 0 made beside `target`, on every rank; state.pt's bytes, made now: the state
    as it is at this step). Collective."""
    import io

    tmp = Path(broadcast_object(str(dcp_io.temp_folder(target)) if is_main else None))
    buf = io.BytesIO()
    if is_main:
        torch.save({**side, "format": FORMAT}, buf)
    return tmp, buf.getvalue()


def place(tmp: Path, target: Path, side_bytes: bytes) -> None:
    """Rank 0, once every rank's shards are in `tmp`: state.pt added, the folder fsynced and renamed to `target`."""
    atomic_write(tmp / SIDE, lambda fh: fh.write(side_bytes))
    dcp_io.replace_folder(tmp, target)


@contextlib.contextmanager
def _named_errors(target: Path):
    """A failed DCP save (a full disk, a size limit: DCP wraps each rank's error in a CheckpointException) raised
    as the OSError behind it, naming the folder being written."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as e:
        error = _write_error(e)
        if error is None:
            raise
        raise OSError(error.errno, error.strerror, str(target)) from None


def _write_error(e: BaseException) -> OSError | None:
    """The OSError behind a failed DCP save on any rank (DCP wraps each rank's in a CheckpointException)."""
    for failure in (getattr(e, "_failures", {}) or {}).values():
        cause = failure[0] if isinstance(failure, tuple) else getattr(failure, "exc", failure)
        if isinstance(cause, BaseException) and (found := os_cause(cause)) is not None:
            return found
    return None


# -------------------------------------------------------------------------------------------- loading


def _check_shapes(path: Path, template: dict[str, torch.Tensor]) -> None:
    """Every tensor of `template` is in the folder's metadata with the same full shape: a KeyError or ValueError
    naming the tensor and both shapes otherwise (DCP's own message names neither)."""
    entries = dcp_io.tensor_entries(dcp_io.read_metadata(path))
    for key, value in template.items():
        if key not in entries:
            raise KeyError(f"tensor '{key}' of this model is not in the checkpoint")
        saved, here = tuple(entries[key].size), tuple(value.shape)
        if saved != here:
            raise ValueError(
                f"tensor '{key}' has shape {list(saved)} in the checkpoint and {list(here)} in this model"
            )


def _dcp_load(path: Path, template: dict[str, torch.Tensor]) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    _check_shapes(path, template)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(
                template,
                storage_reader=dcp_io.reader_for(path),
                planner=dcp_io.TensorsOnlyPlanner(),
                no_dist=_no_dist(),
            )
    except CheckpointException as e:  # a BaseException: every rank raises it, with each rank's failure
        failures = getattr(e, "_failures", {}) or {}
        rank, failure = next(iter(failures.items()), (None, None))
        cause = failure[0] if isinstance(failure, tuple) else getattr(failure, "exc", failure)
        if not isinstance(cause, BaseException):
            raise ValueError(str(e).splitlines()[0]) from None
        shard = "a shard"
        if isinstance(cause, dcp_io.ShardReadError):
            shard, cause = f"its shard {cause.name}", cause.cause
        if isinstance(cause, (KeyError, ValueError, RuntimeError)) and "shape" in str(cause):
            raise ValueError(str(cause).splitlines()[0]) from None
        raise ValueError(
            f"{shard} of {path} read by rank {rank} is damaged: {unreadable_reason(cause)}"
        ) from None


def _optim_template(md, names: set[str]) -> dict[str, torch.Tensor]:
    """Full-size empty tensors for the checkpoint's optimizer entries of parameters in `names`."""
    out = {}
    for key, entry in dcp_io.tensor_entries(md).items():
        if key.startswith(OPTIM) and key[len(OPTIM) :].rsplit(".", 1)[0] in names:
            out[key] = torch.empty(entry.size, dtype=entry.properties.dtype)
    return out


def _name_keyed(tensors: dict[str, torch.Tensor], side: dict, names: set[str]) -> dict:
    state: dict[str, dict] = {}
    for key, value in tensors.items():
        name, entry = key[len(OPTIM) :].rsplit(".", 1)
        state.setdefault(name, {})[entry] = value
    for name, values in (side.get("optimizer_values") or {}).items():
        if name in names:
            state.setdefault(name, {}).update(values)
    groups = [{**g, PARAMS: [n for n in g[PARAMS] if n in names]} for g in side["optimizer_groups"]]
    return {STATE: state, GROUPS: groups}


def load(path: str | os.PathLike, module: nn.Module, optimizer: Any, side: dict) -> None:
    """The model (and optimizer) tensors of DCP folder `path` into this layout: each rank reads its own part.
    Collective. ValueError/KeyError when they do not fit."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    path = Path(path)
    md = dcp_io.read_metadata(path)
    template = {MODEL + k: v for k, v in get_model_state_dict(module).items()}
    sd_mod.check_unused(model_sd_names(template), model_sd_names(dcp_io.tensor_entries(md)))
    _dcp_load(path, template)
    model_sd = {k[len(MODEL) :]: v for k, v in template.items()}
    if sd_mod.has_dtensor(module):
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(module, model_sd, options=sd_mod._options(full=False))
    else:
        module.load_state_dict(model_sd)
    if optimizer is None or "optimizer_groups" not in side:
        return
    names = {n for n, _ in module.named_parameters()}
    if sd_mod.has_dtensor(module) and not sd_mod._is_zero(optimizer):  # shards: DCP reads this rank's part
        osd = get_optimizer_state_dict(module, optimizer)
        tensors = {
            f"{OPTIM}{n}.{k}": v for n, s in osd[STATE].items() for k, v in s.items() if torch.is_tensor(v)
        }
        _dcp_load(path, tensors)
        sd_mod.load_optimizer(module, optimizer, _name_keyed(tensors, side, names), full=False)
    else:  # replicated or ZeRO-1: full tensors of this rank's parameters
        tensors = _optim_template(md, names)
        _dcp_load(path, tensors)
        sd_mod.load_optimizer(module, optimizer, _name_keyed(tensors, side, names), full=True)


def model_shapes(path: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """The full shape of each model tensor of DCP folder `path`, from its metadata (no tensor read)."""
    entries = dcp_io.tensor_entries(dcp_io.read_metadata(path))
    return {k[len(MODEL) :]: tuple(e.size) for k, e in entries.items() if k.startswith(MODEL)}


def read_model(path: str | os.PathLike, names: list[str] | None = None) -> dict[str, torch.Tensor]:
    """The full model state of DCP folder `path` (names to full tensors; only `names` when given), read in this
    process alone (as torch.load reads a .pt file's `model`); collective when a process group exists."""
    md = dcp_io.read_metadata(path)
    template = {
        k: torch.empty(e.size, dtype=e.properties.dtype)
        for k, e in dcp_io.tensor_entries(md).items()
        if k.startswith(MODEL) and (names is None or k[len(MODEL) :] in names)
    }
    try:
        _dcp_load(Path(path), template)
    except ValueError as e:  # a damaged shard: what train and eval say too, as one line
        raise UserError(
            f"checkpoint '{path}': {e}", "give another checkpoint of the run (such as an epoch_NNNN.dcp)"
        ) from None
    return {k[len(MODEL) :]: v for k, v in template.items()}


def read_tensor(path: str | os.PathLike, name: str) -> torch.Tensor:
    """One model tensor of DCP folder `path`, whole: only its chunks are read (export streams a checkpoint
    tensor by tensor)."""
    return read_model(path, [name])[name]
