"""The Llama-shaped families (model.arch=qwen2, qwen3, mistral): the Llama's blocks with q/k/v biases (Qwen2), per-head
q/k norms and heads wider than n_embd / n_head (Qwen3), a sliding window (Mistral). Folders saved by transformers are
read by ddpkit.load_model and written back with logits equal within 1e-4 both ways (the window shorter than the
sequence); what a family cannot hold is one line; each family's folder, through model.init_from, trains under
fsdp x tp2 and fsdp x pp2 on 4 real gloo processes as one process does from the same folder, and `ddpkit export` of
that run gives transformers the same logits. Budget: about 45 s (one 4-rank group of six 4-step runs, three
one-process references and three exports in this process)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import cli_in_process, dist_context, plain, run_group, train_here
from ddpkit.errors import UserError

transformers = pytest.importorskip("transformers")

SHAPE = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "rope_parameters": {"rope_type": "default", "rope_theta": 500.0},
}
HF = {
    "qwen2": ("Qwen2", {}),
    # Qwen3's heads wider than hidden_size / num_attention_heads (16, not 8), as Qwen3-0.6B's (128, not 1024 / 16)
    "qwen3": ("Qwen3", {"head_dim": 16}),
    # a window shorter than the sequences below (16 and 20 positions): the mask is not the causal one
    "mistral": ("Mistral", {"sliding_window": 5}),
}


def _transformers(name: str, tied: bool = False, **more):
    """A tiny transformers model of family `name`, its 1-D weights (biases at 0, norms at 1) made random too."""
    prefix, extra = HF[name]
    cfg = getattr(transformers, f"{prefix}Config")(**SHAPE, tie_word_embeddings=tied, **{**extra, **more})
    torch.manual_seed(0)
    model = getattr(transformers, f"{prefix}ForCausalLM")(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.mark.parametrize(
    ("name", "tied", "more"),
    [
        ("qwen2", True, {}),
        ("qwen3", False, {}),
        ("mistral", False, {}),
        ("mistral", True, {"sliding_window": None}),
    ],
    ids=["qwen2-tied", "qwen3", "mistral-window5", "mistral-no-window"],
)
def test_a_transformers_folder_loads_and_exports_with_equal_logits(tmp_path, name, tied, more):
    import ddpkit
    from ddpkit.models import family_of_module
    from ddpkit.models.hf import export

    ref = _transformers(name, tied, **more)
    ref.save_pretrained(tmp_path / "hf")
    model = ddpkit.load_model(tmp_path / "hf")
    family = family_of_module(model)
    assert family.name == name and (model.tie_embeddings, model.rope_theta) == (tied, 500.0)
    export(model, tmp_path / "back", family)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert type(back) is type(ref)
    x = torch.randint(0, 64, (2, 20))
    with torch.no_grad():
        ours, theirs = model(x), ref(x).logits
        assert (ours - theirs).abs().max() < 1e-4
        assert (back(x).logits - ours).abs().max() < 1e-4
        if model.sliding_window is not None:  # the window decides the logits: without it they differ
            for block in model.blocks.values():
                block.attn.window = None
            assert (model(x) - theirs).abs().max() > 1e-3


def test_what_a_family_cannot_hold_is_one_line(tmp_path):
    import json

    from ddpkit.config import load_config
    from ddpkit.models.loading import load_model

    def refused(model, fragment: str, edit=None) -> None:
        path = tmp_path / str(len(list(tmp_path.iterdir())))
        model.save_pretrained(path)
        if edit is not None:
            cfg = json.loads((path / "config.json").read_text())
            edit(cfg)
            (path / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(UserError) as e:
            load_model(path)
        assert fragment in e.value.line(), e.value.line()

    # a Qwen2 folder relabelled llama: its biases are not the Llama's, named instead of dropped
    refused(_transformers("qwen2"), "q_proj.bias", lambda cfg: cfg.update(model_type="llama"))
    window = {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1}
    refused(_transformers("qwen2", **window), "sliding-window attention")
    refused(_transformers("qwen3", attention_bias=True), "biases in the attention")
    refused(_transformers("mistral"), "has no sliding_window", lambda cfg: cfg.pop("sliding_window"))
    # a config of another of the families, given the folder: one line naming both
    _transformers("qwen2").save_pretrained(tmp_path / "qwen2")
    for arch in ("llama", "qwen3", "mistral"):
        with pytest.raises(UserError) as e:
            load_config(None, [f"model.init_from={tmp_path / 'qwen2'}", f"model.arch={arch}"])
        assert (
            f"model.arch={arch} but model.init_from" in e.value.line()
            and "model_type='qwen2'" in e.value.line()
        )


@pytest.mark.parametrize("name", list(HF))
def test_the_meta_build_replays_each_familys_constructor_exactly(name):
    """Under a sharded layout the model is built on the meta device and its draws replayed (parallel/materialize.py):
    the families' own tensors (Qwen2's biases, Qwen3's per-head norms) are made as the constructor makes them."""
    from ddpkit.models import model_family
    from ddpkit.parallel.materialize import Materializer, StreamReplay

    family = model_family(name)
    cls = family.module_types[0]
    for tied in (False, True):
        torch.manual_seed(3)
        want = cls(19, 8, 2, 4, 16, n_kv_head=2, tie_embeddings=tied, head_dim=8).state_dict()
        with torch.device("meta"):
            meta = cls(19, 8, 2, 4, 16, n_kv_head=2, tie_embeddings=tied, head_dim=8)
        made = Materializer(StreamReplay(meta, family.init_weights, 3), "cpu")(meta).state_dict()
        assert sorted(made) == sorted(want) and all(torch.equal(t, want[k]) for k, t in made.items()), (
            name,
            tied,
        )


# ------------------------------------------------------------------- init_from, the layouts and export

TOKENS = [
    "data.dataset=tokens",
    "data.block_size=16",
    "train.max_steps=4",
    "train.log_every=1",
    # SGD, as conftest.GPT_RUN: Adam would blow the rounding noise of the key bias's gradient (zero in exact
    # arithmetic: softmax ignores what a query adds to every key) up to lr-sized steps that differ by layout
    "optim.name=sgd",
    "optim.lr=0.5",
    "optim.ref_batch_size=null",
    "optim.schedule=constant",
    "optim.warmup_epochs=0",
    "report.curves=false",
]
LAYOUTS = {  # on 4 processes, 2 data-parallel replicas of 4 samples: the global batch of 8
    "fsdp-tp2": ["dist.strategy=fsdp", "dist.tp=2", "train.batch_size=4"],
    "fsdp-pp2": ["dist.strategy=fsdp", "dist.pp=2", "dist.pp_microbatches=2", "train.batch_size=4"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each family's folder, random token files, and the one-process run from the folder (in this process)."""
    root = tmp_path_factory.mktemp("llama_shaped")
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        rng.integers(0, 64, 600, dtype=np.uint16).tofile(root / f"{split}.bin")
    for name in HF:
        _transformers(name).save_pretrained(root / name)
        train_here(
            f"out_dir={root / name}-one", f"model.init_from={root / name}", f"data.root={root}", *TOKENS,
            "train.batch_size=8",
        )  # fmt: skip
    return root


def _layouts(rank: int, world_size: int, root: str) -> dict:
    from ddpkit.config import load_config
    from ddpkit.train.health import Heartbeat
    from ddpkit.train.trainer import Trainer

    weights = {}
    for name in HF:
        for layout, settings in LAYOUTS.items():
            run = [f"out_dir={root}/{name}-{layout}", f"model.init_from={root}/{name}", f"data.root={root}"]
            with Heartbeat(rank, world_size) as heartbeat:
                cfg = load_config(None, [*run, *TOKENS, *settings])
                trainer = Trainer(cfg, dist_context(rank, world_size), heartbeat)
                trainer.fit()
                weights[name, layout] = plain(trainer.strategy.model_state(trainer.wrapped))
    return weights


@pytest.mark.slow
def test_each_family_from_its_folder_under_fsdp_x_tp2_and_fsdp_x_pp2_equals_one_process_and_exports(
    runs, capsys
):
    import ddpkit
    from ddpkit.checkpoint import load_checkpoint

    weights = run_group(_layouts, 4, str(runs), timeout=600)[0]  # full weights on rank 0
    assert len(weights) == len(HF) * len(LAYOUTS)
    for (name, layout), got in weights.items():
        want = load_checkpoint(runs / f"{name}-one" / "checkpoints" / "last.pt")["model"]
        assert sorted(got) == sorted(want), (name, layout)
        for k, v in want.items():  # within 1e-4 of each tensor's scale, as tests/models/test_llama.py
            assert np.abs(got[k] - v.numpy()).max() <= 1e-4 * max(v.abs().max().item(), 1e-2), (
                name,
                layout,
                k,
            )
    x = torch.randint(0, 64, (2, 16))
    for name in HF:
        one = runs / f"{name}-one"
        proc = cli_in_process(capsys, "export", str(one), "--to", "hf", str(runs / f"{name}-back"))
        assert proc.returncode == 0, proc.stderr
        back = transformers.AutoModelForCausalLM.from_pretrained(runs / f"{name}-back").eval()
        with torch.no_grad():
            assert (back(x).logits - ddpkit.load_model(one)(x)).abs().max() < 1e-4, name


@pytest.mark.parametrize("arch", ["llama", "mixtral", *HF])
def test_model_head_dim_reaches_every_llama_shaped_familys_model(arch):
    """model.head_dim is one of the Llama's keys: every family that takes them builds heads of that width (a
    builder that dropped it would build n_embd / n_head and read a folder's wider heads into the wrong shapes)."""
    from ddpkit.config import load_config
    from ddpkit.models import model_family

    experts = ["model.n_experts=2"] if arch == "mixtral" else []
    keys = ["model.n_layer=1", "model.n_head=4", "model.n_kv_head=2", "model.n_embd=16", "model.head_dim=8"]
    cfg = load_config(None, [f"model.arch={arch}", "data.dataset=text", *keys, *experts])
    model = model_family(arch).build_lm(arch, 19, 8, cfg.model)
    attn = model.blocks["0"].attn
    assert (attn.wq.weight.shape, attn.wk.weight.shape, attn.wo.weight.shape) == (
        (32, 16),
        (16, 16),
        (16, 32),
    )
    assert model(torch.randint(0, 19, (1, 8))).shape == (1, 8, 19)
