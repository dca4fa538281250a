"""The porting API on real processes: prepare, launch, gather, save_state/load_state, and the helpers' refusal
to fall back to one process; a single-GPU script ported in a handful of lines trains like its hand-written DDP."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, WeightedRandomSampler

import ddpkit
from conftest import REPO, cli_env, plain_torchrun, run_cli
from ddpkit.data import DistributedLoader
from ddpkit.errors import UserError, WorkerFailure

SCRIPTS = REPO / "tests" / "scripts"


class Indexed(Dataset):
    """Item i is (tensor([i, i]), i % 10)."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return torch.tensor([float(i), float(i)]), i % 10


def pairs(batch):
    xs, ys = zip(*batch, strict=True)
    return torch.stack(xs), torch.tensor(ys)


def _tiny():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(2, 8), nn.ReLU(), nn.Linear(8, 10))


# ---------------------------------------------------------------------------------------------- prepare


def _prepared_shapes():
    model = _tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train = DataLoader(
        Indexed(103),
        batch_size=4,
        shuffle=True,
        num_workers=1,
        collate_fn=pairs,
        persistent_workers=True,
        pin_memory=True,
    )
    val = DataLoader(Indexed(103), batch_size=8, shuffle=False, collate_fn=pairs)
    model, opt, train, val = ddpkit.prepare(model, opt, train, val)
    model.eval()  # an evaluation loader is iterated by an evaluating model (prepare() checks it)
    seen = [int(v) for x, _ in val for v in x[:, 0]]
    return {
        "wrapper": type(model).__name__,
        "inner": type(ddpkit.unwrap(model)).__name__,
        "train": (
            type(train).__name__,
            train.batch_size,
            train.num_workers,
            train.loader.collate_fn is pairs,
            train.loader.persistent_workers,
            train.loader.pin_memory,
            len(train),
        ),
        "val_seen": ddpkit.gather(seen),
        "opt_same": opt.param_groups[0]["params"][0] is next(ddpkit.unwrap(model).parameters()),
    }


@pytest.mark.slow
def test_prepare_places_wraps_and_shards_keeping_the_loaders_arguments():
    r0, r1 = ddpkit.launch(_prepared_shapes, nprocs=2)
    assert r0["wrapper"] == "DistributedDataParallel" and r0["inner"] == "Sequential" and r0["opt_same"]
    # batch per process, workers, collate_fn and persistent_workers kept; pin_memory off without a GPU;
    # ceil(103 / 2) = 52 samples per rank (DistributedSampler's padding, drop_last=False kept) -> 13 batches
    assert r0["train"] == r1["train"] == ("DistributedLoader", 4, 1, True, True, False, 13)
    assert r0["val_seen"] == r1["val_seen"] == list(range(103))  # every sample once, in order


def test_prepare_without_a_launcher_is_one_process_on_its_device():
    model = _tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(Indexed(10), batch_size=3, shuffle=True, drop_last=True)
    m, o, dl = ddpkit.prepare(model, opt, loader)
    assert m is model and o is opt and isinstance(dl, DistributedLoader) and len(dl) == 3
    assert ddpkit.prepare(loader).__class__ is DistributedLoader  # one object in, one out
    assert next(m.parameters()).device.type == "cpu"


@pytest.mark.parametrize(
    ("make", "fragment"),
    [
        (lambda: DataLoader(Stream(), batch_size=2), "IterableDataset"),
        (
            lambda: DataLoader(Indexed(8), batch_size=2, sampler=WeightedRandomSampler([1.0] * 8, 8)),
            "WeightedRandomSampler",
        ),
        (lambda: DataLoader(Indexed(8), batch_sampler=[[0, 1], [2, 3]]), "batch_sampler"),
        (
            lambda: DataLoader(
                Indexed(8), batch_size=2, sampler=torch.utils.data.RandomSampler(Indexed(8), replacement=True)
            ),
            "replacement",
        ),
    ],
)
def test_loaders_that_cannot_be_sharded_are_refused_with_the_fix(make, fragment):
    with pytest.raises(UserError, match=fragment):
        ddpkit.prepare(make())


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(4))


def test_unknown_strategy_and_two_models_are_refused():
    with pytest.raises(UserError, match="unknown strategy"):
        ddpkit.prepare(_tiny(), strategy="deepspeed")
    with pytest.raises(UserError, match="one model"):
        ddpkit.prepare(_tiny(), _tiny())


OPTIMIZERS = {  # each family with two parameter groups (no weight decay on biases) and its own switches
    "sgd": lambda groups: torch.optim.SGD(groups, lr=0.1, momentum=0.9, nesterov=True),
    "adamw": lambda groups: torch.optim.AdamW(groups, lr=0.01, betas=(0.8, 0.99), foreach=False),
}


def _train_with(strategy: str, family: str):
    model = _tiny()
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    opt = OPTIMIZERS[family](
        [{"params": weights, "weight_decay": 0.1}, {"params": biases, "weight_decay": 0.0}]
    )
    loader = DataLoader(Indexed(64), batch_size=4, shuffle=True)
    model, opt, loader = ddpkit.prepare(model, opt, loader, strategy=strategy)
    groups = opt.param_groups
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0], groups
    assert all(g.get("nesterov", True) and g.get("betas", (0.8, 0.99)) == (0.8, 0.99) for g in groups)
    for x, y in loader:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x / 64), y).backward()
        opt.step()
    path = Path(ddpkit.broadcast_object(__import__("tempfile").mkdtemp())) / "s.pt"
    ddpkit.save_state(path, model=model, optimizer=opt)
    return {k: v.clone() for k, v in torch.load(path, weights_only=True)["model"].items()}


def _train_with_each(runs: tuple[tuple[str, str], ...]):
    return {run: _train_with(*run) for run in runs}


SHARDED = ("zero1", "zero2", "fsdp")


@pytest.fixture(scope="module")
def trained_with():
    """Rank 0's weights after the same training under ddp and each sharded strategy, with SGD and with AdamW
    (param groups, hyper-parameters and switches of their own), in turn on one 2-process group."""
    runs = tuple((s, f) for f in OPTIMIZERS for s in ("ddp", *SHARDED))
    return ddpkit.launch(_train_with_each, runs, nprocs=2)[0]


@pytest.mark.slow
@pytest.mark.parametrize("family", list(OPTIMIZERS))
@pytest.mark.parametrize("strategy", SHARDED)
def test_sharded_strategies_rebuild_the_optimizer_and_train_like_ddp(trained_with, strategy, family):
    ddp, sharded = trained_with[("ddp", family)], trained_with[(strategy, family)]
    for k in ddp:
        assert torch.allclose(ddp[k], sharded[k], rtol=1e-5, atol=1e-6), (
            k,
            (ddp[k] - sharded[k]).abs().max(),
        )


def _scheduler_before_zero1():
    model = _tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    try:
        ddpkit.prepare(model, opt, sched, strategy="zero1")
    except UserError as e:
        return str(e)
    return "accepted"


@pytest.mark.slow
def test_a_scheduler_made_before_a_rebuilt_optimizer_is_refused():
    for message in ddpkit.launch(_scheduler_before_zero1, nprocs=2):
        assert "create the scheduler after prepare()" in message


# ---------------------------------------------------------------------------------------------- launch


def _rank_and_sum(offset: int):
    torch.tensor(torch.ones(1))  # a UserWarning of torch's, the same on every rank
    return ddpkit.get_rank() + offset, ddpkit.all_reduce_sum(ddpkit.get_rank() + 1)


def _fail_on_rank_one():
    if ddpkit.get_rank() == 1:
        raise ValueError("bad batch on rank 1")
    ddpkit.barrier()  # rank 0 waits for a peer that is gone: the launcher must not wait for it
    return "unreachable"


@pytest.mark.slow
def test_launch_runs_a_function_on_n_ranks_in_one_group(capfd):
    """... and a warning every rank gives is printed once for the launch, not once per rank (claimed in a
    folder of the launch, gone when it returns)."""
    import tempfile

    from ddpkit.diagnostics.stacks import JOB_PREFIX

    assert ddpkit.launch(_rank_and_sum, 10, nprocs=3) == [(10, 6), (11, 6), (12, 6)]
    err = capfd.readouterr().err
    assert err.count("UserWarning: To copy construct from a tensor") == 1, err
    assert not list(Path(tempfile.gettempdir()).glob(f"{JOB_PREFIX}{os.getpid()}-*"))


@pytest.mark.slow
def test_launch_names_the_failing_rank_and_does_not_hang(capfd):
    import time

    start = time.monotonic()
    with pytest.raises(WorkerFailure, match="worker rank 1 failed: bad batch on rank 1"):
        ddpkit.launch(_fail_on_rank_one, nprocs=2)
    assert time.monotonic() - start < 60
    assert "ValueError: bad batch on rank 1" in capfd.readouterr().err  # the worker's traceback is shown


def test_launch_refuses_a_bad_nprocs():
    with pytest.raises(UserError, match="nprocs"):
        ddpkit.launch(_rank_and_sum, 0, nprocs=0)


@pytest.mark.slow
def test_launch_of_a_function_defined_interactively_forks(tmp_path):
    code = (
        "import ddpkit\n"
        "def f(x):\n"
        "    return ddpkit.get_rank() * x, ddpkit.get_world_size()\n"
        "print(ddpkit.launch(f, 5, nprocs=2))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=180, env=cli_env()
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[(0, 2), (5, 2)]"


# ---------------------------------------------------------------------------------------------- exact eval


def _exact_predictions():
    loader = ddpkit.eval_loader(Indexed(359), 16)
    ids = torch.cat([x[:, 0] for x, _ in loader]).long()
    return ddpkit.gather(ids).tolist(), ddpkit.gather([int(i) for i in ids])


@pytest.mark.slow
def test_gather_of_an_eval_loaders_results_is_every_sample_once_in_order():
    for tensors, lists in ddpkit.launch(_exact_predictions, nprocs=3):
        assert tensors == lists == list(range(359))


# ---------------------------------------------------------------------------------------------- state


def _save_then_load(path: str):
    torch.manual_seed(ddpkit.get_rank())
    model = _tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = DataLoader(Indexed(64), batch_size=4, shuffle=True)
    model, opt, loader = ddpkit.prepare(model, opt, loader)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.5)
    it = iter(loader)
    for _ in range(3):
        x, y = next(it)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x / 64), y).backward()
        opt.step()
        sched.step()
    ddpkit.save_state(path, model=model, optimizer=opt, scheduler=sched, loader=loader, epoch=0, note="mid")
    draw = torch.rand(3)  # the random stream right after the save
    rest = [x[:, 0].tolist() for x, _ in it]  # what the unbroken pass trains on next
    del it
    fresh = _tiny()
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    fresh, fresh_opt, fresh_loader = ddpkit.prepare(
        fresh, fresh_opt, DataLoader(Indexed(64), batch_size=4, shuffle=True)
    )
    fresh_sched = torch.optim.lr_scheduler.StepLR(fresh_opt, 2, gamma=0.5)
    extra = ddpkit.load_state(
        path, model=fresh, optimizer=fresh_opt, scheduler=fresh_sched, loader=fresh_loader
    )
    same = all(
        torch.equal(a, b)
        for a, b in zip(
            ddpkit.unwrap(model).state_dict().values(),
            ddpkit.unwrap(fresh).state_dict().values(),
            strict=True,
        )
    )
    return {
        "extra": extra,
        "weights": same,
        "momentum": torch.equal(
            opt.state_dict()["state"][0]["momentum_buffer"],
            fresh_opt.state_dict()["state"][0]["momentum_buffer"],
        ),
        "lr": fresh_opt.param_groups[0]["lr"],
        "rest": [x[:, 0].tolist() for x, _ in fresh_loader] == rest,
        "rng": torch.equal(torch.rand(3), draw),
    }


@pytest.mark.slow
def test_save_state_and_load_state_round_trip_on_two_ranks(tmp_path):
    for r in ddpkit.launch(_save_then_load, str(tmp_path / "state.pt"), nprocs=2):
        assert r == {
            "extra": {"epoch": 0, "note": "mid"},
            "weights": True,
            "momentum": True,
            "lr": 0.05,
            "rest": True,
            "rng": True,
        }
    state = torch.load(tmp_path / "state.pt", weights_only=True)  # a safe load reads all of it
    assert len(state["rng"]) == 2 and state["loader"] == {"epoch": 0, "consumed": 24}


def test_save_state_refuses_what_a_safe_load_could_not_read_before_writing(tmp_path):
    with pytest.raises(UserError, match=r"extra\['history'\] is a PosixPath"):
        ddpkit.save_state(tmp_path / "s.pt", model=_tiny(), epoch=1, history=Path("x"))
    assert not (tmp_path / "s.pt").exists()


def test_load_state_refuses_a_file_it_did_not_write(tmp_path):
    ddpkit.save_checkpoint({"model": _tiny().state_dict()}, tmp_path / "c.pt")
    with pytest.raises(UserError, match="not written by ddpkit.save_state"):
        ddpkit.load_state(tmp_path / "c.pt", model=_tiny())


# ---------------------------------------------------------------------------------------------- no silent fallback


@pytest.mark.parametrize("var", ["WORLD_SIZE", "SLURM_STEP_NUM_TASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"])
def test_helpers_refuse_one_process_when_a_launcher_says_several(monkeypatch, var):
    monkeypatch.setenv(var, "2")
    for call in (
        lambda: ddpkit.distributed_loader(Indexed(8), 2),  # every rank would train on everything
        ddpkit.get_rank,
        ddpkit.is_main_process,
        lambda: ddpkit.all_reduce_mean(1.0),
        ddpkit.barrier,
    ):
        with pytest.raises(UserError, match=f"{var}=2 .* no process group.*init_distributed"):
            call()
    monkeypatch.setenv(var, "1")
    assert ddpkit.get_rank() == 0 and len(ddpkit.distributed_loader(Indexed(8), 2)) == 4


def test_helpers_refuse_one_process_after_a_one_process_group_ended(monkeypatch):
    # A script (or an earlier test in this process) that made and shut down a one-process group does not
    # answer a launcher that says two: the helpers still refuse instead of answering rank 0 of 1.
    from ddpkit.distributed import collectives

    monkeypatch.setattr(collectives._Ended, "rank_world", None)
    store = torch.distributed.HashStore()
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    ddpkit.shutdown()
    assert collectives._Ended.rank_world == (0, 1)
    monkeypatch.setenv("WORLD_SIZE", "2")
    for call in (ddpkit.get_rank, ddpkit.get_world_size, lambda: ddpkit.distributed_loader(Indexed(8), 2)):
        with pytest.raises(UserError, match="WORLD_SIZE=2 .* no process group"):
            call()


# ---------------------------------------------------------------------------------------------- the scripts


def _run(*args: str, cwd: Path) -> None:
    proc = subprocess.run(list(args), capture_output=True, text=True, timeout=300, env=cli_env(), cwd=cwd)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-3000:])


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)


@pytest.mark.slow
def test_ported_script_trains_to_the_hand_written_ddp_weights(tmp_path):
    plain_torchrun(
        "--nproc-per-node",
        "2",
        str(SCRIPTS / "handwritten_ddp.py"),
        "--out",
        "hand.pt",
        cwd=tmp_path,
        fresh=("hand.pt",),
    )
    proc = run_cli(
        "run", "--nproc-per-node", "2", str(SCRIPTS / "ported.py"), "--out", "ported.pt", cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "on 333 samples" in proc.stdout  # exact evaluation: every validation sample once
    hand, ported = _weights(tmp_path / "hand.pt"), _weights(tmp_path / "ported.pt")
    for k in hand:
        rel = ((hand[k] - ported[k]).abs().max() / hand[k].abs().max()).item()
        assert rel <= 1e-5, (k, rel)


@pytest.mark.slow
def test_ported_script_resumes_mid_epoch_to_the_unbroken_result(tmp_path):
    flags = ["--nproc-per-node", "2", str(SCRIPTS / "ported.py"), "--state", "state.pt"]
    assert run_cli("run", *flags, "--out", "unbroken.pt", cwd=tmp_path).returncode == 0
    (tmp_path / "state.pt").unlink(missing_ok=True)
    crashed = run_cli("run", *flags, "--crash-after-steps", "20", cwd=tmp_path)
    assert crashed.returncode == 75, crashed.stderr[-2000:]  # the script's own exit status
    assert run_cli("run", *flags, "--out", "resumed.pt", cwd=tmp_path).returncode == 0
    a, b = _weights(tmp_path / "unbroken.pt"), _weights(tmp_path / "resumed.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_ported_script_runs_as_plain_python(tmp_path):
    _run(sys.executable, str(SCRIPTS / "ported.py"), "--out", "plain.pt", "--epochs", "1", cwd=tmp_path)
    proc = run_cli("run", str(SCRIPTS / "ported.py"), "--out", "run.pt", "--epochs", "1", cwd=tmp_path)
    assert proc.returncode == 0 and "val acc" in proc.stdout
    a, b = _weights(tmp_path / "plain.pt"), _weights(tmp_path / "run.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)


def _main_body(path: Path) -> list[str]:
    text = path.read_text()
    return text[text.index("def main(args):") : text.index('if __name__ == "__main__":')].splitlines()


def test_the_port_is_a_handful_of_lines():
    """ported.py's main() is single_gpu.py's plus the lines marked `# ddpkit` (the port), `# resume` and
    `# test hook` (the crash the resume test needs); docs/porting.md quotes the count."""
    single = set(_main_body(SCRIPTS / "single_gpu.py"))
    changed = [ln for ln in _main_body(SCRIPTS / "ported.py") if ln not in single]
    unmarked = [
        ln
        for ln in changed
        if not ln.rstrip().endswith(("# ddpkit", "# resume", "# test hook")) and "# test hook:" not in ln
    ]
    assert not unmarked, unmarked
    port = [ln for ln in changed if ln.rstrip().endswith("# ddpkit")]
    assert len(port) == 7, port  # + `import ddpkit`: 8 lines, as docs/porting.md says
