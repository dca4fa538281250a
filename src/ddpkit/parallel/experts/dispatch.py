"""The token exchange of expert parallelism: an MoE block's token-expert pairs, sorted by expert, go to the ranks
holding their experts and their outputs come back, with torch.distributed's all_to_all_single (the autograd-aware
functional collective: the backward sends the gradients the other way). As torchtitan's all-to-all dispatcher:
the per-expert counts are exchanged first (they give each rank's split sizes), the tokens a rank receives are put
in expert-major order for its grouped matmul, and put back before they return."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd


def expert_major(counts: torch.Tensor) -> torch.Tensor:
    """The order that takes rows laid out rank-major (source rank r, then its rows for local expert j: `counts`
    (ranks, local experts)) to expert-major (expert j, then the rows from rank 0, 1, ...)."""
    ranks, local = counts.shape
    flat = counts.flatten()
    starts = (flat.cumsum(0) - flat).view(ranks, local).t().flatten()  # each segment's start, expert-major
    lengths = counts.t().flatten()
    segment = torch.repeat_interleave(torch.arange(lengths.numel(), device=counts.device), lengths)
    first = lengths.cumsum(0) - lengths
    return starts[segment] + torch.arange(segment.numel(), device=counts.device) - first[segment]


def inverse(order: torch.Tensor) -> torch.Tensor:
    back = torch.empty_like(order)
    back[order] = torch.arange(order.numel(), device=order.device)
    return back


class AllToAll:
    """The exchange over the ep group `group` of `ep` ranks, each holding n_experts / ep consecutive experts."""

    def __init__(self, group: Any, ep: int):
        self.group, self.ep = group, ep

    def dispatch(self, x: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """(the rows this rank's experts compute, expert-major; their count per local expert; what combine needs)
        from this rank's rows `x` sorted by expert, `counts[e]` of them for expert e."""
        counts = counts.to(torch.int64)
        # [source rank, local expert]: the rows each rank sends to each expert here
        got = torch.empty_like(counts)
        dist.all_to_all_single(got, counts, group=self.group)
        got = got.view(self.ep, -1)
        send = counts.view(self.ep, -1).sum(1).tolist()
        recv = got.sum(1).tolist()
        rows = all_to_all_single_autograd(x.contiguous(), recv, send, self.group)
        order = expert_major(got)
        return rows.index_select(0, order), got.sum(0), (order, send, recv)

    def combine(self, y: torch.Tensor, ctx: Any) -> torch.Tensor:
        """The outputs `y` of dispatch's rows back on the ranks they came from, in the order they were sent."""
        order, send, recv = ctx
        rows = y.index_select(0, inverse(order))
        return all_to_all_single_autograd(rows.contiguous(), send, recv, self.group)
