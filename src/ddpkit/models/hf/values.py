"""A Hugging Face config.json's values checked by the rules of the config keys they are (ModelFamily.hf's `keys`):
each value's JSON type and the key's bounds, the values the family holds one way only (`fixed`), how the values
fit together (the family's `check_keys`, then the converter's own `check`), and the size of the model they
describe against this machine's memory (the family's `estimate`), all before anything is allocated. Each refusal
is one line naming the file, config.json's key and the rule. Torch-free."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ddpkit.cluster.machine import machine_memory
from ddpkit.config import key_specs, load_config
from ddpkit.config.schema import check_value, shown
from ddpkit.errors import UserError
from ddpkit.models.family import REQUIRED, HFConverter, ModelFamily
from ddpkit.models.hf.files import CONFIG, HINT, read_config

MISSING = object()
_JSON_TYPES = {int: (int,), float: (int, float), bool: (bool,), str: (str,)}


def lookup(raw: dict[str, Any], name: str, path: Path) -> Any:
    """config.json's value at `name` ("a.b": b inside object a); MISSING when absent (or its object is)."""
    value: Any = raw
    parts = name.split(".")
    for i, part in enumerate(parts):
        if value is None:
            return MISSING
        if not isinstance(value, dict):
            parent = ".".join(parts[:i])
            raise UserError(f"'{path}': {parent} is not a JSON object, where {name} belongs", HINT)
        value = value.get(part, MISSING)
        if value is MISSING:
            return MISSING
    return value


def family_for(raw: dict[str, Any], folder: Path, families: Iterable[ModelFamily]) -> ModelFamily:
    """The family whose converter reads config.json's model_type; a UserError listing the ones there are."""
    kind = raw.get("model_type")
    readers = [f for f in families if f.hf is not None]
    family = next((f for f in readers if f.hf.model_type == kind), None)
    if family is None:
        known = " and ".join(f"{f.hf.label} ({f.hf.model_type})" for f in readers)
        raise UserError(
            f"'{folder}' holds a model of type {shown(kind)}; ddpkit reads the {known} architectures", HINT
        )
    return family


def _same(a: Any, b: Any) -> bool:
    return a == b and isinstance(a, bool) == isinstance(b, bool)


def _value(h: Any, raw: dict[str, Any], path: Path) -> tuple[str, Any, Any]:
    """(the name read, config.json's value, the value in the key's terms) of HFKey `h`; a UserError when it is
    required and absent, or not one of its `values`."""
    found = [(n, v) for n in h.names if (v := lookup(raw, n, path)) is not MISSING and v is not None]
    name, theirs = found[0] if found else (h.names[0], h.default)
    if theirs is REQUIRED:
        raise UserError(f"'{path}' has no {name} (the model's {h.key})", HINT)
    if not h.values:
        return name, theirs, theirs
    mapped = [ours for a, ours in h.values if _same(theirs, a)]
    if not mapped:
        holds = ", ".join(shown(a) for a, _ in h.values)
        raise UserError(f"'{path}': {name}={shown(theirs)} is not one the model holds ({holds})", HINT)
    return name, theirs, mapped[0]


def key_values(conv: HFConverter, raw: dict[str, Any], path: Path) -> dict[str, Any]:
    """{config key: its value} of every HFKey, each checked by its key's type and bounds."""
    specs, out = key_specs(), {}
    for h in conv.keys:
        name, _, value = _value(h, raw, path)
        spec = specs[h.key]
        if value is not None and not spec.choices:
            if isinstance(value, bool) != (spec.base is bool) or not isinstance(
                value, _JSON_TYPES[spec.base]
            ):
                raise UserError(
                    f"'{path}': {name}={shown(value)} is not {spec.type_text(True)} ({h.key})", HINT
                )
        try:
            out[h.key] = check_value(spec, value)
        except UserError as e:
            raise UserError(f"'{path}': {name}={shown(value)}: {e.what}", HINT) from None
    return out


def check_fixed(conv: HFConverter, raw: dict[str, Any], path: Path) -> None:
    """Every `fixed` value is absent, null or one the model holds."""
    for f in conv.fixed:
        value = lookup(raw, f.name, path)
        if value is not MISSING and value is not None and not any(_same(value, a) for a in f.allowed):
            raise UserError(
                f"'{path}' asks for {f.what} ({f.name}={shown(value)}), which the built-in {conv.label} does not hold",
                HINT,
            )


def their_words(text: str, conv: HFConverter) -> str:
    """A line about config keys ("model.n_embd=30 ...") in config.json's names ("hidden_size=30 ...")."""
    for h in conv.keys:
        text = text.replace(f"{h.key}=", f"{h.names[0]}=")
    return text


def folder_config(family: ModelFamily, raw: dict[str, Any], path: Path) -> Any:
    """The Config whose model (model.arch = the family) and data keys are config.json's values, every rule of
    those keys checked; a one-line UserError naming `path` otherwise."""
    conv = family.hf
    values = key_values(conv, raw, path)
    check_fixed(conv, raw, path)
    nested: dict[str, dict[str, Any]] = {"model": {"arch": family.name}}
    for key, value in values.items():
        section, _, name = key.rpartition(".")
        nested.setdefault(section, {})[name] = value
    cfg = load_config(None, [], base=nested)
    try:
        family.check_keys(cfg.model)
    except UserError as e:
        raise UserError(f"'{path}': {their_words(e.what, conv)}", HINT) from None
    problem = conv.check(raw, cfg)
    if problem:
        raise UserError(f"'{path}': {problem}", HINT)
    check_size(family, cfg, path)
    return cfg


def check_size(family: ModelFamily, cfg: Any, path: Path) -> None:
    """The model config.json describes fits this machine's memory once, in float32 (the family's estimate)."""
    if family.estimate is None:
        return
    params, _ = family.estimate(cfg.model, cfg.data.block_size, 1)
    refuse_size(params, path)


def refuse_size(params: int, path: Path) -> None:
    need, have = 4 * params, machine_memory()
    if need > have:
        raise UserError(
            f"'{path}' describes a model of about {params:,} parameters ({need / 2**30:.0f} GiB in float32), "
            f"over this machine's {have / 2**30:.0f} GiB",
            "give a smaller model's folder, or read it on a machine with more memory",
        )


def folder_defaults(path: str, families: Iterable[ModelFamily]) -> dict[str, tuple[Any, str]]:
    """model.init_from's defaults: {config key: (the folder's value, where it says so)} for model.arch and every
    key its family's converter reads with `init`; the folder's config.json checked first."""
    folder = Path(path)
    raw = read_config(folder)
    family = family_for(raw, folder, families)
    out = {"model.arch": (family.name, f"model_type={shown(raw.get('model_type'))}")}
    if not family.hf.declared:
        return out
    cfg = folder_config(family, raw, folder / CONFIG)
    for h in family.hf.keys:
        if h.init:
            section, _, key = h.key.rpartition(".")
            name, theirs, _ = _value(h, raw, folder)
            out[h.key] = (getattr(getattr(cfg, section), key), f"{name}={shown(theirs)}")
    return out
