"""Reading and placing torch.distributed.checkpoint (DCP) folders safely.

- A folder's `.metadata` is a pickle: it is read with an unpickler that builds DCP's own metadata classes (and
  torch sizes, dtypes and layouts) and refuses every other global, so a hostile file cannot run code. DCP's own
  reader would call pickle.load on it.
- Only tensors are read back (torch.load(weights_only=True) on each); an entry stored as pickled bytes is refused.
- A folder is put in place atomically as a whole: written under a temporary name, fsynced, then renamed; a folder
  it replaces is first renamed aside (`.NAME.prev`) and removed once the new one is in place, so a kill at any
  moment leaves the old folder or the new one (`restore_aside` puts an old one back after a kill between the two
  renames).
"""

from __future__ import annotations

import os
import pickle
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from ddpkit.atomicio import NotRegularFile, check_regular, fsync_dir, open_regular, sweep_temporaries, umask
from ddpkit.errors import UserError

METADATA = ".metadata"
MAX_METADATA_BYTES = 256 << 20  # far above any real model's; a larger file is not read into memory

_MD = "torch.distributed.checkpoint.metadata"
_ALLOWED = {
    (_MD, "Metadata"),
    (_MD, "MetadataIndex"),
    (_MD, "TensorStorageMetadata"),
    (_MD, "BytesStorageMetadata"),
    (_MD, "ChunkStorageMetadata"),
    (_MD, "TensorProperties"),
    (_MD, "StorageMeta"),
    (_MD, "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata classes and torch dtypes; any other global is refused before it is looked up."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"GLOBAL {module}.{name}")


# Folders of a model's tensors in another format, read through a StorageReader of their own so that every
# layout's sharded load reads them as it reads a DCP folder: (is_one(folder), reader(folder)). A Hugging Face
# folder's is declared by models/hf when it is imported (as a family declares its config keys).
FOREIGN: list[tuple[Callable[[Path], bool], Callable[[Path], Any]]] = []


def declare_foreign(is_one: Callable[[Path], bool], reader: Callable[[Path], Any]) -> None:
    if (is_one, reader) not in FOREIGN:
        FOREIGN.append((is_one, reader))


def reader_for(folder: str | os.PathLike) -> Any:
    """The StorageReader of `folder`: a declared foreign folder's, else SafeReader."""
    found = next((make for is_one, make in FOREIGN if is_one(Path(folder))), None)
    return found(Path(folder)) if found is not None else SafeReader(folder)


def read_metadata(folder: str | os.PathLike):
    """The DCP Metadata of `folder`, read safely; UserError when it is missing, damaged or holds other objects."""
    from torch.distributed.checkpoint.metadata import Metadata

    if any(is_one(Path(folder)) for is_one, _ in FOREIGN):
        return reader_for(folder).read_metadata()
    path = Path(folder) / METADATA
    try:
        with os.fdopen(open_regular(path), "rb") as fh:
            if os.fstat(fh.fileno()).st_size > MAX_METADATA_BYTES:
                raise UserError(
                    f"checkpoint '{folder}' is unreadable: its {METADATA} is larger than any real one"
                )
            md = _MetadataUnpickler(fh).load()
    except NotRegularFile as e:
        raise UserError(
            f"checkpoint '{folder}' is unreadable: its {METADATA} is {e.strerror}, not a file",
            "point to a complete checkpoint written by ddpkit train",
        ) from None
    except FileNotFoundError:
        raise UserError(
            f"checkpoint '{folder}' is unreadable: it has no {METADATA} (an unfinished save?)",
            "point to a complete checkpoint written by ddpkit train",
        ) from None
    except pickle.UnpicklingError as e:
        raise UserError(
            f"checkpoint '{folder}' is unreadable: its {METADATA} holds Python objects ({e}) that a safe "
            "load refuses to run",
            "point to a checkpoint written by ddpkit train",
        ) from None
    except (OSError, EOFError, ValueError, TypeError, AttributeError, IndexError) as e:
        raise UserError(
            f"checkpoint '{folder}' is unreadable: its {METADATA} is damaged ({type(e).__name__})",
            "point to a complete checkpoint written by ddpkit train",
        ) from None
    _check_metadata(md, Metadata, folder)
    _check_storage(md, Path(folder))
    return md


def _check_storage(md: Any, folder: Path) -> None:
    """Every shard file the metadata names is a regular file in `folder` holding at least the bytes its entries
    reach (a FIFO would block the reader; a missing or cut shard would fail deep inside DCP, naming nothing)."""
    reach: dict[str, int] = {}
    for info in (getattr(md, "storage_data", None) or {}).values():
        end = int(getattr(info, "offset", 0) or 0) + int(getattr(info, "length", 0) or 0)
        reach[info.relative_path] = max(reach.get(info.relative_path, 0), end)
    hint = "point to a complete checkpoint written by ddpkit train"
    for name, end in sorted(reach.items()):
        try:
            st = check_regular(folder / name)
        except NotRegularFile as e:
            raise UserError(
                f"checkpoint '{folder}' is unreadable: its shard {name} is {e.strerror}, not a file", hint
            ) from None
        if st is None:
            raise UserError(f"checkpoint '{folder}' is unreadable: its shard {name} is missing", hint)
        if st.st_size < end:
            raise UserError(
                f"checkpoint '{folder}' is unreadable: its shard {name} holds {st.st_size} bytes, its tensors "
                f"reach byte {end} (cut short)",
                hint,
            )


def _check_metadata(md: Any, cls: type, folder: Any) -> None:
    """The unpickled object is DCP's Metadata whose storage files all lie inside the folder."""
    bad = not isinstance(md, cls) or not isinstance(md.state_dict_metadata, dict)
    storage = getattr(md, "storage_data", None)
    if not bad and isinstance(storage, dict):
        names = {getattr(info, "relative_path", None) for info in storage.values()}
        bad = any(
            not isinstance(n, str) or not n or "/" in n or "\\" in n or n.startswith("..") for n in names
        )
    if bad:
        raise UserError(
            f"checkpoint '{folder}' is unreadable: its {METADATA} is not torch.distributed.checkpoint metadata",
            "point to a checkpoint written by ddpkit train",
        )


def tensor_entries(md) -> dict[str, Any]:
    """{key: TensorStorageMetadata} of the metadata's tensor entries (size, properties.dtype)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return {k: v for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}


class ShardReadError(Exception):
    """Reading shard file `name` of a DCP folder failed with `cause`."""

    def __init__(self, name: str, cause: BaseException):
        super().__init__(f"{name}: {cause}")
        self.name, self.cause = name, cause


class SafeReader(FileSystemReader):
    """FileSystemReader whose metadata comes from the restricted unpickler; a shard that cannot be read is named
    (ShardReadError)."""

    def read_data(self, plan: Any, planner: Any):
        import dataclasses

        per_file: dict[str, list] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for name, items in per_file.items():  # one file at a time: a failure is that file's
            try:
                super().read_data(dataclasses.replace(plan, items=items), planner).wait()
            except Exception as e:
                raise ShardReadError(name, e) from e
        return super().read_data(dataclasses.replace(plan, items=[]), planner)

    def read_metadata(self, *args: Any, **kwargs: Any):
        from torch.distributed.checkpoint.metadata import StorageMeta

        md = read_metadata(self.path)
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


class TensorsOnlyPlanner(DefaultLoadPlanner):
    """DCP's load planner, refusing entries stored as pickled bytes (DCP would torch.load them unsafely)."""

    def load_bytes(self, read_item, value) -> None:
        raise ValueError(f"entry '{read_item.dest_index.fqn}' is pickled bytes, not a tensor")


# ------------------------------------------------------------------------------------- atomic folders


def temp_folder(target: Path) -> Path:
    """A new empty folder beside `target` with a temporary name (swept by remove_temporaries)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    os.chmod(tmp, 0o777 & ~umask())
    return tmp


def _aside(target: Path) -> Path:
    return target.with_name(f".{target.name}.prev")


def replace_folder(src: Path, target: Path) -> Path:
    """Rename the complete folder `src` to `target`, replacing a folder there (see the module's docstring)."""
    for path in src.iterdir():
        with open(path, "rb") as fh:
            os.fsync(fh.fileno())
    fsync_dir(src)
    old = _aside(target)
    if target.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.rename(target, old)
    os.rename(src, target)
    fsync_dir(target.parent)
    shutil.rmtree(old, ignore_errors=True)
    return target


def copy_folder(src: Path, target: Path) -> Path:
    """An independent copy of folder `src` at `target`, put in place atomically."""
    tmp = temp_folder(target)
    try:
        for path in src.iterdir():
            shutil.copyfile(path, tmp / path.name)
        return replace_folder(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def surviving(target: Path) -> Path | None:
    """`target`, or the folder it replaced when a kill came between the two renames (None: neither)."""
    if target.is_dir():
        return target
    old = _aside(target)
    return old if old.is_dir() else None


def restore_aside(target: Path) -> None:
    """After a kill between the two renames: put the old folder back (or drop it when the new one is there)."""
    old = _aside(target)
    if old.is_dir():
        if target.exists():
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(old, target)


def remove_temporaries(folder: Path) -> None:
    """Remove the temporary files and folders of saves that were killed half-way (only the names ddpkit makes:
    atomicio.sweep_temporaries)."""
    sweep_temporaries(folder)
