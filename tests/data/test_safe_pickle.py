"""Hostile data files: a CIFAR pickle that would run code is refused (and never runs), in one line from the
command; real CIFAR pickles still load. Budget: 10 s (one command that stops at its checks)."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import cli_env, data_cfg, write_cifar10
from ddpkit.data import (
    build_datasets,
)
from ddpkit.errors import UserError

# ---------------------------------------------------------------- hostile data files


class _Payload:
    """Unpickling this runs `touch MARKER`: what a hostile data file does with __reduce__."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("victim", ["batches.meta", "data_batch_2", "test_batch"])
def test_a_cifar_file_that_runs_code_is_refused_and_never_runs(tmp_path, victim):
    write_cifar10(tmp_path)
    marker = tmp_path / "pwned"
    path = tmp_path / "cifar-10-batches-py" / victim
    path.write_bytes(pickle.dumps({"data": _Payload(marker), "labels": [], "label_names": _Payload(marker)}))
    with pytest.raises(UserError) as e:
        build_datasets(data_cfg("cifar10", tmp_path))
    assert not marker.exists()  # the payload's side effect did not happen
    line = e.value.line()
    assert victim in line and "posix.system" in line and "\n" not in line, line
    import torchvision.datasets.cifar as tv_cifar

    from ddpkit.data import safe_pickle

    assert tv_cifar.pickle is safe_pickle.SAFE_PICKLE  # every pickle.load call site of torchvision's CIFAR


def test_the_cli_refuses_a_hostile_cifar_file_in_one_line(tmp_path):
    write_cifar10(tmp_path / "data")
    marker = tmp_path / "pwned"
    (tmp_path / "data" / "cifar-10-batches-py" / "batches.meta").write_bytes(pickle.dumps(_Payload(marker)))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "ddpkit",
            "train",
            "data.dataset=cifar10",
            f"data.root={tmp_path / 'data'}",
            f"out_dir={tmp_path / 'run'}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=cli_env(),
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "batches.meta asks to run posix.system" in proc.stderr
    assert not marker.exists()


def test_real_cifar_pickles_still_load(tmp_path):
    """What the real files hold (numpy arrays in protocol 2 and 5 pickles, Python 2's latin-1 strings) passes."""
    from ddpkit.data import safe_pickle

    for protocol in (2, 4, 5):
        entry = {
            b"data": np.arange(12, dtype=np.uint8).reshape(2, 6),
            b"labels": [1, 2],
            b"batch_label": b"x",
        }
        back = safe_pickle.loads(pickle.dumps(entry, protocol=protocol), encoding="latin1")
        assert np.array_equal(back[b"data"], entry[b"data"]) and back[b"labels"] == [1, 2]
