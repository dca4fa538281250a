"""The public API (`import ddpkit`): what editors resolve, what is deprecated and how it warns. Budget: 20 s (imports torch; one child process builds a model twice)."""

from __future__ import annotations

import ast
import importlib
import inspect
import os

import pytest
import torch

import ddpkit
from conftest import REPO


def _type_checking_imports() -> dict[str, str]:
    """{name: module} of the `if TYPE_CHECKING:` block of ddpkit/__init__.py."""
    tree = ast.parse((REPO / "src" / "ddpkit" / "__init__.py").read_text())
    block = next(
        n for n in tree.body if isinstance(n, ast.If) and getattr(n.test, "id", "") == "TYPE_CHECKING"
    )
    return {a.name: node.module for node in block.body for a in node.names}


def test_editors_resolve_every_public_name_to_the_module_it_loads_from():
    assert _type_checking_imports() == ddpkit._LAZY
    assert ddpkit.__all__ == ["UserError", *ddpkit._LAZY]
    for name, module in ddpkit._LAZY.items():
        assert getattr(ddpkit, name) is getattr(importlib.import_module(module), name), name


@pytest.mark.parametrize("name", sorted(ddpkit._DEPRECATED))
def test_a_framework_internal_at_the_top_level_warns_and_names_its_module(name):
    module = ddpkit._DEPRECATED[name]
    with pytest.warns(DeprecationWarning, match=f"from {module} import {name}"):
        obj = getattr(ddpkit, name)
    assert obj is getattr(importlib.import_module(module), name)
    assert name not in ddpkit.__all__


def test_gather_object_is_gather_object_to_under_its_old_name_one_release_more():
    with pytest.warns(DeprecationWarning, match="gather_object_to"):
        assert ddpkit.gather_object({"a": 1}) == ddpkit.gather_object_to({"a": 1}) == [{"a": 1}]
    assert ddpkit.all_gather_object(3) == [3]
    assert "gather_object" not in ddpkit.__all__
    assert "None on the others" in inspect.getdoc(ddpkit.gather_object_to)


def test_seed_model_init_is_seed_everything_one_release_more():
    ddpkit.seed_everything(7)
    want = torch.rand(3)
    with pytest.warns(DeprecationWarning, match=r"seed_everything\(seed\)"):
        ddpkit.seed_model_init(7)
    assert torch.equal(torch.rand(3), want)
    assert "seed_model_init" not in ddpkit.__all__


_DETERMINISTIC = """
import os, torch, ddpkit
from ddpkit.config import load_config
from ddpkit.data import build_datasets
from ddpkit.train.builders import make_model
ctx = ddpkit.init_distributed()
for value in ("false", "true"):
    cfg = load_config(None, ["train.deterministic=" + value, "data.dataset=synthetic", "model.arch=mlp"])
    make_model(cfg, ctx, build_datasets(cfg)[2])
    print(torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
          torch.backends.cudnn.benchmark, os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
"""


def test_train_deterministic_turns_on_deterministic_kernels_and_the_default_leaves_them_off():
    """A resumed epoch repeats bit for bit on GPUs only with deterministic kernels (seen on an H200: cuDNN's
    backward moved the weights' checksum by 1e-8); train.deterministic=true (through
    seed_everything(seed, deterministic=True)) turns them on, the default leaves them off."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "CUBLAS_WORKSPACE_CONFIG"}
    out = subprocess.run(
        [sys.executable, "-c", _DETERMINISTIC], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-2:] == ["False False False None", "True True False :4096:8"]
