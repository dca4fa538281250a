"""A `transformers` model object under `ddpkit.prepare()`: the parallel facts the model declares itself, read
without importing transformers (a model is recognised by what it carries: `config`, `base_model_prefix`).

- **Tensor parallel** (`prepare(model, tp=2)` with no `tp_plan`): the model's own plan, its config's
  `base_model_tp_plan` (names under the base model, e.g. `layers.*.self_attn.q_proj`) and its class's entries (the
  head: `lm_head`), each transformers style name translated into torch.distributed.tensor.parallel's style
  (_translations). A style with no torch counterpart here is refused in one line. The embedding and the head stay
  whole where splitting them cannot work (a weight tied between them, a vocabulary tp does not divide): they are
  optional splits; inside the blocks every entry is checked as a user's plan is (parallel/mesh/tp_plan.py).
- **Pipeline parallel** (`prepare(model, pp=2, loss_fn=...)` with no `pp_split`): the config's
  `base_model_pp_plan` names the base model's parts in order (`embed_tokens`, `layers`, `norm`); the layers (its
  one ModuleList) are cut into equal runs, a stage is the model itself with the layers of other stages (and the
  parts before or after it) replaced by pass-throughs, run through the model's own forward: the first stage takes
  the token ids, a later one the hidden states as `inputs_embeds`, the last gives `.logits` (a causal LM) or
  `.last_hidden_state` (a base model), which `loss_fn` scores. A stage holds the model's own modules under their
  full names (the user's optimizer and checkpoints see one model), as transformers' own pipeline does.
- **FSDP**: the units are the classes of `_no_split_modules` (parallel/strategies/fsdp.py `shard_units`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from torch import nn

from ddpkit.errors import UserError
from ddpkit.parallel.mesh.tp_plan import check_plan, matches, split_size
from ddpkit.parallel.pipeline.split import Shared, stage_sharing
from ddpkit.parallel.strategies.fsdp import repeated_blocks

PLAN = "config.base_model_tp_plan"
PP_PLAN = "config.base_model_pp_plan"


def is_hf_model(model: Any) -> bool:
    """Whether `model` is a transformers PreTrainedModel (by what it carries, transformers not imported)."""
    return (
        isinstance(model, nn.Module)
        and isinstance(getattr(model, "base_model_prefix", None), str)
        and hasattr(getattr(model, "config", None), "base_model_tp_plan")
    )


def advice(model: nn.Module) -> str | None:
    """For a model holding a transformers model (a hand-written wrapper around it), how to do without the
    wrapper; None for any other."""
    for name, m in model.named_modules():
        if name and is_hf_model(m):
            return (
                f"or give prepare() the transformers model inside it ({name}) itself: its own {PP_PLAN} cuts it, "
                "with no wrapper"
            )
    return None


def _base(model: nn.Module) -> tuple[str, nn.Module]:
    """(the base model's name in `model`, the base model): ("model", LlamaModel) for a LlamaForCausalLM, ("",
    model) for the base model itself."""
    prefix = model.base_model_prefix
    inner = model._modules.get(prefix) if prefix else None
    return (prefix, inner) if isinstance(inner, nn.Module) else ("", model)


# ---- tensor parallel --------------------------------------------------------------------------------------


def _translations() -> dict[str, Callable[[], Any] | None]:
    """transformers' style name -> a maker of torch's style doing the same (None: the module stays whole)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    gathered = partial(ColwiseParallel, output_layouts=Replicate())
    whole_input = partial(RowwiseParallel, input_layouts=Replicate())
    return {
        "colwise": ColwiseParallel,  # output features split, the output left split (a rowwise one follows)
        "rowwise": RowwiseParallel,  # input features split, the partial outputs summed
        "colwise_rep": gathered,
        "colwise_gather_output": gathered,
        "rowwise_rep": whole_input,
        "rowwise_split_input": whole_input,
        "embedding_rowwise": whole_input,  # an Embedding: the vocabulary split, the partial lookups summed
        "embedding_colwise": gathered,  # an Embedding: each vector's width split, the slices gathered
        "sequence_parallel": partial(SequenceParallel, use_local_output=True),
        # a norm of each rank's own heads: the weight replicated, its gradient summed over the ranks (any dim of
        # the input but the normalised one may be called the split one: dim 0 always exists)
        "replicated_with_grad_allreduce": partial(SequenceParallel, sequence_dim=0, use_local_output=True),
        "replicate": None,
    }


def declared_tp_plan(model: nn.Module) -> dict[str, str]:
    """{full module name pattern: transformers style name}: the config's base-model plan under the base model's
    name, and the class's own entries (the head)."""
    prefix, _ = _base(model)
    base = dict(getattr(model.config, "base_model_tp_plan", None) or {})
    plan = {(f"{prefix}.{k}" if prefix else k): v for k, v in base.items()}
    own = getattr(type(model), "_tp_plan", None)
    if isinstance(own, dict) and prefix:
        plan.update({k: v for k, v in own.items() if not k.startswith(prefix + ".")})
    return plan


def _block_names(model: nn.Module) -> list[str]:
    """The names of the model's repeated blocks (what the per-block entries of the plan split)."""
    ids = {id(m) for m in repeated_blocks(model)}
    return [n for n, m in model.named_modules() if id(m) in ids]


def _optional(model: nn.Module, entry: str, style: Any, tp: int, blocks: list[str]) -> bool:
    """Whether `entry` (outside the blocks: the embedding, the head) is better left whole: it splits a weight tied
    to another module, or a size tp does not divide."""
    found = matches(model, entry)
    if not found or any(n == b or n.startswith(b + ".") for n, _ in found for b in blocks):
        return False
    tied: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        tied[id(p)] = tied.get(id(p), 0) + 1
    for _, module in found:
        if any(tied[id(p)] > 1 for p in module.parameters(recurse=False)):
            return True
        split = split_size(style, module)
        if split is not None and split[1] % tp:
            return True
    return False


def _check_heads(model: nn.Module, tp: int) -> None:
    config = model.config
    get = getattr(config, "get_text_config", None)
    config = get() if callable(get) else config
    for key in ("num_attention_heads", "num_key_value_heads"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value % tp:
            raise UserError(
                f"ddpkit.prepare(tp={tp}): the model's {key}={value} cannot be split over {tp} ranks",
                f"use a tp that divides {value}",
            )


def tp_plan(model: nn.Module, tp: int) -> dict[str, Any]:
    """torch's parallelize_module plan of `model` over `tp` ranks from the plan the model declares; a UserError
    for a model without one or a style with no torch counterpart here."""
    declared = declared_tp_plan(model)
    if not declared:
        raise UserError(
            f"ddpkit.prepare(tp={tp}): {type(model).__name__} declares no tensor-parallel plan ({PLAN} is empty)",
            "pass torch's plan: tp_plan={'layers.*.mlp.up_proj': ColwiseParallel(), ...}",
        )
    makers = _translations()
    unknown = {k: v for k, v in declared.items() if v not in makers}
    if unknown:
        entry, style = next(iter(unknown.items()))
        raise UserError(
            f"ddpkit.prepare(tp={tp}): {PLAN} splits '{entry}' as '{style}', a transformers style ddpkit does "
            "not translate",
            "pass tp_plan={...}: torch's own plan",
        )
    _check_heads(model, tp)
    blocks = _block_names(model)
    plan = {}
    for entry, name in declared.items():
        maker = makers[name]
        if maker is None:
            continue
        style = maker()
        if not _optional(model, entry, style, tp, blocks):
            plan[entry] = style
    check_plan(model, plan, tp, where=f"ddpkit.prepare(tp={tp}) with the model's {PLAN}")
    return plan


# ---- pipeline parallel ------------------------------------------------------------------------------------


class PassThrough(nn.Module):
    """A part of the model another pipeline stage runs: gives back its first input."""

    def forward(self, hidden: Any, *args: Any, **kwargs: Any) -> Any:
        return hidden


class HFStage(nn.Module):
    """One pipeline stage of a transformers model: `shell` is the model with the parts other stages run replaced
    by pass-throughs; its children are this module's, so every parameter has its full-model name."""

    def __init__(self, shell: nn.Module, base: str, first: bool, last: bool):
        super().__init__()
        self._modules = shell._modules
        object.__setattr__(self, "shell", shell)  # not a child: its children are already this module's
        self.base, self.first, self.last = base, first, last
        self.ddpkit_model = type(shell).__name__  # what a refusal calls the model (pipeline.passing)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        given = {"input_ids": x} if self.first else {"inputs_embeds": x}
        if self.last:
            out = self.shell(**given, use_cache=False)
            return _tensor_of(out, "logits" if self.base else "last_hidden_state", self.shell)
        body = self.shell._modules[self.base] if self.base else self.shell
        return _tensor_of(body(**given, use_cache=False), "last_hidden_state", body)


def _tensor_of(out: Any, field: str, module: nn.Module) -> torch.Tensor:
    value = getattr(out, field, None)
    if isinstance(value, torch.Tensor):
        return value
    raise UserError(
        f"ddpkit.prepare(pp=...): {type(module).__name__}'s forward returned a {type(out).__name__} without "
        f"`.{field}`, which its pipeline passes on",
        "pass a causal LM or a base model, or pp_split= and a forward giving a tensor",
    )


def _layers_of(model: nn.Module) -> tuple[str, nn.Module, str, list[str], list[str]]:
    """(base name, base model, the layers' name in it, the plan's parts before them, after them) from the
    model's base_model_pp_plan; a UserError when the plan does not name one ModuleList of layers."""
    base_name, base = _base(model)
    plan = list(dict(getattr(model.config, "base_model_pp_plan", None) or {}))
    lists = [k for k in plan if isinstance(base._modules.get(k), nn.ModuleList)]
    if len(lists) != 1 or any(not isinstance(base._modules.get(k), nn.Module) for k in plan):
        raise UserError(
            f"ddpkit.prepare(pp=...): {type(model).__name__}'s {PP_PLAN} does not name its parts around "
            "one list of layers",
            "pass pp_split= and a model whose forward returns a tensor",
        )
    at = plan.index(lists[0])
    return base_name, base, lists[0], plan[:at], plan[at + 1 :]


def split_names(model: nn.Module, n_stages: int) -> list[str]:
    """The layers where stages 1 .. n_stages-1 begin: the layers cut into runs as equal as they go (the first
    runs one longer), named as model.named_modules() names them."""
    base_name, base, layers, _, _ = _layers_of(model)
    n = len(base._modules[layers])
    if n < n_stages:
        raise UserError(
            f"ddpkit.prepare: {type(model).__name__} has {n} layers, too few for {n_stages} pipeline stages",
            f"use at most {n} stages (pp x the schedule's stages per rank)",
        )
    per, extra = divmod(n, n_stages)
    starts = [s * per + min(s, extra) for s in range(1, n_stages)]
    where = f"{base_name}.{layers}" if base_name else layers
    return [f"{where}.{i}" for i in starts]


def _shell(module: nn.Module, parts: dict[str, nn.Module]) -> nn.Module:
    """A shallow copy of `module` (the same parameters, config and forward) whose children `parts` replace."""
    out = copy.copy(module)
    out._modules = {**module._modules, **parts}
    return out


def stages(model: nn.Module, names: Sequence[str]) -> list[HFStage]:
    """Every pipeline stage of `model`, cut where each layer of `names` begins (split_names' form)."""
    base_name, base, layers, before, after = _layers_of(model)
    where = f"{base_name}.{layers}." if base_name else f"{layers}."
    layer_list = base._modules[layers]
    starts = [0]
    for name in names:
        if not name.startswith(where) or not name[len(where) :].isdigit():
            raise UserError(
                f"ddpkit.prepare: pp_split names '{name}'; a cut by {type(model).__name__}'s {PP_PLAN} begins stages "
                "at layers",
                f"name layers as '{where}N', in order, or leave pp_split out to cut them evenly",
            )
        starts.append(int(name[len(where) :]))
    bounds = list(zip(starts, starts[1:] + [len(layer_list)], strict=True))
    out = []
    for s, (lo, hi) in enumerate(bounds):
        first, last = s == 0, s == len(bounds) - 1
        kept = nn.ModuleList([m if lo <= i < hi else PassThrough() for i, m in enumerate(layer_list)])
        parts = {layers: kept}
        parts.update({k: PassThrough() for k in before if not first})
        parts.update({k: PassThrough() for k in after if not last})
        inner = _shell(base, parts)
        if base_name:
            top = {k: PassThrough() for k in model._modules if k != base_name and not last}
            shell = _shell(model, {base_name: inner, **top})
        else:
            shell = inner
        out.append(HFStage(shell, base_name, first, last))
    return out


def pipeline_cut(model: nn.Module, names: Sequence[str]) -> Callable:
    """What PipelineModel calls to cut `model` (its `cut`): the stages `wanted`, no evaluation twins, and the
    parameters several stages use (a head tied to the embedding)."""

    def cut(wanted: Sequence[int]) -> tuple[list[nn.Module], None, list[Shared]]:
        every = stages(model, names)
        return [every[i] for i in wanted], None, stage_sharing(model, every)

    return cut


__all__ = ["HFStage", "declared_tp_plan", "is_hf_model", "pipeline_cut", "split_names", "stages", "tp_plan"]
