"""model.activation_checkpointing=full: every transformer block re-computed in backward instead of keeping its
activations (torch.utils.checkpoint, non-reentrant), trading one more forward per block for memory.

The block's own `forward` is wrapped in place, so parameter names (and checkpoints) stay those of the plain
model, and tensor parallel and FSDP2, which hook the module's call, compose with it.
"""

from __future__ import annotations

import functools

import torch.nn as nn


def checkpoint_blocks(model: nn.Module) -> int:
    """Wrap the forward of each block of `model.blocks` (a ModuleDict or ModuleList); returns how many."""
    from torch.utils.checkpoint import checkpoint

    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleDict | nn.ModuleList):
        from ddpkit.errors import UserError

        raise UserError(
            f"model.activation_checkpointing=full re-computes transformer blocks; a {type(model).__name__} "
            "has no `blocks`",
            "use model.arch=gpt, or model.activation_checkpointing=none",
        )
    modules = blocks.values() if isinstance(blocks, nn.ModuleDict) else list(blocks)
    for block in modules:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    return len(modules)
