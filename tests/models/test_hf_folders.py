"""Hugging Face folders as hostile input and read strictly (models/hf/): every reader checks config.json's values by
the config keys' own rules, the files (bounded JSON, regular files, weight dtypes) and the tensors (none unused,
none missing) before it allocates, one line naming the file, the key and the rule, from `ddpkit.load_model`
(UserError) and from `ddpkit train model.init_from=...` (exit 2); and model.init_from takes the model's shape
from the folder. In process on tiny transformers models: about 15 s."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from conftest import assert_user_error, cli_in_process, train_here
from ddpkit.errors import UserError

transformers = pytest.importorskip("transformers")

TINY_LLAMA = dict(
    vocab_size=40, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=500.0, max_position_embeddings=64,
)  # fmt: skip


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A tiny transformers Llama (rms_norm_eps 1e-6, transformers' default, not ddpkit's) saved once: (its
    folder, the model in eval mode)."""
    folder = tmp_path_factory.mktemp("llama") / "hf"
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY_LLAMA)).eval()
    ref.save_pretrained(folder)
    return folder, ref


def _copy(folder, to, config=None):
    """`folder` copied to `to` (tensors linked), its config.json changed by `config(dict)`."""
    to.mkdir()
    for f in folder.iterdir():
        os.link(f, to / f.name) if f.name != "config.json" else None
    raw = json.loads((folder / "config.json").read_text())
    if config is not None:
        config(raw)
    (to / "config.json").write_text(json.dumps(raw))
    return to


def _token_files(folder, vocab: int = 40):
    """train.bin and val.bin of random ids below `vocab` in `folder`; returns `folder`."""
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        rng.integers(0, vocab, 400, dtype=np.uint16).tofile(folder / f"{split}.bin")
    return folder


def test_a_qwen2_folder_relabelled_llama_is_refused_naming_the_biases_it_would_drop(tmp_path, capsys):
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(
        vocab_size=40, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2,
    )  # fmt: skip
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(tmp_path / "qwen")
    folder = _copy(tmp_path / "qwen", tmp_path / "as_llama", lambda raw: raw.update(model_type="llama"))
    import ddpkit

    with pytest.raises(
        UserError, match=r"holds 6 tensors .* not use: model\.layers\.0\.self_attn\.k_proj\.bias"
    ):
        ddpkit.load_model(folder)
    run = [f"out_dir={tmp_path / 'run'}", "data.dataset=tokens", f"data.root={_token_files(tmp_path)}"]
    proc = cli_in_process(capsys, "train", *run, f"model.init_from={folder}")
    assert_user_error(proc, "q_proj.bias", "does not use")
    assert not (tmp_path / "run").exists()


def test_init_from_of_a_llama_folder_needs_no_shape_key_and_a_set_key_that_disagrees_is_one_line(
    llama_dir, tmp_path, capsys
):
    from ddpkit.config import load_config

    folder, ref = llama_dir
    cfg = load_config(None, [f"model.init_from={folder}", "data.dataset=tokens"])
    m = cfg.model
    got = (
        m.arch,
        m.n_layer,
        m.n_head,
        m.n_embd,
        m.n_kv_head,
        m.ffn_hidden,
        m.norm_eps,
        m.rope_theta,
        m.tie_embeddings,
    )
    assert got == ("llama", 2, 4, 16, 2, 24, 1e-6, 500.0, False) and cfg.data.vocab_size == 40
    assert load_config(None, [f"model.init_from={folder}", "model.norm_eps=1e-6"]).model.norm_eps == 1e-6
    for bad, line in (
        ("model.n_layer=4", f"model.n_layer=4 but model.init_from '{folder}' has num_hidden_layers=2"),
        ("model.norm_eps=1e-5", "model.norm_eps=1e-05 but model.init_from"),
        ("model.arch=gpt", "model.arch=gpt but model.init_from"),
    ):
        assert_user_error(
            cli_in_process(capsys, "train", f"out_dir={tmp_path / 'bad'}", f"model.init_from={folder}", bad),
            line,
        )
    # the run the docs describe, no shape key: token files below the folder's vocabulary, 1 step of lr 1e-9
    _token_files(tmp_path)
    out = tmp_path / "run"
    train_here(
        f"model.init_from={folder}", "data.dataset=tokens", f"data.root={tmp_path}", f"out_dir={out}",
        "data.block_size=16", "train.batch_size=4", "train.max_steps=1", "optim.name=adamw", "optim.lr=1e-9",
        "optim.ref_batch_size=null", "report.curves=false",
    )  # fmt: skip
    import ddpkit

    model = ddpkit.load_model(out)
    x = torch.randint(0, 40, (2, 16))
    with torch.no_grad():
        assert (model(x) - ref(x).logits).abs().max() < 1e-4


BAD_VALUES = [  # (config.json key, value, what the line says)
    ("hidden_size", 10**7, "hidden_size=10000000: model.n_embd must be in (0, 65536]"),
    ("vocab_size", 10**12, "vocab_size=1000000000000: data.vocab_size must be in (0, 4294967296]"),
    ("hidden_size", 30, "hidden_size=30 is not a multiple of num_attention_heads=4"),  # head_dim null
    ("num_key_value_heads", 3, "num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
    ("num_key_value_heads", "x", "num_key_value_heads='x' is not an integer > 0 or null (model.n_kv_head)"),
    ("num_key_value_heads", -1, "num_key_value_heads=-1: model.n_kv_head must be > 0"),
    ("rms_norm_eps", "abc", "rms_norm_eps='abc' is not a number in (0, 1) (model.norm_eps)"),
    ("rms_norm_eps", -1e-5, "rms_norm_eps=-1e-05: model.norm_eps must be in (0, 1)"),
    (
        "rope_parameters",
        {"rope_type": "default", "rope_theta": -1},
        "rope_parameters.rope_theta=-1: model.rope_theta",
    ),
    ("rope_scaling", "linear", "asks for RoPE scaling (rope_scaling='linear')"),
    ("head_dim", 0, "head_dim=0: model.head_dim must be > 0"),
    ("num_hidden_layers", True, "num_hidden_layers=true is not an integer"),
    ("num_hidden_layers", 1024, "describes a model of about"),  # with hidden_size 65536 below: 70 billion
]


@pytest.mark.parametrize(
    ("key", "value", "line"), BAD_VALUES, ids=[f"{k}={v!r}"[:40] for k, v, _ in BAD_VALUES]
)
def test_a_config_value_the_family_reads_is_checked_by_its_key_rules_before_anything_is_built(
    llama_dir, tmp_path, capsys, key, value, line
):
    import ddpkit

    def change(raw):
        raw[key] = value
        if key == "hidden_size":  # the heads' width then hidden_size / num_attention_heads
            raw["head_dim"] = None
        if key == "num_hidden_layers" and value == 1024:
            raw.update(hidden_size=65536, num_attention_heads=64, num_key_value_heads=64, head_dim=1024)

    folder = _copy(llama_dir[0], tmp_path / "bad", change)
    with pytest.raises(UserError) as refused:
        ddpkit.load_model(folder)
    assert line in str(refused.value) and str(folder / "config.json") in str(refused.value)
    proc = cli_in_process(
        capsys, "train", f"out_dir={tmp_path / 'run'}", f"model.init_from={folder}", "data.dataset=tokens"
    )
    assert_user_error(proc, line)


def test_a_null_head_dim_means_the_width_over_the_heads_as_in_transformers(llama_dir, tmp_path):
    import ddpkit

    folder = _copy(llama_dir[0], tmp_path / "null", lambda raw: raw.update(head_dim=None))
    x = torch.randint(0, 40, (1, 8))
    with torch.no_grad():
        assert (ddpkit.load_model(folder)(x) - llama_dir[1](x).logits).abs().max() < 1e-4


def _sparse(path, size):
    path.unlink(missing_ok=True)
    with open(path, "wb") as fh:
        fh.truncate(size)


def _resaved(folder, change):
    """model.safetensors of `folder` saved again with its tensors changed by `change(dict)`."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    change(tensors)
    (folder / "model.safetensors").unlink()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def _indexed(folder, index_text):
    """`folder` with its weights behind an index (`index_text(tensor names)`)."""
    from safetensors import safe_open

    with safe_open(folder / "model.safetensors", "pt") as fh:
        names = list(fh.keys())
    (folder / "model.safetensors").rename(folder / "part.safetensors")
    (folder / "model.safetensors.index.json").write_text(index_text(names))


def _fifo_shard(folder):
    _indexed(folder, lambda names: json.dumps({"weight_map": dict.fromkeys(names, "fifo.safetensors")}))
    os.mkfifo(folder / "fifo.safetensors")  # read, it would block forever


BAD_FILES = {  # what is done to a copy of the folder, what the line says
    "sparse 30 GB config.json": (
        lambda f: _sparse(f / "config.json", 30 * 10**9),  # 1 MB read, then refused
        "config.json' is larger than 1 MiB",
    ),
    "index nested 100,000 deep": (
        lambda f: _indexed(f, lambda names: "[" * 100_000 + "]" * 100_000),
        "index.json': nested deeper than 32 levels",
    ),
    "sparse 30 GB index": (
        lambda f: (_indexed(f, str), _sparse(f / "model.safetensors.index.json", 30 * 10**9)),
        "index.json' is larger than 64 MiB",
    ),
    "index naming a FIFO": (_fifo_shard, "fifo.safetensors' is a FIFO, not a file"),
    "model.safetensors a FIFO": (
        lambda f: ((f / "model.safetensors").unlink(), os.mkfifo(f / "model.safetensors")),
        "model.safetensors' is a FIFO, not a file",
    ),
    "int64 weight": (
        lambda f: _resaved(f, lambda t: t.update({"model.norm.weight": t["model.norm.weight"].long()})),
        "tensor model.norm.weight is stored as I64, where a weight is a floating-point number",
    ),
    "a tensor lacking": (
        lambda f: _resaved(f, lambda t: t.pop("model.layers.1.mlp.up_proj.weight")),
        "lacks tensor model.layers.1.mlp.up_proj.weight that its config.json's Llama holds",
    ),
    "a tensor of another shape": (
        lambda f: _resaved(f, lambda t: t.update({"model.norm.weight": torch.ones(17)})),
        "ln_f.weight",  # the folder's 17 against the model's 16 (said alike by both readers)
    ),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_files_are_bounded_regular_and_hold_weights_of_a_weight_dtype(llama_dir, tmp_path, capsys, case):
    import ddpkit

    change, line = BAD_FILES[case]
    folder = _copy(llama_dir[0], tmp_path / "bad")
    change(folder)
    with pytest.raises(UserError) as refused:
        ddpkit.load_model(folder)
    assert line in str(refused.value)
    run = [f"out_dir={tmp_path / 'run'}", "data.dataset=tokens", f"data.root={_token_files(tmp_path)}"]
    assert_user_error(cli_in_process(capsys, "train", *run, f"model.init_from={folder}"), line)
    assert not (tmp_path / "run").exists()


def test_a_checkpoint_with_a_tensor_the_model_does_not_use_is_refused_not_dropped(tmp_path):
    import ddpkit
    from ddpkit import config
    from ddpkit.checkpoint import save_checkpoint
    from ddpkit.models.llama.model import Llama

    cfg = config.load_config(
        None, ["model.arch=llama", "data.dataset=tokens", "model.n_layer=1", "model.n_embd=16"]
    )
    sd = Llama(40, cfg.data.block_size, 1, 4, 16).state_dict()
    save_checkpoint(
        {"model": {**sd, "blocks.0.attn.wq.bias": torch.zeros(16)}, "config": config.to_dict(cfg)},
        tmp_path / "x.pt",
    )
    with pytest.raises(UserError, match=r"holds blocks.0.attn.wq.bias, which the model does not use"):
        ddpkit.load_model(tmp_path / "x.pt")
    del sd["ln_f.weight"]
    save_checkpoint({"model": sd, "config": config.to_dict(cfg)}, tmp_path / "y.pt")
    with pytest.raises(UserError, match=r"y.pt' lacks ln_f.weight"):
        ddpkit.load_model(tmp_path / "y.pt")


def test_load_model_on_the_meta_device_checks_the_folder_and_keeps_its_values_for_later(llama_dir):
    """load_model under `with torch.device("meta")` (as ddpkit.prepare calls a builder) builds the model without
    memory and reads nothing: values_of(model) gives the folder's values, read when the model is laid out."""
    import ddpkit
    from ddpkit.models.loading import values_of

    with torch.device("meta"):
        model = ddpkit.load_model(llama_dir[0])
    assert all(t.is_meta for t in model.state_dict().values())
    model.to_empty(device="cpu")
    own = model.state_dict()
    with torch.no_grad():
        for name, piece in values_of(model).pieces(own):
            own[name].copy_(piece)
    x = torch.randint(0, 40, (1, 8))
    with torch.no_grad():
        assert (model(x) - llama_dir[1](x).logits).abs().max() < 1e-4
    assert values_of(ddpkit.load_model(llama_dir[0])) is None  # with memory: filled at once
