"""By-hand rendezvous (--init-method): local ranks per host, the master probe, the file:// rendezvous file."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from conftest import assert_user_error, cli_env, free_port, run_cli
from ddpkit.cluster.env import DistEnv, manual_env
from ddpkit.distributed.rendezvous import layout, probe_window
from ddpkit.errors import UserError


def start(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "ddpkit", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=cli_env(env),
    )


def finish(procs: list[subprocess.Popen], timeout: float = 120) -> list[subprocess.CompletedProcess]:
    out = []
    for p in procs:
        try:
            so, se = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            so, se = p.communicate()
        out.append(subprocess.CompletedProcess(p.args, p.returncode, so, se))
    return out


def info_fields(stdout: str) -> list[dict[str, str]]:
    lines = [ln for ln in stdout.splitlines() if ln.startswith("rank=")]
    return [dict(kv.split("=", 1) for kv in ln.split() if "=" in kv) for ln in lines]


def by_hand(url: str, world: int, extra=lambda r: ([], {})) -> list[subprocess.CompletedProcess]:
    """`ddpkit info --init-method URL --rank r --world-size W` for every r; rank 0's output holds all lines."""
    procs = []
    for r in range(world):
        flags, env = extra(r)
        procs.append(
            start("info", "--init-method", url, "--rank", str(r), "--world-size", str(world), *flags, env=env)
        )
    return finish(procs)


def ok(proc) -> str:
    assert proc.returncode == 0, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    return proc.stdout


def local_ranks(results) -> dict[int, tuple[int, int]]:
    fields = info_fields(ok(results[0]))
    return {int(f["rank"]): (int(f["local_rank"]), int(f["node_rank"])) for f in fields}


def test_layout_orders_ranks_per_host_and_hosts_by_first_rank():
    entries = [["a", ""], ["b", ""], ["a", ""], ["b", ""], ["c", ""]]
    got = [layout(DistEnv(rank=r, world_size=5), entries) for r in range(5)]
    assert [(e.local_rank, e.local_world_size, e.node_rank, e.num_nodes) for e in got] == [
        (0, 2, 0, 3),
        (0, 2, 1, 3),
        (1, 2, 0, 3),
        (1, 2, 1, 3),
        (0, 1, 2, 3),
    ]
    with pytest.raises(UserError, match="both use local rank 0"):
        layout(DistEnv(rank=0, world_size=2), [["a", "0"], ["a", "0"]])
    with pytest.raises(UserError, match="ranks 0 and 1 on host a both use local rank 1"):
        layout(DistEnv(rank=1, world_size=2), [["a", "1"], ["a", ""]])  # rank 1's place is 1 too
    assert layout(DistEnv(rank=0, world_size=2), [["a", "1"], ["a", "0"]]).local_rank == 1


def test_local_rank_comes_from_the_flag_then_local_rank_then_the_rendezvous(tmp_path):
    url = f"file://{tmp_path}/f"
    assert not manual_env(url, 1, 2, environ={}).local_rank_given
    assert manual_env(url, 1, 2, environ={"LOCAL_RANK": "3"}).local_rank == 3
    assert manual_env(url, 1, 2, 5, environ={"LOCAL_RANK": "3"}).local_rank == 5
    with pytest.raises(UserError, match="LOCAL_RANK='x' is not an integer"):
        manual_env(url, 1, 2, environ={"LOCAL_RANK": "x"})
    with pytest.raises(UserError, match="negative"):
        manual_env(url, 1, 2, environ={"LOCAL_RANK": "-1"})


@pytest.mark.slow
def test_three_ranks_by_hand_on_one_host_get_local_ranks_0_1_2():
    results = by_hand(f"tcp://127.0.0.1:{free_port()}", 3)
    assert local_ranks(results) == {0: (0, 0), 1: (1, 0), 2: (2, 0)}


@pytest.mark.slow
def test_local_rank_variable_and_flag_win(tmp_path):
    results = by_hand(f"file://{tmp_path}/rdzv", 2, lambda r: ([], {"LOCAL_RANK": str(1 - r)}))
    assert local_ranks(results) == {0: (1, 0), 1: (0, 0)}
    flag = lambda r: (["--local-rank", str(1 - r)], {"LOCAL_RANK": "0"})  # noqa: E731
    assert local_ranks(by_hand(f"tcp://127.0.0.1:{free_port()}", 2, flag)) == {0: (1, 0), 1: (0, 0)}


@pytest.mark.slow
def test_two_ranks_asking_for_one_local_rank_is_an_error():
    results = by_hand(f"tcp://127.0.0.1:{free_port()}", 2, lambda r: (["--local-rank", "0"], {}))
    for proc in results:
        assert_user_error(proc, "both use local rank 0", "--local-rank")


def test_rank_0_refusing_a_local_rank_keeps_its_store_up_until_every_rank_has_read_the_hosts():
    """Rank 0 hosts the TCP store; if it exits as soon as it sees two ranks on one local rank, a rank still
    reading the hosts gets a connection error (exit 1, a traceback) instead of the one-line reason. Rank 1
    here is a slow reader holding a real store client."""
    import socket

    from torch.distributed import TCPStore

    from ddpkit.distributed.rendezvous import READ_KEY

    port = free_port()
    rank0 = start("info", "--init-method", f"tcp://127.0.0.1:{port}", "--rank", "0", "--world-size", "2",
                  "--local-rank", "0")  # fmt: skip
    store = TCPStore("127.0.0.1", port, 2, False, timeout=__import__("datetime").timedelta(seconds=60))
    store.set("ddpkit/host/1", f"{socket.gethostname()}\t0")
    time.sleep(3)  # rank 0 has every entry now and knows the answer
    assert store.get("ddpkit/host/0").decode().split("\t") == [socket.gethostname(), "0"]
    store.add(READ_KEY, 1)
    (proc,) = finish([rank0])
    assert_user_error(proc, "both use local rank 0", "--local-rank")


@pytest.mark.parametrize(
    "flags, env, fragment",
    [
        (["--local-rank", "-1"], {}, "--local-rank must be at least 0"),
        (["--local-rank", "x"], {}, "invalid int value: 'x'"),
        ([], {"LOCAL_RANK": "one"}, "LOCAL_RANK='one' is not an integer"),
    ],
)
def test_bad_local_ranks_are_one_line(tmp_path, flags, env, fragment):
    url = f"file://{tmp_path}/rdzv"
    proc = run_cli(
        "info", "--init-method", url, "--rank", "0", "--world-size", "2", *flags, env=env, timeout=60
    )
    assert_user_error(proc, fragment)


def test_local_rank_without_init_method_is_refused():
    assert_user_error(run_cli("info", "--local-rank", "1", timeout=60), "belong to a manual rendezvous")


def _unanswered_port(held: list) -> int:
    """A port on this machine whose connection attempts are never answered, as a host that drops packets:
    a listener with a backlog of 0 whose queue is already full (Linux then drops new SYNs)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", free_port()))
    listener.listen(0)
    held.append(listener)
    port = listener.getsockname()[1]
    for _ in range(3):  # fill the accept queue; nobody accepts
        filler = socket.socket()
        filler.setblocking(False)
        filler.connect_ex(("127.0.0.1", port))
        held.append(filler)
    time.sleep(0.2)  # the handshakes of the fillers settle
    return port


@pytest.mark.slow
@pytest.mark.parametrize("unanswered", [False, True], ids=["closed-port", "unanswered"])
def test_a_rank_that_cannot_reach_the_master_fails_in_seconds(unanswered):
    # only this machine's own addresses: a test never sends traffic anywhere else
    host, held = "127.0.0.1", []
    port = _unanswered_port(held) if unanswered else free_port()
    start_t = time.monotonic()
    proc = run_cli(
        "info", "--init-method", f"tcp://{host}:{port}", "--rank", "1", "--world-size", "2",
        env={"DDPKIT_PROBE_S": "2"}, timeout=120,
    )  # fmt: skip
    elapsed = time.monotonic() - start_t
    assert_user_error(proc, f"cannot reach the master at {host}:{port} after 2 s", "DDPKIT_PROBE_S")
    assert elapsed < 60, elapsed
    assert len(proc.stderr.splitlines()) == 1, proc.stderr
    for sock in held:
        sock.close()


@pytest.mark.slow
def test_mpirun_rank_and_launcher_node_probe_the_master():
    port = free_port()
    mpi = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}
    proc = run_cli("info", env={**mpi, "MASTER_PORT": str(port), "DDPKIT_PROBE_S": "2"}, timeout=120)
    assert_user_error(proc, f"cannot reach the master at 127.0.0.1:{port} after 2 s")
    node1 = ["--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1", "--master-port", str(port)]
    proc = run_cli("info", *node1, env={"DDPKIT_PROBE_S": "2"}, timeout=120)
    assert_user_error(proc, f"cannot reach the master at 127.0.0.1:{port} after 2 s")


@pytest.mark.slow
def test_the_probe_waits_for_a_master_that_starts_late():
    url = f"tcp://127.0.0.1:{free_port()}"
    rank1 = start("info", "--init-method", url, "--rank", "1", "--world-size", "2")
    time.sleep(4)
    assert rank1.poll() is None, rank1.communicate()
    rank0 = start("info", "--init-method", url, "--rank", "0", "--world-size", "2")
    results = finish([rank0, rank1])
    assert local_ranks(results) == {0: (0, 0), 1: (1, 0)}
    ok(results[1])


@pytest.mark.slow
def test_the_same_file_rendezvous_runs_twice_and_a_stale_file_is_named(tmp_path):
    path = tmp_path / "rdzv"
    for _ in range(2):
        results = by_hand(f"file://{path}", 2)
        assert local_ranks(results) == {0: (0, 0), 1: (1, 0)}
        assert {f["master"] for f in info_fields(results[0].stdout)} == {
            f"file://{path}"
        }  # not a made-up port
        assert not path.exists()
    # A run that died after the rendezvous leaves its file behind.
    code = (
        "import os, sys, ddpkit\n"
        "ddpkit.init_distributed(init_method=sys.argv[1], rank=int(sys.argv[2]), world_size=2)\n"
        "ddpkit.barrier()\n"  # both ends connected: an exit before would fail the other's connect
        "os._exit(0)\n"
    )
    crashed = [
        subprocess.Popen([sys.executable, "-c", code, f"file://{path}", str(r)], env=cli_env())
        for r in range(2)
    ]
    assert [p.wait(timeout=120) for p in crashed] == [0, 0]
    assert path.exists()
    before = path.read_bytes()
    for proc in by_hand(f"file://{path}", 2):
        assert_user_error(proc, f"the rendezvous file '{path}' was left by an earlier run", "delete it")
    assert path.read_bytes() == before


THREADS = (
    "import os, sys, torch, ddpkit\n"
    "ddpkit.init_distributed(init_method=sys.argv[1], rank=int(sys.argv[2]), world_size=2)\n"
    "print(os.environ['OMP_NUM_THREADS'], torch.get_num_threads())\n"
    "ddpkit.shutdown()\n"
)


def threads_by_hand(tmp_path, env: dict[str, str]) -> list[str]:
    url = f"tcp://127.0.0.1:{free_port()}"
    procs = []
    for r in range(2):
        cmd = [sys.executable, "-c", THREADS, url, str(r)]
        procs.append(
            subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        )
    return [ok(p).strip() for p in finish(procs)]


@pytest.mark.slow
def test_ranks_without_a_launcher_share_the_cores_unless_omp_num_threads_is_set(tmp_path):
    env = cli_env()
    env.pop("OMP_NUM_THREADS")
    share = max(1, (os.cpu_count() or 1) // 2)
    assert threads_by_hand(tmp_path, env) == [f"{share} {share}"] * 2
    assert threads_by_hand(tmp_path, {**env, "OMP_NUM_THREADS": "2"}) == ["2 2"] * 2


@pytest.mark.slow
def test_train_twice_on_one_file_rendezvous_with_rank_1_first(tmp_path):
    # The file an earlier run left used to send the next run's ranks to its dead processes' addresses.
    url = f"file://{tmp_path / 'rdzv'}"
    for run in ("a", "b"):
        train = [
            "train",
            f"out_dir={tmp_path / run}",
            "model.arch=mlp",
            "train.max_steps=1",
            "report.curves=false",
        ]
        rank1 = start(*train, "--init-method", url, "--rank", "1", "--world-size", "2")
        time.sleep(2)
        rank0 = start(*train, "--init-method", url, "--rank", "0", "--world-size", "2")
        for proc in finish([rank0, rank1]):
            ok(proc)
    assert not (tmp_path / "rdzv").exists()


@pytest.mark.parametrize("raw", ["0", "-3", "soon", "inf"])
def test_a_bad_probe_window_is_one_line(monkeypatch, raw):
    monkeypatch.setenv("DDPKIT_PROBE_S", raw)
    with pytest.raises(UserError, match=f"DDPKIT_PROBE_S='{raw}' is not a positive number of seconds"):
        probe_window()
