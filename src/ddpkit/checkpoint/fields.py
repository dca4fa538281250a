"""What a checkpoint's training entries must be, checked right after a safe load: a file whose `epoch` is a
string or whose RNG state is garbage is as unreadable as a truncated one, so a resume falls back to the next
good checkpoint instead of failing with a traceback deep inside the restore."""

from __future__ import annotations

from typing import Any

import torch

from ddpkit.config.bounded import TooDeep, check_tree


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _rng_ok(st: Any) -> bool:
    """One rank's rng_state(): torch's byte tensor, Python's state tuple, numpy's 5 values (name, keys, ...)."""
    if not isinstance(st, dict) or not isinstance(st.get("torch"), torch.Tensor):
        return False
    if st["torch"].dtype != torch.uint8 or not isinstance(st.get("python"), (tuple, list)):
        return False
    py = st["python"]
    if len(py) != 3 or not isinstance(py[1], (tuple, list)) or not all(isinstance(x, int) for x in py[1]):
        return False
    np_state = st.get("numpy")
    if not isinstance(np_state, (list, tuple)) or len(np_state) != 5:
        return False
    name, keys, pos, has_gauss, cached = np_state
    if not isinstance(name, str) or not isinstance(keys, torch.Tensor) or keys.numel() != 624:
        return False
    return _count(pos) and _count(has_gauss) and _number(cached)


_CHECKS = {  # entry -> (test, what it must be); an absent optional entry passes
    "epoch": (_count, "a whole number >= 0"),
    "step": (_count, "a whole number >= 0"),
    "consumed": (lambda v: v is None or _count(v), "a whole number >= 0"),
    "world_size": (lambda v: v is None or (_count(v) and v > 0), "a whole number >= 1"),
    "best_acc1": (lambda v: v is None or _number(v), "a number"),
    "partial_sums": (
        lambda v: v is None or (isinstance(v, (list, tuple)) and len(v) == 3 and all(map(_number, v))),
        "three numbers",
    ),
    "rng": (lambda v: v is None or (isinstance(v, (list, tuple)) and all(map(_rng_ok, v))), "RNG states"),
    "metrics_row": (
        lambda v: v is None or (isinstance(v, dict) and _count(v.get("epoch"))),
        "a metrics line",
    ),
    "optimizer": (lambda v: isinstance(v, dict), "a state dict"),
    "scheduler": (lambda v: isinstance(v, dict), "a state dict"),
    "scaler": (lambda v: v is None or isinstance(v, dict), "a state dict"),
    "config": (lambda v: isinstance(v, dict), "a mapping"),
}


def wrong_field(state: dict[str, Any], training: bool) -> str | None:
    """Why a loaded checkpoint cannot be used (`its 'epoch' entry is str, not ...`), or None; `training`: its
    training entries are checked too (a resume restores them), not only its embedded config."""
    for key, (ok, want) in _CHECKS.items():
        if key not in state or not training:
            continue
        value = state[key]
        if not ok(value):
            return f"its '{key}' entry is {type(value).__name__}, not {want}"
    try:
        check_tree(state.get("config") or {})
    except TooDeep as e:
        return f"its 'config' entry is {e}"
    return None
