"""Start workers: torch's elastic launcher (what torchrun runs), torch.multiprocessing.spawn, or nothing.

Each worker runs `python -m ddpkit CMD ...` (elastic) or the same CLI function (spawn) with the launch flags
removed; it then finds its rank in the environment like under any other launcher.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import sys
import traceback
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from ddpkit import channels
from ddpkit.cluster.netif import hosted_endpoint, use_interface
from ddpkit.diagnostics import stacks
from ddpkit.distributed import reaper, torchrun_compat
from ddpkit.errors import Preempted, UserError, WorkerFailure, first_line
from ddpkit.launcher import signals, usermain, warm_start
from ddpkit.launcher.peers import name_lost_nodes, watch

PREEMPTED_EXIT = Preempted.exit_code

# Every launch flag (each takes a value); the first group starts workers, and workers get the command line
# without those.
STARTER_FLAGS = frozenset(
    {
        "--nproc-per-node",
        "--nnodes",
        "--node-rank",
        "--master-addr",
        "--master-port",
        "--max-restarts",
        "--launcher",
        "--rdzv-endpoint",
        "--rdzv-backend",
        "--rdzv-id",
        "--rdzv-timeout",
    }
    | stacks.FLAGS
)
LAUNCH_FLAGS = STARTER_FLAGS | {"--init-method", "--rank", "--world-size", "--local-rank"}
# torchrun's spellings: each flag with underscores too, and flags that take no value (torchrun_compat.py).
STARTER_FLAGS, LAUNCH_FLAGS = torchrun_compat.spellings(STARTER_FLAGS, LAUNCH_FLAGS)


@dataclass(frozen=True)
class LaunchSpec:
    """What the launch flags asked for."""

    nproc_per_node: int | None = None
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    max_restarts: int = 0
    launcher: str = "torchrun"
    rdzv_endpoint: str | None = None
    rdzv_backend: str | None = None
    rdzv_id: str | None = None
    rdzv_timeout: int = 900
    init_method: str | None = None
    rank: int | None = None
    world_size: int | None = None
    local_rank: int | None = None
    straggler_timeout: float = stacks.DEFAULT_TIMEOUT_S
    straggler_action: str = "report"

    @property
    def starts_workers(self) -> bool:
        return self.init_method is None and (
            self.nproc_per_node is not None
            or self.nnodes > 1
            or self.launcher == "spawn"
            or self.rdzv_endpoint
        )


def add_launch_flags(parser) -> None:
    """The launch flags every command that starts workers shares, on an argparse parser."""
    both = torchrun_compat.both_spellings
    g = parser.add_argument_group("launch flags")
    g.add_argument(
        *both("--nproc-per-node"),
        type=torchrun_compat.nproc_value,
        metavar="N",
        help="start N local workers (auto, cpu, gpu: as torchrun counts them)",
    )
    g.add_argument("--nnodes", type=int, default=1, metavar="N", help="number of nodes")
    g.add_argument(*both("--node-rank"), type=int, default=0, metavar="R", help="this node's rank")
    g.add_argument(*both("--master-addr"), metavar="HOST", help="address of node 0")
    g.add_argument(
        *both("--master-port"), type=int, metavar="PORT", help="port on node 0 (a free one when omitted)"
    )
    g.add_argument(
        *both("--max-restarts"), type=int, default=0, metavar="K", help="restart all workers up to K times"
    )
    g.add_argument("--launcher", choices=["torchrun", "spawn"], default="torchrun")
    g.add_argument(
        *both("--rdzv-endpoint"),
        metavar="HOST:PORT",
        help="c10d rendezvous endpoint (any node may start first)",
    )
    g.add_argument(*both("--rdzv-backend"), choices=["c10d", "static"], help="rendezvous backend")
    g.add_argument(
        *both("--rdzv-id"), metavar="ID", help="job id shared by all nodes for the c10d rendezvous"
    )
    g.add_argument(
        *both("--rdzv-timeout"), type=int, default=900, metavar="S", help="seconds to wait for all nodes"
    )
    g.add_argument(
        *both("--init-method"), metavar="URL", help="manual rendezvous: tcp://HOST:PORT or file:///PATH"
    )
    g.add_argument("--rank", type=int, metavar="R", help="this process's rank (with --init-method)")
    g.add_argument(
        *both("--world-size"), type=int, metavar="W", help="number of processes (with --init-method)"
    )
    g.add_argument(
        *both("--local-rank"),
        type=int,
        metavar="L",
        help="this process's GPU on its host (with --init-method; default LOCAL_RANK, else its place among "
        "the ranks on its host)",
    )
    torchrun_compat.add_flags(g)
    stacks.add_flags(g)


def _slurm_agents(spec: LaunchSpec, environ: Mapping[str, str]) -> LaunchSpec:
    """Under srun with one task per node (`srun -N 2 --ntasks-per-node 1 ddpkit ... --nnodes 2`), each task is
    one node's agent: node 0 is the first host of the node list, this node's rank is SLURM_NODEID, the port is
    derived from the job id unless MASTER_PORT is set."""
    from ddpkit.cluster.env import expand_nodelist, slurm_job_step, slurm_nodelist, slurm_port

    nodes = slurm_nodelist(environ)
    if (
        spec.nnodes == 1
        or spec.master_addr
        or spec.rdzv_endpoint
        or nodes is None
        or "SLURM_PROCID" not in environ
    ):
        return spec
    tasks = environ.get("SLURM_STEP_NUM_TASKS") or environ.get("SLURM_NTASKS") or "1"
    if tasks.strip() != str(spec.nnodes):
        raise UserError(
            f"--nnodes {spec.nnodes} under srun needs one task per node, this step has {tasks} task(s)",
            f"run it as `srun -N {spec.nnodes} --ntasks-per-node 1 ddpkit ...`, or drop the launch flags "
            "to have one Slurm task per rank",
        )
    port = (
        int(environ["MASTER_PORT"])
        if environ.get("MASTER_PORT", "").isdigit()
        else slurm_port(slurm_job_step(environ))
    )
    return replace(
        spec,
        master_addr=expand_nodelist(nodes)[0],
        master_port=spec.master_port or port,
        node_rank=int(environ.get("SLURM_NODEID", "0")),
    )


def spec_from_args(args, environ: Mapping[str, str] | None = None) -> LaunchSpec:
    """Validate the launch flags into a LaunchSpec (under srun, node 0 and this node's rank come from Slurm)."""
    torchrun_compat.apply(args)
    spec = LaunchSpec(
        nproc_per_node=args.nproc_per_node,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
        max_restarts=args.max_restarts,
        launcher=args.launcher,
        rdzv_endpoint=args.rdzv_endpoint,
        rdzv_backend=args.rdzv_backend,
        rdzv_id=args.rdzv_id,
        rdzv_timeout=args.rdzv_timeout,
        init_method=args.init_method,
        rank=args.rank,
        world_size=args.world_size,
        local_rank=args.local_rank,
        straggler_timeout=getattr(args, "straggler_timeout", stacks.DEFAULT_TIMEOUT_S),
        straggler_action=getattr(args, "straggler_action", "report"),
    )
    stacks.check_timeout(spec.straggler_timeout)
    if spec.init_method is not None:
        if (
            spec.nproc_per_node is not None
            or spec.nnodes != 1
            or spec.launcher == "spawn"
            or spec.max_restarts
        ):
            raise UserError(
                "--init-method starts one process per call",
                "drop --nproc-per-node/--nnodes/--launcher/--max-restarts",
            )
    elif spec.rank is not None or spec.world_size is not None or spec.local_rank is not None:
        raise UserError(
            "--rank, --world-size and --local-rank belong to a manual rendezvous",
            "add --init-method tcp://HOST:PORT",
        )
    if spec.local_rank is not None and spec.local_rank < 0:
        raise UserError(f"--local-rank must be at least 0, got {spec.local_rank}", "use e.g. --local-rank 1")
    if spec.nproc_per_node is not None and spec.nproc_per_node < 1:
        raise UserError(
            f"--nproc-per-node must be at least 1, got {spec.nproc_per_node}", "use e.g. --nproc-per-node 2"
        )
    if spec.nnodes < 1:
        raise UserError(f"--nnodes must be at least 1, got {spec.nnodes}", "use e.g. --nnodes 2")
    if not 0 <= spec.node_rank < spec.nnodes:
        raise UserError(
            f"--node-rank {spec.node_rank} is outside --nnodes {spec.nnodes}",
            f"node ranks run from 0 to {spec.nnodes - 1}",
        )
    if spec.master_port is not None and not 1 <= spec.master_port <= 65535:
        raise UserError(
            f"--master-port {spec.master_port} is out of range", "use a port between 1024 and 65535"
        )
    if spec.rdzv_timeout <= 0:
        raise UserError(
            f"--rdzv-timeout must be > 0 seconds, got {spec.rdzv_timeout}", "use e.g. --rdzv-timeout 900"
        )
    if spec.max_restarts < 0:
        raise UserError(f"--max-restarts must be >= 0, got {spec.max_restarts}", "use e.g. --max-restarts 3")
    spec = _slurm_agents(spec, os.environ if environ is None else environ)
    if spec.nnodes > 1 and not spec.master_addr and not spec.rdzv_endpoint:
        raise UserError(
            "--nnodes > 1 needs the address of node 0",
            "add --master-addr HOST (or --rdzv-endpoint HOST:PORT)",
        )
    if spec.launcher == "spawn" and spec.max_restarts:
        raise UserError(
            "--launcher spawn cannot restart workers",
            "use the default --launcher torchrun with --max-restarts",
        )
    if spec.launcher == "spawn" and spec.rdzv_endpoint:
        raise UserError("--launcher spawn does not take --rdzv-endpoint", "use --master-addr/--master-port")
    if spec.rdzv_endpoint and ":" not in spec.rdzv_endpoint:
        raise UserError(f"--rdzv-endpoint '{spec.rdzv_endpoint}' has no port", "write HOST:PORT")
    return spec


def worker_argv(argv: Sequence[str]) -> list[str]:
    """The command line minus the flags that start workers (the workers must not start workers)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a.split("=", 1)[0] in STARTER_FLAGS:
            skip = "=" not in a and a not in torchrun_compat.NO_VALUE
            continue
        out.append(a)
    return out


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def set_thread_env(nproc: int) -> None:
    """As torchrun does: several CPU workers on one node must not each start a thread per core."""
    if "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))


def describe_exit(code: int) -> str:
    """`exit code 3` or `killed by SIGKILL` for a process's exit status (negative: the signal)."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _ended_by_us(codes: dict[int, int], e: Any, forwarder: signals.Forwarder) -> frozenset[int]:
    """Ranks the agent SIGTERMed after the first failure (it ends the others): not the job's status."""
    first, _ = e.get_first_failure()
    return frozenset(
        r for r, c in codes.items() if r != first and c == -signal.SIGTERM and not forwarder.signum
    )


def _failure(
    failures: dict[int, int],
    restarts: int,
    forwarded: int = 0,
    ended_by_us: frozenset[int] = frozenset(),
    script: bool = False,
) -> WorkerFailure | Preempted:
    """How the launch ends when workers failed; `forwarded`: the signal this launcher passed on to them;
    `ended_by_us`: ranks the launcher itself terminated after the first failure (named, but their status is not
    the job's); `script`: a user's script, whose exit 3 means preempted only when this launcher stopped it."""
    codes = {c for r, c in failures.items() if r not in ended_by_us} or set(failures.values())
    if codes == {PREEMPTED_EXIT} and (
        forwarded or not script
    ):  # every worker that ended stopped after the agreed checkpoint
        return Preempted(
            "workers stopped at a step boundary after a checkpoint; rerun the same command to continue"
        )
    ranks = ", ".join(f"rank {r} ({describe_exit(c)})" for r, c in sorted(failures.items()))
    after = f" after {restarts} restart(s)" if restarts else ""
    # The workers' own status when they agree on one, else 1; exit 2 means they all met a user error and said
    # why, one line each, so the launcher adds none; 128 + N when they all died of the signal N passed on.
    code = next(iter(codes)) if len(codes) == 1 and min(codes) > 0 else 1
    if forwarded and set(failures.values()) == {-forwarded}:
        code = 128 + forwarded
    return WorkerFailure(f"worker {ranks} failed{after}", exit_code=code, report=code != 2)


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
            "check that the master address and port name node 0, that node 0 runs, and that no firewall blocks the port",
        )
    # c10d raises RendezvousTimeoutError, static a DistStoreError "Timed out ... 1/2 clients joined."
    if "timeout" in name.lower() or "timed out" in low:
        joined = re.search(r"(\d+)/(\d+) clients joined", msg)
        who = f"only {joined[1]} of {joined[2]} nodes" if joined else f"not all {spec.nnodes} nodes"
        return UserError(
            f"{who} joined the rendezvous at {endpoint} within --rdzv-timeout {spec.rdzv_timeout} s",
            "start every node with the same --nnodes and rendezvous address, check that each can reach it, "
            "or raise --rdzv-timeout",
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


def _launched() -> None:
    channels.FLAGS.launched = True


def launched() -> bool:
    """Whether this process started workers (launch_elastic or launch_spawn ran in it)."""
    return channels.FLAGS.launched


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
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    _launched()
    if meanwhile is not None:
        meanwhile()
    nproc = spec.nproc_per_node or 1
    set_thread_env(nproc)
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
    elif spec.nnodes == 1 and spec.master_port is None:  # like torchrun --standalone: a free port
        backend, endpoint, run_id = "c10d", f"localhost:{free_port()}", str(uuid.uuid4())
        configs = {"timeout": spec.rdzv_timeout}
    else:  # static rendezvous, as torchrun with --master-addr/--master-port/--node-rank
        addr = spec.master_addr or "127.0.0.1"
        port = spec.master_port or 29500
        backend, endpoint, run_id = "static", f"{addr}:{port}", "ddpkit"
        configs = {"rank": spec.node_rank, "timeout": spec.rdzv_timeout}
    use_interface(endpoint.rsplit(":", 1)[0], spec.nnodes > 1)  # workers inherit GLOO/NCCL_SOCKET_IFNAME
    if spec.nnodes > 1:
        from ddpkit.distributed.rendezvous import probe_launch

        probe_launch(backend, endpoint, spec.node_rank, spec.rdzv_timeout)  # seconds, not the whole timeout
    if list(python_args[:3]) != ["-u", "-m", "ddpkit"]:  # a user's script: the signals module arranges it
        python_args = ["-u", "-m", usermain.__name__, *python_args]  # dies with us, runs the script
    entrypoint, args, start_method = sys.executable, tuple(python_args), "spawn"
    if warm is not None and warm_start.running():
        entrypoint, start_method = warm_start.worker, "forkserver"
        args = (warm[0], list(warm[1]), warm_start.LaunchEnviron())
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
    watch(endpoint, spec.nnodes)  # names lost nodes; ends a launcher stuck on a store it lost
    quiet_agent_logs(debug=bool(os.environ.get(channels.DEBUG)))
    forwarder, ranks = signals.Forwarder(), stacks.Watch(spec.straggler_timeout, spec.straggler_action)
    try:
        # SIGTERM/SIGUSR1/SIGINT go on to the workers; we wait for them. Each worker dies with this process (or
        # with its fork server, which does).
        with forwarder, signals.launcher_env(), ranks:
            elastic_launch(config, entrypoint)(*args)
    except ChildFailedError as e:
        codes = {rank: f.exitcode for rank, f in e.failures.items()}
        err = _failure(codes, spec.max_restarts, forwarder.signum, _ended_by_us(codes, e, forwarder), script)
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


class _NoTraceback(logging.Filter):
    """The agent reports a worker forked from the fork server that failed with a traceback of its own join;
    the worker started as a program gets one line: keep the line. A worker that exits 3 stopped as agreed
    (the launcher says so in one line): no error line for it."""

    def filter(self, record: logging.LogRecord) -> bool:
        if "exitcode: %s" in str(record.msg) and record.args and record.args[0] in (PREEMPTED_EXIT, 2):
            return False  # 2: a user error, which the launcher prints once (stacks.job_failure)
        record.exc_info = record.exc_text = None
        return True


def quiet_agent_logs(debug: bool) -> None:
    """torch's agent says only what went wrong (one line per failed worker), unless DDPKIT_DEBUG is set."""
    logging.getLogger("torch.distributed.elastic").setLevel(logging.INFO if debug else logging.ERROR)
    logging.getLogger("torch.multiprocessing").setLevel(logging.INFO if debug else logging.ERROR)
    api = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    if not debug and not any(isinstance(f, _NoTraceback) for f in api.filters):
        api.addFilter(_NoTraceback())


def _spawn_entry(
    local_rank: int, fn: Callable[[list[str]], int], argv: list[str], env: dict[str, str]
) -> None:
    os.environ.update(env)
    signals.die_with_launcher()
    rank = int(env["GROUP_RANK"]) * int(env["LOCAL_WORLD_SIZE"]) + local_rank
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(local_rank))
    stacks.arm()
    try:
        code = fn(argv)
    except UserError as e:  # said once for the job by the launcher
        if not stacks.say_error(f"ddpkit: error: {e.line()}"):
            print(f"ddpkit: error: {e.line()}", file=sys.stderr, flush=True)
        code = e.exit_code
    except Preempted as e:  # as the command line ends it: one line, exit 3 (not a raised exception)
        if e.report:
            print(f"{e.prefix}{e}", file=sys.stderr, flush=True)
        code = e.exit_code
    except KeyboardInterrupt:  # torch's spawn wrapper would end the process with status 0
        traceback.print_exc()
        code = 128 + signal.SIGINT
    if code:
        sys.exit(code)


def launch_spawn(
    spec: LaunchSpec,
    argv: Sequence[str],
    fn: Callable[[list[str]], int],
    meanwhile: Callable[[], None] | None = None,
    script: bool = False,
) -> None:
    """Run fn(argv) on nproc_per_node processes started by torch.multiprocessing.spawn (`meanwhile`, `script`:
    as for launch_elastic); no process they started outlives the launch (reaper.py)."""
    import torch.multiprocessing as mp

    _launched()
    if meanwhile is not None:
        meanwhile()
    nproc = spec.nproc_per_node or 1
    set_thread_env(nproc)
    addr = spec.master_addr or "127.0.0.1"
    port = spec.master_port or (free_port() if spec.nnodes == 1 else 29500)
    env = {
        "MASTER_ADDR": addr,
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(nproc * spec.nnodes),
        "LOCAL_WORLD_SIZE": str(nproc),
        "GROUP_RANK": str(spec.node_rank),
        channels.LAUNCHER: "spawn",
        signals.PARENT_VAR: str(os.getpid()),
    }
    forwarder, ranks = signals.Forwarder(), stacks.Watch(spec.straggler_timeout, spec.straggler_action)
    with forwarder, ranks, reaper.reaping():  # SIGTERM/SIGUSR1/SIGINT go on to the workers; we wait for them
        context = mp.start_processes(_spawn_entry, args=(fn, list(argv), env), nprocs=nproc, join=False)
        try:
            while not context.join():
                pass
        except mp.ProcessRaisedException as e:
            rank = spec.node_rank * nproc + e.error_index
            last = str(e).strip().splitlines()[-1] if str(e).strip() else "an exception"
            raise WorkerFailure(f"worker rank {rank} failed: {last}") from None
        except mp.ProcessExitedException as e:
            # join() has waited for the others (SIGTERM after the first failure): judge them all
            codes = {spec.node_rank * nproc + i: p.exitcode for i, p in enumerate(context.processes)}
            failed = {r: c for r, c in codes.items() if c}
            first = spec.node_rank * nproc + e.error_index
            ours = frozenset(
                r for r, c in failed.items() if r != first and c == -signal.SIGTERM and not forwarder.signum
            )
            raise stacks.job_failure(_failure(failed, 0, forwarder.signum, ours, script), ranks) from None
