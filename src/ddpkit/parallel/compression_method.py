"""`CompressionMethod`: what one dist.grad_compression value is (its hook and the checkpoint state the hook
owns), and the built-in methods (`BUILTIN`: none, fp16, bf16, PowerSGD with its config keys), which the registry
(compression.py) loads. Imports no torch: each hook imports it when it is registered on a DDP module (PowerSGD's
from powersgd.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ddpkit.config.schema import opt


def _no_restore(saved: list[dict], rank: int, world_size: int) -> tuple[dict | None, str | None]:
    return (saved[rank] if len(saved) == world_size else None), None


@dataclass(frozen=True)
class CompressionMethod:
    """One dist.grad_compression value.

    `register(ddp, options) -> holder`: registers the hook on a DistributedDataParallel module (options: the
    `Compression` value: powersgd_rank, ...) and returns what holds its state (None when stateless);
    `state_dict(holder)` / `load_state_dict(holder, saved, device)`: that state in a checkpoint (one per rank);
    `restore(saved_per_rank, rank, world_size) -> (state or None, message or None)`: what this rank takes from
    a checkpoint saved on `len(saved_per_rank)` ranks (and a line to log when some of it is dropped);
    `keys`: the method's own config keys, a dataclass of `opt()` fields added to the `dist` section
    (`dist.powersgd_rank`), documented under the method in --help-config.
    """

    name: str
    summary: str
    register: Callable[[Any, Any], Any]
    state_dict: Callable[[Any], dict | None] = lambda holder: None
    load_state_dict: Callable[[Any, dict, Any], None] = lambda holder, saved, device: None
    restore: Callable[[list[dict], int, int], tuple[dict | None, str | None]] = _no_restore
    keys: type | None = None


def _fp16(ddp: Any, options: Any) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)


def _bf16(ddp: Any, options: Any) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)


def _powersgd(ddp: Any, options: Any) -> Any:
    from ddpkit.parallel.powersgd import register

    return register(ddp, options)


def _powersgd_restore(saved: list[dict], rank: int, world_size: int) -> tuple[dict, str | None]:
    """This rank's saved state; on another world size the shared part only (the error feedback of ranks that no
    longer match starts again from zero)."""
    if len(saved) == world_size:
        return saved[rank], None
    shared = dict(saved[0])
    shared["params"] = {n: {k: v for k, v in p.items() if k != "error"} for n, p in shared["params"].items()}
    return (
        shared,
        f"PowerSGD's error feedback was saved on {len(saved)} ranks, not {world_size}: it restarts from zero",
    )


@dataclass
class PowerSGDKeys:
    """PowerSGD's low-rank approximation."""

    powersgd_rank: int = opt(1, "PowerSGD's matrix approximation rank (more: closer, more bytes)", gt=0)
    powersgd_warmup_steps: int = opt(
        10, "optimizer steps of exact all-reduce before PowerSGD starts compressing (at least 2)", ge=2
    )


BUILTIN = (
    CompressionMethod("none", "exact all-reduce, no hook", register=lambda ddp, o: None),
    CompressionMethod("fp16", "gradients sent as float16 (half the bytes)", register=_fp16),
    CompressionMethod("bf16", "gradients sent as bfloat16 (half the bytes)", register=_bf16),
    CompressionMethod(
        "powersgd",
        "a low-rank approximation of each gradient matrix, with error feedback",
        register=_powersgd,
        state_dict=lambda hook: hook.state_dict(),
        load_state_dict=lambda hook, saved, device: hook.load_state_dict(saved, device),
        restore=_powersgd_restore,
        keys=PowerSGDKeys,
    ),
)
