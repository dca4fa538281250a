"""The one config schema (typed dataclasses) and load_config: defaults <- YAML <- dotted KEY=VALUE, validated.

Each key's type (`Literal[...]` for choices), bounds and one-line meaning sit beside it (`opt()`); the checks,
their error lines, `ddpkit train --help-config` and docs/config.md are all derived from these dataclasses: the
sections' own keys (sections.py) and those a model family or a compression method declares into them
(declared.py), with the checks the registries ask for (a strategy, compression or data-set name they know).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ddpkit.config.declared import run_before_keys, run_checks, run_defaults, section_class
from ddpkit.config.keys import check_keys, flatten, override_value, parse_overrides
from ddpkit.config.reference import describe_keys
from ddpkit.config.schema import check_value, shown, yaml_text
from ddpkit.config.sections import (
    MAX_TIMEOUT_S,
    CheckpointConfig,
    Config,
    DataConfig,
    DistConfig,
    EvalConfig,
    ModelConfig,
    OptimConfig,
    ReportConfig,
    TrainConfig,
    key_specs,
    section_fields,
    valid_keys,
)
from ddpkit.errors import UserError

__all__ = [
    "MAX_TIMEOUT_S",
    "CheckpointConfig",
    "Config",
    "DataConfig",
    "DistConfig",
    "EvalConfig",
    "ModelConfig",
    "OptimConfig",
    "ReportConfig",
    "TrainConfig",
    "describe_keys",
    "key_specs",
    "load_config",
    "parse_overrides",
    "section_fields",
    "to_dict",
    "to_yaml",
    "valid_keys",
]


def load_config(
    file: str | None = None, overrides: list[str] | None = None, base: dict | None = None
) -> Config:
    """Schema defaults <- `base` (e.g. a checkpoint's config) <- YAML file <- KEY=VALUE overrides; typed, validated."""
    from_base = flatten(base, "the checkpoint's config", known=True) if isinstance(base, dict) else {}
    from_file: dict[str, Any] = {}
    if file:
        from ddpkit.config.safe_yaml import read_config_file  # yaml is imported when a file is read

        from_file = flatten(read_config_file(file), f"config file {shown(file)}")
    over = parse_overrides(overrides or [])
    run_before_keys({**from_base, **from_file, **over})  # an owner named there declares its keys
    specs = key_specs()
    merged: dict[str, Any] = {k: v for k, v in from_base.items() if k in specs}
    check_keys([(k, f"in {shown(file)}") for k in from_file] + [(k, "on the command line") for k in over])
    given = {**from_file, **{k: override_value(specs[k], v) for k, v in over.items()}}
    merged.update(given)
    found = run_defaults(given)  # the defaults that replace the schema's: model.init_from's folder's shape
    specs = key_specs()
    merged.update({k: v for k, (v, _) in found.items() if k not in merged and k in specs})
    values = {k: check_value(spec, merged.get(k, spec.default)) for k, spec in specs.items()}
    for key, (value, where) in found.items():
        if key in given and key in specs and values[key] != check_value(specs[key], value):
            raise UserError(
                f"{key}={yaml_text(values[key])} but {where}",
                f"leave {key} out to take it from there, or set {key}={yaml_text(value)}",
            )
    nested: dict[str, Any] = {n: {} for n in section_fields()}
    for key, value in values.items():
        sec, _, name = key.rpartition(".")
        (nested[sec] if sec else nested)[name] = value
    cfg = Config(**{k: section_class(k)(**v) if k in section_fields() else v for k, v in nested.items()})
    if cfg.dist.backend == "nccl" and cfg.dist.device == "cpu":
        raise UserError(
            "dist.backend=nccl needs CUDA devices but dist.device=cpu", "use dist.backend=gloo on CPU"
        )
    run_checks(cfg)  # the names the registries know (strategy, compression, data set), ...
    return cfg


def to_dict(cfg: Config) -> dict[str, Any]:
    """Plain nested dict (for checkpoints and config.yaml)."""
    return dataclasses.asdict(cfg)


def to_yaml(cfg: Config) -> str:
    """The config as YAML, in schema order (what out_dir/config.yaml holds)."""
    import yaml

    return yaml.safe_dump(to_dict(cfg), sort_keys=False)
