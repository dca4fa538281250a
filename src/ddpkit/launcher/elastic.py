"""Workers started by torch's elastic agent (what torchrun runs): the rendezvous it uses, the command each
worker runs (a program, or a fork of the warm fork server), the agent's logs kept to one line per failed worker,
and how a failed launch is told (the workers' status, or a rendezvous that went wrong, in one line)."""

from __future__ import annotations

import logging
import os
import re
import sys
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from ddpkit import channels
from ddpkit.cluster.netif import hosted_endpoint, use_interface
from ddpkit.diagnostics import stacks
from ddpkit.distributed import reaper
from ddpkit.distributed.rendezvous import probe_launch
from ddpkit.errors import Preempted, UserError, first_line
from ddpkit.launcher import signals, usermain, warm_start
from ddpkit.launcher.launch import (
    _ended_by_us,
    _failure,
    _launched,
    set_thread_env,
)
from ddpkit.launcher.peers import name_lost_nodes, watch
from ddpkit.launcher.spec import LaunchSpec


def _rendezvous_error(e: Exception, spec: LaunchSpec, endpoint: str) -> Exception:
    """A failed rendezvous -> a UserError saying what went wrong; any other exception unchanged."""
    name = type(e).__name__
    msg = first_line(e, limit=1000)
    low = msg.lower()
    if "connect" in low and (
        "timed out" in low or "failed to connect" in low
    ):  # never reached the rendezvous host
        why = re.search(r"errno: \d+ - ([^)]+)\)", msg)
        return UserError(
            f"could not reach the rendezvous at {endpoint}: "
            + (why[1] if why else f"no answer within --rdzv-timeout {spec.rdzv_timeout} s"),
            "check that the address names node 0, that it runs, and that no firewall blocks the port",
        )
    # c10d raises RendezvousTimeoutError, static a DistStoreError "Timed out ... 1/2 clients joined."
    if "timeout" in name.lower() or "timed out" in low:
        joined = re.search(r"(\d+)/(\d+) clients joined", msg)
        who = f"only {joined[1]} of {joined[2]} nodes" if joined else f"not all {spec.nnodes} nodes"
        return UserError(
            f"{who} joined the rendezvous at {endpoint} within --rdzv-timeout {spec.rdzv_timeout} s",
            "start every node with the same --nnodes and address, or raise --rdzv-timeout",
        )
    if "EADDRINUSE" in msg or "address already in use" in low:
        return UserError(
            f"the rendezvous port of {endpoint} is already in use on this host",
            "another job listens there: choose another --master-port or --rdzv-endpoint port",
        )
    if "Rendezvous" in name or "rendezvous" in low or isinstance(e, (RuntimeError, OSError, ValueError)):
        return UserError(
            f"the launch failed at the rendezvous {endpoint}: {name}: {msg}",
            "check that every node was started with the same --nnodes and can reach the master address and port",
        )
    return e


def launch_elastic(
    spec: LaunchSpec,
    python_args: Sequence[str],
    warm: tuple[Callable[[list[str]], Any], list[str]] | None = None,
    meanwhile: Callable[[], None] | None = None,
    script: bool = False,
) -> None:
    """Run `python PYTHON_ARGS` on nproc_per_node workers per node via torch's elastic agent (as torchrun does).

    `warm` = (fn, argv): when warm_start.start() ran, each worker is instead forked from its fork server and
    runs fn(argv), as `python PYTHON_ARGS` would have run it. `meanwhile()` is called once this launcher's own
    imports are done: it starts what the launcher does while its workers run.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    _launched()
    if meanwhile is not None:
        meanwhile()
    nproc = spec.nproc_per_node or 1
    set_thread_env(nproc)
    entrypoint, args, start_method = _worker_command(python_args, warm)
    config, endpoint = _agent_config(spec, nproc, start_method)
    watch(endpoint, spec.nnodes)  # names lost nodes; ends a launcher stuck on a store it lost
    quiet_agent_logs(debug=bool(os.environ.get(channels.DEBUG)))
    forwarder, ranks = signals.Forwarder(), stacks.Watch(spec.straggler_timeout, spec.straggler_action)
    try:
        # SIGTERM/SIGUSR1/SIGINT go on to the workers; we wait for them. Each worker dies with this process (or
        # with its fork server, which does); what they started (the script's own children) is ended with the
        # job (reaper.py: this launcher is their subreaper).
        with forwarder, signals.launcher_env(), ranks, reaper.reaping():
            elastic_launch(config, entrypoint)(*args)
    except ChildFailedError as e:
        codes = {rank: f.exitcode for rank, f in e.failures.items()}
        codes.update(_reaped_by_the_server(ranks, codes))
        ours = _ended_by_us(codes, e, forwarder)
        err = _failure(codes, spec.max_restarts, forwarder.signum, ours, script, ranks.gave_up)
        raise stacks.job_failure(err, ranks) from None
    except SignalException as e:  # SIGHUP/SIGQUIT, which torch's agent passes on to the workers itself
        raise Preempted(
            f"received {e.sigval.name}; workers were stopped (they checkpoint at the next step boundary)",
            signum=int(e.sigval),
        ) from None
    except Exception as e:  # rendezvous failures: a node that never came, a port in use, ...
        err = name_lost_nodes(_rendezvous_error(e, spec, endpoint))
        if err is e:
            raise
        raise err from None


def _reaped_by_the_server(ranks: stacks.Watch, known: dict[int, int]) -> dict[int, int]:
    """{rank: exit status} of the warm workers that failed and that torch's agent did not report (it reports
    the first failure it sees of a forked worker, which may be a rank that only waited for the one that died):
    the fork server, their parent, wrote each status down (warm_server)."""
    exits = warm_start.worker_exits()
    return {r: exits[pid] for r, pid in ranks.pids.items() if r not in known and exits.get(pid)}


def _agent_config(spec: LaunchSpec, nproc: int, start_method: str) -> tuple[Any, str]:
    """torch's LaunchConfig for these flags and the rendezvous endpoint; the network interface toward it is
    chosen and, with several nodes, the rendezvous is probed first (a one-line error in seconds)."""
    from torch.distributed.launcher.api import LaunchConfig

    backend, endpoint, run_id, configs = _rendezvous(spec)
    use_interface(endpoint.rsplit(":", 1)[0], spec.nnodes > 1)  # workers inherit GLOO/NCCL_SOCKET_IFNAME
    if spec.nnodes > 1:
        probe_launch(backend, endpoint, spec.node_rank, spec.rdzv_timeout)  # seconds, not the whole timeout
    config = LaunchConfig(
        min_nodes=spec.nnodes,
        max_nodes=spec.nnodes,
        nproc_per_node=nproc,
        run_id=run_id,
        rdzv_endpoint=hosted_endpoint(endpoint) if backend == "c10d" else endpoint,
        rdzv_backend=backend,
        rdzv_configs=configs,
        max_restarts=spec.max_restarts,
        monitor_interval=0.1,
        start_method=start_method,
        signals_to_handle=signals.AGENT_SIGNALS,
    )
    return config, endpoint


def _rendezvous(spec: LaunchSpec) -> tuple[str, str, str, dict]:
    """(backend, endpoint, run id, rendezvous configs) as torchrun chooses them for these flags."""
    if spec.rdzv_endpoint:  # c10d: any node may start first; the rendezvous assigns node ranks
        backend, endpoint = spec.rdzv_backend or "c10d", spec.rdzv_endpoint
        run_id = spec.rdzv_id or os.environ.get("SLURM_JOB_ID") or "ddpkit"
        # c10d reads its wait for the other nodes from `join_timeout` (it ignores `timeout`)
        configs: dict = {"timeout": spec.rdzv_timeout, "join_timeout": spec.rdzv_timeout}
        if backend == "static":
            configs["rank"] = spec.node_rank
        else:
            # Each node's agent counts its own restarts, so workers cannot name a restart round the same way
            # on every node: let each round start a fresh store instead of sharing the agent's (runtime.py).
            os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
        return backend, endpoint, run_id, configs
    if spec.nnodes == 1 and spec.master_port is None:
        # like torchrun --standalone: the agent's store listens on a port the OS gives it (port 0), so no port
        # is chosen first and then lost to another job starting at the same moment
        return "c10d", "localhost:0", str(uuid.uuid4()), {"timeout": spec.rdzv_timeout}
    # static rendezvous, as torchrun with --master-addr/--master-port/--node-rank
    endpoint = f"{spec.master_addr or '127.0.0.1'}:{spec.master_port or 29500}"
    return "static", endpoint, "ddpkit", {"rank": spec.node_rank, "timeout": spec.rdzv_timeout}


def _worker_command(
    python_args: Sequence[str], warm: tuple[Callable[[list[str]], Any], list[str]] | None
) -> tuple[Any, tuple, str]:
    """(entrypoint, its arguments, start method) of each worker: `python PYTHON_ARGS`, or a fork of the fork
    server running warm's function when the fork server runs."""
    if list(python_args[:3]) != ["-u", "-m", "ddpkit"]:  # a user's script: the signals module arranges it
        python_args = ["-u", "-m", usermain.__name__, *python_args]  # dies with us, runs the script
    if warm is not None and warm_start.running():
        launcher = (warm_start.LaunchEnviron(), warm_start.LaunchStdin())
        return warm_start.worker, (warm[0], list(warm[1]), *launcher), "forkserver"
    return sys.executable, tuple(python_args), "spawn"


class _NoTraceback(logging.Filter):
    """The agent reports the first failed worker it sees ("failed (exitcode: -9) local_rank: 2 ...", for a
    forked worker with a traceback of its own join): the launcher's one line names every failed rank, the one
    that died first (launch._failure), so the agent's line is not printed."""

    def filter(self, record: logging.LogRecord) -> bool:
        if "failed (exitcode: %s)" in str(record.msg):
            return False
        record.exc_info = record.exc_text = None
        return True


def quiet_agent_logs(debug: bool) -> None:
    """torch's agent says only what went wrong (one line per failed worker), unless DDPKIT_DEBUG is set."""
    logging.getLogger("torch.distributed.elastic").setLevel(logging.INFO if debug else logging.ERROR)
    logging.getLogger("torch.multiprocessing").setLevel(logging.INFO if debug else logging.ERROR)
    api = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    if not debug and not any(isinstance(f, _NoTraceback) for f in api.filters):
        api.addFilter(_NoTraceback())
