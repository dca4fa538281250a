"""A user's tensor-parallel plan checked against the model before anything is split, and the style that splits
a fused projection (q, k and v in one Linear) head-wise.

torch's parallelize_module warns and goes on when a plan's name matches nothing (the model then runs fully
replicated), shards a layer unevenly when tp does not divide it, unties a weight shared by two modules (a token
embedding and the head) when it splits one of them, and splits a fused q/k/v Linear into contiguous row blocks
(rank 0 gets all of q and half of k): each of these is one `ddpkit: error:` line here, naming the entry and the
fix, before the first step.

    plan = {
        "transformer.h.*.attn.c_attn": FusedColwiseParallel(chunks=3),   # each rank its heads of q, k and v
        "transformer.h.*.attn.c_proj": RowwiseParallel(),
        "transformer.h.*.mlp.c_fc": ColwiseParallel(),
        "transformer.h.*.mlp.c_proj": RowwiseParallel(),
    }
"""

from __future__ import annotations

import difflib
import fnmatch
from functools import partial
from typing import Any

import torch.nn as nn
from torch.distributed.tensor import distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.distributed.tensor.placement_types import _StridedShard

from ddpkit.errors import UserError


class FusedColwiseParallel(ColwiseParallel):
    """ColwiseParallel for a Linear whose output is `chunks` projections side by side (q, k, v: chunks=3): each
    rank holds the r-th slice of every chunk (its heads of q, of k and of v), and its local output is those
    slices side by side, so `q, k, v = out.chunk(3, dim=-1)` gives each rank its own heads. The full weight
    (what a checkpoint stores) is the unsplit one: torch's _StridedShard placement keeps the chunks' order."""

    def __init__(self, chunks: int = 3, *, input_layouts=None):
        super().__init__(input_layouts=input_layouts, use_local_output=True)
        if chunks < 1:
            raise ValueError("chunks must be at least 1")
        self.chunks = chunks

    def _partition_linear_fn(self, name, module, device_mesh):
        placement = [_StridedShard(0, split_factor=self.chunks)]
        for pname, param in module.named_parameters():
            dist_param = nn.Parameter(
                distribute_tensor(param, device_mesh, placement, src_data_rank=self.src_data_rank),
                requires_grad=param.requires_grad,
            )
            module.register_parameter(pname, dist_param)

    @staticmethod
    def _local_output(mod, outputs, device_mesh):
        return outputs.to_local()  # the slices of each chunk, side by side

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        if not isinstance(module, nn.Linear):
            raise NotImplementedError("FusedColwiseParallel splits an nn.Linear only")
        return distribute_module(
            module,
            device_mesh,
            self._partition_linear_fn,
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            self._local_output,
        )

    def __repr__(self) -> str:
        return f"FusedColwiseParallel(chunks={self.chunks}, input_layouts={self.input_layouts})"


def matches(model: nn.Module, entry: str) -> list[tuple[str, nn.Module]]:
    """The modules parallelize_module applies `entry` to: each dotted part an fnmatch pattern."""
    parts = entry.split(".")
    return [
        (name, m)
        for name, m in model.named_modules()
        if name
        and len(name.split(".")) == len(parts)
        and all(fnmatch.fnmatchcase(a, b) for a, b in zip(name.split("."), parts, strict=True))
    ]


def split_size(style: Any, module: nn.Module) -> tuple[str, int] | None:
    """(what the style splits, its size) for a Linear or an Embedding under a colwise or rowwise style."""
    colwise = isinstance(style, ColwiseParallel)
    if not colwise and not isinstance(style, RowwiseParallel):
        return None
    if isinstance(module, nn.Linear):
        return ("out_features", module.out_features) if colwise else ("in_features", module.in_features)
    if isinstance(module, nn.Embedding):
        return (
            ("embedding_dim", module.embedding_dim) if colwise else ("num_embeddings", module.num_embeddings)
        )
    return None


def _tied(model: nn.Module) -> dict[int, list[str]]:
    """{id(parameter): its names} of each parameter the model holds under several names."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return {k: v for k, v in names.items() if len(v) > 1}


def check_plan(model: nn.Module, plan: dict[str, Any], tp: int, where: str = "ddpkit.prepare") -> None:
    """Every entry of `plan` names a module of `model`, splits it evenly over `tp` ranks, leaves tied weights
    alone and does not cut a fused q/k/v projection into contiguous blocks; a UserError naming the first entry
    that fails."""
    names = [n for n, _ in model.named_modules() if n]
    tied = _tied(model)
    for entry, style in plan.items():
        found = matches(model, entry)
        for name, module in found:
            shared = [tied[id(p)] for p in module.parameters(recurse=False) if id(p) in tied]
            if shared:
                mine = next(n for n in shared[0] if n.rpartition(".")[0] == name)
                others = ", ".join(n for n in shared[0] if n != mine)
                raise UserError(
                    f"{where}: tp_plan entry '{entry}' splits {mine}, which the model shares with {others} (tied "
                    "weights)",
                    f"leave the modules of {mine} and {others} out of the plan",
                )
        if not found:
            close = difflib.get_close_matches(entry, names, n=1)
            raise UserError(
                f"{where}: tp_plan entry '{entry}' matches no module of {type(model).__name__}, so it would run unsplit",
                (f"did you mean '{close[0]}'? " if close else "")
                + "name them as model.named_modules() does ('*': one part)",
            )
        for name, module in found:
            split = split_size(style, module)
            if split is None:
                continue
            what, size = split
            chunks = getattr(style, "chunks", 1)
            if size % (tp * chunks):
                raise UserError(
                    f"{where}: tp_plan entry '{entry}' splits {name}.{what}={size} over tp={tp} ranks"
                    + (f" in {chunks} chunks" if chunks > 1 else "")
                    + ", which does not divide it",
                    f"use a tp dividing {size // chunks if chunks > 1 else size}, or leave {name} out",
                )
            fused = (
                type(style) is ColwiseParallel
                and isinstance(module, nn.Linear)
                and module.out_features == 3 * module.in_features
            )
            if fused:
                raise UserError(
                    f"{where}: tp_plan entry '{entry}' splits {name} ({module.in_features} -> {module.out_features}: "
                    "q, k and v in one Linear) into contiguous blocks, not heads",
                    "use FusedColwiseParallel(chunks=3) (docs/porting.md)",
                )


__all__ = ["FusedColwiseParallel", "check_plan", "matches", "split_size"]
