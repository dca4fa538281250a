"""The experts' SwiGLU over tokens sorted by expert: `torch._grouped_mm` (one kernel for every expert) or a loop of
one matmul per expert, whichever the device runs faster (benchmarks/moe_matmul.py, RESULTS.md §22): the same
numbers either way (within float rounding).

The grouped kernel takes matrices whose strides are multiples of 16 bytes (the width and the experts' width a
multiple of 4 in float32, of 8 in bfloat16); other shapes take the loop."""

from __future__ import annotations

import torch
import torch.nn.functional as F

# device type -> the faster of "grouped" and "loop" there (benchmarks/moe_matmul.py). CUDA: torch's grouped GEMM
# (a bfloat16 kernel on compute capability 9.0 and later, where torchtitan uses it); CPU: the loop, measured
# faster at every size of RESULTS.md §22
FASTER = {"cpu": "loop", "cuda": "grouped"}


def _aligned(*tensors: torch.Tensor) -> bool:
    return all(s * t.element_size() % 16 == 0 for t in tensors for s in t.stride()[:-1] if s != 1) and all(
        t.stride(-1) == 1 or t.stride(-2) == 1 for t in tensors
    )


def grouped_here(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether the grouped kernel runs `x` (tokens, width) against `weights` (experts, out, in) on this device."""
    if not hasattr(torch, "_grouped_mm") or FASTER.get(x.device.type) != "grouped":
        return False
    if x.device.type == "cuda":
        if x.dtype != torch.bfloat16 or torch.cuda.get_device_capability(x.device) < (9, 0):
            return False
    return _aligned(x, *(w.transpose(-2, -1) for w in weights))


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype autocast computes a matmul of `x` in (x's own without autocast)."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype


def swiglu_experts(
    x: torch.Tensor, counts: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """down_e(silu(gate_e x) * up_e x) of each row x of `x` (rows sorted by expert, `counts[e]` rows of expert e)
    with the experts' weights `gate`, `up` (experts, hidden, width) and `down` (experts, width, hidden)."""
    dtype = _compute_dtype(x)
    if dtype != x.dtype or gate.dtype != dtype:
        x, gate, up, down = (t.to(dtype) for t in (x, gate, up, down))
    if grouped_here(x, gate, up, down):
        offs = counts.cumsum(0).to(torch.int32)
        h = F.silu(torch._grouped_mm(x, gate.transpose(-2, -1), offs=offs))
        h = h * torch._grouped_mm(x, up.transpose(-2, -1), offs=offs)
        return torch._grouped_mm(h, down.transpose(-2, -1), offs=offs)
    return swiglu_loop(x, counts, gate, up, down)


def swiglu_loop(
    x: torch.Tensor, counts: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """swiglu_experts as one matmul per expert that has rows."""
    outs, start = [], 0
    for e, n in enumerate(counts.tolist()):
        if n or (e == len(counts) - 1 and not outs):
            # no rows at all: the last expert on none, so that the result still hangs on `x` and the weights
            # (under expert parallelism the backward of the all-to-all that brought `x` must run on every rank)
            xe = x[start : start + n]
            outs.append((F.silu(xe @ gate[e].T) * (xe @ up[e].T)) @ down[e].T)
            start += n
    return torch.cat(outs) if len(outs) > 1 else outs[0]
