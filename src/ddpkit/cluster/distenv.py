"""Who this process is in the job: the DistEnv value, and the checks a launcher's variables go through.

Every launcher detector (launchers.py) reads its variables with these; env.py decides which launcher started
this process. Nothing here knows a launcher or touches torch.distributed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

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


def int_var(env: Mapping[str, str], name: str) -> int:
    raw = env[name]
    try:
        return int(raw.strip())
    except ValueError:
        raise UserError(
            f"{name}={raw!r} is not an integer", f"unset {name} or set it to a whole number"
        ) from None


def check_port(port: int, source: str) -> int:
    if not 1 <= port <= 65535:
        raise UserError(
            f"master port {port} (from {source}) is out of range", "use a port between 1024 and 65535"
        )
    return port


def check_ranks(rank: int, world: int, local_rank: int, local_world: int, source: str) -> None:
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


def require_all(env: Mapping[str, str], names: list[str], launcher: str) -> None:
    missing = [n for n in names if n not in env]
    if missing:
        present = [n for n in names if n in env]
        raise UserError(
            f"incomplete {launcher} environment: {', '.join(present)} set but {', '.join(missing)} missing",
            f"set all of {', '.join(names)} or none of them",
        )


def master_port_of(env: Mapping[str, str], fallback: int) -> int:
    """MASTER_PORT when set (checked), else `fallback`."""
    return check_port(int_var(env, "MASTER_PORT"), "MASTER_PORT") if "MASTER_PORT" in env else fallback


def ranked_env(
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
