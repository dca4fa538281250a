"""Tensor parallel, zero2, CPU offload and activation checkpointing on one device mesh (real gloo processes).

Time budget: about 180 s on a quiet 2-core machine (the session's single-process reference, conftest.gpt_reference,
tiny GPT: 2 layers, width 32, context 16; 6 optimizer steps per `ddpkit train` layout, seven layouts; one 2-process
prepare() run of four layouts, 3 steps each). Measured: 231 s with the load average falling from 11 to 2, 443 s at
load average 13-16 (before the reference was shared and the prepare() steps cut from 6 to 3).
"""

from __future__ import annotations

import pytest

from ddpkit.errors import UserError
from ddpkit.parallel.mesh import Layout, layout_of


def test_layout_coordinates_put_tensor_peers_next_to_each_other():
    layout = Layout(dp=2, tp=2, pp=2)
    assert layout.world_size == 8
    assert [layout.coords(r) for r in (0, 1, 2, 5, 7)] == [
        {"pp": 0, "dp": 0, "tp": 0, "dp_replicate": 0, "dp_shard": 0, "ep": 0, "edp": 0},
        {"pp": 0, "dp": 0, "tp": 1, "dp_replicate": 0, "dp_shard": 0, "ep": 0, "edp": 0},
        {"pp": 0, "dp": 1, "tp": 0, "dp_replicate": 0, "dp_shard": 1, "ep": 0, "edp": 1},
        {"pp": 1, "dp": 0, "tp": 1, "dp_replicate": 0, "dp_shard": 0, "ep": 0, "edp": 0},
        {"pp": 1, "dp": 1, "tp": 1, "dp_replicate": 0, "dp_shard": 1, "ep": 0, "edp": 1},
    ]
    # one counting rank per dp replica: tensor rank 0 of the last stage
    assert [r for r in range(8) if layout.counts(r)] == [4, 6]
    assert layout.describe(3) == "dp_replicate=0 dp_shard=1 dp=1 tp=1 pp=0"


GPT = ["model.arch=gpt", "model.n_layer=2", "model.n_head=4", "model.n_embd=32", "data.block_size=16"]
TWO = ["--nproc-per-node", "2"]


@pytest.mark.parametrize(
    "args, fragment",
    [
        (
            ["dist.tp=2", *GPT, "--nproc-per-node", "3"],
            "3 process(es) cannot be split into dist.tp=2 x dist.pp=1",
        ),
        ([*GPT, "model.n_head=2", "model.n_embd=30", "dist.tp=4", "--nproc-per-node", "4"], "model.n_head=2"),
        (["dist.tp=2", *TWO], "model.arch=cnn has none"),
        ([*GPT, "dist.tp=2", "dist.strategy=ddp", *TWO], "dist.strategy=ddp cannot run over tensor-parallel"),
        (
            [*GPT, "dist.tp=2", "dist.strategy=zero1", *TWO],
            "dist.strategy=zero1 cannot run over tensor-parallel",
        ),
        (["dist.offload=cpu", "dist.strategy=ddp", *TWO], "dist.offload=cpu needs a strategy that shards"),
        (["dist.offload=cpu"], "dist.offload=cpu needs several data-parallel processes"),
        (["model.activation_checkpointing=full"], "model.arch=cnn has none"),
    ],
)
def test_layouts_that_cannot_work_are_one_line_before_any_worker_starts(tmp_path, capsys, args, fragment):
    from ddpkit import cli

    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_:
        cli.main(["train", *args, f"out_dir={out}"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and err.startswith("ddpkit: error: "), err
    assert fragment in err
    assert not out.exists()


def test_the_context_must_divide_over_tp_only_where_sequence_parallelism_splits_it():
    """Over gloo (and on a pipeline stage) the plan keeps the sequence whole, so any data.block_size runs; over
    NCCL on a whole model sequence parallelism splits it over the tensor ranks: one line before workers start."""
    from ddpkit.config import load_config
    from ddpkit.parallel.plan import check_config

    odd = [*GPT, "data.block_size=15", "dist.tp=2"]
    for backend in ("gloo", None):  # None: no process group (ddpkit.prepare, an in-process check)
        assert check_config(load_config(None, odd), 2, backend=backend).tp == 2
    assert check_config(load_config(None, [*odd, "dist.pp=2"]), 4, backend="nccl").pp == 2
    with pytest.raises(UserError) as e:
        check_config(load_config(None, odd), 2, backend="nccl")
    assert e.value.line() == (
        "data.block_size=15 cannot be split over dist.tp=2 ranks (it must be a multiple of 2) "
        "(use a data.block_size that is a multiple of 2, or another dist.tp)"
    )
    assert check_config(load_config(None, [*GPT, "dist.tp=2"]), 2, backend="nccl").tp == 2


def test_a_layout_error_is_one_line_from_the_command_line(tmp_path):
    from conftest import assert_user_error, run_cli

    proc = run_cli("train", *GPT, "model.n_head=6", "model.n_embd=48", "dist.tp=4", "--nproc-per-node", "4")
    assert_user_error(proc, "model.n_head=6 cannot be split over dist.tp=4 ranks")


def test_prepare_refuses_a_layout_it_cannot_make():
    import ddpkit

    model = _gpt()
    with pytest.raises(UserError, match=r"prepare\(tp=2\): 1 process\(es\) cannot be split"):
        ddpkit.prepare(model, tp=2)
    with pytest.raises(UserError, match="got a tp_plan but tp=1"):
        ddpkit.prepare(model, tp_plan={})


def test_layout_of_divides_the_world():
    assert layout_of(4, tp=2) == Layout(dp=2, tp=2, pp=1)
    assert layout_of(8, tp=2, pp=2) == Layout(dp=2, tp=2, pp=2)
    with pytest.raises(UserError, match="cannot be split into dist.tp=2 x dist.pp=2"):
        layout_of(6, tp=2, pp=2)


# ------------------------------------------------------------------ the library parts, on real gloo processes

VOCAB, BLOCK, GLOBAL_BATCH, STEPS, LR = 11, 16, 4, 3, 0.5


def _batches():
    import torch

    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (GLOBAL_BATCH, BLOCK + 1), generator=g) for _ in range(STEPS)]


def _gpt():
    import torch

    from ddpkit.models.gpt.model import GPT

    torch.manual_seed(0)
    return GPT(vocab_size=VOCAB, block_size=BLOCK, n_layer=2, n_head=4, n_embd=32)


class TinyTransformer:
    """A user's own small transformer (built lazily: torch is imported in the workers)."""

    @staticmethod
    def make():
        import torch
        import torch.nn as nn

        class Mixer(nn.Module):
            def __init__(self, d):
                super().__init__()
                self.norm, self.up, self.down = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

            def forward(self, x):
                return x + self.down(torch.relu(self.up(self.norm(x))))

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.emb = nn.Embedding(VOCAB, 16)
                self.layers = nn.Sequential(Mixer(16), Mixer(16))
                self.out = nn.Linear(16, VOCAB)

            def forward(self, x):
                return self.out(self.layers(self.emb(x)))

        torch.manual_seed(0)
        return Net()

    @staticmethod
    def plan():
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        return {
            f"layers.{i}.{n}": s()
            for i in (0, 1)
            for n, s in (("up", ColwiseParallel), ("down", RowwiseParallel))
        }


def _train(model, opt, batches):
    from ddpkit.models.gpt.model import lm_loss

    for d in batches:
        lm_loss(model(d[:, :-1]), d[:, 1:]).backward()
        opt.step()
        opt.zero_grad()


def _full(model) -> dict:
    from ddpkit.checkpoint.state_dict import model_state

    return {k: v.numpy().copy() for k, v in model_state(model).items()}  # plain arrays through the queue


def _single(make) -> dict:
    import torch

    model = make()
    _train(model, torch.optim.SGD(model.parameters(), lr=LR), _batches())
    return model.state_dict()


def _prepared_run(rank, world_size, make, options):
    """prepare(model, optimizer, **options) on each rank, then STEPS steps of its dp shard; the full weights."""
    import torch

    import ddpkit
    from ddpkit.parallel.mesh import layout_of
    from ddpkit.parallel.mesh.activation import checkpoint_blocks

    options = dict(options)
    checkpointed = options.pop("checkpointing", False)
    model = make()
    if checkpointed:
        checkpoint_blocks(model.blocks.values())
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    model, opt = ddpkit.prepare(model, opt, **options)
    layout = layout_of(world_size, options.get("tp", 1))
    j, share = layout.coords(rank)["dp"], GLOBAL_BATCH // layout.dp
    _train(model, opt, [d[j * share : (j + 1) * share] for d in _batches()])
    return _full(model)


def _assert_close(got: dict, want: dict, tol: float = 1e-4) -> None:
    import torch

    got = {k: torch.as_tensor(v) for k, v in got.items()}
    assert set(got) == set(want)
    for k in want:
        # relative to the tensor's scale (a key bias has no gradient and stays near zero)
        scale = max(want[k].abs().max().item(), 1e-2)
        assert (got[k] - want[k]).abs().max().item() <= tol * scale, k
    num = sum((got[k] - want[k]).norm() ** 2 for k in want) ** 0.5
    den = sum(want[k].norm() ** 2 for k in want) ** 0.5
    assert float(num / den) <= tol
    assert torch.isfinite(torch.tensor(float(num)))


def _layouts_on_two(rank, world_size):
    from ddpkit.models.gpt.model import STACK

    return {
        "tp2": _prepared_run(rank, world_size, _gpt, {"tp": 2}),
        "tp2_sp": _prepared_run(  # sequence parallel, the default over NCCL, by hand on gloo
            rank, world_size, _gpt, {"tp": 2, "tp_plan": STACK.tp_plan(_gpt(), sequence_parallel=True)}
        ),
        "user_tp2": _prepared_run(
            rank, world_size, TinyTransformer.make, {"tp": 2, "tp_plan": TinyTransformer.plan()}
        ),
        "zero2_ckpt": _prepared_run(rank, world_size, _gpt, {"strategy": "zero2", "checkpointing": True}),
    }


@pytest.fixture(scope="module")
def references():
    return {"gpt": _single(_gpt), "user": _single(TinyTransformer.make)}


def test_prepare_layouts_on_two_ranks_equal_one_process(references):
    from conftest import run_group

    out = run_group(_layouts_on_two, 2, timeout=240)[0]  # the full state is gathered on rank 0
    _assert_close(out["tp2"], references["gpt"])
    _assert_close(out["tp2_sp"], references["gpt"])
    _assert_close(out["zero2_ckpt"], references["gpt"])
    _assert_close(out["user_tp2"], references["user"])


def test_sequence_parallelism_is_in_the_built_in_plan_over_nccl_only():
    """Over gloo its all-gather and reduce-scatter per block cost more than they save (benchmarks/RESULTS.md
    §16): the plan built there is the plain Colwise/Rowwise one; over NCCL (and on a stage: never) as before."""
    import torch.distributed as dist
    from torch.distributed.tensor.parallel import SequenceParallel

    from conftest import free_port
    from ddpkit.models.blocks import sequence_parallel_pays
    from ddpkit.models.gpt.model import STACK

    assert sequence_parallel_pays("nccl") and sequence_parallel_pays("cpu:gloo,cuda:nccl")
    assert not sequence_parallel_pays("gloo") and not sequence_parallel_pays("none")
    model = _gpt()
    assert not any(isinstance(s, SequenceParallel) for s in STACK.plan(model, 2).values())  # no group: off
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        assert dist.get_backend() == "gloo"
        assert not any(isinstance(s, SequenceParallel) for s in STACK.plan(model, 2).values())
    finally:
        dist.destroy_process_group()
    sp = STACK.tp_plan(model, sequence_parallel=sequence_parallel_pays("nccl"))
    assert sum(isinstance(s, SequenceParallel) for s in sp.values()) == 2 * model.n_layer + 1  # norms, ln_f


# ----------------------------------------------------------- `ddpkit train` on the built-in transformer, per layout

GLOBAL = 8  # samples per optimizer step in every layout: train.batch_size x dp (conftest.GPT_GLOBAL_BATCH)
# (name, extra settings, processes, data-parallel degree, {memory field: at most this fraction of one process's})
# The docs' commands are these with the tiny model.
LAYOUTS = [
    ("ddp", ["dist.strategy=ddp"], 2, 2, {}),
    ("zero1", ["dist.strategy=zero1"], 2, 2, {"optim": 0.6}),
    ("zero2", ["dist.strategy=zero2"], 2, 2, {"grad": 0.6, "optim": 0.6}),
    ("fsdp_offload", ["dist.strategy=fsdp", "dist.offload=cpu"], 2, 2, {"param": 0.6, "optim": 0.6}),
    ("tp2", ["dist.tp=2"], 2, 1, {"param": 0.8, "grad": 0.8, "optim": 0.8}),
    ("dp2xtp2", ["dist.tp=2"], 4, 2, {"param": 0.4, "optim": 0.4}),
    ("checkpointing", ["model.activation_checkpointing=full"], 1, 1, {}),
]


def _ddpkit_train(root, out, extra: list[str], nproc: int, dp: int):
    """`ddpkit train` of conftest.GPT_RUN + extra, 6 steps, on `nproc` processes: (full weights of last.pt,
    metrics rows)."""
    from conftest import gpt_train, metrics_rows
    from ddpkit.checkpoint import load_checkpoint

    gpt_train(out, root, nproc, "train.max_steps=6", *extra, dp=dp)
    state = load_checkpoint(out / "checkpoints" / "last.pt", map_location="cpu")
    return state["model"], metrics_rows(out)


@pytest.mark.parametrize("name, extra, nproc, dp, memory", LAYOUTS, ids=[layout[0] for layout in LAYOUTS])
@pytest.mark.slow
def test_ddpkit_train_layout_equals_one_process(
    gpt_reference, gpt_text, tmp_path, name, extra, nproc, dp, memory
):
    weights, rows = _ddpkit_train(gpt_text, tmp_path / "run", extra, nproc, dp)
    want_weights, want_rows = gpt_reference  # one process, the same 6 steps (shared by the session)
    _assert_close(weights, want_weights)
    assert rows[-1]["step"] == 6 and rows[-1]["global_batch_size"] == GLOBAL
    for key in ("train_loss", "val_loss"):  # every sample counted once, whatever the layout
        assert rows[-1][key] == pytest.approx(want_rows[-1][key], rel=1e-4), key
    for what, most in memory.items():  # rank 0's own tensors, measured at the first optimizer step
        field = f"{what}_bytes_per_rank"
        assert rows[0][field] <= most * want_rows[0][field], (field, rows[0][field], want_rows[0][field])


def _lean_on_two(rank, world_size):
    """prepare(strategy="fsdp", memory="lean") of the GPT, STEPS steps: its units, the heap's threshold after it,
    the full weights; then a second model under memory="fast" for its units."""
    import torch
    from torch.distributed.fsdp import FSDPModule

    import ddpkit
    from ddpkit.distributed import allocator

    def units(model) -> list[str]:
        return sorted(
            name for name, m in model.named_modules() if isinstance(m, FSDPModule) and m is not model
        )

    before = allocator.applied()
    model = _gpt()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    model, opt = ddpkit.prepare(model, opt, strategy="fsdp", memory="lean")
    share = GLOBAL_BATCH // world_size
    _train(model, opt, [d[rank * share : (rank + 1) * share] for d in _batches()])
    fast = ddpkit.prepare(_gpt(), strategy="fsdp")
    return {"units": units(model), "fast_units": units(fast), "heap": [before, allocator.applied()]} | {
        "weights": _full(model)
    }


def test_lean_memory_shards_each_blocks_parts_and_equals_one_process(references):
    """memory="lean" (dist.memory=lean): each block's attention and MLP a unit of FSDP2's own (a rank then holds one
    part gathered, not a block and the next prefetched), the CPU heap's mmap threshold at 1 MiB from then on (fresh
    ranks: the pooled ones keep their heap), and the same training as one process."""
    from conftest import run_group

    out = run_group(_lean_on_two, 2, timeout=240, fresh=True)[0]
    assert out["units"] == [f"blocks.{i}.{part}" for i in range(2) for part in ("attn", "mlp")]
    assert out["fast_units"] == ["blocks.0", "blocks.1"]
    assert out["heap"] == [None, 1 << 20]  # ranks started by run_group set no profile before it
    _assert_close(out["weights"], references["gpt"])
