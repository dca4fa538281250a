"""One extension point: named entries asked in an explicit order, added by `register` or by an installed package's
entry point. An entry's `order` (lower first; equal orders in the order they were registered) lets an entry from
outside come before a built-in one: the built-ins leave gaps (100, 200, ...) between them.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TypeVar

from ddpkit.entrypoints import entry_object, named_entry
from ddpkit.errors import UserError

T = TypeVar("T")

LAST = 1000  # the order of an entry that does not say: after every built-in one


class Registry(Mapping[str, T]):
    """Entries of class `cls` by name (entry.name), asked in `order` (entry.order, LAST when it has none). As a
    mapping it holds the entries registered so far, in order; `find(name)` also asks the installed packages for
    that name, and `entries()` for all of theirs (entry point group `group`, loaded once)."""

    def __init__(
        self,
        what: str,
        group: str,
        cls: type,
        spelled: str,
        *,
        unordered: int = LAST,
        newest_first: bool = False,
        builtins: Callable[[], Iterable[T]] | None = None,
        added: Callable[[T], object] = lambda entry: None,
    ):
        """`unordered`: the order of an entry that gives none (LAST: after the built-ins; 0: before them);
        `newest_first`: entries of equal order are asked newest first (else in the order they came);
        `builtins`: the built-in entries, made when the registry is first used (their modules may be heavy);
        `added(entry)`: called with each entry registered, however it came (e.g. to declare its config keys)."""
        self.what, self.group, self.cls, self.spelled = what, group, cls, spelled
        self.unordered, self.newest_first = unordered, newest_first
        self._entries: dict[str, T] = {}
        self._seq: dict[str, int] = {}
        self._counter = 0
        self._loaded = False
        self._builtins = builtins
        self._added = added

    def _ready(self) -> None:
        if self._builtins is not None:
            builtins, self._builtins = self._builtins, None
            for entry in builtins():
                self.register(entry)

    def _key(self, name: str) -> tuple[int, int]:
        order = getattr(self._entries[name], "order", None)
        seq = self._seq[name]
        return (self.unordered if order is None else order, -seq if self.newest_first else seq)

    def register(self, entry: T, *, replace: bool = False) -> T:
        """Add `entry`; refuses a second entry of the same name unless replace=True."""
        self._ready()
        name = entry.name
        if name in self._entries and not replace and self._entries[name] is not entry:
            raise ValueError(f"{self.what} '{name}' is already registered")
        self._added(entry)
        self._entries[name] = entry
        if (
            name not in self._seq or self.newest_first
        ):  # a replaced entry keeps its place, unless newest first
            self._counter += 1
            self._seq[name] = self._counter
        return entry

    def unregister(self, name: str) -> None:
        """Take `name` off the table (a test's or a session's own entry)."""
        self._ready()
        self._entries.pop(name, None)
        self._seq.pop(name, None)

    def __getitem__(self, name: str) -> T:
        self._ready()
        return self._entries[name]

    def __iter__(self) -> Iterator[str]:
        self._ready()
        return iter(sorted(self._entries, key=self._key))

    def __len__(self) -> int:
        self._ready()
        return len(self._entries)

    def find(self, name: str) -> T | None:
        """The entry `name`: registered, or declared under that name by an installed package (registered then)."""
        self._ready()
        if name in self._entries:
            return self._entries[name]
        entry = named_entry(self.group, name, self.cls, f"{self.what} '{name}'", self.spelled)
        return None if entry is None else self.register(entry, replace=True)

    def get(self, name: str, key: str, also: Iterable[str] = ()) -> T:
        """The entry `name` (as `find`); a UserError `unknown KEY 'NAME'` with the closest name when there is none
        (`also`: names that are valid though not entries, e.g. `auto`)."""
        entry = self.find(name)
        if entry is None:
            raise UserError(f"unknown {key} '{name}'", self.hint(name, [*also, *self]))
        return entry

    def hint(
        self,
        name: str,
        names: Iterable[str] | None = None,
        *,
        cutoff: float = 0.6,
        otherwise: str | None = None,
    ) -> str:
        """`did you mean 'X'?` for the closest of `names` (default: the entries' names) to a mistyped `name`;
        `otherwise` (default: `choose one of ...`) when none is close."""
        names = list(self if names is None else names)
        close = difflib.get_close_matches(name, names, n=1, cutoff=cutoff)
        if close:
            return f"did you mean '{close[0]}'?"
        return otherwise if otherwise is not None else "choose one of " + ", ".join(names)

    def _load_entry_points(self, keep: Callable[[str], bool] = lambda name: True) -> None:
        from importlib.metadata import entry_points  # 10 ms: only when a name is not registered

        for ep in entry_points(group=self.group):
            if ep.name not in self._entries and keep(ep.name):
                self.register(entry_object(ep, self.cls, f"{self.what} '{ep.name}'", self.spelled))

    def entries(self) -> list[T]:
        """Every entry, built-in, registered and installed, in order."""
        if not self._loaded:
            self._load_entry_points()
            self._loaded = True
        return [self._entries[name] for name in self]
