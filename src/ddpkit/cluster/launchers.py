"""The launcher-detector table: which launcher started this process, and who the process is under it.

One `LauncherDetector` per launcher that starts a process per rank (torchrun, Slurm srun, Open MPI, MPICH/PMI,
LSF jsrun, PBS pbsdsh), asked in order (ddpkit.registry); a package adds one with `register_launcher` or an entry point in the
`ddpkit.launchers` group. Nothing here touches torch.distributed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ddpkit import channels
from ddpkit.cluster.distenv import (
    DEFAULT_PORT,
    DistEnv,
    check_port,
    check_ranks,
    int_var,
    master_port_of,
    ranked_env,
    require_all,
)
from ddpkit.cluster.slurm_env import (
    expand_nodelist,
    slurm_job_step,
    slurm_nodelist,
    slurm_port,
    tasks_per_node,
)
from ddpkit.errors import UserError
from ddpkit.registry import Registry


def _from_torchrun(env: Mapping[str, str]) -> DistEnv:
    require_all(env, ["RANK", "WORLD_SIZE"], "torchrun")
    rank, world = int_var(env, "RANK"), int_var(env, "WORLD_SIZE")
    local_rank = int_var(env, "LOCAL_RANK") if "LOCAL_RANK" in env else rank
    local_world = int_var(env, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env else world
    check_ranks(rank, world, local_rank, local_world, "RANK/WORLD_SIZE")
    if world > 1:
        require_all(env, ["RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"], "env://")
    port = check_port(int_var(env, "MASTER_PORT"), "MASTER_PORT") if "MASTER_PORT" in env else DEFAULT_PORT
    node_rank = int_var(env, "GROUP_RANK") if "GROUP_RANK" in env else rank // max(local_world, 1)
    launcher = "spawn" if env.get(channels.LAUNCHER) == "spawn" else "torchrun"
    return DistEnv(
        rank=rank,
        local_rank=local_rank,
        world_size=world,
        local_world_size=local_world,
        node_rank=node_rank,
        num_nodes=max(1, -(-world // max(local_world, 1))),
        master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
        master_port=port,
        launcher=launcher,
    )


def _from_slurm(env: Mapping[str, str]) -> DistEnv:
    ntasks_var = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS"
    require_all(env, ["SLURM_PROCID", ntasks_var], "Slurm")
    rank, world = int_var(env, "SLURM_PROCID"), int_var(env, ntasks_var)
    local_rank = int_var(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0
    node_id = int_var(env, "SLURM_NODEID") if "SLURM_NODEID" in env else 0
    nodes = slurm_nodelist(env)
    hosts = expand_nodelist(nodes) if nodes is not None else []
    local_world = None
    for var in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        if var in env:
            local_world = tasks_per_node(env[var], node_id)
            if local_world:
                break
    if not local_world:
        local_world = int_var(env, "SLURM_NTASKS_PER_NODE") if "SLURM_NTASKS_PER_NODE" in env else world
    check_ranks(rank, world, local_rank, local_world, f"SLURM_PROCID/{ntasks_var}")
    if world > 1 and not hosts and "MASTER_ADDR" not in env:
        raise UserError(
            "Slurm job of several tasks without SLURM_NODELIST", "run under srun, or set MASTER_ADDR"
        )
    addr = env.get("MASTER_ADDR") or (hosts[0] if hosts else "127.0.0.1")
    if "MASTER_PORT" in env:
        port = check_port(int_var(env, "MASTER_PORT"), "MASTER_PORT")
    else:
        port = slurm_port(slurm_job_step(env))
    return DistEnv(
        rank=rank,
        local_rank=local_rank,
        world_size=world,
        local_world_size=local_world,
        node_rank=node_id,
        num_nodes=max(len(hosts), 1),
        master_addr=addr,
        master_port=port,
        launcher="slurm",
    )


def _mpi_env(
    env: Mapping[str, str], names: tuple[str, str, str, str], launcher: str, job_key: str
) -> DistEnv:
    rank_v, size_v, lrank_v, lsize_v = names
    require_all(env, [rank_v, size_v], launcher)
    rank, world = int_var(env, rank_v), int_var(env, size_v)
    local_rank = int_var(env, lrank_v) if lrank_v in env else rank
    local_world = int_var(env, lsize_v) if lsize_v in env else world
    check_ranks(rank, world, local_rank, local_world, f"{rank_v}/{size_v}")
    multi_node = local_world < world
    if multi_node and "MASTER_ADDR" not in env:
        raise UserError(
            f"{launcher} job spans several nodes but MASTER_ADDR is not set",
            "pass the first host with `mpirun -x MASTER_ADDR=HOST ...`",
        )
    fallback = slurm_port(env[job_key]) if job_key in env else DEFAULT_PORT
    return ranked_env(rank, world, local_rank, local_world, env, master_port_of(env, fallback), launcher)


@dataclass(frozen=True)
class LauncherDetector:
    """One launcher that starts a process per rank: how to tell it started this process, and who the process is.

    `detects(env)`: true when its variables are there; `read(env) -> DistEnv`; `world_var`: the variable it sets
    to the job's size in every process of a job of several (how a helper called without a process group knows
    that it should have one). Asked in `order` (lower first): the first that detects wins. The built-ins are
    100 (torchrun) to 600 (pbs), a hundred apart; one without an order comes after them all, and one of order
    350 is asked before `pmi` (400), e.g. a scheduler that also sets PMI_RANK.
    """

    name: str
    detects: Callable[[Mapping[str, str]], bool]
    read: Callable[[Mapping[str, str]], DistEnv]
    world_var: str | None = None
    order: int | None = None  # None: after every built-in launcher


DETECTOR_ENTRY_POINT_GROUP = "ddpkit.launchers"
DETECTORS: Registry[LauncherDetector] = Registry(
    "launcher",
    DETECTOR_ENTRY_POINT_GROUP,
    LauncherDetector,
    "ddpkit.cluster.launchers.LauncherDetector",
    builtins=lambda: _builtin_detectors(),  # the table at the end of this module
)


def register_launcher(detector: LauncherDetector, *, replace: bool = False) -> LauncherDetector:
    """Add a launcher to the detection table, at its `order`; refuses a second of the same name."""
    return DETECTORS.register(detector, replace=replace)


def _openmpi(env: Mapping[str, str]) -> DistEnv:
    names = (
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
    )
    return _mpi_env(env, names, "openmpi", "OMPI_MCA_ess_base_jobid")


def _pmi(env: Mapping[str, str]) -> DistEnv:
    return _mpi_env(
        env, ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"), "pmi", "PMI_KVS_NAME"
    )


def _lsf(env: Mapping[str, str]) -> DistEnv:
    """IBM LSF's jsrun: JSM_NAMESPACE_* per task; several hosts need MASTER_ADDR (the first compute host)."""
    names = (
        "JSM_NAMESPACE_RANK",
        "JSM_NAMESPACE_SIZE",
        "JSM_NAMESPACE_LOCAL_RANK",
        "JSM_NAMESPACE_LOCAL_SIZE",
    )
    return _mpi_env(env, names, "lsf", "LSB_JOBID")


def _pbs_hosts(env: Mapping[str, str]) -> list[str]:
    path = env["PBS_NODEFILE"]
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return [ln.strip() for ln in f.read(1 << 20).splitlines() if ln.strip()]
    except OSError as e:
        raise UserError(
            f"cannot read PBS_NODEFILE '{path}': {e.strerror}", "run under pbsdsh in a PBS job"
        ) from None


def _pbs(env: Mapping[str, str]) -> DistEnv:
    """PBS/Torque's pbsdsh: one task per line of PBS_NODEFILE, PBS_VNODENUM its rank, node 0 the master."""
    hosts = _pbs_hosts(env)
    rank, world = int_var(env, "PBS_VNODENUM"), max(len(hosts), 1)
    host = hosts[rank] if rank < len(hosts) else ""
    local_rank = sum(1 for h in hosts[:rank] if h == host)
    local_world = sum(1 for h in hosts if h == host) or 1
    check_ranks(rank, world, local_rank, local_world, "PBS_VNODENUM/PBS_NODEFILE")
    port = master_port_of(env, slurm_port(env["PBS_JOBID"]) if "PBS_JOBID" in env else DEFAULT_PORT)
    first = list(dict.fromkeys(hosts))
    return DistEnv(
        rank=rank,
        local_rank=local_rank,
        world_size=world,
        local_world_size=local_world,
        node_rank=first.index(host) if host in first else 0,
        num_nodes=max(len(first), 1),
        master_addr=env.get("MASTER_ADDR") or (hosts[0] if hosts else "127.0.0.1"),
        master_port=port,
        launcher="pbs",
    )


# The built-in table, in order of precedence (torchrun's variables win over the cluster's that started it).
_BUILTIN = (
    LauncherDetector("torchrun", lambda e: "RANK" in e or "WORLD_SIZE" in e, _from_torchrun, "WORLD_SIZE"),
    LauncherDetector(
        "slurm",
        lambda e: "SLURM_PROCID" in e and ("SLURM_STEP_NUM_TASKS" in e or "SLURM_NTASKS" in e),
        _from_slurm,
        "SLURM_STEP_NUM_TASKS",
    ),
    LauncherDetector(
        "openmpi",
        lambda e: "OMPI_COMM_WORLD_RANK" in e or "OMPI_COMM_WORLD_SIZE" in e,
        _openmpi,
        "OMPI_COMM_WORLD_SIZE",
    ),
    LauncherDetector("pmi", lambda e: "PMI_RANK" in e or "PMI_SIZE" in e, _pmi, "PMI_SIZE"),
    LauncherDetector(
        "lsf", lambda e: "JSM_NAMESPACE_RANK" in e or "JSM_NAMESPACE_SIZE" in e, _lsf, "JSM_NAMESPACE_SIZE"
    ),
    LauncherDetector("pbs", lambda e: "PBS_VNODENUM" in e and "PBS_NODEFILE" in e, _pbs, None),
)


def _builtin_detectors() -> list[LauncherDetector]:
    """The table at orders 100, 200, ...: a hundred apart, so a package's launcher can come between two of them."""
    return [dataclasses.replace(d, order=100 * (i + 1)) for i, d in enumerate(_BUILTIN)]


def launchers() -> list[LauncherDetector]:
    """The detection table in order: built-in launchers, registered ones and those of installed packages."""
    return DETECTORS.entries()


def world_variables() -> tuple[str, ...]:
    """The variables a launcher sets to the job's size in every process of a job of several."""
    return tuple(d.world_var for d in launchers() if d.world_var)
