"""A Hugging Face folder read as shards, two ways.

`FolderReader`: the folder read by torch.distributed.checkpoint as if it were a sharded ddpkit checkpoint: the
folder's tensors under the model's names (`model.NAME`, as checkpoint/sharded.py writes them), each one chunk of
its full shape. Every layout's sharded load (`Strategy.load_sharded`: fsdp, hsdp, zero2, tp, the pipeline's
stages) then reads a Hugging Face folder as it reads a checkpoint: DCP plans, for each rank, the boxes of each
tensor it holds, and this reader reads just those boxes from the safetensors files (FolderTensors.read). No rank
reads or allocates the whole model. Importing this module declares it to checkpoint/dcp_io.py (`declare_foreign`).

`FolderSource`: the folder as the values of a model built on the meta device and laid out, for the step that
gives each rank's shards memory (a weight source: `pieces(wanted)` yields each tensor's piece this rank holds,
reading only that box of the file); as a Mapping, a whole tensor read when it is asked for."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.storage import StorageReader
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from ddpkit.checkpoint import dcp_io
from ddpkit.checkpoint.sharded import MODEL
from ddpkit.models import MODEL_FAMILIES
from ddpkit.models.hf import is_hf_folder, open_folder
from ddpkit.models.hf.tensors import FolderTensors


def is_foreign(folder: Path) -> bool:
    """A Hugging Face folder (config.json), not a DCP one (.metadata)."""
    return is_hf_folder(folder) and not (folder / dcp_io.METADATA).exists()


class FolderReader(StorageReader):
    """DCP's StorageReader over a Hugging Face folder of a family that declares its converter's table; the folder
    is checked (config.json's values, the tensors' names, dtypes and shapes) when its metadata is first read.
    `READ` counts, per folder, the elements this process has read from it (what `model.init_from`'s line reports
    and a test of the sliced reads looks at)."""

    READ: ClassVar[dict[Path, int]] = {}

    def __init__(self, folder: str | os.PathLike):
        super().__init__()
        self.folder = Path(folder)
        self._tensors: Any = None

    @property
    def tensors(self) -> Any:
        if self._tensors is None:
            self._tensors = open_folder(self.folder, MODEL_FAMILIES.entries()).tensors_or_refuse()
        return self._tensors

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        pass

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        entries = {}
        for name, shape in self.tensors.shapes.items():
            size = torch.Size(shape)
            chunk = ChunkStorageMetadata(offsets=torch.Size([0] * len(shape)), sizes=size)
            props = TensorProperties(dtype=self.tensors.dtype(name))
            entries[MODEL + name] = TensorStorageMetadata(properties=props, size=size, chunks=[chunk])
        return Metadata(state_dict_metadata=entries)

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        pass

    def prepare_local_plan(self, plan: Any) -> Any:
        return plan

    def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
        return plans

    def read_data(self, plan: Any, planner: Any) -> torch.futures.Future:
        with torch.no_grad():
            for item in plan.items:
                value = self.tensors.read(
                    item.storage_index.fqn[len(MODEL) :], item.storage_offsets, item.lengths
                )
                self.READ[self.folder] = self.READ.get(self.folder, 0) + value.numel()
                target = planner.resolve_tensor(item).detach()
                target.copy_(value)
                planner.commit_tensor(item, target)
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(None)
        return done

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return is_foreign(Path(checkpoint_id))


class FolderSource(Mapping):
    """The folder's tensors (FolderTensors, checked) as the values of a model built on the meta device: `pieces`
    reads for each laid-out tensor the box this rank holds (a DTensor sharded evenly or replicated; one of
    another layout, such as FSDP's strided shard over a tensor-parallel one, is read whole, one tensor at a time,
    and cut without communication)."""

    def __init__(self, tensors: FolderTensors):
        self.tensors = tensors

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors.read(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors.table)

    def __len__(self) -> int:
        return len(self.tensors.table)

    def piece(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """This rank's piece of tensor `name`, laid out as `like`."""
        if not isinstance(like, DTensor):
            value = self.tensors.read(name)
        elif all(type(p) in (Shard, Replicate) for p in like.placements):
            (chunk,) = like.__create_chunk_list__()  # the box of the whole tensor this rank holds
            value = self.tensors.read(name, chunk.offsets, chunk.sizes)
        else:
            whole = self.tensors.read(name)
            value = distribute_tensor(whole, like.device_mesh, like.placements, src_data_rank=None).to_local()
        folder = self.tensors.folder
        FolderReader.READ[folder] = FolderReader.READ.get(folder, 0) + value.numel()
        return value

    def pieces(self, wanted: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, this rank's piece) of every tensor of `wanted` ({the model's name: the tensor, laid out})."""
        for name, like in wanted.items():
            yield name, self.piece(name, like)


dcp_io.declare_foreign(is_foreign, FolderReader)  # from here on, DCP reads a Hugging Face folder with it
