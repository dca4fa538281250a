"""Pipeline parallelism on real gloo processes: `ddpkit train` on the built-in GPT under pp2 (gpipe, 1f1b,
interleaved 1F1B), dp2 x pp2 (1F1B and GPipe) and tp2 x pp2 ends with the full weights of the single-process
run on the same global batch (6 SGD steps, dropout 0) and with its validation loss; `ddpkit.prepare(pp=2,
pp_split=...)` on a user's own small transformer the same; the settings a pipeline cannot run with are one
error line each.

Time budget: ~150 s on a quiet 2-core machine (one shared single-process reference, seven 2- and 4-process runs
of a 4-block GPT on a 4 KB text file, one 2-process prepare() run, one refused command); the rest runs
in-process in well under a second each. Measured: 395 s at load average 17 (other suites running).
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

import ddpkit
import pipeline_user_model as user
from conftest import assert_user_error, run_cli
from ddpkit.config import load_config
from ddpkit.errors import UserError
from ddpkit.models.blocks import block_ranges
from ddpkit.parallel.pipeline.plan import check_pipeline, stage_ids

TINY = [
    "model.arch=gpt",
    "data.dataset=text",
    "data.block_size=8",
    "model.n_layer=4",
    "model.n_head=2",
    "model.n_embd=16",
    "model.dropout=0",
    "optim.name=sgd",
    "optim.lr=0.5",
    "optim.ref_batch_size=8",  # lr 0.5 as it is (the global batch is 8): 6 steps move the weights well
    "train.clip_grad_norm=0.5",
    "train.max_steps=6",
    "train.log_every=2",  # a progress line every 2 steps: the loss it shows is checked
    "train.epochs=1",
    "report.curves=false",
]
GLOBAL_BATCH = 8


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    import random

    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "pipe", "stage", "block", "token"]
    path = tmp_path_factory.mktemp("text") / "corpus.txt"
    path.write_text(" ".join(rng.choice(words) for _ in range(600)))
    return path


def _train(out, text_file, *extra: str, nproc: int = 1) -> dict:
    """A tiny `ddpkit train` run; its final weights and last metrics line."""
    args = ["train", *TINY, f"data.root={text_file}", f"out_dir={out}", *extra]
    if nproc > 1:
        args += ["--nproc-per-node", str(nproc)]
    proc = run_cli(*args)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    state = torch.load(out / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"model": state["model"], "row": rows[-1], "log": proc.stdout}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, text_file):
    return _train(tmp_path_factory.mktemp("single"), text_file, f"train.batch_size={GLOBAL_BATCH}")


def _relative_error(got: dict, ref: dict) -> float:
    """||got - ref|| / ||ref|| over every tensor of the full model (the same keys required)."""
    assert set(got) == set(ref)
    num = sum(float(((got[k].double() - ref[k].double()) ** 2).sum()) for k in ref)
    den = sum(float((ref[k].double() ** 2).sum()) for k in ref)
    return (num / den) ** 0.5


LAYOUTS = {
    "pp2-gpipe": (2, ["dist.pp=2", "dist.pp_schedule=gpipe"], GLOBAL_BATCH),
    "pp2-1f1b": (2, ["dist.pp=2", "dist.pp_schedule=1f1b"], GLOBAL_BATCH),
    "pp2-interleaved": (2, ["dist.pp=2", "dist.pp_schedule=interleaved_1f1b"], GLOBAL_BATCH),
    "dp2xpp2": (4, ["dist.pp=2"], GLOBAL_BATCH // 2),
    # GPipe's forwards before backwards are what DDP around a stage needs find_unused_parameters for
    "dp2xpp2-gpipe": (4, ["dist.pp=2", "dist.pp_schedule=gpipe"], GLOBAL_BATCH // 2),
    # each stage split over a tensor-parallel pair (parallel/mesh/tensor.py's plan, per stage)
    "tp2xpp2": (4, ["dist.pp=2", "dist.tp=2"], GLOBAL_BATCH),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.slow
def test_ddpkit_train_under_a_pipeline_equals_the_single_process_run(layout, reference, tmp_path, text_file):
    nproc, settings, batch = LAYOUTS[layout]
    run = _train(tmp_path / "run", text_file, *settings, f"train.batch_size={batch}", nproc=nproc)
    assert _relative_error(run["model"], reference["model"]) < 1e-4  # full-model names, every stage's weights
    # exact evaluation through the stages: the same validation loss, every sample once
    assert run["row"]["val_samples"] == reference["row"]["val_samples"]
    assert run["row"]["val_loss"] == pytest.approx(reference["row"]["val_loss"], rel=1e-4)
    assert run["row"]["train_loss"] == pytest.approx(reference["row"]["train_loss"], rel=1e-4)
    assert f"global batch {GLOBAL_BATCH} " in run["log"]
    # rank 0 runs the first stage: its progress line shows the last stage's loss (never nan), which with one
    # data-parallel replica is the one-process run's (with two, replica 0's half of the batch, as under DDP)
    shown = _progress(run["log"])
    if "dp2" not in layout:
        assert shown == _progress(reference["log"])
    # rank 0 holds its stages only: at most 0.8 of the whole model's parameter bytes (the bound)
    assert run["row"]["param_bytes_per_rank"] <= 0.8 * reference["row"]["param_bytes_per_rank"]


def _progress(log: str) -> dict[int, str]:
    """{step: the loss its progress line shows}."""
    shown = {int(step): loss for step, loss in re.findall(r"== step: \[\s*(\d+)/\d+\].*\| loss: (\S+)", log)}
    assert shown and "nan" not in shown.values(), log[-2000:]
    return shown


@pytest.mark.slow
def test_the_progress_line_of_a_pipeline_shows_the_loss_also_after_a_resume(reference, tmp_path, text_file):
    out = tmp_path / "run"
    _train(out, text_file, "dist.pp=2", f"train.batch_size={GLOBAL_BATCH}", "train.max_steps=3", nproc=2)
    resumed = _train(out, text_file, "dist.pp=2", f"train.batch_size={GLOBAL_BATCH}", nproc=2)
    assert "resum" in resumed["log"].lower()
    shown = _progress(resumed["log"])
    assert set(shown) == {4, 6}  # the steps after the resume, each the epoch's running loss so far
    assert shown == {k: v for k, v in _progress(reference["log"]).items() if k in shown}


# ---------------------------------------------------------------------------- a user's model through prepare


@pytest.fixture(scope="module")
def user_reference():
    return user.single()


@pytest.mark.slow
def test_prepare_pp2_on_a_users_model_equals_its_single_process_run(user_reference):
    ranks = ddpkit.launch(user.piped, 2, "1f1b", nprocs=2)
    got = {k: torch.from_numpy(v) for k, v in ranks[0]["state"].items()}
    ref = {k: torch.from_numpy(np.asarray(v)) for k, v in user_reference["state"].items()}
    assert ranks[1]["state"] is None  # the full state is gathered on rank 0
    assert _relative_error(got, ref) < 1e-4
    for r in ranks:  # exact evaluation, on every rank
        assert r["val_loss"] == pytest.approx(user_reference["val_loss"], rel=1e-5)
    assert ranks[0]["losses"] == ranks[1]["losses"]  # the loss reaches the first stage too
    # the unported script's batches, in its order: the same loss at every step
    assert ranks[0]["losses"] == pytest.approx(user_reference["losses"], rel=1e-5)
    for r in ranks:  # model.eval() before the validation and model.train() after reach every stage module
        assert r["modes"]["eval"] == r["modes"]["evaluated"] == [False] * len(r["modes"]["train"])
        assert r["modes"]["train"] == [True] * len(r["modes"]["train"]) and len(r["modes"]["train"]) > 5


@pytest.mark.slow
def test_a_channels_last_conv_net_under_pp2_equals_its_single_process_run():
    """Stages computing in channels_last send contiguous activations forward and contiguous gradients back
    (point-to-point sends take no other layout): the run equals the one-process run."""
    ranks = ddpkit.launch(user.conv_piped, 2, nprocs=2)
    ref = user.conv_single()
    got = {k: torch.from_numpy(v) for k, v in ranks[0]["state"].items()}
    assert _relative_error(got, {k: torch.from_numpy(v) for k, v in ref["state"].items()}) < 1e-4
    assert ranks[0]["val_loss"] == pytest.approx(ref["val_loss"], rel=1e-5)


def test_contiguous_edges_change_no_value_and_send_the_standard_layout():
    from ddpkit.parallel.pipeline.runner import ContiguousEdges

    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    x = torch.randn(2, 3, 6, 6, requires_grad=True)
    plain = conv(x)
    assert not plain.is_contiguous()  # what a send would refuse
    (gx,) = torch.autograd.grad(plain.sum(), x)
    x2 = x.detach().clone().requires_grad_()
    out = ContiguousEdges(conv)(x2)
    out.sum().backward()
    assert out.is_contiguous() and x2.grad.is_contiguous()
    assert torch.equal(out, plain) and torch.equal(x2.grad, gx)


# ------------------------------------------------------------------------------------------ the plan, refusals


def test_stages_and_blocks_of_each_schedule():
    assert stage_ids(1, 2, "1f1b") == [1] and stage_ids(1, 2, "interleaved_1f1b") == [1, 3]
    assert block_ranges(4, 2) == [range(0, 2), range(2, 4)]


REFUSED = {
    "train.amp=fp16": "train.amp=fp16 cannot run with dist.pp=2",
    "dist.grad_compression=fp16": "dist.grad_compression=fp16 cannot run with dist.pp=2",
    "dist.strategy=zero1": "dist.strategy=zero1 cannot run with dist.pp=2",
    "model.n_layer=3": "model.n_layer=3 blocks cannot be cut into 2 equal pipeline stages",
    "train.batch_size=6": "train.batch_size=6 cannot be cut into dist.pp_microbatches=4 equal parts",
    "model.arch=cnn": "model.arch=cnn has no pipeline split",
    "model.sync_bn=true": "model.sync_bn=true cannot run with dist.pp=2",
    "dist.pp_microbatches=1": "dist.pp_microbatches=1 is fewer than the 2 pipeline ranks (dist.pp=2)",
}


@pytest.mark.parametrize("setting", list(REFUSED))
def test_what_a_pipeline_cannot_run_is_refused_before_workers_start(setting):
    base = {k.split("=")[0]: k for k in [*TINY, "dist.pp=2", "train.batch_size=8"]}
    base[setting.split("=")[0]] = setting
    with pytest.raises(UserError) as e:
        check_pipeline(load_config(None, list(base.values())), world_size=2)
    assert REFUSED[setting] in e.value.line()


def test_the_refusal_is_one_line_from_the_command(tmp_path, text_file):
    proc = run_cli(
        "train",
        *TINY,
        f"data.root={text_file}",
        "dist.pp=2",
        "train.amp=fp16",
        f"out_dir={tmp_path}/r",
        "--nproc-per-node",  # two processes can hold two stages: the refusal is the setting's, before they start
        "2",
    )
    assert_user_error(proc, "train.amp=fp16 cannot run with dist.pp=2")
    assert not (tmp_path / "r").exists()


def test_prepare_refuses_a_split_that_is_not_the_models():
    from ddpkit.parallel.pipeline.split import check_split_names

    with pytest.raises(UserError, match="'blocks.9', which is not a module of TinyLM"):
        check_split_names(user.TinyLM(), ["blocks.9"], 2)
    with pytest.raises(UserError, match="cut the model into 3 stage"):
        check_split_names(user.TinyLM(), ["blocks.1", "blocks.2"], 2)
    with pytest.raises(UserError, match="lists 'blocks.1' after 'blocks.2'.* order the model's forward"):
        check_split_names(user.TinyLM(), ["blocks.2", "blocks.1"], 3)
    with pytest.raises(UserError, match="lists 'blocks.1.mlp' after 'blocks.1'"):
        check_split_names(user.TinyLM(), ["blocks.1", "blocks.1.mlp"], 3)


class _CheckedSequential(torch.nn.Sequential):
    def forward(self, x):
        assert x.shape[1] == 3, (
            "3 channels"
        )  # a check on a size: torch.fx cannot record it, torch's tracer can
        return super().forward(x)


def test_traced_stages_evaluate_in_eval_mode_on_the_training_stages_tensors(capsys):
    """A forward that cannot be cut at module boundaries is cut by torch's tracer, which rank 0 says in one line.
    The tracer bakes train-mode BatchNorm and dropout into its graph: evaluation runs eval-mode twins of the
    stages on the training stages' parameters and buffers, and gets the model's own eval output."""
    import torch.nn as nn

    from ddpkit.parallel.pipeline.eager import cut_stages

    torch.manual_seed(0)
    model = _CheckedSequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Dropout(0.5), nn.Flatten(), nn.Linear(4 * 36, 5)
    )
    x = torch.randn(4, 3, 8, 8)
    stages, twins, _, traced = cut_stages(model, ["2"], (x,), [0, 1], say=True)
    lines = capsys.readouterr().err.splitlines()
    assert (
        traced
        and len(lines) == 1
        and lines[0].startswith(
            "ddpkit: warning: _CheckedSequential cannot be cut at module boundaries (torch.fx could not record its "
        )
    )
    assert lines[0].endswith("its pipeline stages run through torch's tracer, which is slower")
    stages[1](stages[0](x))  # a training forward: the running statistics move, in the model's own buffers
    assert float(model[1].running_mean.abs().sum()) > 0

    def run(k, h):
        tensors = {**dict(stages[k].named_parameters()), **dict(stages[k].named_buffers())}
        return torch.func.functional_call(twins[k], tensors, (h,))

    with torch.no_grad():
        got = run(1, run(0, x))
        assert torch.equal(got, model.eval()(x))


# ----------------------------------------------------------------- stages cut at module boundaries (eager)


class _Net(torch.nn.Module):
    """BatchNorm and dropout in modules, a top-level sum of two branches: what eager stages must run as is."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(6, 6)
        self.skip = torch.nn.Linear(6, 6)
        self.layers = torch.nn.ModuleList(
            [torch.nn.Sequential(torch.nn.BatchNorm1d(6), torch.nn.Dropout(0.5)), torch.nn.Linear(6, 3)]
        )

    def forward(self, x):
        h = self.a(x) + self.skip(x)
        for layer in self.layers:
            h = layer(h)
        return h


class _TopLevelDropout(_Net):
    def forward(self, x):  # reads self.training in its own code: the record differs between the modes
        h = torch.nn.functional.dropout(self.a(x), 0.5, self.training)
        return self.layers[1](h)


class _Branchy(_Net):
    def forward(self, x):
        if x.sum() > 0:  # control flow on a tensor's value: torch.fx cannot record it
            x = x * 2
        return self.layers[1](self.a(x))


class _SizeCrossesTheCut(_Net):
    def forward(self, x):
        n = x.size(0)
        return self.layers[1](self.a(x)).view(n, -1)


def test_eager_stages_call_the_models_own_modules_in_its_own_mode(capsys):
    """Each stage is the forward's own code up to the next split point, calling the model's modules (no copy):
    a training forward moves the model's BatchNorm statistics, eval mode switches its dropout off, and a forward
    whose own code reads self.training gets evaluation stages recorded in eval mode. Forwards that cannot be cut
    at module boundaries say why."""
    from ddpkit.parallel.pipeline.eager import NotEager, cut_stages, eager_stages

    torch.manual_seed(0)
    model, x = _Net(), torch.randn(8, 6)
    stages, eval_stages = eager_stages(model, ["layers.1"])
    assert eval_stages is None
    assert (
        stages[0].get_submodule("layers.0") is model.layers[0]
        and stages[1].get_submodule("layers.1") is model.layers[1]
    )
    assert dict(stages[1].named_parameters()) == {
        k: v for k, v in model.named_parameters() if k.startswith("layers.1")
    }
    torch.manual_seed(1)
    got = stages[1](stages[0](x))
    torch.manual_seed(1)
    want = model(x)
    assert torch.equal(got, want)
    assert float(model.layers[0][0].running_mean.abs().sum()) > 0  # the model's own buffers moved
    for s in stages:
        s.eval()
    with torch.no_grad():
        assert torch.equal(stages[1](stages[0](x)), model.eval()(x))

    top = _TopLevelDropout().train()
    stages, eval_stages = eager_stages(top, ["layers.1"])
    assert eval_stages is not None and top.training  # recorded in both modes, left in its mode
    with torch.no_grad():
        assert torch.equal(eval_stages[1](eval_stages[0](x)), top.eval()(x))

    for bad, why in [
        (_Branchy(), "torch.fx could not record its forward"),
        (_SizeCrossesTheCut(), "a value that is not a tensor ('size', from size) crosses a cut"),
        (_TopLevelDropout(), "its forward never calls 'layers.0'"),
    ]:
        with pytest.raises(NotEager, match=re.escape(why)):
            eager_stages(bad, ["layers.0" if isinstance(bad, _TopLevelDropout) else "layers.1"])

    # the cut prepare() makes: at module boundaries, silently, the stages this rank runs
    stages, evals, _, traced = cut_stages(_Net(), ["layers.1"], (x,), [1], say=True)
    assert not traced and evals is None and len(stages) == 1 and capsys.readouterr().err == ""
