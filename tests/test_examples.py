"""The examples/ scripts run end to end on tiny data (CPU, gloo, real processes) and print what the tutorials print."""

from __future__ import annotations

import random
import re
import socket
import subprocess
import sys

import pytest
import torch

from conftest import REPO, cli_env
from ddpkit.checkpoint import load_checkpoint
from ddpkit.distributed.env import slurm_port
from ddpkit.distributed.launch import free_port
from test_data import write_cifar10

EXAMPLES = REPO / "examples"
TIMEOUT = 300
# The tutorials' line: `   == step: [ 50/196] [1/5] | loss: 1.959 | acc: 28.633%`
LOG_LINE = re.compile(
    r"^   == step: \[[ \d]{2}\d/\d+\] \[\d+/\d+\] \| loss: \d+\.\d{3} \| acc: (?:100|[ \d]\d)\.\d{3}%$"
)
DIGITS_VAL = 359
assert LOG_LINE.match("   == step: [ 50/196] [1/5] | loss: 1.959 | acc: 28.633%")


def _check(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, (proc.returncode, proc.stdout[-3000:], proc.stderr[-3000:])
    return proc.stdout


def run_python(*args: str) -> str:
    """`python ARGS` in the repository; its stdout (it must exit 0)."""
    cmd = [sys.executable, *args]
    return _check(
        subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, env=cli_env(), cwd=REPO)
    )


def run_example(script: str, *args: str) -> str:
    """`python examples/SCRIPT ARGS`; its stdout."""
    return run_python(str(EXAMPLES / script), *args)


def torchrun(script: str, *args: str, nproc: int = 2) -> str:
    """`python -m torch.distributed.run --standalone --nproc-per-node N examples/SCRIPT ARGS`; its stdout."""
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    return run_python(*launcher, str(EXAMPLES / script), *args)


def run_ranks(script: str, envs: list[dict[str, str]], args_of) -> list[str]:
    """Start one `python examples/SCRIPT` per rank, each separately (as by hand); every stdout, by rank."""
    procs = [
        subprocess.Popen(
            [sys.executable, str(EXAMPLES / script), *args_of(rank)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=cli_env(env),
            cwd=REPO,
        )
        for rank, env in enumerate(envs)
    ]
    outs = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=TIMEOUT)
            outs.append(_check(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr)))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return outs


def step_lines(out: str) -> list[str]:
    lines = [ln for ln in out.splitlines() if "== step:" in ln]
    bad = [ln for ln in lines if not LOG_LINE.match(ln)]
    assert not bad, bad
    return lines


def saved_model(path) -> dict[str, torch.Tensor]:
    """The `model` entry of a saved checkpoint, read with weights_only=True; its keys carry no `module.`."""
    state = torch.load(path, map_location="cpu", weights_only=True)["model"]
    assert state and not [k for k in state if k.startswith("module.")], list(state)[:5]
    return state


def tiny(tmp_path, *, train_size: int = 64, epochs: int = 1, log_every: int = 50) -> list[str]:
    return [
        f"--train-size={train_size}",
        "--batch-size=16",
        f"--epochs={epochs}",
        f"--log-every={log_every}",
        f"--out={tmp_path / 'out' / 'model.pt'}",
    ]


# ------------------------------------------------------------------------------------------ A: the path


def test_a1_single_process_prints_the_tutorial_log_line_on_cifar10(tmp_path):
    write_cifar10(tmp_path / "cifar", per_batch=8, test=4)  # the real pickled batches: 40 training images
    out = run_example(
        "01_single_gpu.py",
        "--data=cifar10",
        f"--data-root={tmp_path / 'cifar'}",
        *tiny(tmp_path, train_size=40, epochs=2, log_every=2),
    )
    # 40 images / batch 16 = 3 steps (the last one short): lines at step 2 and at the epoch's end
    assert [ln.split("|")[0].strip() for ln in step_lines(out)] == [
        "== step: [  2/3] [1/2]",
        "== step: [  3/3] [1/2]",
        "== step: [  2/3] [2/2]",
        "== step: [  3/3] [2/2]",
    ]
    assert out.count("=======  Training Finished  =======") == 1
    state = saved_model(tmp_path / "out" / "model.pt")
    assert state["conv1.weight"].shape == (64, 3, 7, 7) and state["fc.weight"].shape == (10, 512)


def test_a2_data_parallel_is_a1_with_one_line_changed(tmp_path):
    out = run_example("02_data_parallel.py", *tiny(tmp_path, log_every=1))
    assert re.search(r"^nn\.DataParallel over \d+ GPU\(s\)$", out, re.M), out
    assert len(step_lines(out)) == 4  # 64 digits / 16
    state = saved_model(tmp_path / "out" / "model.pt")  # the wrapped model's own keys, no `module.`
    assert state["conv1.weight"].shape == (64, 1, 7, 7)


@pytest.mark.slow
def test_a3_torchrun_prints_once_and_counts_steps_of_the_global_batch(tmp_path):
    out = torchrun("03_ddp_torchrun.py", *tiny(tmp_path, train_size=100, epochs=2, log_every=2))
    assert sorted(re.findall(r"^\[init\] == local rank: (\d), global rank: (\d) ==$", out, re.M)) == [
        ("0", "0"),
        ("1", "1"),
    ]
    # 100 // (16 x 2) = 3 steps, the same on both ranks; DistributedSampler: ceil(ceil(100 / 2) / 16) = 4
    assert (
        "steps per epoch: 3 (100 samples // global batch 32 = 16 x 2); a padding DistributedSampler would give 4"
        in out
    )
    assert "lr: 0.00125 (0.01 x 32 / 256)" in out
    lines = [ln.split("|")[0].strip() for ln in step_lines(out)]
    assert lines == [
        "== step: [  2/3] [1/2]",
        "== step: [  3/3] [1/2]",
        "== step: [  2/3] [2/2]",
        "== step: [  3/3] [2/2]",
    ]
    assert out.count("=======  Training  =======") == 1 and out.count("saved ") == 1
    state = saved_model(tmp_path / "out" / "model.pt")
    assert state["conv1.weight"].shape == (64, 1, 7, 7) and state["fc.weight"].shape == (10, 512)


@pytest.mark.slow
def test_a4_spawn_starts_its_own_workers(tmp_path):
    out = run_example("04_ddp_spawn.py", "--nproc=2", *tiny(tmp_path))
    assert len(re.findall(r"^\[init\] == local rank: \d, global rank: \d ==$", out, re.M)) == 2
    assert "steps per epoch: 2 (64 samples // global batch 32 = 16 x 2)" in out
    assert len(step_lines(out)) == 1 and out.count("saved ") == 1
    saved_model(tmp_path / "out" / "model.pt")


def _free_slurm_job() -> tuple[str, int]:
    """A Slurm job id whose port (ddpkit derives it from SLURM_JOB_ID.SLURM_STEP_ID) is free right now."""
    first = random.randrange(10**6)
    for job in range(first, first + 100):
        port = slurm_port(f"{job}.0")
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return str(job), port
    raise RuntimeError("no free port for a Slurm job id")


@pytest.mark.slow
def test_a5_runs_under_a_slurm_environment(tmp_path):
    job, port = _free_slurm_job()
    slurm = dict(
        SLURM_NTASKS="2",
        SLURM_NODEID="0",
        SLURM_NODELIST="localhost",
        SLURM_TASKS_PER_NODE="2",
        SLURM_JOB_ID=job,
        SLURM_STEP_ID="0",
    )
    envs = [dict(slurm, SLURM_PROCID=str(r), SLURM_LOCALID=str(r)) for r in range(2)]
    outs = run_ranks("05_slurm.py", envs, lambda rank: tiny(tmp_path))
    for rank, out in enumerate(outs):
        # the rank from SLURM_PROCID, the master from SLURM_NODELIST, the port from SLURM_JOB_ID
        assert f"[slurm] rank {rank} of 2, local rank {rank} of 2 on node 0, master localhost:{port}" in out
        assert f"[init] == local rank: {rank}, global rank: {rank} ==" in out
    assert "steps per epoch: 2 (" in outs[0] and len(step_lines(outs[0])) == 1
    assert not step_lines(outs[1]) and "Training" not in outs[1]  # rank 1 prints its [init] line only
    saved_model(tmp_path / "out" / "model.pt")


@pytest.mark.slow
def test_a6_framework_takes_a_recipe_and_key_value_pairs(tmp_path):
    run_dir = tmp_path / "r"
    out = torchrun(
        "06_framework_config.py",
        "--cfg",
        "configs/digits.yaml",
        "TRAIN.EPOCHS",
        "1",
        "train.max_steps",
        "3",
        "OUT_DIR",
        str(run_dir),
    )
    assert out.count("ddpkit: 2 process(es), backend gloo") == 1
    assert len(re.findall(rf"^final val_acc1 \S+ \(\S+%\) on {DIGITS_VAL} samples$", out, re.M)) == 1, out
    assert load_checkpoint(run_dir / "checkpoints" / "last.pt")["step"] == 3


def test_a6_framework_names_a_wrong_key_and_exits_2():
    cmd = [sys.executable, str(EXAMPLES / "06_framework_config.py"), "OPTIM.BASE_LR", "6.4"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, env=cli_env(), cwd=REPO)
    assert proc.returncode == 2 and "unknown config key 'optim.base_lr'" in proc.stderr, proc.stderr


# ------------------------------------------------------------------------------ B: manual rendezvous


def _assert_trained_on_rank0_only(outs: list[str], world: int) -> None:
    assert (
        len(
            re.findall(
                rf"^epoch 1/1 \| train loss \S+ \(mean of {world} ranks\) \| val acc \S+% on {DIGITS_VAL} samples$",
                outs[0],
                re.M,
            )
        )
        == 1
    ), outs[0]
    assert all(out.strip() == "" for out in outs[1:]), outs[1:]


@pytest.mark.slow
def test_b7_three_processes_started_by_hand_meet_over_tcp(tmp_path):
    url = f"tcp://127.0.0.1:{free_port()}"
    outs = run_ranks(
        "07_tcp_three_terminals.py",
        [{}] * 3,
        lambda r: [f"--init-method={url}", f"--rank={r}", "--world-size=3", *tiny(tmp_path, train_size=96)],
    )
    assert f"3 processes joined at {url}, backend gloo" in outs[0]
    _assert_trained_on_rank0_only(outs, 3)
    saved_model(tmp_path / "out" / "model.pt")


@pytest.mark.slow
def test_b8_shared_file_rendezvous(tmp_path):
    url = f"file://{tmp_path / 'sharedfile'}"  # must not exist beforehand
    outs = run_ranks(
        "08_shared_file.py",
        [{}] * 2,
        lambda r: [f"--init-method={url}", f"--rank={r}", "--world-size=2", *tiny(tmp_path)],
    )
    assert f"2 processes joined at {url}" in outs[0]
    _assert_trained_on_rank0_only(outs, 2)


@pytest.mark.slow
def test_b9_env_variables_rendezvous(tmp_path):
    port = free_port()
    envs = [
        dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(r)) for r in range(2)
    ]
    outs = run_ranks("09_env_variables.py", envs, lambda r: tiny(tmp_path))
    assert f"rank 0 of 2 via env:// at 127.0.0.1:{port}" in outs[0]
    _assert_trained_on_rank0_only(outs, 2)


# -------------------------------------------------------------------------------------- C: the rules


@pytest.mark.slow
def test_c_rules_ranks_batches_seeds_mean_loss_and_rank0_saving(tmp_path):
    out = torchrun("10_ddp_rules.py", *tiny(tmp_path))
    ranks = re.findall(r"^rank (\d) \| local_rank (\d) \| world_size 2 \| device cpu \| gloo$", out, re.M)
    assert sorted(ranks) == [("0", "0"), ("1", "1")]  # C.10: one line per process
    assert "batch 16 per process x 2 processes = global batch 32" in out  # C.11
    assert "lr 0.4 at batch 256 -> 0.05 at 32" in out
    assert "steps per epoch: 2 (a plain DataLoader: 4, each process sees the whole set)" in out
    inits = re.search(r"^init checksum per rank: \[(\S+), (\S+)\] \(identical\)$", out, re.M)  # C.12
    assert inits and inits.group(1) == inits.group(2)
    aug = re.search(r"^augmented samples 0-7 checksum per rank: \[(\S+), (\S+)\] \(different\)$", out, re.M)
    assert aug and aug.group(1) != aug.group(2)
    losses = re.search(r"^train loss per rank \[(\S+), (\S+)\] -> all_reduce mean (\S+)$", out, re.M)  # C.15
    assert losses and abs((float(losses[1]) + float(losses[2])) / 2 - float(losses[3])) < 1e-3
    assert out.count("rank 0 saved") == 1 and len(step_lines(out)) == 1  # C.14
    assert "0.weight" in saved_model(tmp_path / "out" / "model.pt")


@pytest.mark.slow
def test_c_files_rank0_prepares_pretrained_weights_and_checkpoint_round_trip(tmp_path):
    out = torchrun("11_weights_and_checkpoints.py", *tiny(tmp_path))
    assert "data prepared by rank 0 (64 samples), read by all 2 ranks" in out  # C.16
    weights = re.search(
        r"^weights per rank: random init \[(\S+), (\S+)\] -> after loading pretrained.pt \[(\S+), (\S+)\]$",
        out,
        re.M,
    )
    assert weights and weights[1] != weights[2] and weights[3] == weights[4], out  # C.13
    assert re.search(
        r"^checkpoint round trip: every rank's weights equal \S+: \[True, True\]$", out, re.M
    )  # C.17
    state = saved_model(tmp_path / "out" / "model.pt")
    pretrained = load_checkpoint(tmp_path / "out" / "pretrained.pt")["model"]
    assert state.keys() == pretrained.keys() and not all(torch.equal(state[k], pretrained[k]) for k in state)


# ------------------------------------------------------------------------------ E: model parallelism


@pytest.mark.slow
def test_e21_two_device_halves_under_ddp_stay_identical(tmp_path):
    out = torchrun("13_model_parallel.py", *tiny(tmp_path))
    assert sorted(re.findall(r"^rank (\d): part1 on cpu, part2 on cpu$", out, re.M)) == ["0", "1"]
    assert out.count("epoch 1/1 | train loss") == 1
    sums = re.search(r"^replicas identical after training: \[(\S+), (\S+)\]$", out, re.M)
    assert sums and sums.group(1) == sums.group(2)
