"""`ddpkit info` under every single-node launcher, real processes; launch-flag errors exit 2 with one line."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from conftest import assert_user_error, cli_env, free_port, run_cli
from ddpkit.launcher.spec import worker_argv

LINE = re.compile(r"rank=(\d+) local_rank=(\d+) world_size=(\d+) host=(\S+) backend=(\S+) device=(\S+)")


def table(stdout: str) -> list[tuple[int, int, int, str, str]]:
    """[(rank, local_rank, world_size, backend, device)] in printed order."""
    return [(int(m[1]), int(m[2]), int(m[3]), m[5], m[6]) for m in LINE.finditer(stdout)]


def expect(world: int, local: int | None = None) -> list[tuple[int, int, int, str, str]]:
    local = world if local is None else local
    return [(r, r % local, world, "gloo", "cpu") for r in range(world)]


def test_info_single_process():
    proc = run_cli("info")
    assert proc.returncode == 0, proc.stderr
    assert table(proc.stdout) == expect(1)
    assert "launcher=none" in proc.stdout
    assert proc.stdout.rstrip().endswith("dp=0 tp=0 pp=0")  # the rank's coordinates in the layout


@pytest.mark.slow
def test_info_nproc_per_node_uses_the_elastic_launcher():
    proc = run_cli("info", "dist.tp=2", "--nproc-per-node", "2")
    assert proc.returncode == 0, proc.stderr
    assert table(proc.stdout) == expect(2)  # printed by rank 0 in rank order, once
    assert proc.stdout.count("launcher=torchrun") == 2
    # each rank's coordinates in the dist.tp x dist.pp layout: tensor-parallel peers share a dp coordinate
    assert re.findall(r" (dp=\d+ tp=\d+ pp=\d+)$", proc.stdout, re.M) == ["dp=0 tp=0 pp=0", "dp=0 tp=1 pp=0"]


@pytest.mark.slow
def test_info_spawn_launcher():
    proc = run_cli("info", "--nproc-per-node", "3", "--launcher", "spawn")
    assert proc.returncode == 0, proc.stderr
    assert table(proc.stdout) == expect(3)
    assert proc.stdout.count("launcher=spawn") == 3


@pytest.mark.slow
def test_torchrun_dash_m_ddpkit():
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "ddpkit", "info"],
        capture_output=True,
        text=True,
        timeout=180,
        env=cli_env(),
    )
    assert proc.returncode == 0, proc.stderr
    assert table(proc.stdout) == expect(2)


def start_manual(url: str, world: int) -> list[subprocess.Popen]:
    return [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "ddpkit",
                "info",
                "--init-method",
                url,
                "--rank",
                str(r),
                "--world-size",
                str(world),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=cli_env(),
        )
        for r in range(world)
    ]


def collect(procs: list[subprocess.Popen]) -> list[tuple[int, str, str]]:
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=180)
        out.append((p.returncode, stdout, stderr))
    return out


@pytest.mark.slow
def test_three_terminals_tcp():
    port = free_port()
    results = collect(start_manual(f"tcp://127.0.0.1:{port}", 3))
    assert [r[0] for r in results] == [0, 0, 0], [r[2] for r in results]
    assert [(r, r, 3, "gloo", "cpu") for r in range(3)] == table(results[0][1])  # one host: local ranks 0-2
    assert results[1][1] == results[2][1] == ""  # only rank 0 prints


@pytest.mark.slow
def test_shared_file_rendezvous(tmp_path):
    url = f"file://{tmp_path}/sharedfile"
    results = collect(start_manual(url, 2))
    assert [r[0] for r in results] == [0, 0], [r[2] for r in results]
    assert table(results[0][1]) == [(0, 0, 2, "gloo", "cpu"), (1, 1, 2, "gloo", "cpu")]


@pytest.mark.slow
def test_torchrun_variables_without_a_launcher():
    # env:// by hand (and Kubeflow pods): two processes given MASTER_ADDR/PORT/RANK/WORLD_SIZE.
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "ddpkit", "info"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=cli_env({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "RANK": str(r), "WORLD_SIZE": "2"}),
        )
        for r in range(2)
    ]
    results = collect(procs)
    assert [r[0] for r in results] == [0, 0], [r[2] for r in results]
    assert [row[:3] for row in table(results[0][1])] == [(0, 0, 2), (1, 1, 2)]


@pytest.mark.slow
def test_failed_worker_is_named(tmp_path):
    # A worker that dies makes the job exit non-zero and the message names its rank.
    script = tmp_path / "die.py"
    script.write_text("import os, sys\nsys.exit(7 if os.environ['RANK'] == '1' else 0)\n")
    from ddpkit.errors import WorkerFailure
    from ddpkit.launcher.elastic import launch_elastic
    from ddpkit.launcher.spec import LaunchSpec

    spec = LaunchSpec(nproc_per_node=2)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with pytest.raises(WorkerFailure, match=r"rank 1 \(exit code 7\)"):
        launch_elastic(spec, [str(script)])


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--nproc-per-node", "0"], "--nproc-per-node must be at least 1"),
        (["--nnodes", "2"], "needs the address of node 0"),
        (["--nnodes", "2", "--node-rank", "2", "--master-addr", "h"], "outside --nnodes"),
        (["--master-port", "70000", "--nproc-per-node", "2"], "out of range"),
        (["--max-restarts", "-1"], "--max-restarts must be >= 0"),
        (["--launcher", "spawn", "--max-restarts", "1"], "cannot restart"),
        (["--rank", "0"], "manual rendezvous"),
        (["--init-method", "tcp://127.0.0.1:1234"], "needs --rank"),
        (
            [
                "--init-method",
                "tcp://127.0.0.1:1234",
                "--rank",
                "0",
                "--world-size",
                "2",
                "--nproc-per-node",
                "2",
            ],
            "one process per call",
        ),
        (["--init-method", "file:///no/such/dir/x", "--rank", "0", "--world-size", "2"], "does not exist"),
        (["--launcher", "mpirun"], "invalid choice"),
        (["--nproc-per-node", "two"], "a number or one of auto, cpu, gpu"),
        (["--bogus"], "unrecognized arguments"),
        (["dist.backend=nccl"], "needs CUDA"),
        (["dist.backend=nccl", "--nproc-per-node", "2"], "needs CUDA"),
        (["train.epochs=3"], "only dist.*"),
    ],
)
def test_bad_launch_inputs(args, fragment):
    assert_user_error(run_cli("info", *args, timeout=60), fragment)


@pytest.mark.parametrize(
    "variables, fragment",
    [
        ({"RANK": "0"}, "WORLD_SIZE missing"),
        (
            {"RANK": "5", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"},
            "outside world size",
        ),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0"}, "out of range"),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}, "SLURM_NODELIST"),
    ],
)
def test_bad_environment_exits_2(variables, fragment):
    assert_user_error(run_cli("info", env=variables, timeout=60), fragment)


def test_unknown_command():
    assert_user_error(run_cli("trian"), "did you mean 'train'")


def test_worker_argv_strips_only_launch_flags():
    argv = [
        "train",
        "-c",
        "x.yaml",
        "--nproc-per-node",
        "2",
        "a.b=1",
        "--master-port=123",
        "--max-restarts",
        "3",
        "--init-method",
        "u",
    ]
    assert worker_argv(argv) == ["train", "-c", "x.yaml", "a.b=1", "--init-method", "u"]


@pytest.mark.parametrize("command", ["info", "run"])
def test_more_processes_than_cores_is_refused_with_the_numbers(tmp_path, command):
    script = tmp_path / "s.py"
    script.write_text("print('started')\n")
    extra = [str(script)] if command == "run" else []
    env = {k: v for k, v in cli_env().items() if k != "DDPKIT_OVERSUBSCRIBE"}
    proc = subprocess.run(
        [sys.executable, "-m", "ddpkit", command, "--nproc-per-node", "1000", *extra],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    cores = os.cpu_count()
    assert_user_error(
        proc, f"1000 processes on this node but it has only {cores} CPU core(s)", "DDPKIT_OVERSUBSCRIBE=1"
    )
    assert "started" not in proc.stdout


def test_a_rank_the_agent_ends_after_a_handled_forwarded_signal_is_not_the_jobs_status():
    # SIGTERM passed on to a script whose handler exits 7: rank 1 ends first with 7; rank 0, already ending from
    # its own handler, gets the agent's second SIGTERM (the agent ends the others after a failure) and dies of it.
    # The job's status is the script's 7; a script without a handler (every rank killed by SIGTERM) keeps 143.
    import signal
    import types

    from ddpkit.launcher.launch import _ended_by_us, _failure

    def failed(first):
        return types.SimpleNamespace(get_first_failure=lambda: (first, None))

    forwarded = types.SimpleNamespace(signum=signal.SIGTERM)
    handled = {0: -signal.SIGTERM, 1: 7}
    assert _ended_by_us(handled, failed(1), forwarded) == {0}
    assert (
        _failure(handled, 0, signal.SIGTERM, _ended_by_us(handled, failed(1), forwarded), True).exit_code == 7
    )
    unhandled = {0: -signal.SIGTERM, 1: -signal.SIGTERM}
    assert _ended_by_us(unhandled, failed(1), forwarded) == frozenset()
    assert _failure(unhandled, 0, signal.SIGTERM, frozenset(), True).exit_code == 128 + signal.SIGTERM
