"""One way to read an extension from an installed package: every registry (data sets, models, strategies,
compression methods, launcher detectors, commands) loads its entry points through `entry_object`
(`named_entry`: the one declared under a given name)."""

from __future__ import annotations

from typing import Any

from ddpkit.errors import UserError


def entry_object(ep: Any, cls: type, what: str, spelled: str) -> Any:
    """The `cls` instance an entry point names, or that the function it names returns; a UserError otherwise.
    `what`: e.g. "data set 'signs'"; `spelled`: the class as users import it (e.g. ddpkit.data.DatasetEntry)."""
    obj = ep.load()
    entry = obj() if callable(obj) and not isinstance(obj, cls) else obj
    if not isinstance(entry, cls):
        raise UserError(
            f"entry point '{ep.value}' for {what} gave {type(entry).__name__}",
            f"it must name a {spelled} (or a function returning one)",
        )
    return entry


def named_entry(group: str, name: str, cls: type, what: str, spelled: str) -> Any:
    """The `cls` instance that an installed package declares under `name` in entry point group `group`, or None
    when no package does (see entry_object for `what` and `spelled`)."""
    from importlib.metadata import entry_points

    for ep in entry_points(group=group, name=name):
        return entry_object(ep, cls, what, spelled)
    return None
