"""Pickled data files without code: an unpickler that rebuilds only what a real data file holds.

CIFAR's python batches are pickles; a plain pickle.load of a file someone else wrote runs whatever its
`__reduce__` says. This unpickler accepts numbers, strings, bytes, lists, tuples, dicts and numpy arrays (the
numpy reconstruction functions a real file needs) and refuses every other global, naming the file.
`guard(module)` replaces a module's `pickle` with this one, so every call site in torchvision's CIFAR code —
today's and any added later that calls `pickle.load` — goes through it.
"""

from __future__ import annotations

import io
import pickle
from typing import Any, BinaryIO

# (module, name) of every global a real data set pickle may name (numpy 1 and 2 spellings, protocols 2-5).
ALLOWED = frozenset(
    {
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy.core.multiarray", "scalar"),
        ("numpy._core.multiarray", "scalar"),
        ("numpy.core.numeric", "_frombuffer"),
        ("numpy._core.numeric", "_frombuffer"),
        ("_codecs", "encode"),  # protocol-2 pickles of bytes written by Python 3
    }
)
UnpicklingError = pickle.UnpicklingError


class CodeRefused(pickle.UnpicklingError):
    """A data file asked to run code: its message names the file and the callable."""


class RestrictedUnpickler(pickle.Unpickler):
    """pickle.Unpickler that refuses every global outside `allowed` (ALLOWED unless told), so a file cannot run
    code."""

    allowed: frozenset[tuple[str, str]] = ALLOWED

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self.allowed:
            return super().find_class(module, name)
        where = getattr(getattr(self, "_source", None), "name", "a data file")
        raise CodeRefused(
            f"{where} asks to run {module}.{name} (a data file may hold only arrays and plain values)"
        )


def load(file: BinaryIO, allowed: frozenset[tuple[str, str]] = ALLOWED, **kwargs: Any) -> Any:
    """pickle.load without code: see RestrictedUnpickler; `allowed`: the globals it may name (frozenset():
    none, plain values only)."""
    unpickler = RestrictedUnpickler(file, **kwargs)
    unpickler.allowed = allowed
    unpickler._source = file  # type: ignore[attr-defined]
    return unpickler.load()


def loads(data: bytes, allowed: frozenset[tuple[str, str]] = ALLOWED, **kwargs: Any) -> Any:
    """pickle.loads without code."""
    return load(io.BytesIO(data), allowed, **kwargs)


class _SafePickleModule:
    """What a guarded module sees as `pickle`: the restricted loaders, the rest of pickle unchanged."""

    load = staticmethod(load)
    loads = staticmethod(loads)
    Unpickler = RestrictedUnpickler
    UnpicklingError = pickle.UnpicklingError

    def __getattr__(self, name: str) -> Any:
        return getattr(pickle, name)


SAFE_PICKLE = _SafePickleModule()


def guard(module: Any) -> None:
    """Make `module`'s own `pickle` the restricted one (its every pickle.load call site, present and future)."""
    module.pickle = SAFE_PICKLE
