"""Tensor parallel, zero2, CPU offload and activation checkpointing on one device mesh (real gloo processes).

Time budget: about 120 s on a quiet 2-core machine (one shared single-process reference, tiny GPT: 2 layers,
width 32, context 16; 6 optimizer steps per layout).
"""

from __future__ import annotations

import pytest

from ddpkit.errors import UserError
from ddpkit.parallel.mesh import Layout, layout_of


def test_layout_coordinates_put_tensor_peers_next_to_each_other():
    layout = Layout(dp=2, tp=2, pp=2)
    assert layout.world_size == 8
    assert [layout.coords(r) for r in (0, 1, 2, 5, 7)] == [
        {"pp": 0, "dp": 0, "tp": 0},
        {"pp": 0, "dp": 0, "tp": 1},
        {"pp": 0, "dp": 1, "tp": 0},
        {"pp": 1, "dp": 0, "tp": 1},
        {"pp": 1, "dp": 1, "tp": 1},
    ]
    # one counting rank per dp replica: tensor rank 0 of the last stage
    assert [r for r in range(8) if layout.counts(r)] == [4, 6]
    assert layout.describe(3) == "dp=1 tp=1 pp=0"


def test_layout_of_divides_the_world():
    assert layout_of(4, tp=2) == Layout(dp=2, tp=2, pp=1)
    assert layout_of(8, tp=2, pp=2) == Layout(dp=2, tp=2, pp=2)
    with pytest.raises(UserError, match="cannot be split into dist.tp=2 x dist.pp=2"):
        layout_of(6, tp=2, pp=2)
