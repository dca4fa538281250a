"""A user's model cut into pipeline stages at module boundaries, each stage running eager code.

torch.fx records the model's own forward once, symbolically, with every submodule kept whole (a call of the
real module) except the containers holding the split points (`pp_split`): the record is the top-level glue
(embedding sums, loops over blocks, a final norm) around calls of the user's modules. It is cut where each split
module is first called; each stage is a torch.fx.GraphModule (Python code, generated once) that calls the user's
own modules, so its parameters are the model's own, under their full names, and it runs as the model does:
dropout and BatchNorm follow train()/eval() as usual, and no copy of the model is made.

Where the forward cannot be recorded this way (control flow on tensor values, a split module called more than
once or not from the forward, values other than tensors crossing a cut), `eager_stages` raises NotEager with the
reason, and the caller falls back on torch's pipeline tracer (pipeline.split.traced_stages), saying so.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Sequence

import torch.fx as fx
import torch.nn as nn

from ddpkit.errors import first_line
from ddpkit.parallel.pipeline.split import Shared, stage_sharing, traced_stages


class NotEager(Exception):
    """The model cannot be cut at module boundaries; the message says why."""


class _ModuleTracer(fx.Tracer):
    """Records calls of submodules as calls (their code runs eagerly), tracing only through the model itself and
    the containers of the split points."""

    def __init__(self, through: set[str]):
        super().__init__()
        self.through = through

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return qualname not in self.through


def _record(model: nn.Module, names: Sequence[str]) -> fx.Graph:
    through = {""} | {n.rsplit(".", k)[0] for n in names for k in range(1, n.count(".") + 1)}
    params = list(inspect.signature(model.forward).parameters.values())
    # arguments after the input that have defaults keep them (model.step passes the input alone)
    concrete = {p.name: p.default for p in params[1:] if p.default is not inspect.Parameter.empty}
    try:
        return _ModuleTracer(through).trace(model, concrete_args=concrete or None)
    except Exception as e:  # fx's refusals are many: control flow on tensors, unsupported Python
        raise NotEager(f"torch.fx could not record its forward: {first_line(e, joined=True)}") from None


def _stage_of_nodes(graph: fx.Graph, names: Sequence[str]) -> dict[fx.Node, int]:
    """The stage of each node: the split modules' first calls begin the stages, in the order of `names`."""

    def under(target: str, name: str) -> bool:
        return target == name or target.startswith(name + ".")

    stage, out = 0, {}
    for node in graph.nodes:
        if (
            stage < len(names)
            and node.op in ("call_module", "get_attr")
            and under(str(node.target), names[stage])
        ):
            stage += 1
        out[node] = len(names) if node.op == "output" else stage
    if stage != len(names):
        after = f" after '{names[stage - 1]}'" if stage else ""
        raise NotEager(f"its forward never calls '{names[stage]}'{after}")
    return out


def _cut(gm: fx.GraphModule, stage_of: dict[fx.Node, int], names: Sequence[str]) -> list[fx.GraphModule]:
    """One GraphModule per stage: stage s takes the values live across the cut before it (the model's inputs for
    the first) and gives those live across the cut after it (the model's output for the last); the cuts are
    where each module of `names` begins."""
    n_stages = len(names) + 1
    nodes = list(gm.graph.nodes)
    live = []  # live[s]: values made at or before stage s and used after it, in the graph's order
    for s in range(n_stages - 1):
        live.append([n for n in nodes if stage_of[n] <= s and any(stage_of[u] > s for u in n.users)])
    stages = []
    for s in range(n_stages):
        graph, env = fx.Graph(), {}
        if s > 0:
            for n in live[s - 1]:
                env[n] = graph.placeholder(n.name)
        for n in nodes:
            if stage_of[n] != s or (n.op == "output" and s != n_stages - 1):
                continue
            env[n] = graph.node_copy(n, env.__getitem__)
        if s < n_stages - 1:
            outs = [env[n] for n in live[s]]
            graph.output(outs[0] if len(outs) == 1 else tuple(outs))
        graph.lint()
        stage = fx.GraphModule(gm, graph, class_name=f"Stage{s}")
        if s < n_stages - 1:  # where each value it gives the next stage comes from (pipeline.passing)
            stage.ddpkit_gives = [f"{_source(n)}, crossing the cut at '{names[s]}'" for n in live[s]]
        stages.append(stage)
    return stages


def _source(node: fx.Node) -> str:
    """Where a recorded value comes from, in a few words."""
    if node.op == "call_module":
        return f"the output of {node.target}"
    if node.op == "placeholder":
        return f"the model's input '{node.target}'"
    name = getattr(node.target, "__name__", str(node.target))
    return f"'{node.name}', from {name}"


# what a recorded forward computes that is not a tensor: sizes, devices, dtypes, numbers derived from them
_NOT_TENSOR_METHODS = {
    "size",
    "dim",
    "numel",
    "item",
    "tolist",
    "stride",
    "element_size",
    "get_device",
    "__len__",
}


def _not_tensor(node: fx.Node) -> bool:
    if node.op == "call_method":
        return node.target in _NOT_TENSOR_METHODS
    if node.op == "call_function":
        if node.target in (getattr, len):  # x.shape, x.device, x.dtype, len(x)
            return True
        operands = [a for a in node.args if isinstance(a, fx.Node)]
        return getattr(node.target, "__module__", None) in ("_operator", "operator") and all(
            _not_tensor(a) for a in operands
        )
    return False


def _check_crossings(stage_of: dict[fx.Node, int], n_stages: int) -> None:
    """Every value crossing a cut is a tensor: what a pipeline stage sends its neighbour."""
    for n, s in stage_of.items():
        if s < n_stages - 1 and any(stage_of[u] > s for u in n.users) and _not_tensor(n):
            raise NotEager(f"a value that is not a tensor ('{n.name}', from {n.target}) crosses a cut")


def eager_stages(
    model: nn.Module, names: Sequence[str]
) -> tuple[list[fx.GraphModule], list[fx.GraphModule] | None]:
    """(every stage, the stages to evaluate with or None) of `model` cut where each module of `names` is first
    called. Evaluation runs the training stages in eval mode, unless the forward's own top-level code reads
    `self.training` (the recorded code differs between the modes): then it runs stages cut from the eval-mode
    record, which call the same modules."""
    modes = [(m, m.training) for m in model.modules()]  # each module's own: a frozen part may be in eval
    try:
        graph = _record(model.train(), names)
        eval_graph = _record(model.eval(), names)
    finally:
        for m, mode in modes:
            m.training = mode
    gm = fx.GraphModule(model, graph)
    stage_of = _stage_of_nodes(graph, names)
    _check_crossings(stage_of, len(names) + 1)
    stages = _cut(gm, stage_of, names)
    for stage in stages:
        stage.ddpkit_model = type(model).__name__
    if eval_graph.python_code("self").src == graph.python_code("self").src:
        return stages, None
    eval_gm = fx.GraphModule(model, eval_graph)
    return stages, _cut(eval_gm, _stage_of_nodes(eval_graph, names), names)


def cut_stages(
    model: nn.Module, names: Sequence[str], example: tuple, wanted: Sequence[int], say: bool
) -> tuple[list[nn.Module], list[nn.Module] | None, list[Shared], bool]:
    """(the stages `wanted`, their evaluation stages or None, the parameters several stages share, whether torch's
    tracer cut them): at module boundaries, or by the tracer on `example` (one micro-batch) where the model
    cannot be cut there, which `say` prints in one line."""
    try:
        stages, eval_stages = eager_stages(model, names)
    except NotEager as e:
        if say:
            print(
                f"ddpkit: warning: {type(model).__name__} cannot be cut at module boundaries ({e}): its pipeline "
                "stages run through torch's tracer, which is slower",
                file=sys.stderr,
                flush=True,
            )
        return (*traced_stages(model, names, example, wanted), True)
    shared = stage_sharing(model, stages)
    evals = None if eval_stages is None else [eval_stages[i] for i in wanted]
    return [stages[i] for i in wanted], evals, shared, False
