"""The one config schema (typed dataclasses), YAML + dotted KEY=VALUE merging, and validation."""

from __future__ import annotations

import dataclasses
import difflib
import os
from dataclasses import dataclass, field
from typing import Any

from ddpkit.errors import UserError

DATASETS = ("digits", "synthetic", "cifar10", "cifar100", "mnist", "imagefolder")
AMP_MODES = ("none", "bf16", "fp16")
OPTIMIZERS = ("sgd", "adamw")
SCHEDULES = ("cosine", "step", "constant")
BACKENDS = ("auto", "gloo", "nccl", "mpi")
DEVICES = ("auto", "cpu", "cuda")
STRATEGIES = ("auto", "single", "dp", "ddp", "zero1", "fsdp")


@dataclass
class DataConfig:
    dataset: str = "digits"
    root: str = "data"
    num_workers: int = 0
    download: bool = False
    synthetic_size: int = 2048
    synthetic_val_size: int = 512
    image_size: int | None = (
        None  # None: the data set's own size (digits 8, cifar 32, mnist 28, imagefolder 224)
    )
    augment: bool = True
    pin_memory: bool = True


@dataclass
class ModelConfig:
    arch: str = "cnn"
    num_classes: int | None = None  # None: taken from the data set
    sync_bn: bool = False
    channels_last: bool = False
    compile: bool = False
    pretrained: str | None = None  # a weights file (loaded with weights_only=True) or "torchvision"


@dataclass
class TrainConfig:
    epochs: int = 10
    max_steps: int | None = None
    batch_size: int = 32
    grad_accum_steps: int = 1
    amp: str = "none"
    label_smoothing: float = 0.0
    clip_grad_norm: float | None = None
    log_every: int = 50
    nonfinite: str = "stop"  # stop | skip


@dataclass
class OptimConfig:
    name: str = "sgd"
    lr: float = 0.1
    ref_batch_size: int | None = 256
    schedule: str = "cosine"
    warmup_epochs: float = 0.0
    momentum: float = 0.9
    nesterov: bool = True
    weight_decay: float = 1e-4
    step_size: int = 30  # epochs between decays for schedule=step
    step_gamma: float = 0.1


@dataclass
class DistConfig:
    backend: str = "auto"
    strategy: str = "auto"
    timeout_s: float = 600.0
    device: str = "auto"


@dataclass
class CheckpointConfig:
    resume: str = "auto"
    keep: int = 3
    path: str | None = None
    every_steps: int = 0  # also checkpoint every N optimizer steps (0: only at epoch ends)
    every_minutes: float = 0.0  # also checkpoint every N minutes of training (0: off)


@dataclass
class EvalConfig:
    every: int = 1
    batch_size: int | None = None  # None: train.batch_size


@dataclass
class Config:
    out_dir: str = "runs/default"
    seed: int = 0
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)


def valid_keys(cls: type = Config, prefix: str = "") -> list[str]:
    """Every dotted leaf key of the schema."""
    keys = []
    for f in dataclasses.fields(cls):
        name = prefix + f.name
        if dataclasses.is_dataclass(
            f.default_factory if f.default_factory is not dataclasses.MISSING else None
        ):
            keys.extend(valid_keys(f.default_factory, name + "."))
        else:
            keys.append(name)
    return keys


def _sections() -> set[str]:
    return {k.split(".")[0] for k in valid_keys() if "." in k}


def _check_key(key: str) -> None:
    keys = valid_keys()
    if key in keys:
        return
    if key in _sections():
        raise UserError(
            f"config key '{key}' is a section, not a value",
            f"set one of its keys, e.g. {key}.{_first_in(key)}=...",
        )
    close = difflib.get_close_matches(key, keys, n=1, cutoff=0.5)
    if not close:  # try matching the last part alone, e.g. 'batchsize' -> train.batch_size
        tail = key.split(".")[-1]
        by_tail = {k.split(".")[-1]: k for k in keys}
        hit = difflib.get_close_matches(tail, list(by_tail), n=1, cutoff=0.6)
        close = [by_tail[hit[0]]] if hit else []
    hint = f"did you mean '{close[0]}'?" if close else "see `ddpkit train --help-config` for the valid keys"
    raise UserError(f"unknown config key '{key}'", hint)


def _first_in(section: str) -> str:
    return next(k for k in valid_keys() if k.startswith(section + ".")).split(".", 1)[1]


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    if isinstance(d, dict):
        for k, v in d.items():
            key = f"{prefix}{k}"
            if isinstance(v, dict) and key in _sections():
                out.update(_flatten(v, key + "."))
            else:
                out[key] = v
    return out


def _read_yaml(path: str) -> dict[str, Any]:
    import yaml

    if not os.path.isfile(path):
        raise UserError(f"config file '{path}' does not exist", "check the path given to -c")
    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh)
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(
            f"cannot read config file '{path}': {e}", "check the file's permissions and encoding"
        ) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise UserError(f"config file '{path}' is not valid YAML{where}", "fix the YAML syntax") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"config file '{path}' must hold a mapping of keys", "write `key: value` lines")
    return data


def parse_overrides(items: list[str]) -> dict[str, str]:
    """`a.b=c` strings -> {dotted key: raw value string}; later ones win."""
    out: dict[str, str] = {}
    for item in items:
        if "=" not in item or item.startswith("="):
            raise UserError(f"expected KEY=VALUE, got '{item}'", "write overrides as e.g. train.epochs=5")
        key, value = item.split("=", 1)
        out[key.strip()] = value
    return out


def load_config(
    file: str | None = None, overrides: list[str] | None = None, base: dict | None = None
) -> Config:
    """Schema defaults <- `base` (e.g. a checkpoint's config) <- YAML file <- KEY=VALUE overrides; typed, validated."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    layers = []
    if base:
        known = set(valid_keys())
        layers.append({k: v for k, v in _flatten(base).items() if k in known})
    if file:
        raw = _flatten(_read_yaml(file))
        for key in raw:
            _check_key(key)
        layers.append(raw)
    over = parse_overrides(overrides or [])
    for key in over:
        _check_key(key)
    if over:
        # YAML-parse each value, as OmegaConf's dotlist does, so `null`, `true`, `1e-3` mean what they say.
        import yaml

        parsed = {}
        for k, v in over.items():
            try:
                parsed[k] = yaml.safe_load(v) if v.strip() != "" else ""
            except yaml.YAMLError:
                parsed[k] = v
        layers.append(parsed)

    cfg = OmegaConf.structured(Config)
    for layer in layers:
        for key, value in layer.items():
            try:
                OmegaConf.update(cfg, key, value, merge=False)
            except OmegaConfBaseException as e:
                expected = _type_name(key)
                raise UserError(
                    f"config key '{key}' expects {expected}, got {value!r}",
                    f"give {key} {_an(expected)} value",
                ) from e
    obj: Config = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    validate(obj)
    return obj


def _type_name(key: str) -> str:
    cls: Any = Config
    parts = key.split(".")
    for p in parts[:-1]:
        cls = {f.name: f for f in dataclasses.fields(cls)}[p].default_factory
    f = {f.name: f for f in dataclasses.fields(cls)}[parts[-1]]
    t = str(f.type).replace("Optional[", "").rstrip("]")
    names = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string"}
    out = names.get(t, t)
    return out + (" or null" if "Optional" in str(f.type) else "")


def _an(expected: str) -> str:
    return "a valid" if expected.startswith(("a ", "an ")) else "a"


def _choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        close = difflib.get_close_matches(str(value), choices, n=1)
        hint = f"did you mean '{close[0]}'?" if close else "choose one of " + ", ".join(choices)
        raise UserError(f"{key} must be one of {', '.join(choices)}, got '{value}'", hint)


def _positive(key: str, value: float | None, allow_zero: bool = False, allow_none: bool = False) -> None:
    if value is None:
        if allow_none:
            return
        raise UserError(f"{key} must be set", f"give {key} a value")
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise UserError(f"{key} must be {bound}, got {value}", f"set {key} to a value {bound}")


def validate(cfg: Config) -> None:
    """Values the types alone cannot check; raises UserError naming the key."""
    _choice("data.dataset", cfg.data.dataset, DATASETS)
    _choice("train.amp", cfg.train.amp, AMP_MODES)
    _choice("optim.name", cfg.optim.name, OPTIMIZERS)
    _choice("optim.schedule", cfg.optim.schedule, SCHEDULES)
    _choice("dist.backend", cfg.dist.backend, BACKENDS)
    _choice("dist.device", cfg.dist.device, DEVICES)
    _choice("dist.strategy", cfg.dist.strategy, STRATEGIES)
    _choice("train.nonfinite", cfg.train.nonfinite, ("stop", "skip"))
    if not cfg.out_dir.strip():
        raise UserError("out_dir must not be empty", "set out_dir=runs/NAME")
    _positive("data.num_workers", cfg.data.num_workers, allow_zero=True)
    _positive("data.synthetic_size", cfg.data.synthetic_size)
    _positive("data.synthetic_val_size", cfg.data.synthetic_val_size)
    _positive("data.image_size", cfg.data.image_size, allow_none=True)
    _positive("model.num_classes", cfg.model.num_classes, allow_none=True)
    _positive("train.epochs", cfg.train.epochs)
    _positive("train.max_steps", cfg.train.max_steps, allow_none=True)
    _positive("train.batch_size", cfg.train.batch_size)
    _positive("train.grad_accum_steps", cfg.train.grad_accum_steps)
    _positive("train.log_every", cfg.train.log_every)
    _positive("train.clip_grad_norm", cfg.train.clip_grad_norm, allow_none=True)
    if not 0.0 <= cfg.train.label_smoothing < 1.0:
        raise UserError(
            f"train.label_smoothing must be in [0, 1), got {cfg.train.label_smoothing}", "use e.g. 0.1"
        )
    _positive("optim.lr", cfg.optim.lr)
    _positive("optim.ref_batch_size", cfg.optim.ref_batch_size, allow_none=True)
    _positive("optim.warmup_epochs", cfg.optim.warmup_epochs, allow_zero=True)
    _positive("optim.momentum", cfg.optim.momentum, allow_zero=True)
    _positive("optim.weight_decay", cfg.optim.weight_decay, allow_zero=True)
    _positive("optim.step_size", cfg.optim.step_size)
    _positive("optim.step_gamma", cfg.optim.step_gamma)
    _positive("dist.timeout_s", cfg.dist.timeout_s)
    _positive("checkpoint.keep", cfg.checkpoint.keep)
    _positive("checkpoint.every_steps", cfg.checkpoint.every_steps, allow_zero=True)
    _positive("checkpoint.every_minutes", cfg.checkpoint.every_minutes, allow_zero=True)
    _positive("eval.every", cfg.eval.every)
    _positive("eval.batch_size", cfg.eval.batch_size, allow_none=True)
    if cfg.dist.backend == "nccl" and cfg.dist.device == "cpu":
        raise UserError(
            "dist.backend=nccl needs CUDA devices but dist.device=cpu", "use dist.backend=gloo on CPU"
        )


def to_dict(cfg: Config) -> dict[str, Any]:
    """Plain nested dict (for checkpoints and config.yaml)."""
    return dataclasses.asdict(cfg)


def to_yaml(cfg: Config) -> str:
    import yaml

    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def describe_keys() -> str:
    """Every key with its default, for --help-config."""
    defaults = _flatten(to_dict(Config()))
    return "\n".join(f"{k} = {defaults[k]!r}" for k in valid_keys())
