"""Extension points from outside the package: a data set registered through an entry point trains with ddpkit
train; a model, a strategy and a compression method train on two processes; a model family trains under tp x pp
with activation checkpointing; a launcher is detected before a built-in one; a command runs on two processes.

Time budget: 175 s on 2 cores (four launches of 2 processes, one of 4, a few single processes; measured 116 s
before the family's test)."""

from __future__ import annotations

import os
import re

import pytest

from conftest import REPO, free_port, run_cli
from ddpkit.errors import UserError
from ddpkit.train.metrics import read_metrics

PACKAGE = """
import torch
from torch.utils.data import TensorDataset

from ddpkit.data import DatasetEntry, Splits


def build(cfg):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 3, 8, 8, generator=g)
    y = (x.mean(dim=(1, 2, 3)) > 0).long()
    return Splits(TensorDataset(x[:448], y[:448]), TensorDataset(x[448:], y[448:]),
                  num_classes=2, in_channels=3, image_size=8)


ENTRY = DatasetEntry("signs", build, label="signs of the mean")
"""


def on_path(site) -> str:
    """PYTHONPATH with `site` in front of what this process has (the ddpkit under test, where it is set)."""
    return os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])


def install(site):
    """mydata, installed as pip would (a dist-info with an entry point), on a folder put on PYTHONPATH."""
    (site / "mydata").mkdir(parents=True)
    (site / "mydata" / "__init__.py").write_text(PACKAGE)
    info = site / "mydata-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: mydata\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[ddpkit.datasets]\nsigns = mydata:ENTRY\n")


@pytest.mark.slow
def test_a_data_set_from_another_package_trains_with_ddpkit_train(tmp_path):
    install(tmp_path / "site")
    args = [
        "train",
        "data.dataset=signs",
        "train.epochs=2",
        "train.batch_size=16",
        "model.arch=mlp",
        f"out_dir={tmp_path / 'run'}",
        "--nproc-per-node",
        "2",
    ]
    proc = run_cli(*args, env={"PYTHONPATH": on_path(tmp_path / "site")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metrics(tmp_path / "run")
    assert (
        [r["epoch"] for r in rows] == [1, 2] and rows[-1]["val_samples"] == 64 and rows[-1]["world_size"] == 2
    )


def test_without_the_package_the_name_is_an_unknown_data_set(tmp_path):
    proc = run_cli("train", "data.dataset=signs", f"out_dir={tmp_path / 'run'}")
    assert proc.returncode == 2 and "unknown data.dataset 'signs'" in proc.stderr
    assert not (tmp_path / "run").exists()


def test_the_docs_example_is_the_tested_package():
    doc = (REPO / "docs" / "extending.md").read_text()
    code = re.search(r"```python\n(.*?)```", doc, re.S)[1]
    assert 'DatasetEntry("signs", build' in code and 'signs = "mydata:ENTRY"' in doc
    namespace: dict = {}
    exec(compile(code, "extending.md", "exec"), namespace)  # the doc's package builds the same splits
    splits = namespace["build"](None)
    assert (len(splits.train), len(splits.val), splits.num_classes) == (448, 64, 2)


# ------------------------------------------------- a model, a strategy, a compression method and a launcher

EXTENSIONS = """
from dataclasses import dataclass

import torch
import torch.nn as nn

from ddpkit.commands import Command
from ddpkit.cluster.distenv import DistEnv
from ddpkit.cluster.launchers import LauncherDetector
from ddpkit.config.schema import opt
from ddpkit.models import ModelFamily
from ddpkit.parallel.compression import CompressionMethod
from ddpkit.parallel.strategies.ddp import DDPStrategy
from ddpkit.parallel.strategy import StrategyEntry


def build_tiny(arch, num_classes, in_channels, image_size):
    return nn.Sequential(nn.Flatten(), nn.Linear(in_channels * image_size * image_size, num_classes))


MODEL = ModelFamily("tiny", owns=lambda arch: arch == "tiny", build=build_tiny, names=lambda: ["tiny"])


class RenamedDDP(DDPStrategy):
    name = "myddp"


STRATEGY = StrategyEntry("myddp", RenamedDDP, "DDP under another name", ddp_knobs=True, compression=True)


class Counter:
    calls = 0


def register_half(ddp, options):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    counter = Counter()
    counter.label = options.setting("half_label")  # its own key, dist.half_label

    def hook(state, bucket):
        counter.calls += 1
        return default_hooks.fp16_compress_hook(state, bucket)

    ddp.register_comm_hook(None, hook)
    return counter


@dataclass
class HalfKeys:
    \"\"\"the counted hook's own setting.\"\"\"

    half_label: str = opt("calls", "half: the name its checkpoint state counts under", nonblank=True)


COMPRESSION = CompressionMethod(
    "half", "fp16, counted", register=register_half, state_dict=lambda counter: {counter.label: counter.calls},
    keys=HalfKeys,
)


def read_myl(env):
    rank, size = int(env["MYL_RANK"]), int(env["MYL_SIZE"])
    return DistEnv(rank=rank, local_rank=rank, world_size=size, local_world_size=size,
                   master_addr=env["MASTER_ADDR"], master_port=int(env["MASTER_PORT"]), launcher="myl")


# asked before the built-in pmi (order 400): its jobs set PMI_RANK too
LAUNCHER = LauncherDetector("myl", lambda env: "MYL_RANK" in env, read_myl, world_var="MYL_SIZE", order=350)


def add_flags(parser):
    parser.add_argument("--times", type=int, default=1)


def count_command(cfg, args, ctx):
    import torch.distributed as dist

    total = torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(total)
    print(f"rank {ctx.rank}/{ctx.world_size}: sum {total.item() * args.times:g}", flush=True)


COMMAND = Command(
    "count", "sum the ranks, each plus one", "myext:count_command", config="dist", flags="myext:add_flags"
)


# a language model whose family declares its own parallel facts, written with torch's styles only
class Layer(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class StackLM(nn.Module):
    def __init__(self, vocab_size, width, n_layer):
        super().__init__()
        self.emb = nn.Embedding(vocab_size, width)
        self.layers = nn.ModuleDict({str(i): Layer(width) for i in range(n_layer)})
        self.out = nn.Linear(width, vocab_size)

    def forward(self, x):
        x = self.emb(x) if self.emb is not None else x
        for layer in self.layers.values():
            x = layer(x)
        return self.out(x) if self.out is not None else x


def stack_plan(model, tp):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {f"layers.{i}.up": ColwiseParallel() for i in model.layers}
    return plan | {f"layers.{i}.down": RowwiseParallel() for i in model.layers}


def stack_stage(model, stage, n_stages):
    per = len(model.layers) // n_stages
    for name in list(model.layers):
        if int(name) // per != stage:
            del model.layers[name]
    model.emb = model.emb if stage == 0 else None
    model.out = model.out if stage == n_stages - 1 else None
    return model


@dataclass
class StackKeys:
    \"\"\"the stack's own width.\"\"\"

    my_width: int = opt(0, "stacklm: the layers' width; 0: model.n_embd", ge=0)


STACK_MODEL = ModelFamily(
    "stacklm",
    owns=lambda arch: arch == "stacklm",
    build=None,
    build_lm=lambda arch, vocab_size, block_size, m: StackLM(vocab_size, m.my_width or m.n_embd, m.n_layer),
    keys=(StackKeys,),
    module_types=(StackLM,),
    tp_plan=stack_plan,
    pp_stage=stack_stage,
    pp_check=lambda cfg, n_stages: None,
    checkpointed=lambda model: list(model.layers.values()),
)
"""

ENTRY_POINTS = """[ddpkit.models]
tiny = myext:MODEL
stacklm = myext:STACK_MODEL

[ddpkit.strategies]
myddp = myext:STRATEGY

[ddpkit.compression]
half = myext:COMPRESSION

[ddpkit.launchers]
myl = myext:LAUNCHER

[ddpkit.commands]
count = myext:COMMAND
"""


def install_extensions(site):
    """myext, installed as pip would, declaring one entry of each extension point."""
    (site / "myext").mkdir(parents=True)
    (site / "myext" / "__init__.py").write_text(EXTENSIONS)
    info = site / "myext-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: myext\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(ENTRY_POINTS)


@pytest.mark.slow
def test_a_model_strategy_and_compression_from_another_package_train_on_two_processes(tmp_path):
    import torch

    install_extensions(tmp_path / "site")
    out = tmp_path / "run"
    args = ["train", "model.arch=tiny", "dist.strategy=myddp", "dist.grad_compression=half", "train.epochs=1"]
    proc = run_cli(*args, "dist.half_label=steps", "train.max_steps=5", f"out_dir={out}", "--nproc-per-node", "2",
                   env={"PYTHONPATH": on_path(tmp_path / "site")})  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "strategy myddp" in (out / "log.txt").read_text()
    ckpt = torch.load(out / "checkpoints" / "last.pt", weights_only=True)
    assert set(ckpt["model"]) == {"1.weight", "1.bias"}  # the package's model
    # its hook ran on every step, its state saved under the name its own key (dist.half_label) gave
    assert [s["steps"] for s in ckpt["comm_hook"]] == [5, 5]


@pytest.mark.slow
def test_a_model_family_from_another_package_trains_under_tp_pp_and_checkpointing_as_one_process(
    tmp_path, gpt_text
):
    # its family declares a tensor-parallel plan, a pipeline cut and its checkpointed blocks; ddpkit names none
    from ddpkit.checkpoint import load_checkpoint

    install_extensions(tmp_path / "site")
    env = {"PYTHONPATH": on_path(tmp_path / "site")}
    run = [
        "train",
        "model.arch=stacklm",
        "model.n_layer=2",
        "model.my_width=16",  # a key the family declares
        "data.dataset=text",
        "data.block_size=8",
        "train.batch_size=4",
        "train.max_steps=2",
        "optim.name=sgd",
        "optim.lr=0.5",
        "optim.ref_batch_size=4",
        "optim.schedule=constant",
        "optim.warmup_epochs=0",
        f"data.root={gpt_text}",
    ]
    # fmt: skip
    one = run_cli(*run, f"out_dir={tmp_path / 'one'}", env=env)
    assert one.returncode == 0, one.stderr[-3000:]
    split = ["dist.tp=2", "dist.pp=2", "dist.pp_microbatches=2", "model.activation_checkpointing=full"]
    proc = run_cli(*run, *split, f"out_dir={tmp_path / 'split'}", "--nproc-per-node", "4", "--oversubscribe",
                   env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    want, got = (load_checkpoint(tmp_path / d / "checkpoints" / "last.pt")["model"] for d in ("one", "split"))
    assert set(got) == set(want) and want["layers.1.down.weight"].shape == (16, 32)  # model.my_width=16
    for k in want:
        assert (got[k] - want[k]).abs().max() <= 1e-4 * max(want[k].abs().max().item(), 1e-2), k


def test_a_family_from_another_package_declares_its_own_config_keys(tmp_path, monkeypatch):
    # model.arch names the package's family: it is loaded before the keys are checked, its key joins the schema
    import sys

    from ddpkit.config import describe_keys, load_config
    from ddpkit.config.declared import forget
    from ddpkit.models import MODEL_FAMILIES
    from ddpkit.parallel import compression
    from ddpkit.parallel.compression import Compression

    install_extensions(tmp_path / "site")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    try:
        assert load_config(None, ["model.arch=stacklm", "model.my_width=3"]).model.my_width == 3
        assert load_config(None, ["model.arch=stacklm"]).model.my_width == 0  # its default
        with pytest.raises(UserError) as typo:
            load_config(None, ["model.arch=stacklm", "model.my_widht=3"])
        assert typo.value.line() == (
            "unknown config key 'model.my_widht' on the command line (did you mean 'model.my_width'?)"
        )
        assert (
            "### `model.arch=stacklm`: the stack's own width.\n\n- `model.my_width = 0` (integer >= 0):"
            in (describe_keys())
        )
        # ddpkit's own families and methods declare theirs the same way, each under its name
        assert "### `model.arch=gpt, llama, mixtral, qwen2, qwen3, mistral, qwen3_moe`:" in describe_keys()
        assert "### `dist.grad_compression=powersgd`:" in describe_keys()
        assert Compression.from_config(load_config(None, ["dist.powersgd_rank=2"]).dist).powersgd_rank == 2
        # a compression method from the package declares its keys the same way (named by dist.grad_compression)
        half = load_config(None, ["dist.grad_compression=half", "dist.half_label=n"])
        assert Compression.from_config(half.dist).setting("half_label") == "n"
    finally:
        forget(sys.modules["myext"].StackKeys)
        forget(sys.modules["myext"].HalfKeys)
        MODEL_FAMILIES.unregister("stacklm")
        compression._REGISTRY.unregister("half")
        sys.modules.pop("myext", None)
    with pytest.raises(UserError, match="unknown config key 'model.my_width'"):
        load_config(None, ["model.my_width=3"])


@pytest.mark.slow
def test_a_launcher_from_another_package_is_detected_before_a_built_in_one(tmp_path):
    import subprocess
    import sys

    from conftest import cli_env

    install_extensions(tmp_path / "site")
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "ddpkit", "info"],
            env=cli_env(
                {
                    "PYTHONPATH": on_path(tmp_path / "site"),
                    "MYL_RANK": str(r),
                    "MYL_SIZE": "2",
                    "PMI_RANK": str(r),  # what pmi, a built-in detector, would read
                    "PMI_SIZE": "2",
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": port,
                }
            ),  # fmt: skip
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    lines = outs[0][0].splitlines()
    assert len(lines) == 2 and all("launcher=myl" in ln and "world_size=2" in ln for ln in lines), lines


@pytest.mark.slow
def test_a_command_from_another_package_runs_on_two_processes(tmp_path):
    install_extensions(tmp_path / "site")
    env = {"PYTHONPATH": on_path(tmp_path / "site")}
    listed = run_cli("--help", env=env)
    assert listed.returncode == 0 and "count  sum the ranks, each plus one" in listed.stdout
    proc = run_cli("count", "--times", "10", "dist.backend=gloo", "--nproc-per-node", "2", env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # both ranks write to one stdout, where their lines can interleave (seen: "rank 1/2: sum 30rank 0/2: sum
    # 30"); find them wherever they are
    lines = sorted(re.findall(r"rank \d/2: sum \d+", proc.stdout))
    assert lines == ["rank 0/2: sum 30", "rank 1/2: sum 30"]  # the package's flag and its collective
    unknown = run_cli("count", "--times", "10")  # without the package: an unknown command, one line
    assert unknown.returncode == 2 and "unknown command 'count'" in unknown.stderr


def test_every_extension_point_is_one_registry_type_asked_in_order():
    # data sets, models, strategies, compression, launcher detectors and commands: one Registry each, where an
    # entry's `order` puts it before the built-ins
    from ddpkit.cluster.launchers import DETECTORS
    from ddpkit.commands import COMMANDS
    from ddpkit.data import DatasetEntry, dataset_names
    from ddpkit.data import registry as data_registry
    from ddpkit.models import MODEL_FAMILIES
    from ddpkit.parallel import compression
    from ddpkit.parallel import strategy as strategies
    from ddpkit.parallel.strategies.ddp import DDPStrategy
    from ddpkit.registry import Registry

    tables = [data_registry._REGISTRY, MODEL_FAMILIES, strategies._REGISTRY, compression._REGISTRY]
    assert all(isinstance(t, Registry) for t in [*tables, DETECTORS, COMMANDS])
    first = [
        (data_registry.register_dataset, DatasetEntry("early-set", build=print, order=1), dataset_names),
        (
            strategies.register_strategy,
            strategies.StrategyEntry("early-ddp", DDPStrategy, "ddp, asked first", order=1),
            strategies.strategy_names,
        ),
    ]
    try:
        for register, entry, names in first:
            register(entry)
            assert names()[0] == entry.name and len(names()) > 2
    finally:
        data_registry._REGISTRY.unregister("early-set")
        strategies._REGISTRY.unregister("early-ddp")
    assert "early-set" not in dataset_names()
