"""The strategy registry: one `StrategyEntry` per dist.strategy, holding the facts others ask about it, and the
`Strategy` interface the trainer, `ddpkit.prepare`, `save_state` and `ddpkit eval` call.

Adding a strategy is one module that defines a `Strategy` subclass and its entry (see
`ddpkit.parallel.strategies.ddp`; a built-in one is named in `BUILTIN`), or a package of your own (an entry point
in the `ddpkit.strategies` group, loaded when its name is first asked for, or `register_strategy`). Everything else
(config validation, the layout plan (parallel/plan.py), `prepare`, `save_state`, report, the trainer) asks the
entries' facts, never a name. Importing this module imports no torch, so the config can check a name cheaply.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ddpkit.config.declared import check_with, declare_values
from ddpkit.config.schema import yaml_text
from ddpkit.errors import UserError
from ddpkit.registry import Registry

if TYPE_CHECKING:
    import torch
    import torch.nn as nn

    from ddpkit.distributed.runtime import DistContext
    from ddpkit.parallel.compression import Compression

ENTRY_POINT_GROUP = "ddpkit.strategies"
SHARDABLE = ("optimizer", "gradients", "parameters")
BUILTIN = (
    "single",
    "dp",
    "ddp",
    "zero1",
    "zero2",
    "fsdp",
    "hsdp",
)  # modules of parallel/strategies/, in order


@dataclass(frozen=True)
class StrategyEntry:
    """One dist.strategy: its class and the facts others ask about it.

    `shards`: which of optimizer / gradients / parameters each rank keeps only a part of;
    `remakes_optimizer`: the optimizer must be built over the wrapped model (prepare() re-makes a user's);
    `one_process`: runs in a single process only (single, dp); `needs_group`: without a process group the plain
    module computes the same numbers, so one process falls back to `single`;
    `ddp_knobs`: takes DDP's keyword arguments (dist.bucket_cap_mb, static_graph, grad_as_bucket_view);
    `compression`: registers a gradient-compression hook (dist.grad_compression);
    `recognizes(model, optimizer)`: true when prepared objects are this strategy's (save_state/load_state);
    `over_dtensors`: runs over the "dp" dim of a tensor-parallel model (its parameters DTensors);
    `offloads`: keeps its shards in CPU memory under dist.offload=cpu;
    `replicates`: every rank holds the whole parameters and all-reduces the gradients (DDP; a pipeline wraps
    each stage in DDP, where the others shard each stage with FSDP2);
    `with_pp`: runs over the data-parallel ranks of a pipeline (dist.pp);
    `hybrid`: shards inside groups of dist.dp_shard ranks and replicates across the groups;
    `with_ep`: runs with expert parallelism (dist.ep: the routed experts split over some of its ranks, their
    gradients reduced over the ranks that hold the same experts);
    `auto`: where dist.strategy=auto picks it (`AUTO`: "one" data-parallel replica, "several", "tp" several
    replicas of a tensor-parallel model, "offload" dist.offload=cpu);
    `wraps_meta`: its wrap takes a model on the meta device and leaves it there, laid out (the plain module,
    FSDP2's fully_shard): a model built on meta is made real after the wrap, each rank allocating only its
    shards (parallel/materialize.py); without it the model is made whole before the wrap (DDP broadcasts it).
    """

    name: str
    cls: type[Strategy]
    summary: str
    shards: tuple[str, ...] = ()
    remakes_optimizer: bool = False
    one_process: bool = False
    needs_group: bool = True
    ddp_knobs: bool = False
    compression: bool = False
    recognizes: Callable[[Any, Any], bool] | None = None
    over_dtensors: bool = False
    offloads: bool = False
    replicates: bool = False
    with_pp: bool = False
    hybrid: bool = False
    with_ep: bool = False
    auto: tuple[str, ...] = ()
    wraps_meta: bool = False
    order: int | None = None  # where the registry asks it (lower first; none: in the order registered)

    def __post_init__(self):
        for what, given, allowed in (("shards", self.shards, SHARDABLE), ("auto", self.auto, AUTO)):
            unknown = set(given) - set(allowed)
            if unknown:
                raise ValueError(
                    f"strategy '{self.name}': {what} must be among {tuple(allowed)}, got {sorted(unknown)}"
                )

    @property
    def shards_gradients(self) -> bool:
        """FSDP2's units: each reduce-scatters its gradients (dist.memory=lean cuts the units finer)."""
        return "gradients" in self.shards

    def describe(self) -> str:
        """`zero2 (what it does; also with dist.tp and dist.pp)`: the config reference's line of it."""
        keys = [
            k
            for k, ok in (
                ("dist.tp", self.over_dtensors),
                ("dist.pp", self.with_pp),
                ("dist.ep", self.with_ep),
            )
            if ok
        ]
        also = " and ".join([", ".join(keys[:-1]), keys[-1]] if len(keys) > 1 else keys)
        return f"{self.name} ({self.summary}{f'; also with {also}' if also else ''})"


# dist.strategy=auto picks, by the situation (StrategyEntry.auto): what each phrase of the reference says
AUTO = {
    "several": "with several data-parallel processes",
    "one": "with one",
    "tp": "over the data-parallel ranks of a tensor-parallel model",
    "offload": "with dist.offload=cpu",
}


def _builtin_entries() -> list[StrategyEntry]:
    return [importlib.import_module(f"ddpkit.parallel.strategies.{name}").ENTRY for name in BUILTIN]


_REGISTRY: Registry[StrategyEntry] = Registry(
    "strategy",
    ENTRY_POINT_GROUP,
    StrategyEntry,
    "ddpkit.parallel.StrategyEntry",
    builtins=_builtin_entries,
)


def register_strategy(entry: StrategyEntry, *, replace: bool = False) -> StrategyEntry:
    """Make `entry.name` a valid dist.strategy; refuses to shadow a registered name unless replace=True."""
    if entry.name == "auto":
        raise ValueError("'auto' is not a strategy name: it picks one")
    return _REGISTRY.register(entry, replace=replace)


def strategy_names() -> list[str]:
    """Every registered strategy name (built-in ones first)."""
    return list(_REGISTRY)


def picked(situation: str) -> str:
    """The strategy dist.strategy=auto picks in `situation` (a key of AUTO): the first entry that says so."""
    return next(name for name, entry in _REGISTRY.items() if situation in entry.auto)


def names_with(fact: str) -> str:
    """`zero2 or fsdp`: the registered strategies whose entry has `fact` (for a hint)."""
    return " or ".join(name for name, entry in _REGISTRY.items() if getattr(entry, fact))


def _described() -> list[str]:
    """The reference's phrases of dist.strategy's values: auto's picks, then each built-in entry."""
    picks = ", ".join(f"{picked(s)} {said}" for s, said in AUTO.items())
    return [f"auto ({picks})", *(_REGISTRY[name].describe() for name in BUILTIN)]


declare_values("dist.strategy", _described)


def get_strategy(name: str, key: str = "dist.strategy") -> StrategyEntry:
    """The entry for strategy `name`; a UserError naming the closest valid one when there is none."""
    return _REGISTRY.get(name, key, also=("auto",))


@check_with
def _check_config(cfg: Any) -> None:
    """At load: dist.strategy is a registered strategy, and DDP's knobs are set only for one with a DDP wrapper."""
    d = cfg.dist
    if d.strategy == "auto":
        return
    entry = get_strategy(d.strategy)
    knobs = [
        f"dist.{k}={yaml_text(v)}"  # as the user writes it: true, not Python's True
        for k, v, default in (
            ("grad_compression", d.grad_compression, "none"),
            ("bucket_cap_mb", d.bucket_cap_mb, None),
            ("static_graph", d.static_graph, False),
            ("grad_as_bucket_view", d.grad_as_bucket_view, False),
        )
        if v != default
    ]
    if knobs and not entry.ddp_knobs:
        raise UserError(
            f"{knobs[0]} is a DDP setting, but dist.strategy={d.strategy} has no DDP wrapper",
            "use dist.strategy=ddp, zero1 or auto, or drop the setting",
        )


def unwrap_module(model: nn.Module) -> nn.Module:
    """The module inside DDP, DataParallel and torch.compile wrappers."""
    import torch.nn as nn

    while isinstance(inner := getattr(model, "module", None) or getattr(model, "_orig_mod", None), nn.Module):
        model = inner
    return model


class Strategy:
    """How the model and optimizer are spread over the ranks. Subclasses override what differs; the base class
    is the single-process strategy (the plain module)."""

    name = "single"
    mesh = None  # the ("pp", "dp", "tp") DeviceMesh when the model is split (tensor / pipeline parallel)
    offload = "none"  # dist.offload: cpu keeps the shards in CPU memory (fsdp and zero2 honour it)
    amp = "none"  # train.amp: bf16 makes FSDP2's own mixed precision (fsdp, hsdp, zero2)
    memory = "fast"  # dist.memory: lean shards each block's parts as units of their own (fsdp, hsdp, zero2)
    experts = (
        None  # dist.ep > 1: the ExpertMeshes the routed experts are split and reduced over (parallel/experts)
    )

    def __init__(
        self, ctx: DistContext, ddp_options: dict | None = None, compression: Compression | None = None
    ):
        self.ctx = ctx
        self.ddp_options = dict(ddp_options or {})  # DistributedDataParallel's own keyword arguments
        self.compression = compression

    @property
    def entry(self) -> StrategyEntry:
        return get_strategy(self.name)

    @property
    def dp_mesh(self):
        """The 1-D mesh of this rank's data-parallel peers (None: all ranks, the default group)."""
        return self.mesh["dp"] if self.mesh is not None else None

    @property
    def dp_group(self):
        """The process group of this rank's data-parallel peers (None: the default group)."""
        return self.mesh.get_group("dp") if self.mesh is not None else None

    def wrap(self, model: nn.Module) -> nn.Module:
        """The module to call forward/backward on."""
        return model

    def unwrap(self, wrapped: nn.Module) -> nn.Module:
        """The user's module (what a checkpoint stores): inside DDP, DataParallel and torch.compile wrappers."""
        return unwrap_module(wrapped)

    def eval_module(self, wrapped: nn.Module) -> nn.Module:
        """What evaluation calls: the plain module, so uneven shards run no collective."""
        return self.unwrap(wrapped)

    @property
    def collective_forward(self) -> bool:
        """True when every forward is a collective (fsdp): all ranks must run the same number of them."""
        return False

    def step_autocast(self, autocast: Callable[[], Any]) -> Callable[[], Any]:
        """The autocast factory a step runs under: train.amp's (`autocast`), or none where the strategy casts
        the parameters itself (FSDP2's mixed precision)."""
        return autocast

    def sync_context(self, wrapped: nn.Module, sync: bool):
        """Gradient sync on (last micro-step) or off (the others)."""
        return contextlib.nullcontext()

    def build_optimizer(
        self, model: nn.Module, factory: Callable[[nn.Module], torch.optim.Optimizer]
    ) -> torch.optim.Optimizer:
        return factory(model)

    def hook_state(self) -> dict | None:
        """The gradient-communication hook's state to checkpoint (None: no hook)."""
        return None

    def load_hook_state(self, state: dict | None) -> None:
        """Restore hook_state() (nothing to do without a hook)."""

    def restore_hook_states(self, saved: list[dict] | None) -> str | None:
        """This rank's part of the per-rank hook states a checkpoint holds (its compression method decides what
        carries over to another world size); returns a line to log when some of it was dropped."""
        if self.compression is None:
            return None
        state, note = self.compression.restore(saved, self.ctx.rank, self.ctx.world_size)
        self.load_hook_state(state)
        return note

    def model_state(self, wrapped: nn.Module) -> dict:
        """The full model state under the user's module names, whatever the layout (checkpoint/state_dict.py): on
        rank 0, and on every rank when nothing had to be gathered (elsewhere empty). Collective."""
        from ddpkit.checkpoint import state_dict

        return state_dict.model_state(self.unwrap(wrapped))

    def optimizer_state(self, wrapped: nn.Module, optimizer: torch.optim.Optimizer) -> dict | None:
        """The full optimizer state keyed by parameter name on rank 0 (None elsewhere when it had to be
        gathered). Collective."""
        from ddpkit.checkpoint import state_dict

        return state_dict.optimizer_state(self.unwrap(wrapped), optimizer)

    def load(
        self,
        wrapped: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        model_sd: dict,
        optim_sd: dict | None,
    ) -> None:
        """A full state written under any layout into this one. Collective."""
        from ddpkit.checkpoint import state_dict

        state_dict.load_state(self.unwrap(wrapped), optimizer, model_sd, optim_sd)

    def sharded_state(self, wrapped: nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[dict, dict]:
        """(this rank's tensors for a sharded checkpoint, the non-tensor optimizer entries). Collective."""
        from ddpkit.checkpoint import sharded

        return sharded.state_tensors(self.unwrap(wrapped), optimizer)

    def load_sharded(self, wrapped: nn.Module, optimizer, path, side: dict) -> None:
        """A sharded checkpoint folder, written under any layout and world size, into this one. Collective."""
        from ddpkit.checkpoint import sharded

        sharded.load(path, self.unwrap(wrapped), optimizer, side)


def ddp_options(dist_cfg: Any) -> dict:
    """DistributedDataParallel's keyword arguments from dist.bucket_cap_mb, static_graph, grad_as_bucket_view."""
    out: dict = {}
    if dist_cfg.bucket_cap_mb is not None:
        out["bucket_cap_mb"] = dist_cfg.bucket_cap_mb
    if dist_cfg.static_graph:
        out["static_graph"] = True
    if dist_cfg.grad_as_bucket_view:
        out["gradient_as_bucket_view"] = True
    return out


def strategy_of(model: Any, optimizer: Any, ctx: DistContext) -> Strategy:
    """The Strategy that reads and writes this prepared model's and optimizer's full state (the first entry
    that recognizes them; the plain one otherwise)."""
    for entry in reversed(list(_REGISTRY.values())):  # the later, more specific entries first
        if entry.recognizes is not None and entry.recognizes(model, optimizer):
            return entry.cls(ctx)
    return Strategy(ctx)
