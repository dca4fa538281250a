"""model.activation_checkpointing: what a transformer block keeps of its forward for the backward.

- `full`: every block re-computed in backward instead of keeping its activations (torch.utils.checkpoint,
  non-reentrant), trading one more forward per block for memory;
- `selective`: torch's op-level selective recomputation (torch.utils.checkpoint.create_selective_checkpoint_contexts)
  around every block: the outputs of the matrix products and of the attention kernel (the expensive ops, `SAVED`)
  are kept, every other op (norms, activation functions, elementwise work, dropout) is
  re-computed in backward. A block then keeps what its matmuls made and drops the many elementwise intermediates
  between them, for a fraction of a forward's extra work (benchmarks/RESULTS.md, "Selective activation
  checkpointing", measures both against recomputing every second block).

The block's own `forward` is wrapped in place, so parameter names (and checkpoints) stay those of the plain
model, and tensor parallel and FSDP2, which hook the module's call, compose with it.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import torch.nn as nn

MODES = ("full", "selective")


def _saved_ops() -> set[Any]:
    """The ops whose outputs `selective` keeps: matrix products, attention, and the collectives of a
    tensor-parallel block (recomputing a reduce-scatter would repeat the communication)."""
    import torch

    aten, names = torch.ops.aten, []
    names += ["mm", "addmm", "bmm", "baddbmm", "_scaled_mm"]
    names += [
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_attention_math",
    ]
    ops = {getattr(aten, n).default for n in names if hasattr(aten, n)}
    functional = getattr(torch.ops, "_c10d_functional", None)
    for n in ("reduce_scatter_tensor", "all_reduce", "all_gather_into_tensor"):
        if functional is not None and hasattr(functional, n):
            ops.add(getattr(functional, n).default)
    return ops


@functools.cache
def _policy():
    from torch.utils.checkpoint import CheckpointPolicy

    saved = _saved_ops()

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _selective_context():
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_policy())


def checkpoint_blocks(blocks: Iterable[nn.Module], mode: str = "full") -> int:
    """Wrap the forward of each of `blocks` (what the model's family names: ModelFamily.checkpointed) for `mode`
    (`full` or `selective`); returns how many."""
    from torch.utils.checkpoint import checkpoint

    if mode not in MODES:
        raise ValueError(f"activation checkpointing mode {mode!r}: one of {MODES}")
    extra = {"context_fn": _selective_context} if mode == "selective" else {}
    n = 0
    for block in blocks:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False, **extra)
        n += 1
    return n
