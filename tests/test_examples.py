"""The examples/ scripts print what the tutorials print. Every command line of their docstrings parses and is
run here on tiny data (CPU, gloo, real processes) unless it is marked as needing what this machine lacks."""

from __future__ import annotations

import argparse
import ast
import importlib
import random
import re
import runpy
import socket
import subprocess
import sys

import pytest
import torch

from conftest import (
    REPO,
    RUN_BY,
    DocCommand,
    check_ok,
    cli_env,
    doc_commands,
    free_port,
    run_doc,
    runs_doc,
    torchrun_args,
    write_cifar10,
)
from ddpkit.checkpoint import load_checkpoint
from ddpkit.cluster.slurm_env import slurm_port
from ddpkit.config import load_config

EXAMPLES = REPO / "examples"
SCRIPTS = sorted(p.name for p in EXAMPLES.glob("[0-9][0-9]_*.py"))
TIMEOUT = 300
# The tutorials' line: `   == step: [ 50/196] [1/5] | loss: 1.959 | acc: 28.633%`
LOG_LINE = re.compile(
    r"^   == step: \[[ \d]{2}\d/\d+\] \[\d+/\d+\] \| loss: \d+\.\d{3} \| acc: (?:100|[ \d]\d)\.\d{3}%$"
)
DIGITS_VAL = 359
assert LOG_LINE.match("   == step: [ 50/196] [1/5] | loss: 1.959 | acc: 28.633%")


def run_together(commands: list[tuple[list[str], dict[str, str]]]) -> list[str]:
    """Start every (argv, env) at once, each on its own (as in separate terminals); every stdout, in order."""
    procs = [
        subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cli_env(env), cwd=REPO
        )
        for argv, env in commands
    ]
    outs = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=TIMEOUT)
            outs.append(check_ok(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr)))
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


class _Parsed(Exception):
    """Raised in place of parsing, once the example has built its parser."""


def example_parser(script: str, monkeypatch) -> argparse.ArgumentParser:
    """The ArgumentParser examples/SCRIPT builds when run, caught as it is about to parse (nothing runs)."""
    built = []

    def capture(self, args=None, namespace=None):
        built.append(self)
        raise _Parsed

    monkeypatch.syspath_prepend(str(EXAMPLES))
    with monkeypatch.context() as m, pytest.raises(_Parsed):
        m.setattr(sys, "argv", [script])
        m.setattr(argparse.ArgumentParser, "parse_args", capture)
        runpy.run_path(str(EXAMPLES / script), run_name="__main__")
    return built[0]


# -------------------------------------------------------------------------------- the docstrings themselves


@pytest.mark.parametrize("script", SCRIPTS)
def test_docstring_names_its_step_and_its_lines_parse(script, monkeypatch):
    assert ast.get_docstring(ast.parse((EXAMPLES / script).read_text())).startswith(f"Step {int(script[:2])}")
    parser = example_parser(script, monkeypatch)
    for doc in doc_commands(script):
        _, prog, words = doc.split()
        named = (
            torchrun_args(words).training_script
            if prog == "torchrun"
            else next(w for w in words if ".py" in w)
        )
        assert named == f"examples/{script}", doc.text
        try:
            parser.parse_args(doc.example_args())  # every flag defined, every value accepted
        except SystemExit:
            pytest.fail(f"{script}: the example rejects its own docstring's line {doc.text!r}")


def _needs(doc: DocCommand) -> set[str]:
    """What a command line needs that this machine (CPU, one node, no Slurm, no CIFAR-10 files) lacks."""
    env, prog, words = doc.split()
    needs = set()
    if "cifar10" in doc.text:
        needs.add("CIFAR-10")
    if "CUDA_VISIBLE_DEVICES" in env or "--gres=gpu" in doc.text:
        needs.add("GPU")
    if prog == "srun":
        needs.add("Slurm")
    if prog == "torchrun" and torchrun_args(words).nnodes not in ("1", "1:1"):
        needs.add("node")
    return needs


@pytest.mark.parametrize("script", SCRIPTS)
def test_lines_needing_what_this_machine_lacks_say_so(script):
    for doc in doc_commands(script):
        needs = _needs(doc)
        if not needs:
            assert doc.mark is None, (
                f"{doc.text!r} is marked `needs {doc.mark}` but runs here: run it in a test"
            )
        for need in needs:
            assert doc.mark and need in doc.mark, f"{doc.text!r} needs {need}: say so (`# needs {need}`)"


def test_every_line_that_runs_here_is_run_by_a_test():
    importlib.import_module("test_example_dist_sgd")  # its tests register the lines they run, too
    unrun = [(d.script, d.text) for s in SCRIPTS for d in doc_commands(s) if d.mark is None]
    assert [line for line in unrun if line not in RUN_BY] == []


def test_docstring_parsing_sees_marks_continuations_and_unknown_commands(tmp_path, monkeypatch):
    import conftest

    monkeypatch.setattr(conftest, "EXAMPLES", tmp_path)  # where doc_commands reads the examples
    (tmp_path / "x.py").write_text(
        '"""Doc.\n\n    A=1 torchrun --nnodes 2 examples/x.py \\\\\n'
        "        --data cifar10    # 2 nodes; needs CIFAR-10\n"
        '    python examples/x.py    # CPU\n"""\n'
    )
    long, short = doc_commands("x.py")
    assert long.text == "A=1 torchrun --nnodes 2 examples/x.py --data cifar10" and long.mark == "CIFAR-10"
    assert _needs(long) == {"CIFAR-10", "node"} and long.example_args() == ["--data", "cifar10"]
    assert short.mark is None and short.argv("--epochs=1")[0][1:] == ["examples/x.py", "--epochs=1"]
    (tmp_path / "y.py").write_text('"""Doc.\n\n    mpirun -n 2 examples/y.py\n"""\n')
    with pytest.raises(AssertionError, match="does not recognise"):
        doc_commands("y.py")


# --------------------------------------------------------------------- steps 1-6: from one GPU to a framework


@runs_doc("01_single_gpu.py", "--data cifar10")
def test_01_single_process_prints_the_tutorial_log_line_on_cifar10(tmp_path, doc):
    write_cifar10(tmp_path / "cifar", per_batch=8, test=4)  # the real pickled batches: 40 training images
    tiny_cifar = tiny(tmp_path, train_size=40, epochs=2, log_every=2)
    out = run_doc(doc, f"--data-root={tmp_path / 'cifar'}", *tiny_cifar)
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


@runs_doc("01_single_gpu.py", "python examples/01_single_gpu.py")
def test_01_runs_on_the_digits_without_a_download(tmp_path, doc):
    out = run_doc(doc, *tiny(tmp_path, log_every=2))
    assert len(step_lines(out)) == 2  # 64 digits / 16 = 4 steps: lines at 2 and 4
    assert saved_model(tmp_path / "out" / "model.pt")["conv1.weight"].shape == (64, 1, 7, 7)


@runs_doc("02_data_parallel.py", "python examples/02_data_parallel.py")
def test_02_data_parallel_is_01_with_one_line_changed(tmp_path, doc):
    out = run_doc(doc, *tiny(tmp_path, log_every=1))
    assert re.search(r"^nn\.DataParallel over \d+ GPU\(s\)$", out, re.M), out
    assert len(step_lines(out)) == 4  # 64 digits / 16
    state = saved_model(tmp_path / "out" / "model.pt")  # the wrapped model's own keys, no `module.`
    assert state["conv1.weight"].shape == (64, 1, 7, 7)


@pytest.mark.slow
@runs_doc("03_ddp_torchrun.py", "torchrun --nproc-per-node 2 examples/03_ddp_torchrun.py")
def test_03_torchrun_prints_once_and_counts_steps_as_distributed_sampler(tmp_path, doc):
    out = run_doc(doc, *tiny(tmp_path, train_size=100, epochs=2, log_every=2))
    assert sorted(re.findall(r"^\[init\] == local rank: (\d), global rank: (\d) ==$", out, re.M)) == [
        ("0", "0"),
        ("1", "1"),
    ]
    # DistributedSampler's count: ceil(100 / 2) = 50 samples per rank (padded), ceil(50 / 16) = 4 steps
    assert "steps per epoch: 4 (ceil(100 samples / 2 processes) = 50 per process, in batches of 16)" in out
    assert "lr: 0.00125 (0.01 x global batch 32 / 256)" in out
    lines = [ln.split("|")[0].strip() for ln in step_lines(out)]
    assert lines == [
        "== step: [  2/4] [1/2]",
        "== step: [  4/4] [1/2]",
        "== step: [  2/4] [2/2]",
        "== step: [  4/4] [2/2]",
    ]
    assert out.count("=======  Training  =======") == 1 and out.count("saved ") == 1
    state = saved_model(tmp_path / "out" / "model.pt")
    assert state["conv1.weight"].shape == (64, 1, 7, 7) and state["fc.weight"].shape == (10, 512)


@pytest.mark.slow
@runs_doc("04_ddp_spawn.py", "python examples/04_ddp_spawn.py --nproc 2", "--launch")
def test_04_spawn_and_launch_start_their_own_workers(tmp_path, doc):
    out = run_doc(doc, *tiny(tmp_path))
    assert len(re.findall(r"^\[init\] == local rank: \d, global rank: \d ==$", out, re.M)) == 2
    assert "steps per epoch: 2 (ceil(64 samples / 2 processes) = 32 per process, in batches of 16)" in out
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
@runs_doc("05_slurm.py", "srun --ntasks=2 python -u examples/05_slurm.py")
def test_05_srun_line_under_a_slurm_environment(tmp_path, doc):
    _, _, words = doc.split()
    tasks = int(words[0].removeprefix("--ntasks="))
    program = words[words.index("python") + 1 :]  # what srun starts in each task, with these variables:
    job, port = _free_slurm_job()
    slurm = dict(SLURM_NTASKS=str(tasks), SLURM_NODEID="0", SLURM_NODELIST="localhost", SLURM_JOB_ID=job)
    slurm.update(SLURM_TASKS_PER_NODE=str(tasks), SLURM_STEP_ID="0")
    argv = [sys.executable, *program, *tiny(tmp_path)]
    envs = [dict(slurm, SLURM_PROCID=str(r), SLURM_LOCALID=str(r)) for r in range(tasks)]
    outs = run_together([(argv, env) for env in envs])
    for rank, out in enumerate(outs):
        # the rank from SLURM_PROCID, the master from SLURM_NODELIST, the port from SLURM_JOB_ID
        assert f"[slurm] rank {rank} of 2, local rank {rank} of 2 on node 0, master localhost:{port}" in out
        assert f"[init] == local rank: {rank}, global rank: {rank} ==" in out
    assert "steps per epoch: 2 (" in outs[0] and len(step_lines(outs[0])) == 1
    assert not step_lines(outs[1]) and "Training" not in outs[1]  # rank 1 prints its [init] line only
    saved_model(tmp_path / "out" / "model.pt")


@pytest.mark.slow
@runs_doc("06_framework_config.py", "--cfg configs/digits.yaml")
def test_06_framework_takes_a_recipe_and_key_value_pairs(tmp_path, doc):
    run_dir = tmp_path / "r"
    out = run_doc(doc, "TRAIN.EPOCHS", "1", "train.max_steps", "3", "OUT_DIR", str(run_dir))
    assert out.count("ddpkit: 2 process(es), backend gloo") == 1
    assert len(re.findall(rf"^final val_acc1 \S+ \(\S+%\) on {DIGITS_VAL} samples$", out, re.M)) == 1, out
    assert load_checkpoint(run_dir / "checkpoints" / "last.pt")["step"] == 3


def test_06_every_recipe_and_override_in_the_docstring_loads(monkeypatch):
    parser = example_parser("06_framework_config.py", monkeypatch)
    framework = importlib.import_module("06_framework_config")
    for doc in doc_commands("06_framework_config.py"):
        args = parser.parse_args(doc.example_args())
        assert (REPO / args.cfg).is_file(), args.cfg
        load_config(REPO / args.cfg, framework.overrides(args.opts))  # a wrong key raises UserError


def test_06_framework_names_a_wrong_key_and_exits_2():
    cmd = [sys.executable, str(EXAMPLES / "06_framework_config.py"), "OPTIM.BASE_LR", "6.4"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, env=cli_env(), cwd=REPO)
    assert proc.returncode == 2 and "unknown config key 'optim.base_lr'" in proc.stderr, proc.stderr
    assert proc.stderr.startswith("06_framework_config.py: error: ") and "Traceback" not in proc.stderr


# ------------------------------------------------------------------------- steps 7-9: rendezvous by hand


def _assert_trained_on_rank0_only(outs: list[str], world: int) -> None:
    epoch = (
        rf"^epoch 1/1 \| train loss \S+ \(mean of {world} ranks\) \| val acc \S+% on {DIGITS_VAL} samples$"
    )
    assert len(re.findall(epoch, outs[0], re.M)) == 1, outs[0]
    assert all(out.strip() == "" for out in outs[1:]), outs[1:]


def _ranks(docs: tuple[DocCommand, ...], tmp_path, replace: dict[str, str]) -> list[str]:
    return run_together([d.argv(*tiny(tmp_path, train_size=96), replace=replace) for d in docs])


@pytest.mark.slow
@runs_doc("07_tcp_three_terminals.py", "--rank 0", "--rank 1", "--rank 2", together=True)
def test_07_three_processes_started_by_hand_meet_over_tcp(tmp_path, doc):
    url = f"tcp://127.0.0.1:{free_port()}"  # the docstring's port may be taken on a shared machine
    outs = _ranks(doc, tmp_path, {"tcp://127.0.0.1:22225": url})
    assert f"3 processes joined at {url}, backend gloo" in outs[0]
    _assert_trained_on_rank0_only(outs, 3)
    saved_model(tmp_path / "out" / "model.pt")


@pytest.mark.slow
@runs_doc("08_shared_file.py", "--rank 0", "--rank 1", together=True)
def test_08_shared_file_rendezvous(tmp_path, doc):
    url = f"file://{tmp_path / 'sharedfile'}"  # a fresh file (it must not exist beforehand)
    outs = _ranks(doc, tmp_path, {"file:///tmp/ddpkit_sharedfile": url})
    assert f"2 processes joined at {url}" in outs[0]
    _assert_trained_on_rank0_only(outs, 2)


@pytest.mark.slow
@runs_doc("09_env_variables.py", "RANK=0", "RANK=1", together=True)
def test_09_env_variables_rendezvous(tmp_path, doc):
    port = free_port()
    outs = _ranks(doc, tmp_path, {"MASTER_PORT=29500": f"MASTER_PORT={port}"})
    assert f"rank 0 of 2 via env:// at 127.0.0.1:{port}" in outs[0]
    _assert_trained_on_rank0_only(outs, 2)


# -------------------------------------------------------------------- steps 10-11: the rules, the files


@pytest.mark.slow
@runs_doc("10_ddp_rules.py", "torchrun --nproc-per-node 2 examples/10_ddp_rules.py")
def test_10_rules_ranks_batches_seeds_mean_loss_and_rank0_saving(tmp_path, doc):
    out = run_doc(doc, *tiny(tmp_path))
    ranks = re.findall(r"^rank (\d) \| local_rank (\d) \| world_size 2 \| device cpu \| gloo$", out, re.M)
    assert sorted(ranks) == [("0", "0"), ("1", "1")]  # one line per process
    assert "batch 16 per process x 2 processes = global batch 32" in out
    assert "lr 0.4 at batch 256 -> 0.05 at 32" in out
    assert "steps per epoch: 2 (a plain DataLoader: 4, each process sees the whole set)" in out
    inits = re.search(r"^init checksum per rank: \[(\S+), (\S+)\] \(identical\)$", out, re.M)
    assert inits and inits.group(1) == inits.group(2)
    aug = re.search(r"^augmented samples 0-7 checksum per rank: \[(\S+), (\S+)\] \(different\)$", out, re.M)
    assert aug and aug.group(1) != aug.group(2)
    losses = re.search(r"^train loss per rank \[(\S+), (\S+)\] -> all_reduce mean (\S+)$", out, re.M)
    assert losses and abs((float(losses[1]) + float(losses[2])) / 2 - float(losses[3])) < 1e-3
    assert out.count("rank 0 saved") == 1 and len(step_lines(out)) == 1
    assert "0.weight" in saved_model(tmp_path / "out" / "model.pt")


@pytest.mark.slow
@runs_doc("11_weights_and_checkpoints.py", "torchrun --nproc-per-node 2")
def test_11_rank0_prepares_pretrained_weights_checkpoint_round_trip_and_resume(tmp_path, doc):
    out = run_doc(doc, *tiny(tmp_path, epochs=2))
    assert "data prepared by rank 0 (64 samples), read by all 2 ranks" in out
    weights = re.search(
        r"^weights per rank: random init \[(\S+), (\S+)\] -> after loading pretrained.pt \[(\S+), (\S+)\]$",
        out,
        re.M,
    )
    assert weights and weights[1] != weights[2] and weights[3] == weights[4], out
    assert re.search(r"^checkpoint round trip: every rank's weights equal \S+: \[True, True\]$", out, re.M)
    resumed = re.search(
        r"^resumed after epoch 1: epoch 2 retrained to the same weights \[(\S+), (\S+)\]$", out, re.M
    )
    assert resumed and resumed[1] == resumed[2], out
    state = saved_model(tmp_path / "out" / "model.pt")
    pretrained = load_checkpoint(tmp_path / "out" / "pretrained.pt")["model"]
    assert state.keys() == pretrained.keys() and not all(torch.equal(state[k], pretrained[k]) for k in state)
    assert load_checkpoint(tmp_path / "out" / "resume.pt")["extra"] == {"epoch": 1}


# ----------------------------------------------------------------- steps 13-14: model parallel, notebooks


@runs_doc("13_model_parallel.py", "python examples/13_model_parallel.py")
def test_13_two_halves_in_one_process(tmp_path, doc):
    out = run_doc(doc, *tiny(tmp_path))
    assert "rank 0: part1 on cpu, part2 on cpu" in out and out.count("epoch 1/1 | train loss") == 1
    assert re.search(r"^replicas identical after training: \[\S+\]$", out, re.M), out


@pytest.mark.slow
@runs_doc("13_model_parallel.py", "torchrun --nproc-per-node 2")
def test_13_two_device_halves_under_ddp_stay_identical(tmp_path, doc):
    out = run_doc(doc, *tiny(tmp_path))
    assert sorted(re.findall(r"^rank (\d): part1 on cpu, part2 on cpu$", out, re.M)) == ["0", "1"]
    assert out.count("epoch 1/1 | train loss") == 1
    sums = re.search(r"^replicas identical after training: \[(\S+), (\S+)\]$", out, re.M)
    assert sums and sums.group(1) == sums.group(2)


def _assert_two_rank_results(out: str) -> None:
    results = [ast.literal_eval(ln) for ln in out.splitlines() if ln.startswith("{'rank'")]
    assert [r["rank"] for r in results] == [0, 1], out
    assert [r["train samples per epoch"] for r in results] == [32, 32]  # ceil(64 / 2) each
    assert sum(r["val samples scored here"] for r in results) == DIGITS_VAL  # an exact split
    assert len({r["val acc (all ranks)"] for r in results}) == 1  # both scored the gathered predictions
    assert len({r["weights checksum"] for r in results}) == 1
    assert len({r["last epoch's loss"] for r in results}) == 2  # each rank's own shard
    assert len(step_lines(out)) == 1  # rank 0's log line


@pytest.mark.slow
@runs_doc("14_notebook_launch.py", "python examples/14_notebook_launch.py")
def test_14_launch_runs_the_function_on_two_processes_and_returns_each_result(tmp_path, doc):
    _assert_two_rank_results(run_doc(doc, *tiny(tmp_path)))


@pytest.mark.slow
def test_14_runs_as_notebook_cells(tmp_path):
    """The script's code run by an interpreter without a file (as in a notebook): launch forks its workers."""
    cells = (EXAMPLES / "14_notebook_launch.py").read_text()
    code = (
        f"import sys; sys.path.insert(0, {str(EXAMPLES)!r}); exec(compile({cells!r}, '<notebook>', 'exec'))"
    )
    argv = [sys.executable, "-c", code, *tiny(tmp_path)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT, env=cli_env(), cwd=REPO)
    _assert_two_rank_results(check_ok(proc))
