"""examples/12_dist_sgd_by_hand.py: all-reducing the gradients by hand gives DDP's weights."""

from __future__ import annotations

import importlib
import re
import sys

import numpy as np
import pytest
import torch

from conftest import REPO, run_doc, run_group, runs_doc

sys.path.insert(0, str(REPO / "examples"))
example = importlib.import_module("12_dist_sgd_by_hand")

STEPS = 8


def _weights(model: torch.nn.Module) -> list[np.ndarray]:
    return [p.detach().numpy().copy() for p in model.parameters()]  # numpy: torch tensors would travel as fds


def _weights_by_mode(rank: int, world_size: int, steps: int) -> dict[str, list[np.ndarray]]:
    """On one rank of a gloo group: the weights after `steps` steps in each mode."""
    return {mode: _weights(example.train(mode, steps)) for mode in example.MODES}


def _max_gap(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b, strict=True))


def test_partition_is_a_disjoint_cover_of_equal_fractions():
    data = torch.utils.data.TensorDataset(torch.arange(10))
    parts = [example.partition(data, r, 3).indices for r in range(3)]
    assert [len(p) for p in parts] == [3, 3, 3]
    assert len(set().union(*parts)) == 9
    assert parts[0] != list(range(3))  # shuffled, with a seed every rank shares
    assert example.partition(data, 1, 3).indices == parts[1]


@pytest.mark.slow
def test_hand_written_all_reduce_sgd_matches_ddp_on_two_processes():
    ranks = run_group(_weights_by_mode, 2, STEPS, timeout=300)
    initial = _weights(example.train("local", steps=0))
    for weights in ranks:
        assert _max_gap(weights["by_hand"], weights["ddp"]) < 1e-5
        assert _max_gap(weights["by_hand"], initial) > 1e-2  # it trained
    assert _max_gap(ranks[0]["by_hand"], ranks[1]["by_hand"]) < 1e-6  # every rank took the same steps
    # Without the all-reduce each rank follows its own half of the data: the comparison above can fail.
    assert _max_gap(ranks[0]["local"], ranks[1]["local"]) > 1e-3
    assert _max_gap(ranks[0]["local"], ranks[0]["ddp"]) > 1e-3


@runs_doc("12_dist_sgd_by_hand.py", "python examples/12_dist_sgd_by_hand.py")
def test_example_runs_as_a_single_process_script(doc):
    out = run_doc(doc, "--steps", "3")
    assert "1 process(es) (gloo), batch 128 each, 3 steps" in out
    assert "largest weight difference 0.00e+00" in out


@pytest.mark.slow
@runs_doc("12_dist_sgd_by_hand.py", "torchrun --nproc-per-node 2")
def test_example_runs_under_torchrun_and_by_hand_equals_ddp(doc):
    out = run_doc(doc, "--steps", "3")
    found = re.search(
        r"^2 process\(es\) \(gloo\), batch 64 each, 3 steps: .* largest weight difference (\S+)$", out, re.M
    )
    assert found and float(found[1]) < 1e-5, out
