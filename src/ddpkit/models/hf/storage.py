"""A Hugging Face folder read by torch.distributed.checkpoint as if it were a sharded ddpkit checkpoint: the
folder's tensors under the model's names (`model.NAME`, as checkpoint/sharded.py writes them), each one chunk of
its full shape. Every layout's sharded load (`Strategy.load_sharded`: fsdp, hsdp, zero2, tp, the pipeline's
stages) then reads a Hugging Face folder as it reads a checkpoint: DCP plans, for each rank, the boxes of each
tensor it holds, and this reader reads just those boxes from the safetensors files (FolderTensors.read). No rank
reads or allocates the whole model. Importing this module declares it to checkpoint/dcp_io.py (`declare_foreign`)."""

from __future__ import annotations

import os
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

from ddpkit.checkpoint import dcp_io
from ddpkit.checkpoint.sharded import MODEL
from ddpkit.models import MODEL_FAMILIES
from ddpkit.models.hf import is_hf_folder, open_folder


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
        with torch.no_grad(), self.tensors.opened():
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


dcp_io.declare_foreign(is_foreign, FolderReader)  # from here on, DCP reads a Hugging Face folder with it
