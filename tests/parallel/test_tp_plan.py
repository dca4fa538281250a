"""A user's tensor-parallel plan is checked against the model before anything is split (in-process: the check
needs no process group): each entry that matches nothing, splits a layer unevenly or cuts a fused q/k/v Linear
into contiguous blocks is one line naming the entry and the fix; a plan that fits passes."""

from __future__ import annotations

import pytest
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from ddpkit.errors import UserError
from ddpkit.parallel.mesh.tp_plan import FusedColwiseParallel, check_plan


class Attention(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)


class Net(nn.Module):
    def __init__(self, d: int = 32, vocab: int = 10):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.h = nn.ModuleList(
            nn.ModuleDict({"attn": Attention(d), "fc": nn.Linear(d, 4 * d)}) for _ in range(2)
        )
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight  # tied


class Untied(Net):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(32, 10, bias=False)


def _refused(plan: dict, tp: int = 2, model: type = Net) -> str:
    with pytest.raises(UserError) as e:
        check_plan(model(), plan, tp)
    line = e.value.line()
    assert line.startswith("ddpkit.prepare: tp_plan entry ") and "\n" not in line
    return line


def test_a_plan_that_fits_passes():
    check_plan(
        Untied(),
        {
            "h.*.attn.c_attn": FusedColwiseParallel(chunks=3),
            "h.*.attn.c_proj": RowwiseParallel(),
            "h.*.fc": ColwiseParallel(),
            "wte": RowwiseParallel(),
        },
        2,
    )


def test_an_entry_matching_no_module_is_named_with_the_closest_name():
    line = _refused({"h.*.attn.cattn": FusedColwiseParallel(chunks=3)})
    assert "'h.*.attn.cattn' matches no module of Net, so it would run unsplit" in line
    assert "did you mean 'h.1.attn.c_attn'" in line


def test_a_split_that_does_not_divide_the_layer_is_named():
    assert "splits h.0.fc.out_features=128 over tp=3 ranks, which does not divide it" in _refused(
        {"h.*.fc": ColwiseParallel()}, tp=3
    )
    assert "splits wte.num_embeddings=10 over tp=4 ranks" in _refused({"wte": RowwiseParallel()}, 4, Untied)
    assert "in 3 chunks" in _refused({"h.*.attn.c_attn": FusedColwiseParallel(chunks=3)}, tp=3)


def test_a_fused_qkv_linear_under_a_plain_column_split_is_refused_with_the_head_wise_style():
    line = _refused({"h.*.attn.c_attn": ColwiseParallel()})
    assert "splits h.0.attn.c_attn (32 -> 96: q, k and v in one Linear) into contiguous blocks" in line
    assert "FusedColwiseParallel(chunks=3)" in line


def test_a_plan_that_would_untie_a_shared_weight_is_refused():
    line = _refused({"head": ColwiseParallel()})
    assert "'head' splits head.weight, which the model shares with wte.weight (tied weights)" in line
    assert "leave the modules of head.weight and wte.weight out of the plan" in line
