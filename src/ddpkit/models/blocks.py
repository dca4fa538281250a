"""The parallel facts of a stack-of-blocks model (the GPT, the Llama, or a family of your own shaped the same way),
which its family declares (`ModelFamily.tp_plan`, `pp_stage`, `pp_check`, `checkpointed`, `tp_sizes`):

- the blocks sit in a ModuleDict keyed "0", "1", ... (`model.blocks`), so a pipeline stage deletes the blocks it
  does not run and every parameter keeps its full-model name (checkpoints of any layout use one set of keys);
- `forward` skips a part set to None: the parts only the first stage runs (the embeddings) and those only the
  last runs (the final norm and the head);
- the Megatron-LM tensor-parallel plan: in every block the `column` projections are column-parallel and the `row`
  projections row-parallel (their partial sums reduced); with sequence parallelism the block norms, the final norm
  and the residual stream between the blocks hold 1/tp of the sequence each (all-gather in, reduce-scatter out),
  the embeddings and the head stay replicated. The attention counts its heads from the tensor it gets, so the
  module is unchanged. Sequence parallelism is on where it pays: over NCCL (its all-gather and reduce-scatter
  are cheap, and it saves 1/tp of the norms' activations); over gloo each block's extra all-gather and
  reduce-scatter cost more than they save (0.74x the tokens/s of the plan without them, benchmarks/RESULTS.md
  §16), so there the residual stream stays replicated, as a hand-written Colwise/Rowwise plan has it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from ddpkit.errors import UserError


def block_ranges(n_layer: int, n_stages: int) -> list[range]:
    """The blocks of each pipeline stage: n_layer / n_stages consecutive blocks each."""
    if n_layer % n_stages:
        raise UserError(
            f"model.n_layer={n_layer} blocks cannot be cut into {n_stages} equal pipeline stages",
            f"use a model.n_layer that is a multiple of {n_stages}",
        )
    per = n_layer // n_stages
    return [range(s * per, (s + 1) * per) for s in range(n_stages)]


@dataclass(frozen=True)
class BlockStack:
    """A model of `blocks` (a ModuleDict keyed "0", "1", ...) between `first` parts and `last` parts, whose block
    projections split `column`- and `row`-wise, and whose config sizes `tp_keys` must divide over dist.tp (and
    `sp_keys` too where sequence parallelism splits the sequence)."""

    column: tuple[str, ...]  # projections of a block, column-parallel
    row: tuple[str, ...]  # projections of a block, row-parallel
    first: tuple[str, ...] = ("tok_emb",)
    last: tuple[str, ...] = ("ln_f", "head")
    norms: tuple[str, ...] = ("ln1", "ln2")  # a block's norms (sequence-parallel)
    # a block's norms of each attention head (Qwen3's of the queries and keys), where the block has them: their
    # input (batch, sequence, heads, width) split by its heads over tp, their weight replicated (its gradient
    # summed over the tp ranks)
    head_norms: tuple[str, ...] = ()
    entry: str = "drop"  # the module the embeddings' output enters (where the sequence is split)
    tp_keys: tuple[str, ...] = ("model.n_head", "model.n_embd")
    sp_keys: tuple[str, ...] = ("data.block_size",)  # the sequence, split by sequence parallelism only
    # False: the blocks always take whole sequences (a mixture of experts routes each token of a replicated input)
    sequence_parallel: bool = True

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        """The blocks activation checkpointing re-computes."""
        return list(model.blocks.values())

    def check(self, cfg: Any, n_stages: int) -> None:
        """model.n_layer cuts into `n_stages` equal stages (a UserError otherwise)."""
        block_ranges(cfg.model.n_layer, n_stages)

    def stage(self, model: nn.Module, stage: int, n_stages: int) -> nn.Module:
        """`model` cut down, in place, to pipeline stage `stage` of `n_stages`."""
        keep = block_ranges(len(model.blocks), n_stages)[stage]
        for name in list(model.blocks.keys()):
            if int(name) not in keep:
                del model.blocks[name]
        for part in (self.first if stage > 0 else ()) + (self.last if stage < n_stages - 1 else ()):
            setattr(model, part, None)
        return model

    def sizes(self, cfg: Any) -> list[tuple[str, int]]:
        """(key, value) of each config size that must be a multiple of dist.tp."""
        return _values(cfg, self.tp_keys)

    def sp_sizes(self, cfg: Any) -> list[tuple[str, int]]:
        """(key, value) of each config size that must be a multiple of dist.tp where the sequence is split."""
        return _values(cfg, self.sp_keys)

    def plan(self, model: nn.Module, tp: int) -> dict[str, Any]:
        """The parallelize_module plan of `model` or of a pipeline stage of it over `tp` ranks (its heads and
        width checked): sequence parallel on a whole model where it pays (sequence_parallel_pays), not on a
        stage (a stage takes and gives whole hidden states)."""
        check_heads(model, tp)
        whole = all(getattr(model, part, None) is not None for part in (self.first[0], self.last[-1]))
        split = self.sequence_parallel and whole and sequence_parallel_pays()
        return self.tp_plan(model, sequence_parallel=split)

    def tp_plan(self, model: nn.Module, sequence_parallel: bool = True) -> dict[str, Any]:
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            PrepareModuleInput,
            RowwiseParallel,
            SequenceParallel,
        )

        between = Shard(1) if sequence_parallel else Replicate()  # the residual stream between the matmuls
        plan: dict[str, Any] = {}
        for i in model.blocks:
            b, block = (
                f"blocks.{i}.",
                model.blocks[i],
            )  # a projection a block lacks (an MoE block's MLP) is left out
            plan.update(
                {
                    b + name: ColwiseParallel(input_layouts=between)
                    for name in self.column
                    if _holds(block, name)
                }
            )
            plan.update(
                {
                    b + name: RowwiseParallel(output_layouts=between)
                    for name in self.row
                    if _holds(block, name)
                }
            )
            plan.update(
                {
                    b + name: SequenceParallel(sequence_dim=2, use_local_output=True)
                    for name in self.head_norms
                    if _holds(model.blocks[i], name)
                }
            )
            if sequence_parallel:
                plan.update({b + name: SequenceParallel() for name in self.norms})
        if not sequence_parallel:
            return plan
        rep, seq = (Replicate(),), (Shard(1),)
        if (
            getattr(model, self.first[0], None) is not None
        ):  # the replicated embedding's output: split the sequence
            plan[self.entry] = PrepareModuleInput(
                input_layouts=rep, desired_input_layouts=seq, use_local_output=True
            )
        *norms, head = self.last
        plan.update({name: SequenceParallel() for name in norms if getattr(model, name, None) is not None})
        if getattr(model, head, None) is not None:  # the replicated head sees the whole sequence
            plan[head] = PrepareModuleInput(
                input_layouts=seq, desired_input_layouts=rep, use_local_output=True
            )
        return plan

    def family_fields(self) -> dict[str, Any]:
        """The ModelFamily fields of a family of this shape: ModelFamily(..., **STACK.family_fields())."""
        return {
            "tp_plan": self.plan,
            "tp_sizes": self.sizes,
            "sp_sizes": self.sp_sizes,
            "pp_stage": self.stage,
            "pp_check": self.check,
            "checkpointed": self.blocks,
        }


def _holds(block: nn.Module, name: str) -> bool:
    """Whether `block` has a module at dotted `name` (None where a part is left out)."""
    try:
        return block.get_submodule(name) is not None
    except AttributeError:
        return False


def _values(cfg: Any, keys: Sequence[str]) -> list[tuple[str, int]]:
    """(key, value) of each dotted `keys` set in cfg."""
    out = []
    for key in keys:
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name, None)
        if value is not None:
            out.append((key, value))
    return out


def sequence_parallel_pays(backend: str | None = None) -> bool:
    """Sequence parallelism pays over NCCL and not over gloo (benchmarks/RESULTS.md §16); `backend`: the default
    process group's (none initialised: no sequence parallelism)."""
    if backend is None:
        import torch.distributed as dist

        backend = str(dist.get_backend()) if dist.is_available() and dist.is_initialized() else "none"
    return "nccl" in backend


def check_heads(model: nn.Module, tp: int, names: Sequence[str] = ("n_head", "n_embd", "n_kv_head")) -> None:
    """The model's heads and width divisible by tp (a UserError otherwise)."""
    for what in names:
        value = getattr(model, what, None)
        if value is not None and value % tp:
            raise UserError(
                f"model.{what}={value} cannot be split over dist.tp={tp} ranks (it must be a multiple of {tp})",
                f"use a model.{what} that is a multiple of {tp}, or another dist.tp",
            )
