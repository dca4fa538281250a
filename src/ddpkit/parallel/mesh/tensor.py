"""Tensor parallelism with torch.distributed.tensor.parallel, by the plan the model's family declares
(`ModelFamily.tp_plan`; a stack of blocks declares models/blocks.py's Megatron-style plan) or by a user's own
torch plan (`ddpkit.prepare(model, tp=2, tp_plan={...})`, checked against the model first: tp_plan.py).
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from ddpkit.errors import UserError, first_line
from ddpkit.models import ModelFamily, family_of_module
from ddpkit.parallel.mesh.tp_plan import check_plan


def plan_for(model: nn.Module, tp: int, family: ModelFamily | None = None) -> dict[str, Any]:
    """The plan `family` declares for `model` over `tp` ranks (default: the family that builds a model of its
    class); a UserError for a model without one."""
    family = family or family_of_module(model)
    if family is None or family.tp_plan is None:
        raise UserError(
            f"dist.tp={tp}: there is no tensor-parallel plan for a {type(model).__name__}",
            "pass ddpkit.prepare(model, tp=2, tp_plan={...}), or declare ModelFamily.tp_plan",
        )
    return family.tp_plan(model, tp)


def apply_tensor_parallel(
    model: nn.Module, tp_mesh, plan: dict[str, Any] | None = None, family: ModelFamily | None = None
) -> nn.Module:
    """Split `model` over the 1-D `tp_mesh` by a user's `plan` (checked), or by its family's, in place."""
    import logging

    from torch.distributed.tensor.parallel import parallelize_module

    # DTensor warns at every 2-D (dp x tp) gather that two collectives run where one could: a cost note, per
    # step, on every rank; the layout is the user's choice, so it is not repeated into their log
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    if plan is None:
        plan = plan_for(model, tp_mesh.size(), family)
    else:
        check_plan(model, plan, tp_mesh.size())
    try:
        return parallelize_module(model, tp_mesh, plan)
    except (ValueError, KeyError, AttributeError, RuntimeError) as e:
        raise UserError(
            f"the tensor-parallel plan does not fit the model: {first_line(e, 60)}",
            "map submodule names (model.named_modules()) to torch's ParallelStyle",
        ) from None


__all__ = ["apply_tensor_parallel", "plan_for"]
