"""Which launcher started this process -> one immutable DistEnv value.

Order of precedence: manual flags, then the launcher-detector table (launchers.py: torchrun, Slurm srun, Open
MPI, MPICH/PMI, LSF jsrun, PBS pbsdsh, then any registered with `register_launcher` or the `ddpkit.launchers`
entry point), and finally a single process. Nothing here touches torch.distributed.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import replace

from ddpkit.cluster import distenv
from ddpkit.cluster.distenv import DEFAULT_PORT, DistEnv
from ddpkit.cluster.launchers import launchers
from ddpkit.errors import UserError


def _rendezvous_address(init_method: str) -> tuple[str, int]:
    """(master address, port) of a tcp:// or file:// --init-method, checked before anything starts."""
    if init_method.startswith("tcp://"):
        m = re.fullmatch(r"tcp://(\[[^\]]+\]|[^:/\[\]]+):(\d+)/?", init_method)
        if not m:
            raise UserError(
                f"bad --init-method '{init_method}'", "write tcp://HOST:PORT, e.g. tcp://127.0.0.1:22225"
            )
        return m.group(1).strip("[]"), distenv.check_port(int(m.group(2)), "--init-method")
    if not init_method.startswith("file://"):
        raise UserError(
            f"unsupported --init-method '{init_method}'", "use tcp://HOST:PORT, file:///PATH or env://"
        )
    path = init_method[len("file://") :]
    if not path.startswith("/"):
        raise UserError(f"bad --init-method '{init_method}'", "write file:///ABSOLUTE/PATH (three slashes)")
    if not os.path.isdir(os.path.dirname(path) or "/"):
        raise UserError(
            f"the folder of the rendezvous file '{path}' does not exist", "create it on a shared file system"
        )
    if os.path.isdir(path):
        raise UserError(f"the rendezvous file '{path}' is a folder", "name a file that does not exist yet")
    return "127.0.0.1", DEFAULT_PORT


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
    distenv.check_ranks(rank, world_size, 0, 1, "--rank/--world-size")
    if local_rank is None and "LOCAL_RANK" in environ:
        local_rank = distenv.int_var(environ, "LOCAL_RANK")
    if local_rank is not None and local_rank < 0:
        raise UserError(f"local rank {local_rank} is negative", "local ranks run from 0")
    if init_method.startswith("env://"):
        return replace_launcher(detect_env(os.environ), "manual")
    addr, port = _rendezvous_address(init_method)
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
    local_rank = distenv.int_var(environ, "LOCAL_RANK") if "LOCAL_RANK" in environ else rank
    local_world = (
        distenv.int_var(environ, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in environ else world_size
    )
    distenv.check_ranks(rank, world_size, local_rank, local_world, "rank=/world_size=")
    if world_size == 1:
        return DistEnv()
    return distenv.ranked_env(
        rank,
        world_size,
        local_rank,
        local_world,
        environ,
        distenv.master_port_of(environ, DEFAULT_PORT),
        "manual",
    )


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
    return replace(env, launcher=launcher)


def detect_env(env: Mapping[str, str] | None = None) -> DistEnv:
    """The DistEnv of this process from its environment variables: the first launcher that detects itself."""
    env = os.environ if env is None else env
    for detector in launchers():
        if detector.detects(env):
            return detector.read(env)
    return DistEnv()
