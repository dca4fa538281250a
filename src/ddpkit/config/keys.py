"""The keys a config file or the command line gives: flattened to dotted keys, values read as YAML, and every
unknown key reported at once with the closest valid one."""

from __future__ import annotations

import difflib
from typing import Any

from ddpkit.config.schema import MAX_TEXT, Spec, shown
from ddpkit.config.sections import key_specs, section_fields
from ddpkit.errors import UserError


def parse_overrides(items: list[str]) -> dict[str, str]:
    """`a.b=c` strings -> {dotted key: raw value string}; later ones win."""
    out: dict[str, str] = {}
    for item in items:
        if "=" not in item or item.startswith("="):
            raise UserError(
                f"expected KEY=VALUE, got {shown(item)}", "write overrides as e.g. train.epochs=5"
            )
        key, value = item.split("=", 1)
        out[key.strip()] = value
    return out


def flatten(tree: dict, name: str, known: bool = False, prefix: str = "") -> dict[str, Any]:
    """Nested mappings -> {dotted key: value}; `known`: descend into the schema's sections only."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        key = prefix + str(k)
        section = key in section_fields()
        # descend into sections, and into unknown non-empty mappings (TRAIN: {BATCH_SIZE: ..} -> TRAIN.BATCH_SIZE)
        descend = isinstance(v, dict) and (section or (not known and v and key not in key_specs()))
        for dotted, value in flatten(v, name, known, key + ".").items() if descend else [(key, v)]:
            if dotted in out:
                raise UserError(f"{name} sets {shown(dotted)} twice", "keep one of them")
            out[dotted] = value
    return out


def override_value(spec: Spec, raw: str) -> Any:
    """A KEY=VALUE value read as YAML (so null, true, 1e-3 mean what they say); string keys keep the text as typed."""
    if len(raw) > MAX_TEXT:
        raise UserError(f"the value of {spec.key} is {len(raw)} characters long", f"give at most {MAX_TEXT}")
    if "\n" in raw or "\r" in raw:  # YAML would fold it into a space: out_dir would name another folder
        raise UserError(f"the value of {spec.key} holds a line break: {raw!r}", "give the value on one line")
    if raw.strip() == "":
        return ""
    from ddpkit.config.safe_yaml import NotYAML, parse_yaml

    try:
        value = parse_yaml(raw, f"the value of {spec.key}")
    except NotYAML:
        return raw
    keep_text = spec.base is str and value is not None and not isinstance(value, (str, list, dict))
    return raw.strip() if keep_text else value


def check_keys(found: list[tuple[str, str]]) -> None:
    """One UserError naming every key that is not in the schema (found: (key, where)), each with the closest one."""
    bad = [(k, where) for k, where in found if k not in key_specs()]
    if not bad:
        return
    see = "`ddpkit train --help-config` lists every key"
    if len(bad) == 1:
        key, where = bad[0]
        if key in section_fields():
            first = next(k for k in key_specs() if k.startswith(key + "."))
            raise UserError(
                f"config key '{key}' is a section, not a value", f"set one of its keys, e.g. {first}=..."
            )
        close = _closest(key)
        raise UserError(
            f"unknown config key {shown(key)} {where}", f"did you mean '{close}'?" if close else see
        )
    groups: dict[str, list[str]] = {}
    for key, where in bad[:20]:
        close = _closest(key)
        hint = (
            "a section, not a value"
            if key in section_fields()
            else f"did you mean '{close}'?"
            if close
            else "?"
        )
        groups.setdefault(where, []).append(f"{shown(key)} ({hint})")
    listed = "; ".join(f"{where}: " + ", ".join(items) for where, items in groups.items())
    more = f"; and {len(bad) - 20} more" if len(bad) > 20 else ""
    raise UserError(f"{len(bad)} unknown config keys {listed}{more}", see)


def _closest(key: str) -> str | None:
    """The valid key the user most likely meant: case-insensitive, then other frameworks' names, then spelling."""
    specs = key_specs()
    if len(key) > 200:  # no valid key is that long; difflib's time grows with the length
        return None
    low = key.lower().replace("-", "_")
    if low in specs:
        return low
    parts = low.rsplit(".", 1)
    sec_aka = {a: n for n, f in section_fields().items() for a in (n, *f.metadata["aka"])}
    sec = sec_aka.get(parts[0]) if len(parts) == 2 else None
    tail = parts[-1]
    pool = [s for s in specs.values() if sec is None or s.key.startswith(sec + ".")]
    for s in pool + list(specs.values()):
        if tail == s.key.rsplit(".", 1)[-1] or tail in s.meta.aka:
            return s.key
    close = difflib.get_close_matches(low if sec is None else f"{sec}.{tail}", list(specs), n=1, cutoff=0.5)
    if close:
        return close[0]
    by_tail = {s.key.rsplit(".", 1)[-1]: s.key for s in reversed(pool)}
    hit = difflib.get_close_matches(tail, list(by_tail), n=1, cutoff=0.6)
    return by_tail[hit[0]] if hit else None
