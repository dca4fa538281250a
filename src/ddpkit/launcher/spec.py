"""The launch flags and what they ask for: the flags every worker-starting command shares, their checks, the
LaunchSpec they make (under srun, node 0 and this node's rank come from Slurm), and the command line a worker gets
(the same, without the flags that start workers)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace

from ddpkit.cluster.slurm_env import expand_nodelist, slurm_job_step, slurm_nodelist, slurm_port
from ddpkit.diagnostics import stacks
from ddpkit.distributed import torchrun_compat
from ddpkit.errors import UserError

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
            f"run `srun -N {spec.nnodes} --ntasks-per-node 1 ddpkit ...`, or drop the launch flags",
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
    given = {f.name: getattr(args, f.name) for f in fields(LaunchSpec) if hasattr(args, f.name)}
    spec = LaunchSpec(**given)  # commands without the straggler flags keep their defaults
    stacks.check_timeout(spec.straggler_timeout)
    _check_rendezvous_kind(spec)
    _check_ranges(spec)
    spec = _slurm_agents(spec, os.environ if environ is None else environ)
    _check_nodes_and_launcher(spec)
    return spec


def _check_rendezvous_kind(spec: LaunchSpec) -> None:
    """A manual rendezvous (--init-method) starts one process per call and alone takes --rank and friends."""
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


def _check_ranges(spec: LaunchSpec) -> None:
    """Each number in its range."""
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


def _check_nodes_and_launcher(spec: LaunchSpec) -> None:
    """Several nodes need node 0's address; the spawn launcher neither restarts nor uses an endpoint."""
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
