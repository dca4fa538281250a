"""A built-in model family is a folder of models/ (keys.py: its torch-free card and config keys; model.py: the
model and its ModelFamily), named once in FAMILY_FOLDERS; what the command line asks of a family before torch is
imported (its keys, its names' meaning, whether it is a language model, what a worker preloads) is its card's, and
its FLOPs per token is its family's answer. Budget: about 3 s (one fresh interpreter)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from torch import nn

from conftest import REPO
from ddpkit import models
from ddpkit.config import load_config
from ddpkit.models import CARDS, FAMILY_FOLDERS, MODEL_FAMILIES, ModelFamily
from ddpkit.models.flops import decoder_flops, model_flops

MODELS = REPO / "src" / "ddpkit" / "models"


def test_each_built_in_family_is_a_folder_named_once_whose_card_agrees_with_its_family():
    # hf/: Hugging Face folders in and out for every family (the weight format, not a family)
    folders = {p.parent.name for p in MODELS.glob("*/__init__.py")} - {"hf"}
    assert folders == set(FAMILY_FOLDERS), (
        "a family folder not in FAMILY_FOLDERS (or one named there missing)"
    )
    families = {f.name: f for f in MODEL_FAMILIES.values()}
    for folder, card in zip(FAMILY_FOLDERS, CARDS, strict=True):
        assert (MODELS / folder / "keys.py").is_file() and (MODELS / folder / "model.py").is_file(), folder
        family = families[card.name]
        assert (family.keys, family.tokens) == (card.keys, card.tokens), card.name
        if card.owns is not None:  # the card tells the family's names without torch, the same ones
            assert all(card.owns(name) for name in family.names()), card.name
        assert card.summary and card.summary.split()[0] in (*family.names(), "a", "timm:NAME"), card.summary


def test_what_the_command_line_asks_of_a_family_imports_no_torch():
    code = (
        "import sys\n"
        "from ddpkit import models\n"
        "from ddpkit.config import describe_keys, load_config\n"
        "load_config(None, ['model.arch=llama', 'model.n_kv_head=2', 'data.dataset=text'])\n"
        "said = (models.preload_for('llama'), models.preload_for('resnet18'), models.preload_for('timm:vit'),\n"
        "        models.language_models(), models.card_of('gpt').tokens, models.card_of('resnet18'))\n"
        "assert 'gpt (the built-in GPT-2-style decoder' in describe_keys()\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))\n"
        "print(said)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    # the Llama preloads nothing more (not torchvision, as a list of names once had it)
    assert proc.stdout.strip() == (
        "([], ['torchvision'], ['timm'], ['gpt', 'llama', 'mixtral', 'qwen2', 'qwen3', 'mistral', 'qwen3_moe'], True, None)"
    )


def test_flops_per_token_is_asked_of_the_family():
    from ddpkit.data import DataSpec

    spec = DataSpec(0, 0, 0, train_size=1, val_size=1, vocab_size=50, block_size=16)
    for arch, free in (("gpt", ("pos_emb.",)), ("llama", ())):
        cfg = load_config(
            None, [f"model.arch={arch}", "model.n_layer=2", "model.n_embd=32", "data.dataset=text"]
        )
        model = models.model_family(arch).build_lm(arch, 50, 16, cfg.model)
        n = sum(p.numel() for name, p in model.named_parameters() if not name.startswith(free))
        assert model_flops(cfg, spec) == 6 * n + 12 * 2 * 32 * 16, arch  # the GPT leaves its positions out
    assert decoder_flops(nn.Linear(2, 2), 16) is None  # no n_layer and n_embd: not a decoder

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(50, 8)

    tiny = ModelFamily(
        "tinylm",
        owns=lambda arch: arch == "tinylm",
        build=models.family.images_refused,
        build_lm=lambda arch, vocab, block, m: Tiny(),
        flops_per_token=lambda model, block: 7 * block,
    )
    models.register_model(tiny)
    try:
        cfg = load_config(None, ["model.arch=tinylm", "data.dataset=text"])
        assert model_flops(cfg, spec) == 7 * 16
    finally:
        MODEL_FAMILIES.unregister("tinylm")


@pytest.mark.parametrize("dataset", ["text", "tokens"])
def test_bench_trains_the_default_language_model_on_token_data(dataset):
    from ddpkit.commands.bench import _value

    assert _value(load_config(None, []), set(), "model.arch") == "cnn"  # bench's own default, for images
    cfg = load_config(None, [f"data.dataset={dataset}"])
    assert _value(cfg, {"data.dataset"}, "model.arch") == models.language_models()[0] == "gpt"
