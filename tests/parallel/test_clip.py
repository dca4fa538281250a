"""ddpkit.clip_grad_norm_ on real processes: under ddp, fsdp and tensor parallel (DTensor and plain gradients
mixed) the norm is the one-process norm of the whole batch, the same on every rank, and the clipped gradients are
the one-process clipped gradients. (A pipeline's: tests/parallel/test_pipeline.py trains with it.)"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ddpkit

MAX_NORM = 0.05


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4), nn.LayerNorm(4))


def _batch() -> torch.Tensor:
    return torch.randn(6, 4, generator=torch.Generator().manual_seed(1))


def _full(g: torch.Tensor) -> torch.Tensor:
    return g.full_tensor() if hasattr(g, "full_tensor") else g


def _reference() -> tuple[float, list[torch.Tensor]]:
    model = _model()
    model(_batch()).square().mean().backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    return float(norm), [p.grad.clone() for p in model.parameters()]


def _clipped_under(layout: str) -> tuple[float, list[torch.Tensor]]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    model, x = _model(), _batch()
    if layout == "tp":  # both ranks the whole batch; the two Linears split, the LayerNorm replicated
        model = ddpkit.prepare(model, tp=2, tp_plan={"0": ColwiseParallel(), "2": RowwiseParallel()})
    else:  # each rank half the batch
        model = ddpkit.prepare(model, strategy=layout)
        x = x.chunk(2)[ddpkit.get_rank()]
    model(x).square().mean().backward()
    norm = ddpkit.clip_grad_norm_(model, MAX_NORM)
    return float(norm), [_full(p.grad).clone() for p in model.parameters()]


def _each_layout(layouts):
    return {layout: _clipped_under(layout) for layout in layouts}


@pytest.mark.slow
def test_the_norm_and_the_clipped_gradients_are_one_process_ones_under_each_layout():
    norm, grads = _reference()
    assert norm > 4 * MAX_NORM  # the clip scales the gradients
    plain = _model()
    plain(_batch()).square().mean().backward()
    assert float(ddpkit.clip_grad_norm_(plain.parameters(), MAX_NORM)) == pytest.approx(norm, rel=1e-6)
    layouts = ("ddp", "fsdp", "tp")
    for rank, results in enumerate(ddpkit.launch(_each_layout, layouts, nprocs=2)):
        for layout in layouts:
            got_norm, got = results[layout]
            assert got_norm == pytest.approx(norm, rel=1e-5), (rank, layout)
            # tp sums the row-split Linear's halves in another order, and the LayerNorm over 4 features after it
            # magnifies that rounding (up to 2e-7 on gradients of 1e-3, measured); a clip that missed a part of
            # the norm would be off by far more (the coefficient is below 1/4)
            rtol, atol = (1e-4, 1e-6) if layout == "tp" else (1e-5, 1e-7)
            for a, b in zip(got, grads, strict=True):
                assert torch.allclose(a, b, rtol=rtol, atol=atol), (rank, layout, (a - b).abs().max())


def test_torch_own_clip_fails_where_ddpkits_is_needed():
    """The reason this exists: torch's clip on a list mixing DTensor and plain gradients (checked in-process on
    a one-rank mesh, the mix a tensor-parallel model has)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    if dist.is_initialized():
        pytest.skip("a process group exists already")
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        model = _model()
        parallelize_module(model, init_device_mesh("cpu", (1,)), {"0": ColwiseParallel()})
        model(_batch()).square().mean().backward()
        with pytest.raises(RuntimeError):
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        ref_norm, _ = _reference()
        assert float(ddpkit.clip_grad_norm_(model, MAX_NORM)) == pytest.approx(ref_norm, rel=1e-6)
    finally:
        dist.destroy_process_group()
