"""Cutting a model into pipeline stages; every stage keeps the full model's parameter names.

- a model family that cuts itself (`ModelFamily.pp_stage`, e.g. a stack of blocks: models/blocks.py): each
  stage is the same class with the blocks and parts it does not run deleted, so checkpoints of any layout use one
  set of keys.
- a family that names its split points (`ModelFamily.pp_split`) and a user's model: torch.distributed.pipelining's tracer cuts the forward where the
  named modules begin (`pp_split`); the traced stages hold the original parameters under their full names.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn

from ddpkit.errors import UserError, first_line


def check_split_names(model: nn.Module, names: Sequence[str], n_stages: int, key: str = "pp_split") -> None:
    """pp_split names modules of `model`, one fewer than the stages."""
    modules = dict(model.named_modules())
    unknown = [n for n in names if n not in modules or not n]
    if unknown:
        raise UserError(
            f"{key} names '{unknown[0]}', which is not a module of {type(model).__name__}",
            "name submodules as model.named_modules() spells them, e.g. 'layers.2'",
        )
    if len(names) != n_stages - 1:
        raise UserError(
            f"{key} has {len(names)} split point(s), which cut the model into {len(names) + 1} stage(s), but the "
            f"pipeline runs {n_stages}",
            f"give {n_stages - 1} split point(s)",
        )
    order = list(modules)  # registration order: the order a forward of a stack of blocks reaches them
    for before, after in zip(names, names[1:], strict=False):
        if after == before or after.startswith(before + ".") or order.index(after) < order.index(before):
            raise UserError(
                f"{key} lists '{after}' after '{before}', but it does not begin a later stage of "
                f"{type(model).__name__} ({'the same module' if after == before else 'it comes first or inside it'})",
                "list the split points in the order the model's forward reaches them",
            )


def _trace(model: nn.Module, names: Sequence[str], example: tuple):
    from torch.distributed.pipelining import SplitPoint, pipeline

    try:
        pipe = pipeline(model, mb_args=example, split_spec=dict.fromkeys(names, SplitPoint.BEGINNING))
    except Exception as e:  # the tracer's own errors are many and varied
        raise UserError(
            f"torch's pipeline tracer could not cut {type(model).__name__} at {list(names)}: "
            f"{first_line(e, limit=50, joined=True)}",
            "split at modules that run in sequence, tensors flowing between them",
        ) from None
    if pipe.num_stages != len(names) + 1:
        raise UserError(
            f"cutting {type(model).__name__} at {list(names)} gave {pipe.num_stages} stages, not {len(names) + 1}",
            "name modules that each run once, in the order the forward calls them",
        )
    return pipe


def traced_stages(
    model: nn.Module, names: Sequence[str], example: tuple, wanted: Sequence[int]
) -> tuple[list[nn.Module], list[nn.Module], list[Shared]]:
    """(training stages, evaluation stages, shared parameters) `wanted` of `model`, cut where each module of `names` begins by
    torch's pipeline tracer on one example micro-batch. The training stages share the model's parameters and
    buffers under their full names. The tracer fixes train/eval behaviour (dropout, BatchNorm) into the graph,
    so the evaluation stages are traced from an eval-mode copy; evaluation runs them on the training stages'
    tensors (torch.func.functional_call)."""
    twin = _trace(copy.deepcopy(model).eval(), names, example)  # first: tracing marks the model it traced
    shared = shared_parameters(model)
    pipe = _trace(model.train(), names, example)
    stages = [pipe.get_stage_module(i) for i in range(pipe.num_stages)]
    tied = retie(stages, wanted, shared)
    return [stages[i] for i in wanted], [twin.get_stage_module(i) for i in wanted], tied


@dataclass(frozen=True)
class Shared:
    """A parameter the model uses under several names (a token embedding tied to the output head), and the
    pipeline stages whose forward uses it."""

    param: nn.Parameter
    names: tuple[str, ...]
    stages: tuple[int, ...]


def shared_parameters(model: nn.Module) -> dict[int, tuple[nn.Parameter, tuple[str, ...]]]:
    """{id: (parameter, its names)} of each parameter the model holds under more than one name."""
    names: dict[int, list[str]] = {}
    params: dict[int, nn.Parameter] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
        params[id(p)] = p
    return {k: (params[k], tuple(v)) for k, v in names.items() if len(v) > 1}


def _used_names(module: nn.Module, prefix: str = "") -> set[str]:
    """The full names of the parameters and buffers a traced stage's graph reads (through its nested graphs)."""
    graph = getattr(module, "graph", None)
    if graph is None:  # a module the tracer kept whole: all of its tensors
        return {prefix + n for n, _ in module.named_parameters(remove_duplicate=False)}
    used: set[str] = set()
    for node in graph.nodes:
        if node.op == "get_attr":
            used.add(prefix + str(node.target))
        elif node.op == "call_module":
            used |= _used_names(module.get_submodule(str(node.target)), f"{prefix}{node.target}.")
    return used


def retie(stages: Sequence[nn.Module], wanted: Sequence[int], shared: dict) -> list[Shared]:
    """torch's tracer gives each stage that uses a shared parameter its own copy, which the user's optimizer does
    not hold: in the stages `wanted` here every copy is replaced by the model's own parameter (one tensor, one
    gradient summed over this rank's stages, the optimizer's); returns each shared parameter with the stages
    that use it, whose ranks sum its gradient (PipelineRunner)."""
    used = [_used_names(stage) for stage in stages]
    out = []
    for param, names in shared.values():
        users = tuple(i for i, u in enumerate(used) if any(n in u for n in names))
        for i in wanted:
            for name in names:
                path, _, attr = name.rpartition(".")
                try:
                    owner = stages[i].get_submodule(path) if path else stages[i]
                except AttributeError:
                    continue
                if isinstance(getattr(owner, attr, None), nn.Parameter):
                    setattr(owner, attr, param)
        if users:
            out.append(Shared(param, names, users))
    return out


def stage_sharing(model: nn.Module, stages: Sequence[nn.Module]) -> list[Shared]:
    """Each parameter of `model` that several of `stages` use (stages holding the model's own modules), with
    those stages: whose ranks sum its gradient (PipelineRunner)."""
    by_name = dict(model.named_parameters(remove_duplicate=False))
    names: dict[int, list[str]] = {}
    for name, p in by_name.items():
        names.setdefault(id(p), []).append(name)
    users: dict[int, set[int]] = {}
    for i, stage in enumerate(stages):
        for name in _used_names(stage):
            if name in by_name:
                users.setdefault(id(by_name[name]), set()).add(i)
    params = {id(p): p for p in by_name.values()}
    return [Shared(params[k], tuple(names[k]), tuple(sorted(v))) for k, v in users.items() if len(v) > 1]


def owned_parameters(stages: Sequence[nn.Module]) -> list[tuple[str, nn.Parameter]]:
    """(full name, parameter) of every stage on this rank, each parameter once."""
    seen: set[int] = set()
    out = []
    for stage in stages:
        for name, p in stage.named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out.append((name, p))
    return out


def micro_chunks(t: torch.Tensor, n: int) -> list[torch.Tensor]:
    """`t` cut along dim 0 into n equal chunks (the batch is a multiple of n)."""
    if t.shape[0] % n:
        raise UserError(
            f"a batch of {t.shape[0]} samples cannot be cut into {n} equal pipeline micro-batches",
            f"use a batch size that is a multiple of {n} (and drop_last=True)",
        )
    return list(t.chunk(n))
