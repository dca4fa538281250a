"""Config field metadata: `opt()` puts a key's meaning and bounds beside its type; checking one value against them.

A key's type comes from its annotation (int, float, bool, str, `Literal[...]` for choices, `X | None` when null
is allowed); `opt()` adds a one-line meaning and bounds. `spec_of` reads both back; `check_value` turns a raw
value (from YAML, the command line or a checkpoint) into the typed value or raises a one-line UserError.
"""

from __future__ import annotations

import dataclasses
import datetime
import difflib
import math
import reprlib
import types
from dataclasses import dataclass, field
from typing import Any, Literal, NoReturn, Union, get_args, get_origin

from ddpkit.errors import UserError

MAX_SHOWN = 200  # characters of any user value that an error line shows
MAX_TEXT = 4096  # characters in a string value (the longest path Linux accepts)
_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = MAX_SHOWN
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 6
_REPR.maxlevel = 3
_NOUNS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}

FLOAT32_MAX = 3.4028234663852886e38  # the largest float32: a larger lr or decay overflows in the optimizer


@dataclass(frozen=True)
class Meta:
    """What `opt()` stores beside a field: its meaning, bounds, and names other frameworks give it."""

    meaning: str
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    nonblank: bool = False
    aka: tuple[str, ...] = ()


def opt(default: Any, meaning: str, **limits: Any) -> Any:
    """A config key: its default, one-line meaning and bounds (ge/gt/le/lt, nonblank, aka) in the field metadata."""
    return field(default=default, metadata={"meta": Meta(meaning, **limits)})


@dataclass(frozen=True)
class Spec:
    """One dotted key of the schema, everything about it read from its dataclass field."""

    key: str
    default: Any
    base: type  # int, float, bool or str
    choices: tuple[str, ...] | None
    nullable: bool
    meta: Meta

    def type_text(self, article: bool = False) -> str:
        """'integer > 0 or null', 'one of sgd, adamw', ...; with `article`: 'an integer > 0 or null'."""
        if self.choices:
            text = "one of " + ", ".join(self.choices)
        else:
            noun = _NOUNS[self.base]
            text = (noun if article or self.base is bool else noun.split(" ", 1)[1]) + self.bounds_text(" ")
            text += ", not empty" if self.meta.nonblank else ""
        return text + (" or null" if self.nullable else "")

    def bounds_text(self, lead: str = "") -> str:
        """'> 0', '>= 0', 'in [0, 1)', '' when unbounded."""
        m = self.meta
        low = ("[", m.ge) if m.ge is not None else ("(", m.gt) if m.gt is not None else None
        high = (m.le, "]") if m.le is not None else (m.lt, ")") if m.lt is not None else None
        if low and high:
            return f"{lead}in {low[0]}{_num(low[1])}, {_num(high[0])}{high[1]}"
        if low:
            return f"{lead}{'>=' if low[0] == '[' else '>'} {_num(low[1])}"
        if high:
            return f"{lead}{'<=' if high[1] == ']' else '<'} {_num(high[0])}"
        return ""


def spec_of(key: str, f: dataclasses.Field, hint: Any) -> Spec:
    """The Spec of dataclass field `f` (its resolved annotation `hint`) at dotted `key`."""
    nullable = get_origin(hint) in (Union, types.UnionType) and type(None) in get_args(hint)
    if nullable:
        (hint,) = [a for a in get_args(hint) if a is not type(None)]
    choices = get_args(hint) if get_origin(hint) is Literal else None
    base = str if choices else hint
    if base not in _NOUNS or "meta" not in f.metadata:
        raise TypeError(f"config key {key}: give it a scalar type and opt(default, meaning), not {hint!r}")
    return Spec(key, f.default, base, choices, nullable, f.metadata["meta"])


def shown(value: Any) -> str:
    """A value as an error line shows it: YAML spellings for null/true/false, at most ~200 characters, one line."""
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    text = _REPR.repr(value)
    if isinstance(value, str) and len(value) > MAX_SHOWN:
        text += f" ({len(value)} characters)"
    return text if len(text) <= MAX_SHOWN + 40 else text[:MAX_SHOWN] + "..."


def yaml_text(value: Any) -> str:
    """A default as the user writes it: null, true, 0.1, runs/default."""
    return shown(value) if value is None or isinstance(value, bool) else str(value)


def check_value(spec: Spec, value: Any) -> Any:
    """`value` as spec's type, or a one-line UserError naming the key, the value and the fix."""
    if value is None:
        if spec.nullable:
            return None
        _wrong(spec, value)
    if not isinstance(value, (str, int, float, datetime.date)):
        kind = "a mapping" if isinstance(value, dict) else f"a {type(value).__name__}"
        raise UserError(
            f"config key '{spec.key}' expects {spec.type_text(True)}, got {kind}: {shown(value)}",
            "give one value, not a list or a mapping",
        )
    value = _as_base(spec, value)
    if spec.base is float and not (math.isfinite(value) and abs(value) <= FLOAT32_MAX):
        raise UserError(
            f"{spec.key} must be a finite number, got {shown(value)}"
            + ("" if not math.isfinite(value) else " (beyond a float32: torch computes in float32)"),
            f"set {spec.key} to a finite number{spec.bounds_text(' ')}",
        )
    if spec.choices and value not in spec.choices:
        low = {c.lower(): c for c in spec.choices}
        close = (
            [low[value.lower()]]
            if value.lower() in low
            else difflib.get_close_matches(value, spec.choices, 1)
        )
        hint = f"did you mean '{close[0]}'?" if close else f"choose one of {', '.join(spec.choices)}"
        raise UserError(f"{spec.key} must be one of {', '.join(spec.choices)}, got {shown(value)}", hint)
    _check_bounds(spec, value)
    return value


def _as_base(spec: Spec, value: Any) -> Any:
    """`value` converted to int/float/bool/str the way a user means it, or a UserError."""
    base = spec.base
    try:
        if base is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.strip().lower() in ("true", "false"):
                return value.strip().lower() == "true"
        elif base is int and not isinstance(value, (bool, float, datetime.date)):
            return int(value.strip() if isinstance(value, str) else value)
        elif base is float and not isinstance(value, (bool, datetime.date)):
            return float(value.strip() if isinstance(value, str) else value)
        elif base is str and not isinstance(value, bool):
            return _checked_text(spec, str(value))
    except (ValueError, OverflowError):
        pass
    _wrong(spec, value)


def _checked_text(spec: Spec, text: str) -> str:
    if len(text) > MAX_TEXT:
        raise UserError(
            f"{spec.key} is {len(text)} characters long: {shown(text)}", f"give at most {MAX_TEXT} characters"
        )
    if any(ord(c) < 32 or ord(c) == 127 for c in text):
        raise UserError(f"{spec.key} contains a control character: {shown(text)}", "remove it")
    if "${" in text:
        raise UserError(
            f"{spec.key} holds '${{' in {shown(text)}", "ddpkit does not interpolate: write the value out"
        )
    return text


def _wrong(spec: Spec, value: Any) -> NoReturn:
    example = "" if spec.default is None else f", e.g. {spec.key}={yaml_text(spec.default)}"
    quote = " (quote it in YAML)" if spec.base is str and isinstance(value, bool) else ""
    raise UserError(
        f"config key '{spec.key}' expects {spec.type_text(True)}, got {shown(value)}{quote}",
        f"give {spec.key} {spec.type_text(True)}{example}",
    )


def _check_bounds(spec: Spec, value: Any) -> None:
    m = spec.meta
    if spec.base is str:
        if m.nonblank and not value.strip():
            raise UserError(
                f"{spec.key} must not be empty", f"set {spec.key}, e.g. {spec.key}={spec.default}"
            )
        return
    if spec.base is bool:
        return
    ok = (
        (m.ge is None or value >= m.ge)
        and (m.gt is None or value > m.gt)
        and (m.le is None or value <= m.le)
        and (m.lt is None or value < m.lt)
    )
    if not ok:
        bounds = spec.bounds_text()
        raise UserError(
            f"{spec.key} must be {bounds}, got {shown(value)}", f"set {spec.key} to a value {bounds}"
        )


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)
