"""`ddpkit.prepare`: a user's own model, optimizer and DataLoaders in, ready for this process out.

    model, optimizer, train_loader, val_loader = ddpkit.prepare(model, optimizer, train_loader, val_loader)

The model goes to this rank's device and is wrapped for the strategy (DDP when there are several processes,
as is with one); a shuffled DataLoader becomes a sharded training loader (the global order of torch's
DistributedSampler, set_epoch automatic), an unshuffled one an exact evaluation loader (every sample once over
all ranks); every other DataLoader argument is kept. Without a launcher it is one process and the objects come
back on the right device, unwrapped: the same script runs as `python script.py`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from ddpkit.data.loaders import DistributedLoader, convert_loader
from ddpkit.distributed.runtime import DistContext, current, init_distributed
from ddpkit.errors import UserError
from ddpkit.parallel.materialize import wrap_made
from ddpkit.parallel.mesh import build_mesh, layout_of
from ddpkit.parallel.mesh.tensor import apply_tensor_parallel
from ddpkit.parallel.optimizer import rebuild_optimizer
from ddpkit.parallel.pipeline.plan import stages_per_rank
from ddpkit.parallel.pipeline.user_model import PipelineModel
from ddpkit.parallel.plan import build_strategy
from ddpkit.parallel.strategy import Strategy, get_strategy, names_with, picked, unwrap_module
from ddpkit.parallel.sync_bn import convert_gloo_sync_batchnorm
from ddpkit.porting import hf_model
from ddpkit.porting.meta import built, maker
from ddpkit.porting.roles import agreed, prepare_loader, remember_model, roles_for


def unwrap(model: nn.Module) -> nn.Module:
    """The user's own module inside a DDP / DataParallel / torch.compile wrapper (what to save and load)."""
    return unwrap_module(model)


def _context() -> DistContext:
    return current() or init_distributed()


def _sync_bn(model: nn.Module, device: torch.device) -> nn.Module:

    if device.type == "cuda":
        return nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return convert_gloo_sync_batchnorm(model)


def _rebuilt_optimizer(
    strategy: Strategy, model: nn.Module, before: list[nn.Parameter], old: torch.optim.Optimizer
) -> torch.optim.Optimizer:
    """The user's optimizer made again over the wrapped model's parameters (zero1 shards its state, fsdp
    replaces the parameters): same class, same hyperparameters, same parameter groups."""
    if old.state:
        raise UserError(
            f"ddpkit.prepare(strategy='{strategy.name}') needs a fresh optimizer, this one has taken steps",
            "call prepare() before training, or load the optimizer state after it",
        )
    after = list(model.parameters())  # the same order as `before`, wrapped or sharded
    position = {id(p): i for i, p in enumerate(before)}
    held = [p for g in old.param_groups for p in g["params"]]
    if len(after) != len(before) or any(id(p) not in position for p in held):
        raise UserError(
            "ddpkit.prepare: the optimizer holds parameters that are not the model's",
            "build the optimizer from model.parameters() before prepare()",
        )
    groups = [[after[position[id(p)]] for p in g["params"]] for g in old.param_groups]

    def factory(_model: nn.Module) -> torch.optim.Optimizer:
        return rebuild_optimizer(old, groups, f"ddpkit.prepare(strategy='{strategy.name}')")

    return strategy.build_optimizer(model, factory)


def _wrapped(model: nn.Module) -> bool:
    """Already inside a wrapper (DDP, FSDP, torch.compile: prepare() made it, or the user did)."""
    return unwrap_module(model) is not model


def _layout(ctx: DistContext, tp: int, tp_plan: dict | None, has_model: bool):
    """(layout, mesh) of prepare(tp=...): the mesh only when there is a model to split."""
    if tp_plan is not None and tp == 1:
        raise UserError("ddpkit.prepare got a tp_plan but tp=1", "pass tp=2 (or more) with the plan")
    try:
        layout = layout_of(ctx.world_size, tp)
    except UserError as e:
        raise UserError(f"ddpkit.prepare(tp={tp}): {e.what}", e.hint) from None
    if tp == 1:
        return layout, None
    if not has_model:
        raise UserError(f"ddpkit.prepare(tp={tp}) needs the model too", "pass the model with its optimizer")
    return layout, build_mesh(layout, ctx.device.type)


def _prepare_pipeline(objects, pp, pp_split, loss_fn, schedule, microbatches, strategy, seed, split) -> Any:
    """prepare() for pp > 1: the model as a PipelineModel, loaders sharded over the data-parallel replicas."""
    models = [o for o in objects if isinstance(o, nn.Module)]
    hf = len(models) == 1 and hf_model.is_hf_model(models[0])  # cut where its own pipeline plan says
    if (not pp_split and not hf) or loss_fn is None:
        raise UserError(
            f"ddpkit.prepare(pp={pp}) needs " + ("loss_fn" if hf else "pp_split=[module names] and loss_fn"),
            "e.g. loss_fn=lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten())"
            if hf
            else "e.g. prepare(model, opt, loader, pp=2, pp_split=['layers.2'], loss_fn=F.cross_entropy)",
        )
    if strategy not in ("auto", picked("several")):  # the pipeline replicates each stage with DDP
        raise UserError(
            f"ddpkit.prepare(pp={pp}) runs DDP over the data-parallel replicas, not strategy='{strategy}'",
            "drop the strategy argument",
        )
    if len(models) != 1:
        raise UserError(
            f"ddpkit.prepare(pp={pp}) takes exactly one model", "pass the model to cut into stages"
        )
    ctx = _context()
    make = maker(models[0], seed, ctx.device)  # a model on the meta device: made whole, then cut
    model = make(models[0]) if make is not None else models[0].to(ctx.device)
    if hf:
        pp_split = pp_split or hf_model.split_names(model, pp * stages_per_rank(schedule))
    piped = PipelineModel(
        model,
        pp_split,
        pp=pp,
        loss_fn=loss_fn,
        schedule=schedule,
        microbatches=microbatches,
        device=ctx.device,
        cut=hf_model.pipeline_cut(model, pp_split) if hf else None,
    )
    piped.advice = None if hf else hf_model.advice(model)
    rank, world = piped.data_rank
    ready = []
    for obj in objects:
        if obj is models[0]:
            ready.append(piped)
        elif isinstance(obj, DataLoader | DistributedLoader):
            # one replica reads the user's own order (torch's global random stream), as one process does
            made = convert_loader(
                obj, seed=seed, rank=rank, world_size=world, plain_rng=world == 1, split=split
            )
            ready.append(agreed(made))
        else:
            ready.append(obj)
    return ready[0] if len(ready) == 1 else ready


def prepare(
    *objects: Any,
    strategy: str = "auto",
    sync_bn: bool = False,
    seed: int = 0,
    ddp_options: dict | None = None,
    roles: Sequence[str] | None = None,
    tp: int = 1,
    tp_plan: dict | None = None,
    pp: int = 1,
    pp_split: list[str] | None = None,
    loss_fn: Any = None,
    pp_schedule: str = "1f1b",
    pp_microbatches: int | None = None,
    split_batches: bool = False,
    memory: str = "fast",
) -> Any:
    """Each object ready for this process, returned in the order given (one object: returned alone).

    nn.Module: moved to this rank's device, SyncBatchNorm if `sync_bn` and several processes, wrapped for
    `strategy` (auto: ddp with several processes, as is with one; single, ddp, zero1, fsdp). Optimizer: kept
    (re-made over the sharded parameters for zero1/fsdp). DataLoader: re-made as a distributed loader keeping its
    other arguments (shuffled -> training, unshuffled -> exact evaluation, unless `roles` names each loader's;
    porting/roles.py checks a guess): one data-parallel replica draws its order as the DataLoader does (its
    generator=, or torch's stream), several DistributedSampler's (seed=`seed`), `split_batches`: batch_size is the
    global batch, cut over the ranks in the one-process order. Anything else: returned as it is.

    A model on the meta device, or a function of no argument that builds it: laid out, then each rank makes only
    its shards from `seed` (porting/meta.py: by its family's steps, its init_weights() or reset_parameters()).
    `tp`: the model split over groups of `tp` neighbouring ranks by `tp_plan` (torch's parallelize_module plan;
    default: a ddpkit model's family's, or a transformers model's own, porting/hf_model.py), the strategy over the
    data-parallel ranks (auto: zero2 when there are several), the optimizer re-made over the DTensor parameters.
    pp > 1: the model cut into `pp` stages where each module of `pp_split` begins (a transformers model: its
    layers, by its own pipeline plan), a PipelineModel (model.step(x, y); see parallel/pipeline/user_model.py);
    `loss_fn(output, target)` runs on the last stage; loaders shard over the replicas (world_size / pp).
    `memory="lean"` (fsdp, hsdp, zero2): dist.memory=lean, each block's parts sharded as units of their own."""
    _check_arguments(locals())
    objects = tuple(built(objects))  # a function of no argument: the model it builds on the meta device
    if pp != 1:
        return _prepare_pipeline(
            objects, pp, pp_split, loss_fn, pp_schedule, pp_microbatches, strategy, seed, split_batches
        )
    models = _checked_models(objects, strategy)
    ctx = _context()
    optimizers = [o for o in objects if isinstance(o, torch.optim.Optimizer)]
    loader_roles = roles_for(objects, roles)
    layout, mesh = _layout(ctx, tp, tp_plan, bool(models))
    chosen = _lean_checked(build_strategy(strategy, ctx, ddp_options, mesh=mesh, memory=memory), memory)
    model = models[0] if models else None
    out = _prepared_model(model, optimizers, chosen, ctx, (sync_bn, seed), mesh, tp_plan)
    model_out = out.get(id(model), model)
    if model_out is not None:
        remember_model(model_out)
    dp = layout.coords(ctx.rank)["dp"]
    out.update(_prepared_loaders(objects, loader_roles, dp, layout.dp, seed, model_out, split_batches))
    _check_schedulers(objects, out, chosen)
    ready = [out.get(id(o), o) for o in objects]
    return ready[0] if len(ready) == 1 else ready


def _lean_checked(chosen: Strategy, memory: str) -> Strategy:
    """The strategy built for prepare(memory=...); memory="lean" needs one with FSDP2's units (UserError)."""
    if memory == "lean" and not chosen.entry.shards_gradients:
        raise UserError(
            f"ddpkit.prepare(memory='lean') shards each block's parts with FSDP2, which {chosen.entry.name} does not",
            f"use strategy {names_with('shards_gradients')} with several processes, or memory='fast'",
        )
    return chosen


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_arguments(given: dict[str, Any]) -> None:
    """Every keyword of prepare() of the right type and range, before anything is made (UserError)."""
    from torch.distributed.tensor.parallel import ParallelStyle

    def refuse(name: str, want: str, example: str) -> None:
        value = given[name]
        raise UserError(
            f"ddpkit.prepare({name}={value!r}): {name} must be {want}, not a {type(value).__name__}"
            if not isinstance(value, (int, float)) or isinstance(value, bool)
            else f"ddpkit.prepare({name}={value!r}): {name} must be {want}",
            f"e.g. {example}",
        )

    for name in ("tp", "pp"):
        if not _is_int(given[name]) or given[name] < 1:
            refuse(name, "a whole number >= 1", f"{name}=2")
    tp, pp = given["tp"], given["pp"]
    if pp != 1 and tp != 1:
        raise UserError(
            f"ddpkit.prepare(tp={tp}, pp={pp}): tensor and pipeline parallel together are for `ddpkit train`",
            "use one of them with prepare(), or dist.tp and dist.pp with `ddpkit train`",
        )
    if not _is_int(given["seed"]):
        refuse("seed", "a whole number", "seed=0")
    for name in ("strategy", "pp_schedule"):
        if not isinstance(given[name], str):
            refuse(name, "a name", f"{name}={'auto' if name == 'strategy' else '1f1b'!r}")
    if given["memory"] not in ("fast", "lean"):
        refuse("memory", "'fast' or 'lean'", "memory='lean'")
    for name in ("sync_bn", "split_batches"):
        if not isinstance(given[name], bool):
            refuse(name, "True or False", f"{name}=True")
    mb = given["pp_microbatches"]
    if mb is not None and (not _is_int(mb) or mb < 1):
        refuse("pp_microbatches", "a whole number >= 1 or None", "pp_microbatches=4")
    if given["ddp_options"] is not None and not isinstance(given["ddp_options"], dict):
        refuse(
            "ddp_options", "a dict of DistributedDataParallel's keyword arguments", "{'bucket_cap_mb': 25}"
        )
    for name in ("roles", "pp_split"):
        value = given[name]
        if value is not None and (isinstance(value, str) or not all(isinstance(v, str) for v in value)):
            refuse(name, "a list of names", f"{name}={['train'] if name == 'roles' else ['blocks.2']!r}")
    if given["loss_fn"] is not None and not callable(given["loss_fn"]):
        refuse("loss_fn", "a function loss_fn(output, target)", "loss_fn=torch.nn.functional.cross_entropy")
    plan = given["tp_plan"]
    if plan is not None:
        if not isinstance(plan, dict):
            refuse(
                "tp_plan",
                "a dict {submodule name: ColwiseParallel() / RowwiseParallel() / ...}",
                "{'fc1': ColwiseParallel()}",
            )
        for key, style in plan.items():
            if not isinstance(key, str) or not isinstance(style, ParallelStyle):
                shown = style.__name__ if isinstance(style, type) else repr(style)
                raise UserError(
                    f"ddpkit.prepare(tp_plan=...): the entry {key!r}: {shown} is not a torch ParallelStyle",
                    f"map each name to an instance: {{{key!r}: ColwiseParallel()}}",
                )


def _checked_models(objects: Sequence[Any], strategy: str) -> list[nn.Module]:
    """The model among `objects` (none or one), once `strategy` is known to be a strategy's name."""
    if strategy != "auto":
        try:
            get_strategy(strategy, key="strategy")
        except UserError as e:
            raise UserError(f"ddpkit.prepare: {e.what}", e.hint) from None
    models = [o for o in objects if isinstance(o, nn.Module)]
    if len(models) > 1:
        raise UserError("ddpkit.prepare takes one model", "prepare each model in its own call")
    return models


def _prepared_model(
    model: nn.Module | None,
    optimizers: list[torch.optim.Optimizer],
    chosen: Strategy,
    ctx: DistContext,
    sync_bn_seed: tuple[bool, int],
    mesh: Any,
    tp_plan: dict | None,
) -> dict[int, Any]:
    """{id(given object): what replaces it} for the model and the optimizers the strategy re-makes: the model on
    this rank's device, synchronised BatchNorm, split over the tensor-parallel mesh, wrapped for the strategy. A
    model on the meta device is laid out there and made with `seed` (porting/meta.py): each rank its own shards.
    A model prepared already stays as it is, and so do its optimizers."""
    out: dict[int, Any] = {}
    sync_bn, seed = sync_bn_seed
    if model is not None and not _wrapped(model):
        make = maker(model, seed, ctx.device)
        moved = model.to(ctx.device) if make is None else model
        if sync_bn and ctx.world_size > 1:
            moved = _sync_bn(moved, ctx.device)
        before = list(moved.parameters())
        if mesh is not None:
            if tp_plan is None and hf_model.is_hf_model(moved):  # the plan the model declares
                tp_plan = hf_model.tp_plan(moved, mesh["tp"].size())
            apply_tensor_parallel(moved, mesh["tp"], tp_plan)
        out[id(model)] = wrap_made(chosen, moved, make)
        for opt in optimizers:
            if chosen.entry.remakes_optimizer or mesh is not None:
                out[id(opt)] = _rebuilt_optimizer(chosen, moved, before, opt)
    elif model is None and optimizers and chosen.entry.remakes_optimizer:
        raise UserError(
            f"ddpkit.prepare(strategy='{chosen.name}') needs the model too", "pass model and optimizer"
        )
    return out


def _prepared_loaders(
    objects: Sequence[Any],
    roles: list[str],
    dp_rank: int,
    dp_size: int,
    seed: int,
    model: nn.Module | None,
    split: bool,
) -> dict[int, Any]:
    """{id(loader): its distributed loader} for each DataLoader, sharded over the data-parallel ranks."""
    loaders = [o for o in objects if isinstance(o, DataLoader | DistributedLoader)]
    return {
        id(obj): prepare_loader(
            obj, role, seed=seed, rank=dp_rank, world_size=dp_size, model=model, split=split
        )
        for obj, role in zip(loaders, roles, strict=True)
    }


def _check_schedulers(objects: Sequence[Any], out: dict[int, Any], chosen: Strategy) -> None:
    """An LR scheduler made over an optimizer that prepare() re-made would drive the old one: refused."""
    for obj in objects:
        if isinstance(obj, torch.optim.lr_scheduler.LRScheduler) and id(obj.optimizer) in out:
            raise UserError(
                f"ddpkit.prepare(strategy='{chosen.name}') re-makes the optimizer, so a scheduler made before it "
                "would drive the old one",
                "create the scheduler after prepare(), from its optimizer",
            )
