"""Tensor parallelism (Megatron-LM style) with torch.distributed.tensor.parallel, and the full state of a model
whose parameters are DTensors.

The plan for the built-in GPT (ddpkit.models.gpt.GPT): in every block wq, wk, wv and mlp.fc are column-parallel (each
rank computes n_head / tp heads, a quarter of the MLP's width on 4 ranks), attn.wo and mlp.proj row-parallel
(their partial sums reduced); with sequence parallelism the LayerNorms and the residual stream between the
blocks hold 1/tp of the sequence each (all-gather in, reduce-scatter out, instead of all-reduces), the embeddings
and the output head stay replicated. The attention counts its heads from the tensor it gets, so the module is
unchanged. A user's model takes torch's own plan: `ddpkit.prepare(model, tp=2, tp_plan={...})`.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from ddpkit.errors import UserError

# (column-parallel, row-parallel) projections of a block of each built-in family
PROJECTIONS = {
    "GPT": (("attn.wq", "attn.wk", "attn.wv", "mlp.fc"), ("attn.wo", "mlp.proj")),
    "Llama": (("attn.wq", "attn.wk", "attn.wv", "mlp.gate", "mlp.up"), ("attn.wo", "mlp.down")),
}


def gpt_plan(model: nn.Module, sequence_parallel: bool = True) -> dict[str, Any]:
    """The parallelize_module plan of a ddpkit.models.gpt.GPT or models.llama.Llama (a pipeline stage's blocks
    and parts too)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    between = Shard(1) if sequence_parallel else Replicate()  # the residual stream between the matmuls
    plan: dict[str, Any] = {}
    column, row = PROJECTIONS["Llama" if type(model).__name__ == "Llama" else "GPT"]
    for i in model.blocks:
        b = f"blocks.{i}."
        for name in column:
            plan[b + name] = ColwiseParallel(input_layouts=between)
        for name in row:
            plan[b + name] = RowwiseParallel(output_layouts=between)
        if sequence_parallel:
            plan[b + "ln1"] = plan[b + "ln2"] = SequenceParallel()
    if sequence_parallel:
        if (
            getattr(model, "tok_emb", None) is not None
        ):  # the replicated embedding's output: split the sequence
            plan["drop"] = PrepareModuleInput(
                input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True
            )
        if getattr(model, "ln_f", None) is not None:
            plan["ln_f"] = SequenceParallel()
        if getattr(model, "head", None) is not None:  # the replicated head sees the whole sequence
            plan["head"] = PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
            )
    return plan


def check_gpt_split(model: nn.Module, tp: int) -> None:
    """Heads and width divisible by tp (a UserError otherwise)."""
    sizes = [("n_head", model.n_head), ("n_embd", model.n_embd)]
    sizes += [("n_kv_head", model.n_kv_head)] if hasattr(model, "n_kv_head") else []
    for what, value in sizes:
        if value % tp:
            raise UserError(
                f"model.{what}={value} cannot be split over dist.tp={tp} ranks (it must be a multiple of {tp})",
                f"use a model.{what} that is a multiple of {tp}, or another dist.tp",
            )


def plan_for(model: nn.Module, tp: int) -> dict[str, Any]:
    """The built-in plan of `model` (ddpkit.models.gpt.GPT); a UserError for a model without one."""
    from ddpkit.models.gpt import GPT
    from ddpkit.models.llama import Llama

    if not isinstance(model, GPT | Llama):
        raise UserError(
            f"dist.tp={tp}: there is no tensor-parallel plan for a {type(model).__name__}",
            "use model.arch=gpt or llama, or pass torch's plan: ddpkit.prepare(model, tp=2, tp_plan={...})",
        )
    check_gpt_split(model, tp)
    # sequence parallel on the whole model; a pipeline stage takes and gives whole hidden states
    whole = all(getattr(model, part, None) is not None for part in ("tok_emb", "head"))
    return gpt_plan(model, sequence_parallel=whole)


def apply_tensor_parallel(model: nn.Module, tp_mesh, plan: dict[str, Any] | None = None) -> nn.Module:
    """Split `model` over the 1-D `tp_mesh` by `plan` (default: the built-in plan of its family), in place."""
    import logging

    from torch.distributed.tensor.parallel import parallelize_module

    # DTensor warns at every 2-D (dp x tp) gather that two collectives run where one could: a cost note, per
    # step, on every rank; the layout is the user's choice, so it is not repeated into their log
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    if plan is None:
        plan = plan_for(model, tp_mesh.size())
    else:
        from ddpkit.parallel.mesh.tp_plan import check_plan

        check_plan(model, plan, tp_mesh.size())
    try:
        return parallelize_module(model, tp_mesh, plan)
    except (ValueError, KeyError, AttributeError, RuntimeError) as e:
        from ddpkit.errors import first_line

        raise UserError(
            f"the tensor-parallel plan does not fit the model: {first_line(e)}",
            "name submodules of the model (model.named_modules()) with torch.distributed.tensor.parallel styles",
        ) from None


__all__ = ["apply_tensor_parallel", "gpt_plan", "plan_for"]
