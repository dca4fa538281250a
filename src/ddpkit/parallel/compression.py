"""The gradient-compression registry (dist.grad_compression): one `CompressionMethod` per name, registered on
DDP's all-reduce as torch's own communication hooks. A method owns its hook's checkpoint state: how it is
saved, loaded, and carried to another world size, so the trainer knows nothing of any method's insides.

Adding a method is one `CompressionMethod` passed to `register_compression`, from inside ddpkit or from a
package of your own (an entry point in the `ddpkit.compression` group). Importing this module imports no torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ddpkit.config.declared import before_keys, check_with, declare, key_sets
from ddpkit.parallel.compression_method import BUILTIN, CompressionMethod
from ddpkit.registry import Registry

ENTRY_POINT_GROUP = "ddpkit.compression"


def _declare_keys(method: CompressionMethod) -> None:
    if method.keys is not None:
        declare("dist", method.keys, "dist.grad_compression", method.name)


_REGISTRY: Registry[CompressionMethod] = Registry(
    "compression method",
    ENTRY_POINT_GROUP,
    CompressionMethod,
    "ddpkit.parallel.compression.CompressionMethod",
    builtins=lambda: BUILTIN,
    added=_declare_keys,  # a method's own config keys join the schema when it is registered
)
for _method in BUILTIN:  # the built-ins' keys are known before the registry is first asked (--help-config)
    _declare_keys(_method)


def register_compression(method: CompressionMethod, *, replace: bool = False) -> CompressionMethod:
    """Make `method.name` a valid dist.grad_compression (and its `keys` config keys); refuses to shadow a name
    unless replace=True."""
    return _REGISTRY.register(method, replace=replace)


def compression_names() -> list[str]:
    """The registered names (built-in ones first)."""
    return list(_REGISTRY)


def get_compression(name: str) -> CompressionMethod:
    """The method for dist.grad_compression `name`; a UserError naming the closest valid one when there is none."""
    return _REGISTRY.get(name, "dist.grad_compression")


@before_keys
def _load_named_method(given: dict[str, Any]) -> None:
    """A config whose dist.grad_compression names a method an installed package declares: load it before the
    keys are checked, so that its own keys are known."""
    name = given.get("dist.grad_compression")
    if isinstance(name, str) and name not in compression_names():
        _REGISTRY.find(name)  # registers it (its keys declared) when a package declares it; checked at load


@check_with
def _check_name(cfg: Any) -> None:
    """At load: dist.grad_compression is a registered method (built in, registered, or an installed package's)."""
    get_compression(cfg.dist.grad_compression)


@dataclass(frozen=True)
class Compression:
    """dist.grad_compression and its options, as one value the DDP strategy registers: PowerSGD's, and
    `settings`, the values of the keys the method declares (`CompressionMethod.keys`), by name."""

    kind: str = "none"
    powersgd_rank: int = 1
    powersgd_warmup_steps: int = 10
    settings: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def from_config(cls, dist_cfg: Any) -> Compression:
        kind = dist_cfg.grad_compression
        own = [f.name for s in key_sets("dist") if kind in s.owners for f in dataclasses.fields(s.keys)]
        settings = tuple((name, getattr(dist_cfg, name)) for name in own)
        return cls(kind, dist_cfg.powersgd_rank, dist_cfg.powersgd_warmup_steps, settings)

    def setting(self, name: str) -> Any:
        """The value of the method's own config key `name` (dist.NAME)."""
        return dict(self.settings)[name]

    @property
    def method(self) -> CompressionMethod:
        return get_compression(self.kind)

    def register(self, ddp: Any) -> Any:
        """Register the hook on a DistributedDataParallel module; returns what holds its state (or None)."""
        return self.method.register(ddp, self)

    def state_dict(self, holder: Any) -> dict | None:
        """The hook's state (loadable with weights_only=True); None for a stateless method."""
        return None if holder is None else self.method.state_dict(holder)

    def load_state_dict(self, holder: Any, saved: dict | None, device: Any) -> None:
        """Put a state_dict() back (a run without a hook ignores it)."""
        if holder is not None and saved:
            self.method.load_state_dict(holder, saved, device)

    def restore(self, saved: list[dict] | None, rank: int, world_size: int) -> tuple[dict | None, str | None]:
        """This rank's part of the per-rank states a checkpoint holds (see CompressionMethod.restore)."""
        if not saved:
            return None, None
        return self.method.restore(saved, rank, world_size)
