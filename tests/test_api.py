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


# the framework's classes, once importable from the top level too: from their modules only (0.1.0 shipped no
# top-level alias, so none is kept)
INTERNALS = {
    "Trainer": "ddpkit.train.trainer",
    "evaluate": "ddpkit.train.tasks",
    "Config": "ddpkit.config",
    "load_config": "ddpkit.config",
    "DistEnv": "ddpkit.cluster.env",
    "DistributedLoader": "ddpkit.data",
    "GlobalOrderSampler": "ddpkit.data",
    "ExactEvalSampler": "ddpkit.data",
}


@pytest.mark.parametrize("name", sorted(INTERNALS))
def test_a_framework_internal_is_imported_from_its_module_not_the_top_level(name):
    assert getattr(importlib.import_module(INTERNALS[name]), name) is not None
    with pytest.raises(AttributeError, match=f"no attribute '{name}'"):
        getattr(ddpkit, name)
    assert name not in ddpkit.__all__


def test_the_collectives_have_one_name_each():
    assert ddpkit.gather_object_to({"a": 1}) == [{"a": 1}] and ddpkit.all_gather_object(3) == [3]
    assert "None on the others" in inspect.getdoc(ddpkit.gather_object_to)
    ddpkit.seed_everything(7)
    want = torch.rand(3)
    ddpkit.seed_everything(7)
    assert torch.equal(torch.rand(3), want)
    for gone in ("gather_object", "seed_model_init"):  # the old names of gather_object_to, seed_everything
        assert not hasattr(ddpkit, gone) and gone not in ddpkit.__all__


def test_no_module_is_importable_under_an_old_name():
    import subprocess
    import sys

    code = "import ddpkit, importlib\nfor old in ('ddpkit.trainer', 'ddpkit.gpt', 'ddpkit.distributed.launch'):\n"
    code += (
        "    try:\n        importlib.import_module(old)\n    except ModuleNotFoundError:\n        continue\n"
    )
    code += "    raise SystemExit(old)\n"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]


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
