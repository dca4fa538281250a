"""Config: YAML + dotted overrides, typed; unknown keys and wrong types named with the closest valid key."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import REPO, assert_user_error, run_cli
from ddpkit.config import Config, load_config, to_yaml, valid_keys
from ddpkit.errors import UserError

CONTRACT_KEYS = [
    "out_dir", "seed", "data.dataset", "data.root", "data.num_workers", "data.download", "data.synthetic_size",
    "data.image_size", "data.augment", "model.arch", "model.num_classes", "model.sync_bn", "model.channels_last",
    "model.compile", "model.pretrained", "train.epochs", "train.max_steps", "train.batch_size",
    "train.grad_accum_steps", "train.amp", "optim.name", "optim.lr", "optim.ref_batch_size", "optim.schedule",
    "optim.warmup_epochs", "optim.momentum", "optim.weight_decay", "dist.backend", "dist.strategy",
    "dist.timeout_s", "checkpoint.resume", "checkpoint.keep", "checkpoint.path", "eval.every",
]  # fmt: skip


def test_every_contract_key_exists():
    assert set(CONTRACT_KEYS) <= set(valid_keys())


def test_defaults_are_the_digits_recipe():
    cfg = load_config()
    assert isinstance(cfg, Config)
    assert (cfg.data.dataset, cfg.model.arch, cfg.checkpoint.resume, cfg.dist.strategy) == (
        "digits",
        "cnn",
        "auto",
        "auto",
    )


def test_yaml_then_overrides_later_wins(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("train:\n  epochs: 7\n  batch_size: 16\noptim:\n  lr: 0.5\n")
    cfg = load_config(
        str(f), ["train.epochs=3", "optim.ref_batch_size=null", "model.sync_bn=true", "optim.lr=1e-3"]
    )
    assert cfg.train.epochs == 3 and cfg.train.batch_size == 16
    assert (
        cfg.optim.ref_batch_size is None and cfg.model.sync_bn is True and cfg.optim.lr == pytest.approx(1e-3)
    )
    assert load_config(None, ["train.epochs=2", "train.epochs=4"]).train.epochs == 4


def test_base_layer_below_file_and_overrides():
    cfg = load_config(
        None, ["train.epochs=2"], base={"model": {"arch": "mlp"}, "train": {"epochs": 9}, "gone": 1}
    )
    assert cfg.model.arch == "mlp" and cfg.train.epochs == 2


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(None, ["train.epochs=3", "model.arch=mlp"])
    f = tmp_path / "config.yaml"
    f.write_text(to_yaml(cfg))
    assert load_config(str(f)) == cfg


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("train.batchsize=3", "did you mean 'train.batch_size'"),
        ("optim.lrr=0.1", "did you mean 'optim.lr'"),
        ("epochs=3", "did you mean 'train.epochs'"),
        ("train=3", "is a section"),
        ("train.epochs=three", "expects an integer"),
        ("optim.lr=fast", "expects a number"),
        ("model.sync_bn=maybe", "expects true or false"),
        ("train.batch_size=0", "train.batch_size must be > 0"),
        ("train.epochs=-1", "train.epochs must be > 0"),
        ("train.grad_accum_steps=0", "train.grad_accum_steps must be > 0"),
        ("train.amp=fp8", "train.amp must be one of"),
        ("dist.strategy=ddpp", "did you mean 'ddp'"),
        ("optim.name=adam", "did you mean 'adamw'"),
        ("optim.schedule=linear", "optim.schedule must be one of"),
        ("data.dataset=cifar", "data.dataset must be one of"),
        ("checkpoint.keep=0", "checkpoint.keep must be > 0"),
        ("data.num_workers=-2", "data.num_workers must be >= 0"),
        ("train.label_smoothing=1.5", "label_smoothing"),
        ("noequals", "expected KEY=VALUE"),
    ],
)
def test_bad_values_name_the_key(override, fragment):
    with pytest.raises(UserError) as info:
        load_config(None, [override])
    assert fragment in info.value.line()


def test_bad_yaml_files(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_config(str(tmp_path / "missing.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [1, 2\n")
    with pytest.raises(UserError, match="not valid YAML"):
        load_config(str(bad))
    lst = tmp_path / "list.yaml"
    lst.write_text("- a\n- b\n")
    with pytest.raises(UserError, match="mapping"):
        load_config(str(lst))
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("train:\n  epochz: 3\n")
    with pytest.raises(UserError, match="did you mean 'train.epochs'"):
        load_config(str(unknown))
    code = tmp_path / "code.yaml"
    code.write_text("out_dir: !!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(UserError, match="not valid YAML"):  # safe loading: no object construction
        load_config(str(code))


def test_shipped_recipes_load():
    for path in sorted((REPO / "configs").glob("*.yaml")):
        load_config(str(path))


def test_cli_config_errors_exit_2_and_write_nothing(tmp_path):
    out = tmp_path / "existing"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    before = sorted(p.name for p in out.iterdir())
    for args, frag in [
        ([f"out_dir={out}", "train.batchsize=3"], "train.batch_size"),
        ([f"out_dir={out}", "train.epochs=0"], "train.epochs"),
        (["-c", str(tmp_path / "nope.yaml"), f"out_dir={out}"], "does not exist"),
        ([f"out_dir={out}", "model.arch=resnet81"], "resnet18"),
        ([f"out_dir={out}", "train.amp=fp8"], "train.amp"),
        ([f"out_dir={out}", "dist.strategy=zero3"], "dist.strategy"),
        ([f"out_dir={out}", "data.dataset=cifar10", f"data.root={tmp_path / 'nodata'}"], "data"),
        ([f"out_dir={out}", f"checkpoint.resume={tmp_path / 'none.pt'}"], "checkpoint.resume"),
    ]:
        assert_user_error(run_cli("train", *args, timeout=120), frag)
        assert sorted(p.name for p in out.iterdir()) == before


def test_help_config_lists_keys():
    proc = run_cli("train", "--help-config")
    assert proc.returncode == 0
    assert "train.batch_size = 32" in proc.stdout and "optim.ref_batch_size" in proc.stdout


def test_out_dir_that_is_a_file(tmp_path):
    f = Path(tmp_path / "file")
    f.write_text("x")
    assert_user_error(run_cli("train", f"out_dir={f}"), "not a folder")
