"""model.activation_checkpointing=full: every transformer block re-computed in backward instead of keeping its
activations (torch.utils.checkpoint, non-reentrant), trading one more forward per block for memory.

The block's own `forward` is wrapped in place, so parameter names (and checkpoints) stay those of the plain
model, and tensor parallel and FSDP2, which hook the module's call, compose with it.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch.nn as nn


def checkpoint_blocks(blocks: Iterable[nn.Module]) -> int:
    """Wrap the forward of each of `blocks` (what the model's family names: ModelFamily.checkpointed); returns
    how many."""
    from torch.utils.checkpoint import checkpoint

    n = 0
    for block in blocks:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
        n += 1
    return n
