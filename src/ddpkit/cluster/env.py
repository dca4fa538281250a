"""Which launcher started this process -> one immutable DistEnv value.

Order of precedence: manual flags, then the launcher-detector table (torchrun/torch.distributed.launch, Slurm
srun, Open MPI, MPICH/PMI, LSF jsrun, PBS pbsdsh, then any registered with `register_launcher` or the
`ddpkit.launchers` entry point), and finally a single process. Nothing here touches torch.distributed.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ddpkit import channels
from ddpkit.errors import UserError

DEFAULT_PORT = 29500


@dataclass(frozen=True)
class DistEnv:
    """Who this process is in the job, and where the job meets."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    node_rank: int = 0
    num_nodes: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = DEFAULT_PORT
    launcher: str = (
        "none"  # none | manual | spawn | a detector's name (torchrun, slurm, openmpi, pmi, lsf, ...)
    )
    init_method: str = "env://"
    local_rank_given: bool = True  # false: a by-hand rank whose local rank is learnt at the rendezvous

    @property
    def distributed(self) -> bool:
        return self.world_size > 1 or self.launcher not in ("none",)


def _int(env: Mapping[str, str], name: str) -> int:
    raw = env[name]
    try:
        return int(raw.strip())
    except ValueError:
        raise UserError(
            f"{name}={raw!r} is not an integer", f"unset {name} or set it to a whole number"
        ) from None


def _check_port(port: int, source: str) -> int:
    if not 1 <= port <= 65535:
        raise UserError(
            f"master port {port} (from {source}) is out of range", "use a port between 1024 and 65535"
        )
    return port


def _check_ranks(rank: int, world: int, local_rank: int, local_world: int, source: str) -> None:
    if world < 1:
        raise UserError(
            f"world size {world} (from {source}) must be at least 1", "check the launcher's task count"
        )
    if not 0 <= rank < world:
        raise UserError(
            f"rank {rank} is outside world size {world} (from {source})", f"ranks run from 0 to {world - 1}"
        )
    if not 0 <= local_rank < max(local_world, 1):
        raise UserError(
            f"local rank {local_rank} is outside local world size {local_world} (from {source})",
            "check the launcher's per-node task count",
        )


def _require_all(env: Mapping[str, str], names: list[str], launcher: str) -> None:
    missing = [n for n in names if n not in env]
    if missing:
        present = [n for n in names if n in env]
        raise UserError(
            f"incomplete {launcher} environment: {', '.join(present)} set but {', '.join(missing)} missing",
            f"set all of {', '.join(names)} or none of them",
        )


def expand_nodelist(nodelist: str, use_scontrol: bool = True) -> list[str]:
    """Slurm node list -> host names, via `scontrol show hostnames` when present, else our own parser."""
    if use_scontrol and shutil.which("scontrol"):
        try:
            out = subprocess.run(
                ["scontrol", "show", "hostnames", nodelist],
                capture_output=True,
                text=True,
                timeout=30,
                check=True,
            ).stdout.split()
            if out:
                return out
        except (subprocess.SubprocessError, OSError):
            pass
    return parse_nodelist(nodelist)


def _split_top(s: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    parts, depth, cur = [], 0, ""
    for ch in s:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if depth != 0:
        raise UserError(f"malformed Slurm node list '{s}'", "check SLURM_NODELIST")
    parts.append(cur)
    return [p for p in parts if p]


def parse_nodelist(nodelist: str) -> list[str]:
    """Expand Slurm's compressed host list syntax: `node[01-03,7],gpu7` -> node01 node02 node03 node7 gpu7."""
    hosts: list[str] = []
    for item in _split_top(nodelist.strip()):
        m = re.search(r"\[([^\]]*)\]", item)
        if not m:
            hosts.append(item)
            continue
        head, tail = item[: m.start()], item[m.end() :]
        for sub in m.group(1).split(","):
            if "-" in sub:
                lo, hi = sub.split("-", 1)
                if not (lo.isdigit() and hi.isdigit()) or int(hi) < int(lo):
                    raise UserError(
                        f"malformed Slurm node range '{sub}' in '{nodelist}'", "check SLURM_NODELIST"
                    )
                width = len(lo)
                for i in range(int(lo), int(hi) + 1):
                    hosts.extend(parse_nodelist(f"{head}{i:0{width}d}{tail}"))
            elif sub:
                hosts.extend(parse_nodelist(f"{head}{sub}{tail}"))
    return hosts


def slurm_port(job_id: str) -> int:
    """A port derived from the job id, so two jobs on one node do not collide."""
    try:
        n = int(job_id)
    except ValueError:
        n = zlib.crc32(job_id.encode())
    return 15000 + n % 20000


def slurm_nodelist(env: Mapping[str, str]) -> str | None:
    """The nodes of this Slurm step: SLURM_STEP_NODELIST, else SLURM_NODELIST, else SLURM_JOB_NODELIST."""
    return next(
        (env[v] for v in ("SLURM_STEP_NODELIST", "SLURM_NODELIST", "SLURM_JOB_NODELIST") if v in env), None
    )


def slurm_job_step(env: Mapping[str, str]) -> str:
    """`JOB.STEP` of this Slurm step (SLURM_STEPID is the older spelling of SLURM_STEP_ID)."""
    return env.get("SLURM_JOB_ID", "0") + "." + env.get("SLURM_STEP_ID", env.get("SLURM_STEPID", "0"))


def _tasks_per_node(spec: str, node_id: int) -> int | None:
    """SLURM_STEP_TASKS_PER_NODE like `2(x3),1` -> tasks on node `node_id`."""
    counts: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            return None
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return counts[node_id] if node_id < len(counts) else None


def _from_torchrun(env: Mapping[str, str]) -> DistEnv:
    _require_all(env, ["RANK", "WORLD_SIZE"], "torchrun")
    rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
    local_rank = _int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else rank
    local_world = _int(env, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env else world
    _check_ranks(rank, world, local_rank, local_world, "RANK/WORLD_SIZE")
    if world > 1:
        _require_all(env, ["RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"], "env://")
    port = _check_port(_int(env, "MASTER_PORT"), "MASTER_PORT") if "MASTER_PORT" in env else DEFAULT_PORT
    node_rank = _int(env, "GROUP_RANK") if "GROUP_RANK" in env else rank // max(local_world, 1)
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
    _require_all(env, ["SLURM_PROCID", ntasks_var], "Slurm")
    rank, world = _int(env, "SLURM_PROCID"), _int(env, ntasks_var)
    local_rank = _int(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0
    node_id = _int(env, "SLURM_NODEID") if "SLURM_NODEID" in env else 0
    nodes = slurm_nodelist(env)
    hosts = expand_nodelist(nodes) if nodes is not None else []
    local_world = None
    for var in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        if var in env:
            local_world = _tasks_per_node(env[var], node_id)
            if local_world:
                break
    if not local_world:
        local_world = _int(env, "SLURM_NTASKS_PER_NODE") if "SLURM_NTASKS_PER_NODE" in env else world
    _check_ranks(rank, world, local_rank, local_world, f"SLURM_PROCID/{ntasks_var}")
    if world > 1 and not hosts and "MASTER_ADDR" not in env:
        raise UserError(
            "Slurm job of several tasks without SLURM_NODELIST", "run under srun, or set MASTER_ADDR"
        )
    addr = env.get("MASTER_ADDR") or (hosts[0] if hosts else "127.0.0.1")
    if "MASTER_PORT" in env:
        port = _check_port(_int(env, "MASTER_PORT"), "MASTER_PORT")
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


def _port(env: Mapping[str, str], fallback: int) -> int:
    """MASTER_PORT when set (checked), else `fallback`."""
    return _check_port(_int(env, "MASTER_PORT"), "MASTER_PORT") if "MASTER_PORT" in env else fallback


def _ranked(
    rank: int, world: int, local_rank: int, local_world: int, env: Mapping[str, str], port: int, launcher: str
) -> DistEnv:
    """A DistEnv whose node rank and node count follow from the ranks per node; master address from MASTER_ADDR."""
    per_node = max(local_world, 1)
    return DistEnv(
        rank=rank,
        local_rank=local_rank,
        world_size=world,
        local_world_size=local_world,
        node_rank=rank // per_node,
        num_nodes=max(1, -(-world // per_node)),
        master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
        master_port=port,
        launcher=launcher,
    )


def _mpi_env(
    env: Mapping[str, str], names: tuple[str, str, str, str], launcher: str, job_key: str
) -> DistEnv:
    rank_v, size_v, lrank_v, lsize_v = names
    _require_all(env, [rank_v, size_v], launcher)
    rank, world = _int(env, rank_v), _int(env, size_v)
    local_rank = _int(env, lrank_v) if lrank_v in env else rank
    local_world = _int(env, lsize_v) if lsize_v in env else world
    _check_ranks(rank, world, local_rank, local_world, f"{rank_v}/{size_v}")
    multi_node = local_world < world
    if multi_node and "MASTER_ADDR" not in env:
        raise UserError(
            f"{launcher} job spans several nodes but MASTER_ADDR is not set",
            "pass the first host with `mpirun -x MASTER_ADDR=HOST ...`",
        )
    fallback = slurm_port(env[job_key]) if job_key in env else DEFAULT_PORT
    return _ranked(rank, world, local_rank, local_world, env, _port(env, fallback), launcher)


def manual_env(
    init_method: str,
    rank: int | None,
    world_size: int | None,
    local_rank: int | None = None,
    environ: Mapping[str, str] | None = None,
) -> DistEnv:
    """`--init-method URL --rank R --world-size W [--local-rank L]`: one process of a hand-started job.

    The local rank is --local-rank, else LOCAL_RANK, else learnt at the rendezvous (rendezvous.py)."""
    environ = os.environ if environ is None else environ
    if rank is None or world_size is None:
        raise UserError(
            "--init-method needs --rank and --world-size", "give all three, e.g. --rank 0 --world-size 3"
        )
    _check_ranks(rank, world_size, 0, 1, "--rank/--world-size")
    if local_rank is None and "LOCAL_RANK" in environ:
        local_rank = _int(environ, "LOCAL_RANK")
    if local_rank is not None and local_rank < 0:
        raise UserError(f"local rank {local_rank} is negative", "local ranks run from 0")
    addr, port = "127.0.0.1", DEFAULT_PORT
    if init_method.startswith("tcp://"):
        m = re.fullmatch(r"tcp://(\[[^\]]+\]|[^:/\[\]]+):(\d+)/?", init_method)
        if not m:
            raise UserError(
                f"bad --init-method '{init_method}'", "write tcp://HOST:PORT, e.g. tcp://127.0.0.1:22225"
            )
        addr, port = m.group(1).strip("[]"), _check_port(int(m.group(2)), "--init-method")
    elif init_method.startswith("file://"):
        path = init_method[len("file://") :]
        if not path.startswith("/"):
            raise UserError(
                f"bad --init-method '{init_method}'", "write file:///ABSOLUTE/PATH (three slashes)"
            )
        parent = os.path.dirname(path) or "/"
        if not os.path.isdir(parent):
            raise UserError(
                f"the folder of the rendezvous file '{path}' does not exist",
                "create it on a shared file system",
            )
        if os.path.isdir(path):
            raise UserError(
                f"the rendezvous file '{path}' is a folder", "name a file that does not exist yet"
            )
    elif init_method.startswith("env://"):
        return replace_launcher(detect_env(os.environ), "manual")
    else:
        raise UserError(
            f"unsupported --init-method '{init_method}'", "use tcp://HOST:PORT, file:///PATH or env://"
        )
    return DistEnv(
        rank=rank,
        local_rank=local_rank or 0,
        world_size=world_size,
        local_world_size=(local_rank or 0) + 1,
        node_rank=rank,
        num_nodes=world_size,
        master_addr=addr,
        master_port=port,
        launcher="manual",
        init_method=init_method,
        local_rank_given=local_rank is not None,
    )


def explicit_env(
    rank: int | None, world_size: int | None, environ: Mapping[str, str] | None = None
) -> DistEnv:
    """A DistEnv from a rank and world size given in code (as mp.spawn scripts pass them to init_process_group);
    master address and port from MASTER_ADDR / MASTER_PORT when set."""
    environ = os.environ if environ is None else environ
    if rank is None or world_size is None:
        raise UserError(
            "init_distributed(rank=..., world_size=...) needs both",
            "pass both, or neither to detect the launcher",
        )
    local_rank = _int(environ, "LOCAL_RANK") if "LOCAL_RANK" in environ else rank
    local_world = _int(environ, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in environ else world_size
    _check_ranks(rank, world_size, local_rank, local_world, "rank=/world_size=")
    if world_size == 1:
        return DistEnv()
    return _ranked(rank, world_size, local_rank, local_world, environ, _port(environ, DEFAULT_PORT), "manual")


def torch_variables(env: DistEnv) -> dict[str, str]:
    """The variables torchrun gives a worker, from a DistEnv (what `ddpkit run` hands a user's script)."""
    return {
        "RANK": str(env.rank),
        "LOCAL_RANK": str(env.local_rank),
        "WORLD_SIZE": str(env.world_size),
        "LOCAL_WORLD_SIZE": str(env.local_world_size),
        "GROUP_RANK": str(env.node_rank),
        "GROUP_WORLD_SIZE": str(env.num_nodes),
        "MASTER_ADDR": env.master_addr,
        "MASTER_PORT": str(env.master_port),
    }


def replace_launcher(env: DistEnv, launcher: str) -> DistEnv:
    from dataclasses import replace

    return replace(env, launcher=launcher)


@dataclass(frozen=True)
class LauncherDetector:
    """One launcher that starts a process per rank: how to tell it started this process, and who the process is.

    `detects(env)`: true when its variables are there; `read(env) -> DistEnv`; `world_var`: the variable it sets
    to the job's size in every process of a job of several (how a helper called without a process group knows
    that it should have one). Asked in registry order: the first that detects wins.
    """

    name: str
    detects: Callable[[Mapping[str, str]], bool]
    read: Callable[[Mapping[str, str]], DistEnv]
    world_var: str | None = None


_DETECTORS: dict[str, LauncherDetector] = {}
DETECTOR_ENTRY_POINT_GROUP = "ddpkit.launchers"


def register_launcher(detector: LauncherDetector, *, replace: bool = False) -> LauncherDetector:
    """Add a launcher to the detection table (after the built-in ones); refuses a second of the same name."""
    if detector.name in _DETECTORS and not replace and _DETECTORS[detector.name] is not detector:
        raise ValueError(f"launcher '{detector.name}' is already registered")
    _DETECTORS[detector.name] = detector
    return detector


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
    rank, world = _int(env, "PBS_VNODENUM"), max(len(hosts), 1)
    host = hosts[rank] if rank < len(hosts) else ""
    local_rank = sum(1 for h in hosts[:rank] if h == host)
    local_world = sum(1 for h in hosts if h == host) or 1
    _check_ranks(rank, world, local_rank, local_world, "PBS_VNODENUM/PBS_NODEFILE")
    port = _port(env, slurm_port(env["PBS_JOBID"]) if "PBS_JOBID" in env else DEFAULT_PORT)
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
for _detector in (
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
):
    register_launcher(_detector)


def _entry_point_detectors() -> None:
    """Launchers that installed packages declare (entry point group ddpkit.launchers), loaded once."""
    from importlib.metadata import entry_points

    for ep in entry_points(group=DETECTOR_ENTRY_POINT_GROUP):
        if ep.name in _DETECTORS:
            continue
        obj = ep.load()
        detector = obj() if callable(obj) and not isinstance(obj, LauncherDetector) else obj
        if not isinstance(detector, LauncherDetector):
            raise UserError(
                f"entry point '{ep.value}' for launcher '{ep.name}' gave {type(detector).__name__}",
                "it must name a ddpkit.cluster.env.LauncherDetector (or a function returning one)",
            )
        register_launcher(detector)


def launchers() -> list[LauncherDetector]:
    """The detection table: built-in launchers first, then registered ones and those of entry points."""
    _entry_point_detectors()
    return list(_DETECTORS.values())


def world_variables() -> tuple[str, ...]:
    """The variables a launcher sets to the job's size in every process of a job of several."""
    return tuple(d.world_var for d in launchers() if d.world_var)


def detect_env(env: Mapping[str, str] | None = None) -> DistEnv:
    """The DistEnv of this process from its environment variables: the first launcher that detects itself."""
    env = os.environ if env is None else env
    for detector in launchers():
        if detector.detects(env):
            return detector.read(env)
    return DistEnv()
