"""By-hand rendezvous (`--init-method tcp://` or `file://`): reach the master, learn the ranks per host, clean up.

Each rank gives only its rank and the world size, so which ranks share a host (local rank, local world size,
node rank) is learnt from the rendezvous store before the process group, and the device, are made.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
from dataclasses import replace

from ddpkit import channels
from ddpkit.cluster.env import DistEnv
from ddpkit.cluster.netif import is_loopback, owns
from ddpkit.errors import UserError, first_line

PROBE_VAR = channels.PROBE_S
DEFAULT_PROBE_S = 30.0
# Set by every rank once all ranks have told their host: a rank that finds it in a file:// rendezvous file
# before joining meets a file an earlier run left behind (a rank of this run can only come before it).
COMPLETE_KEY = "ddpkit/rendezvous_complete"
READ_KEY = "ddpkit/hosts_read"  # how many ranks have read every host entry
LEAVE_WAIT_S = 20.0  # a loaded machine can keep a rank seconds behind rank 0 at exit
REAPPEAR_S = 1.0  # how long rank 0 watches for the file coming back (see leave)


def probe_window() -> float:
    """Seconds a rank waits for the master's port to accept a connection (DDPKIT_PROBE_S, default 30)."""
    raw = os.environ.get(PROBE_VAR, "")
    try:
        value = float(raw) if raw.strip() else DEFAULT_PROBE_S
    except ValueError:
        value = -1.0
    if not 0 < value < 1e6:
        raise UserError(f"{PROBE_VAR}={raw!r} is not a positive number of seconds", f"e.g. {PROBE_VAR}=60")
    return value


def probe(host: str, port: int, window_s: float | None = None) -> None:
    """Wait until HOST:PORT accepts a TCP connection, at most `window_s`; else a one-line UserError.

    Without it a wrong master address waits out the whole rendezvous timeout while torch prints a retry line
    every few seconds. The window lets the master come up a little later than this process.
    """
    window = probe_window() if window_s is None else window_s
    deadline = time.monotonic() + window
    why = "no answer"
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(2.0, left))):
                return
        except OSError as e:
            why = e.strerror or first_line(e) or type(e).__name__
        if time.monotonic() >= deadline:
            raise UserError(
                f"cannot reach the master at {host}:{port} after {window:g} s ({why})",
                f"check the address, that rank 0 runs, the firewall; {PROBE_VAR}=SECONDS waits longer",
            )
        time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))


def probe_launch(backend: str, endpoint: str, node_rank: int, rdzv_timeout: float) -> None:
    """A launcher node that connects to a rendezvous store another node hosts: probe it first (for at most
    --rdzv-timeout)."""
    host, _, port = endpoint.rpartition(":")
    host = host.strip("[]")
    if backend == "static" and node_rank == 0:
        return  # node 0's agent hosts the store
    if backend == "c10d" and (not host or host == "localhost" or is_loopback(host) or owns(host)):
        return  # hosted here (or on this host, by whichever agent comes first)
    probe(host, int(port), min(probe_window(), rdzv_timeout))


def file_path(env: DistEnv) -> str | None:
    return env.init_method[len("file://") :] if env.init_method.startswith("file://") else None


def check_stale_file(path: str) -> None:
    """Refuse a file:// rendezvous file that an earlier run got past the rendezvous with."""
    try:
        with open(path, "rb") as f:
            stale = COMPLETE_KEY.encode() in f.read()
    except FileNotFoundError:
        return
    except OSError as e:
        raise UserError(
            f"cannot read the rendezvous file '{path}' ({e.strerror})", "use another path"
        ) from None
    if stale:
        raise UserError(
            f"the rendezvous file '{path}' was left by an earlier run",
            "delete it, or give this run a new file:// path",
        )


def _where(env: DistEnv) -> str:
    return env.init_method


def join(env: DistEnv, timeout: datetime.timedelta) -> tuple[DistEnv, object]:
    """Meet the other ranks at env.init_method -> (env with the ranks per host filled in, the store)."""
    import torch.distributed as dist

    requested_local_rank = env.local_rank if env.local_rank_given else None
    path = file_path(env)
    if path is not None:
        check_stale_file(path)
    elif env.rank != 0:  # rank 0 hosts the store
        probe(env.master_addr, env.master_port, min(probe_window(), timeout.total_seconds()))
    try:
        store, _, _ = next(
            dist.rendezvous(env.init_method, rank=env.rank, world_size=env.world_size, timeout=timeout)
        )
    except (RuntimeError, ValueError, OSError) as e:
        raise UserError(
            f"rank {env.rank} could not join the rendezvous at {_where(env)} ({first_line(e, 50)})",
            "give every rank the same --init-method and --world-size; is rank 0 running?",
        ) from None
    store.set(
        f"ddpkit/host/{env.rank}",
        f"{socket.gethostname()}\t{'' if requested_local_rank is None else requested_local_rank}",
    )
    entries = [store.get(f"ddpkit/host/{r}").decode().split("\t") for r in range(env.world_size)]
    store.set(COMPLETE_KEY, "1")
    store.add(READ_KEY, 1)
    try:
        return layout(env, entries), store
    except UserError:
        if env.rank == 0:  # it hosts the TCP store: the others must read the hosts before it exits
            wait_for_count(store, READ_KEY, env.world_size, LEAVE_WAIT_S)
        raise


def wait_for_count(store, key: str, count: int, seconds: float) -> bool:
    """Wait (at most `seconds`) until the counter `key` reaches `count`; whether it did."""
    deadline = time.monotonic() + seconds
    while store.add(key, 0) < count:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def layout(env: DistEnv, entries: list[list[str]]) -> DistEnv:
    """entries[r] = [host, asked local rank or ""]. local rank = the one it asked for, else its place among the
    ranks on its host; node rank = its host's place among the hosts in order of their first rank."""
    hosts = [e[0] for e in entries]
    mine = hosts[env.rank]
    same = [r for r, h in enumerate(hosts) if h == mine]
    order = list(dict.fromkeys(hosts))
    chosen = {r: int(entries[r][1]) if len(entries[r]) > 1 and entries[r][1] else same.index(r) for r in same}
    taken: dict[int, int] = {}
    for r, lr in sorted(chosen.items()):
        if lr in taken:
            raise UserError(
                f"ranks {taken[lr]} and {r} on host {mine} both use local rank {lr}",
                "give each process on a host its own --local-rank (or LOCAL_RANK), or none of them",
            )
        taken[lr] = r
    local_rank = chosen[env.rank]
    return replace(
        env,
        local_rank=local_rank,
        local_world_size=len(same),
        node_rank=order.index(mine),
        num_nodes=len(order),
    )


def leave(store, env: DistEnv) -> None:
    """After the group is destroyed: rank 0 waits (briefly) for every rank to leave, then removes the file://
    rendezvous file, so that the same command runs again."""
    path = file_path(env)
    if path is None:
        return
    try:
        store.add("ddpkit/left", 1)
        if env.rank != 0:
            return
        if not wait_for_count(store, "ddpkit/left", env.world_size, LEAVE_WAIT_S):
            return  # a rank that did not leave: the file stays, and the next run is told to delete it
        os.remove(path)
        # torch's FileStore destructor in another rank checks that the file exists, then adds to its clean-up
        # counter, creating the file again when the removal fell in between: remove that leftover too.
        deadline = time.monotonic() + REAPPEAR_S
        while time.monotonic() < deadline:
            time.sleep(0.05)
            if os.path.exists(path):
                os.remove(path)
    except (RuntimeError, OSError):
        pass
