"""Config: YAML + dotted overrides, typed; unknown keys and wrong types named with the closest valid key."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest

import ddpkit.config
from conftest import REPO, assert_user_error, run_cli, run_clis
from ddpkit.config import Config, TrainConfig, describe_keys, load_config, to_yaml, valid_keys
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
        ("data.dataset=cifar", "unknown data.dataset 'cifar' (did you mean 'cifar10'?)"),
        ("checkpoint.keep=0", "checkpoint.keep must be > 0"),
        ("data.num_workers=-2", "data.num_workers must be >= 0"),
        ("train.label_smoothing=1.5", "label_smoothing"),
        ("noequals", "expected KEY=VALUE"),
        ("train.max_steps=three", "config key 'train.max_steps' expects an integer > 0 or null, got 'three'"),
        ("model.pretrained=[a]", "expects a string or null, got a list"),
        ("train.amp=BF16", "did you mean 'bf16'"),
        ("model.sync_bn=2", "expects true or false, got 2"),
        ("train.epochs=2.5", "expects an integer > 0, got 2.5"),
        ("out_dir=", "out_dir must not be empty"),
        ("seed=9223372036854775808", "seed must be in [-9223372036854775808, 9223372036854775808)"),
        ("seed=-9223372036854775809", "seed must be in"),  # torch.manual_seed would raise an OverflowError
        ("dist.timeout_s=1e9", "dist.timeout_s must be in (0, 604800]"),
        ("out_dir=runs/${model.arch}", "does not interpolate"),
        ("TRAIN.BATCH_SIZE=3", "did you mean 'train.batch_size'"),
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


def test_shipped_recipes_load_and_say_what_their_files_say():
    import yaml

    from ddpkit.config.keys import flatten

    recipes = sorted((REPO / "configs").glob("*.yaml"))
    assert len(recipes) >= 3
    for path in recipes:
        cfg, written = to_yaml(load_config(str(path))), flatten(yaml.safe_load(path.read_text()), path.name)
        assert written, path.name
        loaded = flatten(yaml.safe_load(cfg), "loaded")
        assert {k: loaded[k] for k in written} == written, path.name


def test_cli_config_errors_exit_2_and_write_nothing(tmp_path):
    outs = [tmp_path / f"existing{i}" for i in range(8)]  # one each: the commands run two at a time
    for out in outs:
        out.mkdir()
        (out / "keep.txt").write_text("mine")
    cases = [
        (["train.batchsize=3"], "train.batch_size"),
        (["train.epochs=0"], "train.epochs"),
        (["-c", str(tmp_path / "nope.yaml")], "does not exist"),
        (["model.arch=resnet81"], "resnet18"),
        (["train.amp=fp8"], "train.amp"),
        (["dist.strategy=zero3"], "dist.strategy"),
        (["data.dataset=cifar10", f"data.root={tmp_path / 'nodata'}"], "data"),
        ([f"checkpoint.resume={tmp_path / 'none.pt'}"], "checkpoint.resume"),
    ]
    procs = run_clis(
        *(["train", *args, f"out_dir={out}"] for (args, _), out in zip(cases, outs, strict=True)), timeout=120
    )
    for proc, (_, frag), out in zip(procs, cases, outs, strict=True):
        assert_user_error(proc, frag)
        assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]


def test_help_config_lists_keys():
    proc = run_cli("train", "--help-config")
    assert proc.returncode == 0
    assert "train.batch_size = 64" in proc.stdout and "optim.ref_batch_size" in proc.stdout
    doc = REPO / "docs" / "config.md"
    assert proc.stdout == doc.read_text(), (
        "docs/config.md is stale: regenerate it with `PYTHONPATH=src python -m ddpkit train --help-config "
        "> docs/config.md`"
    )


def test_out_dir_that_is_a_file(tmp_path):
    f = Path(tmp_path / "file")
    f.write_text("x")
    assert_user_error(run_cli("train", f"out_dir={f}"), "not a folder")


# ------------------------------------------------------------------ the schema explains itself


def test_every_key_has_type_default_and_meaning_in_the_help():
    text = describe_keys().splitlines()
    for key in valid_keys():
        head = [i for i, ln in enumerate(text) if ln.startswith(f"- `{key} = ")]
        assert len(head) == 1, key
        line, meaning = text[head[0]], text[head[0] + 1]
        assert line.endswith("):") and " (" in line, line  # `key = default` (type):
        assert meaning.startswith("  ") and len(meaning.strip()) > 10, (key, meaning)
    assert "- `train.max_steps = null` (integer > 0 or null):" in text
    assert "- `train.amp = none` (one of none, bf16, fp16):" in text
    assert "- `dist.timeout_s = 600.0` (number in (0, 604800]):" in text
    for word in ("*micro-batch*", "*optimizer\nstep*", "*global batch*"):
        assert word in describe_keys()


def test_choices_are_literal_types_and_errors_list_them():
    amp = typing.get_type_hints(TrainConfig)["amp"]
    assert typing.get_origin(amp) is typing.Literal and typing.get_args(amp) == ("none", "bf16", "fp16")
    with pytest.raises(UserError) as info:
        load_config(None, ["train.nonfinite=skp"])
    assert info.value.line() == "train.nonfinite must be one of stop, skip, got 'skp' (did you mean 'skip'?)"


def test_the_error_hint_never_prints_python_types():
    for override in [
        "train.max_steps=x",
        "model.num_classes=x",
        "optim.ref_batch_size=x",
        "eval.batch_size=x",
    ]:
        with pytest.raises(UserError) as info:
            load_config(None, [override])
        assert "None" not in info.value.line() and "| " not in info.value.line(), info.value.line()
        assert "an integer > 0 or null" in info.value.line()


FLOAT_KEYS = [
    "optim.lr", "optim.warmup_epochs", "optim.momentum", "optim.weight_decay", "optim.step_gamma",
    "train.label_smoothing", "train.clip_grad_norm", "dist.timeout_s", "checkpoint.every_minutes",
    "dist.bucket_cap_mb", "model.dropout", "model.rope_theta", "model.norm_eps", "train.peak_tflops",
    "model.moe_aux_loss", "model.moe_bias_rate",
]  # fmt: skip


def test_float_key_list_is_complete():
    floats = {k for k in valid_keys() if f"`{k} = " in describe_keys() and _type_of(k).startswith("number")}
    assert floats == set(FLOAT_KEYS)


def _type_of(key: str) -> str:
    line = next(ln for ln in describe_keys().splitlines() if ln.startswith(f"- `{key} = "))
    return line.split("` (", 1)[1][:-2]


@pytest.mark.parametrize("key", FLOAT_KEYS)
@pytest.mark.parametrize("value", ["nan", ".nan", "inf", "-inf", ".inf", "-.inf", "1e999", "1e200", "-1e39"])
def test_nan_and_inf_are_refused_for_every_float_key(key, value):
    with pytest.raises(UserError) as info:
        load_config(None, [f"{key}={value}"])
    assert info.value.line().startswith(f"{key} must be"), info.value.line()


def test_nan_in_a_yaml_file_is_refused(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("optim:\n  lr: .nan\n")
    with pytest.raises(UserError, match="optim.lr must be a finite number, got nan"):
        load_config(str(f))


def test_seed_keeps_its_range_but_not_beyond_torch():
    assert load_config(None, ["seed=-1"]).seed == -1 and load_config(None, ["seed=4294967296"]).seed == 2**32


def test_timeout_upper_bound():
    assert load_config(None, ["dist.timeout_s=604800"]).dist.timeout_s == 604800
    with pytest.raises(UserError, match=r"dist.timeout_s must be in \(0, 604800\], got 604801"):
        load_config(None, ["dist.timeout_s=604801"])


@pytest.mark.parametrize(
    "text, fragment",
    [
        (
            "train:\n  epochs: {a: 1}\n",
            "config key 'train.epochs' expects an integer > 0, got a mapping: {'a': 1}",
        ),
        ("train:\n  amp: [bf16]\n", "config key 'train.amp' expects one of none, bf16, fp16, got a list"),
        ("out_dir: [a, b]\n", "config key 'out_dir' expects a string, not empty, got a list: ['a', 'b']"),
        ("model:\n  sync_bn: {x: 1}\n", "expects true or false, got a mapping"),
        ("data:\n  image_size: []\n", "expects an integer > 0 or null, got a list"),
        ("dist:\n  timeout_s: !!binary aGVsbG8=\n", "expects a number in (0, 604800], got a bytes"),
    ],
)
def test_non_scalar_values_are_one_line_errors(tmp_path, text, fragment):
    f = tmp_path / "c.yaml"
    f.write_text(text)
    with pytest.raises(UserError) as info:
        load_config(str(f))
    assert fragment in info.value.line() and "\n" not in info.value.line()


def test_string_overrides_keep_the_text_as_typed():
    over = [
        "out_dir=007",
        "data.root=on",
        "model.pretrained=null",
        "checkpoint.path=1e3",
        "checkpoint.resume=2001-13-45",
    ]
    cfg = load_config(None, over)
    got = (cfg.out_dir, cfg.data.root, cfg.model.pretrained, cfg.checkpoint.path, cfg.checkpoint.resume)
    assert got == ("007", "on", None, "1e3", "2001-13-45")


def test_strings_refuse_control_characters(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text('out_dir: "runs/a\\0b"\ndata:\n  root: "x\\ny"\n')
    with pytest.raises(UserError, match="out_dir contains a control character"):
        load_config(str(f))


# ------------------------------------------------------------------ every unknown key at once


DISTRIBUUUU = "TRAIN:\n  BATCH_SIZE: 128\nOPTIM:\n  BASE_LR: 0.1\n  LR_POLICY: cos\nOUT_DIR: ./r18\nseed: 3\n"


def test_every_unknown_key_is_reported_in_one_line(tmp_path):
    f = tmp_path / "distribuuuu.yaml"
    f.write_text(DISTRIBUUUU)
    with pytest.raises(UserError) as info:
        load_config(str(f), ["train.epochz=3", "TEST.BATCH_SIZE=64"])
    line = info.value.line()
    assert line.startswith("6 unknown config keys in ") and "\n" not in line
    for given, meant in [
        ("TRAIN.BATCH_SIZE", "train.batch_size"),
        ("OPTIM.BASE_LR", "optim.lr"),
        ("OPTIM.LR_POLICY", "optim.schedule"),
        ("OUT_DIR", "out_dir"),
        ("train.epochz", "train.epochs"),
        ("TEST.BATCH_SIZE", "eval.batch_size"),
    ]:
        assert f"'{given}' (did you mean '{meant}'?)" in line, (given, line)
    assert "; on the command line: 'train.epochz'" in line


def test_unknown_keys_and_sections_together(tmp_path):
    with pytest.raises(UserError) as info:
        load_config(None, ["train=3", "nope.x=1", "optim.lrr=2"])
    line = info.value.line()
    assert "'train' (a section, not a value)" in line and "'optim.lrr' (did you mean 'optim.lr'?)" in line
    assert "'nope.x'" in line


@pytest.mark.parametrize(
    "key, meant",
    [("MODEL.TYPE", "model.arch"), ("OPTIM.MAX_EPOCH", "train.epochs"), ("data.workers", "data.num_workers")],
)
def test_closest_key_knows_other_frameworks_names(key, meant):
    with pytest.raises(UserError, match=f"did you mean '{meant}'"):
        load_config(None, [f"{key}=1"])


# ------------------------------------------------------------------ hostile files

# The textbook "billion laughs": 9 levels of 9 aliases, 9**9 = 387 million values from about 300 bytes.
LAUGHS = ["[" + ",".join("x" * 9) + "]"] + ["[" + ",".join([f"*{p}"] * 9) + "]" for p in "abcdefgh"]
BOMB_TOP = "".join(f"{c}: &{c} {v}\n" for c, v in zip("abcdefghi", LAUGHS, strict=True))
# The same under a valid key, so that no unknown-key check can stop it first.
BOMB_IN_A_KEY = (
    "train:\n  epochs: [" + ", ".join(f"&{c} {v}" for c, v in zip("abcdefghi", LAUGHS, strict=True)) + "]\n"
)

_MEASURE = """
import json, os, resource, sys, types
resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))  # the old loader ran out of this instead of the machine
pkg = types.ModuleType("ddpkit"); pkg.__path__ = [os.path.join(sys.argv[1], "ddpkit")]; sys.modules["ddpkit"] = pkg
from ddpkit.config import load_config
from ddpkit.errors import UserError
try:
    load_config(sys.argv[2]); out = "loaded"
except UserError as e:
    out = e.line()
except BaseException as e:
    out = f"{type(e).__name__}: {str(e)[:200]}"
# peak resident memory of this program (VmHWM: ru_maxrss would count the parent's memory from before exec)
mb = int(next(ln.split()[1] for ln in open("/proc/self/status") if ln.startswith("VmHWM:"))) / 1024
print(json.dumps({"line": out, "peak_mb": mb, "torch": "torch" in sys.modules, "yaml": "yaml" in sys.modules}))
"""


def _load_in_fresh_process(path) -> dict:
    """load_config(path) in a fresh interpreter that imports only ddpkit.config (not the package, not torch)."""
    proc = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(Path(ddpkit.config.__file__).parents[2]), str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


@pytest.mark.parametrize("text", [BOMB_TOP, BOMB_IN_A_KEY], ids=["top-level", "in-a-key"])
def test_alias_bomb_is_refused_before_expansion(tmp_path, text):
    f = tmp_path / "bomb.yaml"
    f.write_text(text)
    assert f.stat().st_size < 400
    got = _load_in_fresh_process(f)
    assert "more than 10000 values once aliases are expanded" in got["line"], got
    assert got["peak_mb"] < 100, got  # the expanded document would need gigabytes


def test_importing_the_config_module_imports_no_torch(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("seed: 1\n")
    got = _load_in_fresh_process(f)
    assert got["line"] == "loaded" and got["torch"] is False and got["yaml"] is True


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("# " + "x" * (1 << 20) + "\nseed: 1\n", "is larger than 1 MiB"),
        ("seed: " + "[" * 5000 + "]" * 5000 + "\n", "line 1: nested deeper than 32 levels"),
        ("seed: &a [1, *a]\n", "line 1: an alias inside its own anchor"),
        ("".join(f"k{i}: {i}\n" for i in range(20000)), "more than 10000 values"),
        ("out_dir: !!python/object/apply:os.system ['echo pwned']\n", "not valid YAML"),
        (b"seed: \xff\n", "cannot read config file"),
        ("seed: " + "1" * 5000 + "\n", "holds a value YAML cannot convert"),  # int() refuses > 4300 digits
        ("out_dir: 2001-13-45\n", "holds a value YAML cannot convert: 'month must be in 1..12'"),
    ],
)
def test_hostile_files_are_refused_in_one_line(tmp_path, text, fragment):
    f = tmp_path / "c.yaml"
    f.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(UserError) as info:
        load_config(str(f))
    assert fragment in info.value.line() and "\n" not in info.value.line()


@pytest.mark.parametrize(
    "text, line",
    [
        (
            "train:\n  epochs: 3\n  batch_size: 8\n  epochs: 5\n",
            "sets 'train.epochs' twice, at lines 2 and 4",
        ),
        (
            "train:\n  epochs: 3\noptim:\n  lr: 1\ntrain:\n  batch_size: 8\n",
            "sets 'train' twice, at lines 1 and 5",
        ),
        ("train.epochs: 3\ntrain:\n  epochs: 5\n", "sets 'train.epochs' twice"),
    ],
)
def test_duplicate_keys_are_an_error(tmp_path, text, line):
    f = tmp_path / "c.yaml"
    f.write_text(text)
    with pytest.raises(UserError, match=line.replace(".", r"\.")):
        load_config(str(f))


def test_yaml_merge_keys_still_override(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("train: &t\n  epochs: 3\n  batch_size: 8\neval:\n  <<: {every: 2}\n  every: 4\n")
    assert load_config(str(f)).eval.every == 4


def test_error_lines_show_at_most_200_characters_of_a_value():
    huge = "x" * 39_000_000
    cases = [
        dict(base={"train": {"epochs": huge}}),
        dict(base={"out_dir": huge}),
        dict(base={"train": {"epochs": [huge, {"a": huge}]}}),
        dict(overrides=[f"train.epochs={huge}"]),
        dict(overrides=[f"{huge}=1"]),
        dict(overrides=[huge]),
    ]
    for kwargs in cases:
        with pytest.raises(UserError) as info:
            load_config(**kwargs)
        assert len(info.value.line()) < 400, info.value.line()[:500]


def test_cli_refuses_hostile_or_foreign_configs_in_one_line(tmp_path):
    bomb, dup, foreign = tmp_path / "bomb.yaml", tmp_path / "dup.yaml", tmp_path / "foreign.yaml"
    bomb.write_text(BOMB_TOP)  # not BOMB_IN_A_KEY: with no memory limit, a loader that expands it eats GBs
    dup.write_text("train:\n  epochs: 3\n  epochs: 5\n")
    foreign.write_text(DISTRIBUUUU)
    out = tmp_path / "run"
    assert_user_error(run_cli("train", "-c", str(bomb), f"out_dir={out}"), "aliases are expanded")
    assert_user_error(run_cli("train", "-c", str(dup), f"out_dir={out}"), "at lines 2 and 3")
    line = assert_user_error(run_cli("train", "-c", str(foreign), "OPTIM.LR=1"), "5 unknown config keys")
    assert "'OUT_DIR' (did you mean 'out_dir'?)" in line and "'OPTIM.LR' (did you mean 'optim.lr'?)" in line
    assert not out.exists()


def test_schema_defaults_pass_their_own_checks():
    assert dataclasses.asdict(load_config()) == dataclasses.asdict(Config())


# ------------------------------------------------------------------ keys declared by their owners


def test_a_declared_key_set_joins_its_section_and_leaves_it_again():
    import pickle
    from dataclasses import dataclass

    from ddpkit.config import ModelConfig
    from ddpkit.config.declared import declare, forget
    from ddpkit.config.schema import opt

    @dataclass
    class WidthKeys:
        """a test family's width."""

        test_width: int = opt(2, "a test family's width", gt=0)

    before = load_config()
    declare("model", WidthKeys, "model.arch", "testfam")
    try:
        cfg = load_config(None, ["model.test_width=5"])
        # the section's own class is built once and never changed: the config's section is a class made from it
        assert isinstance(cfg.model, ModelConfig) and "test_width" not in ModelConfig.__dataclass_fields__
        assert cfg.model.test_width == 5 and before.model.test_width == 2
        assert pickle.loads(pickle.dumps(cfg)) == cfg and to_yaml(cfg).count("test_width: 5") == 1
        assert "### `model.arch=testfam`: a test family's width." in describe_keys()
        assert_one_line(["model.test_width=0"], "model.test_width must be > 0, got 0")
        declare("model", WidthKeys, "model.arch", "otherfam")  # a second family sharing the set
        assert "### `model.arch=testfam, otherfam`:" in describe_keys()

        @dataclass
        class Clash:
            """a key the section has."""

            n_layer: int = opt(1, "again")

        with pytest.raises(ValueError, match="model.n_layer is already declared"):
            declare("model", Clash, "model.arch", "clash")

        @dataclass
        class Untyped:
            """a key with no opt()."""

            shape: tuple = (1, 2)

        with pytest.raises(TypeError, match="model.shape"):
            declare("model", Untyped, "model.arch", "untyped")
    finally:
        forget(WidthKeys)
    assert "model.test_width" not in valid_keys() and not hasattr(load_config().model, "test_width")
    assert_one_line(["model.test_width=5"], "unknown config key 'model.test_width'")


def assert_one_line(overrides, fragment):
    with pytest.raises(UserError) as info:
        load_config(None, overrides)
    assert fragment in info.value.line() and "\n" not in info.value.line()


def test_registries_check_their_names_at_load_and_config_imports_none_of_them():
    # the names are checked by the registries' own checks (config/declared.py), at load as before
    for override, line in [
        ("dist.strategy=zer01", "unknown dist.strategy 'zer01' (did you mean 'zero1'?)"),
        (
            "dist.grad_compression=powrsgd",
            "unknown dist.grad_compression 'powrsgd' (did you mean 'powersgd'?)",
        ),
        ("data.dataset=digit", "unknown data.dataset 'digit' (did you mean 'digits'?)"),
    ]:
        assert_one_line([override], line)
    # every module that declares keys or checks is one that config loads by name before the schema is read
    from ddpkit.config.declared import DECLARED_BY

    src = REPO / "src"
    declaring = {
        ".".join(p.relative_to(src).with_suffix("").parts).removesuffix(".__init__")
        for p in (src / "ddpkit").rglob("*.py")
        if "from ddpkit.config.declared import" in p.read_text() and p.parent.name != "config"
    }
    assert declaring == set(DECLARED_BY)
    # config/ imports none of them (tests/test_layout.py checks the folder order for every module)
    above = re.compile(r"(import|from) ddpkit\.(models|parallel|data)\b")
    assert [
        p.name for p in (REPO / "src" / "ddpkit" / "config").glob("*.py") if above.search(p.read_text())
    ] == []
