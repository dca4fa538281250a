"""Hugging Face folders in and out through a model family's own converter (ModelFamily.hf): a family registered
from outside ddpkit writes, reads and starts from a folder of its own architecture, with no change to
models/hf.py. In process, a model of 8 parameters: well under a second."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from ddpkit.errors import UserError


class Pair(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.width = width
        self.lin = nn.Linear(width, 2)

    def forward(self, x):
        return self.lin(x)


def test_a_family_from_outside_reads_and_writes_its_own_hugging_face_folder(tmp_path):
    import ddpkit
    from ddpkit.models import MODEL_FAMILIES, ModelFamily, family_of_module, register_model
    from ddpkit.models.family import HFConverter
    from ddpkit.models.hf import export, need
    from ddpkit.models.loading import init_from

    converter = HFConverter(
        "pairnet",
        "PairNet",
        shape=lambda cfg, folder: {"width": need(cfg, "width", folder)},
        to_ours=lambda tensors, shape: {"lin.weight": tensors["pair.w"], "lin.bias": tensors["pair.b"]},
        build=Pair,
        config=lambda m: {"model_type": "pairnet", "width": m.width},
        to_theirs=lambda m: {"pair.w": m.lin.weight, "pair.b": m.lin.bias},
    )
    family = ModelFamily(
        "pairnet", owns=lambda arch: arch == "pairnet", build=None, module_types=(Pair,), hf=converter
    )
    register_model(family)
    try:
        torch.manual_seed(0)
        model = Pair(3)
        export(model, tmp_path / "out", family_of_module(model))
        written = json.loads((tmp_path / "out" / "config.json").read_text())
        assert written["model_type"] == "pairnet" and written["width"] == 3
        back = ddpkit.load_model(tmp_path / "out")
        assert type(back) is Pair and back.width == 3 and not back.training
        fresh = Pair(3)
        init_from(fresh, str(tmp_path / "out"))
        for m in (back, fresh):
            assert torch.equal(m.lin.weight, model.lin.weight) and torch.equal(m.lin.bias, model.lin.bias)
        with pytest.raises(UserError, match="has width=3 but this config gives 4"):
            init_from(Pair(4), str(tmp_path / "out"))
        with pytest.raises(UserError, match="a Linear has no Hugging Face format"):
            export(nn.Linear(2, 2), tmp_path / "lin", family_of_module(nn.Linear(2, 2)))
        assert not (tmp_path / "lin").exists()
    finally:
        MODEL_FAMILIES.unregister("pairnet")
    with pytest.raises(
        UserError, match=r"type 'pairnet'; ddpkit reads the GPT-2 \(gpt2\) and Llama \(llama\) (and .+ )?arch"
    ):
        ddpkit.load_model(tmp_path / "out")


def test_a_family_from_outside_checks_its_own_keys_and_sizes_before_anything_is_built():
    """models.check_arch asks the family (ModelFamily.check_keys, .estimate), not a list of built-in names."""
    from ddpkit.config import load_config
    from ddpkit.models import MODEL_FAMILIES, ModelFamily, check_arch, register_model

    asked = []

    def check_keys(m):
        asked.append(m.n_layer)
        if m.n_layer == 3:
            raise UserError("model.n_layer=3 is unlucky for tinylm", "pick another")

    family = ModelFamily(
        "tinylm",
        owns=lambda arch: arch == "tinylm",
        build=None,
        build_lm=lambda arch, vocab, block, m: nn.Linear(1, 1),
        check_keys=check_keys,
        estimate=lambda m, block, batch: (
            (m.n_layer - 1) * 10**12,
            0,
        ),  # a trillion parameters a layer after the first
    )
    register_model(family)
    try:
        check_arch(load_config(None, ["model.arch=tinylm", "data.dataset=text", "model.n_layer=1"]))
        with pytest.raises(UserError, match="unlucky for tinylm"):
            check_arch(load_config(None, ["model.arch=tinylm", "data.dataset=text", "model.n_layer=3"]))
        with pytest.raises(UserError, match="needs about .* GiB"):
            check_arch(load_config(None, ["model.arch=tinylm", "data.dataset=text", "model.n_layer=2"]))
        assert asked == [1, 3, 2]
    finally:
        MODEL_FAMILIES.unregister("tinylm")
