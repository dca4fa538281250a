"""Keys declared by their owners: a model family's (model.n_layer, ...) or a compression method's
(dist.powersgd_rank, ...) keys, added to a section of the schema, and the checks a registry makes of a loaded
config (a strategy, compression method or data-set name it knows).

config/ sits below the folders that own these keys, so it never imports them: each owner declares here what it
owns, when its module is imported (`declare`, `check_with`, `before_keys`). The modules that do so for ddpkit's
own families, methods and registries are named in `DECLARED_BY` and imported once, before the schema is first
read, the way an installed package's entry point is loaded by name; a family from an installed package declares
its keys when its entry point loads (ddpkit.models).

A key set is a dataclass of `opt()` fields (its docstring: what the keys are for). The schema's section classes
(config/sections.py) are built once and never changed: a loaded config's section is an instance of
`section_class(name)`, a dataclass made (`dataclasses.make_dataclass`) from the section's class and the key sets
declared into it, once per set of declarations, so `cfg.model.n_layer` is a field like any other and defaults,
types, bounds, errors, config.yaml and `--help-config` treat a declared key as any other.
"""

from __future__ import annotations

import dataclasses
import importlib
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ddpkit.config.schema import spec_of

# ddpkit's own modules that declare keys or checks at import, in the order their checks run
DECLARED_BY = (
    "ddpkit.parallel.strategy",
    "ddpkit.parallel.compression",
    "ddpkit.data.registry",
    "ddpkit.models",
)


@dataclass
class KeySet:
    """One declared set of keys: its section, its dataclass, and who owns it (`by`=`owners`, e.g. model.arch=gpt)."""

    section: str
    keys: type
    by: str
    owners: list[str] = field(default_factory=list)

    @property
    def title(self) -> str:
        """What --help-config heads the set with: '`model.arch=gpt, llama`: the decoder's size, ...'."""
        return f"`{self.by}={', '.join(self.owners)}`: {self.keys.__doc__}"


_SECTIONS: dict[str, type] = {}  # section name -> its own dataclass (set by config/sections.py)
_BUILT: dict[tuple[str, int], type] = {}  # (section, generation) -> its class with the keys declared so far
_SETS: dict[type, KeySet] = {}  # key-set dataclass -> where it went, in declaration order
_CHECKS: list[Callable[[Any], None]] = []
_BEFORE: list[Callable[[dict[str, Any]], None]] = []
_DEFAULTS: list[Callable[[dict[str, Any]], dict[str, tuple[Any, str]]]] = []
_VALUES: dict[str, Callable[[], list[str]]] = {}  # dotted key -> what its owners' values mean (the reference)
_state = {"loaded": False, "generation": 0}


def own_sections(sections: dict[str, type]) -> None:
    """The schema's sections by name, to which keys are declared (config/sections.py)."""
    _SECTIONS.update(sections)


def load_declarers() -> None:
    """Import ddpkit's declaring modules once (each declares its keys and checks as it is imported)."""
    if not _state["loaded"]:
        _state["loaded"] = True
        for name in DECLARED_BY:
            importlib.import_module(name)


def generation() -> int:
    """A number that changes whenever a key is declared (what a cache of the schema is valid for)."""
    return _state["generation"]


def declare(section: str, keys: type, by: str, owner: str) -> None:
    """Add the fields of dataclass `keys` (each `opt(default, meaning, bounds...)`) to config section `section`,
    owned by `owner` (a value of config key `by`: a family's model.arch, a method's dist.grad_compression). The
    same `keys` declared again by another owner adds the owner; a key that the section has already is refused."""
    if keys in _SETS:
        if owner not in _SETS[keys].owners:
            _SETS[keys].owners.append(owner)
        return
    hints = typing.get_type_hints(keys)
    new = dataclasses.fields(keys)
    have = {f.name for f in dataclasses.fields(_SECTIONS[section])}
    have |= {f.name for s in key_sets(section) for f in dataclasses.fields(s.keys)}
    taken = [f.name for f in new if f.name in have]
    if taken:
        raise ValueError(
            f"config key {section}.{taken[0]} is already declared: give {owner}'s key another name"
        )
    for f in new:
        spec_of(f"{section}.{f.name}", f, hints[f.name])  # a scalar type and opt(), or a TypeError now
    _SETS[keys] = KeySet(section, keys, by, [owner])
    _state["generation"] += 1


def forget(keys: type) -> None:
    """Take a declared key set off its section again (a test's or a session's own family)."""
    if _SETS.pop(keys, None) is not None:
        _state["generation"] += 1


def section_class(section: str) -> type:
    """The class of config section `section`: a subclass of its own dataclass with the keys declared into it so
    far, made once per set of declarations (an instance of an earlier one reads a key declared since as its
    default: sections.Section)."""
    load_declarers()
    built = _BUILT.get((section, generation()))
    if built is None:
        base = _SECTIONS[section]
        fields = []
        for key_set in key_sets(section):
            hints = typing.get_type_hints(key_set.keys)
            fields += [
                (f.name, hints[f.name], dataclasses.field(default=f.default, metadata=f.metadata))
                for f in dataclasses.fields(key_set.keys)
            ]
        built = dataclasses.make_dataclass(base.__name__, fields, bases=(base,))
        built.__module__, built.__doc__ = base.__module__, base.__doc__
        for old in [k for k in _BUILT if k[1] != generation()]:  # an earlier set of declarations'
            del _BUILT[old]
        _BUILT[(section, generation())] = built
    return built


def section_of(instance: Any) -> str:
    """The name of the section whose class `instance` is (or a subclass of)."""
    return next(name for name, base in _SECTIONS.items() if isinstance(instance, base))


def declared_default(section: str, name: str) -> Any:
    """The default of key `name` declared into `section`; AttributeError when no key set declares it."""
    for key_set in key_sets(section):
        found = {f.name: f for f in dataclasses.fields(key_set.keys)}.get(name)
        if found is not None:
            return found.default
    raise AttributeError(name)


def remade(section: str, values: dict[str, Any]) -> Any:
    """An instance of section_class(section) holding `values` (how a pickled section is read back)."""
    cls = section_class(section)
    known = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in values.items() if k in known})


def key_sets(section: str | None = None) -> list[KeySet]:
    """The declared key sets (of `section`), in the order they were declared."""
    return [s for s in _SETS.values() if section is None or s.section == section]


def declare_values(key: str, meanings: Callable[[], list[str]]) -> None:
    """What the values of `key` mean, said by the registry that owns them (the model families' model.arch names,
    the strategies' dist.strategy): `meanings()` gives one phrase per value, e.g. "gpt (the built-in ...)", and the
    reference puts them where the key's meaning says `{values}`."""
    _VALUES[key] = meanings


def meaning(key: str, text: str) -> str:
    """`text` (a key's meaning) with `{values}` replaced by what its owner says its values mean."""
    if "{values}" not in text:
        return text
    load_declarers()
    return text.replace("{values}", ", ".join(_VALUES[key]()))


def check_with(check: Callable[[Any], None]) -> Callable[[Any], None]:
    """Run `check(cfg)` on every loaded config (after its values are typed; raise a UserError to refuse it)."""
    if check not in _CHECKS:
        _CHECKS.append(check)
    return check


def before_keys(hook: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
    """Call `hook(given)` with the dotted keys a config gives, before they are checked against the schema: a
    registry may load the owner of a value there (a family named by model.arch), which declares its keys."""
    if hook not in _BEFORE:
        _BEFORE.append(hook)
    return hook


def run_before_keys(given: dict[str, Any]) -> None:
    load_declarers()
    for hook in list(_BEFORE):
        hook(given)


def defaults_from(
    hook: Callable[[dict[str, Any]], dict[str, tuple[Any, str]]],
) -> Callable[[dict[str, Any]], dict[str, tuple[Any, str]]]:
    """Call `hook(given)` with the dotted keys a config file and the command line give (typed as the schema
    types them): it returns {dotted key: (value, where it comes from)}, the values those keys take when the
    config does not set them, in place of the schema's defaults (model.init_from's folder gives the model's
    shape). A key the config sets to another value is refused, naming both (load_config)."""
    if hook not in _DEFAULTS:
        _DEFAULTS.append(hook)
    return hook


def run_defaults(given: dict[str, Any]) -> dict[str, tuple[Any, str]]:
    out: dict[str, tuple[Any, str]] = {}
    for hook in list(_DEFAULTS):
        out.update(hook(given))
    return out


def run_checks(cfg: Any) -> None:
    for check in list(_CHECKS):
        check(cfg)
