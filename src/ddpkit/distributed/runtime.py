"""Backend and device choice, validation, init_process_group and teardown: one call for every launcher."""

from __future__ import annotations

import atexit
import datetime
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ddpkit import channels
from ddpkit.cluster.env import DistEnv, detect_env, explicit_env, manual_env, torch_variables
from ddpkit.cluster.netif import use_interface
from ddpkit.distributed import rendezvous
from ddpkit.distributed.allocator import tune_cpu_allocator
from ddpkit.distributed.collectives import group_ended
from ddpkit.errors import UserError, first_line


@dataclass(frozen=True)
class DistContext:
    """The initialised runtime: who we are (env), what we talk over (backend), where we compute (device)."""

    env: DistEnv
    backend: str
    device: torch.device

    rank = property(lambda self: self.env.rank)
    local_rank = property(lambda self: self.env.local_rank)
    world_size = property(lambda self: self.env.world_size)

    @property
    def is_main(self) -> bool:
        return self.env.rank == 0

    def __iter__(self):
        """`rank, local_rank, world_size, device, backend = ddpkit.init_distributed()`."""
        return iter((self.rank, self.local_rank, self.world_size, self.device, self.backend))


OVERSUBSCRIBE_VAR = channels.OVERSUBSCRIBE


def check_cpu_processes(nproc: int) -> None:
    """Refuse more CPU processes on this node than it has cores (a thousand torch imports on two cores is a
    typo, not a plan), unless DDPKIT_OVERSUBSCRIBE=1 says the user means it."""
    cores = os.cpu_count() or 1
    if nproc > cores and os.environ.get(OVERSUBSCRIBE_VAR) != "1":
        raise UserError(
            f"{nproc} processes on this node but it has only {cores} CPU core(s) and no GPU",
            f"start at most {cores} per node, or add --oversubscribe ({OVERSUBSCRIBE_VAR}=1) to share them",
        )


def resolve_device_backend(
    env: DistEnv, backend: str = "auto", device: str = "auto"
) -> tuple[str, torch.device]:
    """nccl + cuda:local_rank when every local rank has its own GPU; gloo + cpu without GPUs."""
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device == "auto":
        device = "cuda" if (n_gpus > 0 and backend != "gloo") or backend == "nccl" else "cpu"
    if device == "cuda":
        if n_gpus == 0:
            what = "dist.backend=nccl" if backend == "nccl" else "dist.device=cuda"
            raise UserError(
                f"{what} needs CUDA but no GPU is visible", "use dist.backend=gloo dist.device=cpu on CPU"
            )
        if env.local_rank >= n_gpus:
            raise UserError(
                f"local rank {env.local_rank} needs GPU {env.local_rank} but only {n_gpus} GPU(s) are visible",
                f"use local ranks 0 to {n_gpus - 1} on this node, or run on CPU with dist.device=cpu",
            )
        if env.local_world_size > n_gpus:
            raise UserError(
                f"{env.local_world_size} processes on this node but only {n_gpus} GPU(s) visible",
                f"start at most {n_gpus} per node (--nproc-per-node {n_gpus}) or run on CPU with dist.device=cpu",
            )
        dev = torch.device("cuda", env.local_rank)
    else:
        check_cpu_processes(env.local_world_size)
        dev = torch.device("cpu")
    if backend == "auto":
        backend = "nccl" if dev.type == "cuda" and dist.is_nccl_available() else "gloo"
    if backend == "nccl" and dev.type != "cuda":
        raise UserError("dist.backend=nccl needs CUDA devices", "use dist.backend=gloo on CPU")
    if backend == "mpi" and not dist.is_mpi_available():
        raise UserError(
            "dist.backend=mpi but this PyTorch was built without MPI", "use dist.backend=gloo or nccl"
        )
    if backend == "gloo" and not dist.is_gloo_available():
        raise UserError("dist.backend=gloo but this PyTorch has no gloo", "use dist.backend=nccl")
    return backend, dev


_CONTEXT: DistContext | None = None


def init_distributed(
    backend: str = "auto",
    device: str = "auto",
    timeout_s: float = 600.0,
    env: DistEnv | None = None,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    init_method: str | None = None,
) -> DistContext:
    """Join whatever launcher started this process (or none) and return the DistContext.

    `rank`/`world_size` (and optionally `init_method`, tcp:// or file://) say it in code instead, as the tutorials'
    mp.spawn scripts do. Safe to call again: a later call returns the first context; a process group the caller
    made with init_process_group is adopted.
    """
    global _CONTEXT
    if dist.is_available() and dist.is_initialized():
        if _CONTEXT is None:
            _CONTEXT = _adopt()
            if _CONTEXT.device.type == "cpu":
                tune_cpu_allocator()
        return _CONTEXT
    if env is None:
        if init_method is not None:
            env = manual_env(init_method, rank, world_size)
        elif rank is not None or world_size is not None:
            env = explicit_env(rank, world_size)
        else:
            env = detect_env()
            _refuse_a_lonely_child(env)
    asked = backend
    backend, dev = resolve_device_backend(env, backend, device)
    store = None
    if env.distributed:
        use_interface(env.master_addr, env.num_nodes > 1)  # before gloo/NCCL pick an address
        if env.launcher == "manual" and not env.init_method.startswith("env://"):
            env, store = rendezvous.join(env, datetime.timedelta(seconds=timeout_s))
            backend, dev = resolve_device_backend(env, asked, device)  # the device follows the local rank
    set_thread_count(env)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    else:
        tune_cpu_allocator()  # before the model is built: its freed tensors go back to the system
    if env.distributed:
        _init_group(env, backend, dev, timeout_s, store)
    _CONTEXT = DistContext(env=env, backend=backend, device=dev)
    return _CONTEXT


def _refuse_a_lonely_child(env: DistEnv) -> None:
    """A process that multiprocessing started (mp.spawn's workers) with no launcher variables would otherwise
    run as world size 1, each worker training alone on everything."""
    import multiprocessing

    if env.launcher == "none" and multiprocessing.parent_process() is not None:
        raise UserError(
            "init_distributed() in a process multiprocessing started (mp.spawn) cannot tell which rank it is",
            "pass rank= and world_size=, or start it with ddpkit.launch(fn, nprocs=N)",
        )


def _adopt() -> DistContext:
    """The context of a process group made outside ddpkit (init_process_group called by the user)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", rank))
    backend = dist.get_backend()
    env = DistEnv(rank=rank, local_rank=local, world_size=world, local_world_size=world, launcher="external")
    dev = torch.device("cuda", local) if backend == "nccl" else torch.device("cpu")
    return DistContext(env=env, backend=backend, device=dev)


def set_thread_count(env: DistEnv) -> None:
    """Without a launcher that set OMP_NUM_THREADS (srun, mpirun, by hand), each of the ranks on a node would
    start a thread per core: give each cores // ranks-on-this-node, as the ddpkit launcher does."""
    if not env.distributed or "OMP_NUM_THREADS" in os.environ:
        return
    n = max(1, (os.cpu_count() or 1) // max(env.local_world_size, 1))
    os.environ["OMP_NUM_THREADS"] = str(n)
    torch.set_num_threads(n)


def _init_group(env: DistEnv, backend: str, dev: torch.device, timeout_s: float, rdzv_store=None) -> None:
    global _RDZV
    kwargs: dict = {}
    if env.init_method.startswith("env://"):
        # Make env:// see exactly what was detected, whatever the launcher called it.
        os.environ.update(torch_variables(env))
    if dev.type == "cuda":
        kwargs["device_id"] = dev
    timeout = datetime.timedelta(seconds=timeout_s)
    if rdzv_store is None and env.rank != 0 and env.launcher not in ("torchrun", "spawn"):
        # rank 0 hosts the store; torchrun's agent has its store up before it starts workers
        rendezvous.probe(env.master_addr, env.master_port, min(rendezvous.probe_window(), timeout_s))
    try:
        store = (
            _attempt_store(env, timeout) if rdzv_store is None else dist.PrefixStore("ddpkit/pg/", rdzv_store)
        )
        if store is not None:
            kwargs["store"] = store
        else:
            kwargs["init_method"] = env.init_method
        dist.init_process_group(
            backend=backend, rank=env.rank, world_size=env.world_size, timeout=timeout, **kwargs
        )
    except (RuntimeError, ValueError, OSError) as e:
        where = f"{env.master_addr}:{env.master_port}" if env.init_method == "env://" else env.init_method
        raise UserError(
            f"rank {env.rank} could not join the process group at {where} ({first_line(e, 50)})",
            "give every rank the same master address and port; is it reachable?",
        ) from None
    _RDZV = (rdzv_store, env) if rdzv_store is not None else None
    for handler in (_drain_at_exit, shutdown):  # last in, first out: shutdown, then the drain
        atexit.unregister(handler)  # once each, however often the group is made again
        atexit.register(handler)


def _attempt_store(env: DistEnv, timeout: datetime.timedelta):
    """Under torch's elastic agent: its store, seen through a prefix of this restart attempt; else None.

    The agent keeps one store for the whole job and hands it to every restart round, so keys that the
    killed workers wrote (gloo's peer addresses, heartbeats) are still there when their replacements
    connect: a replacement may read a dead peer's address and hang until the timeout. A per-attempt
    prefix gives every round fresh keys. (TORCHELASTIC_RESTART_COUNT is the same for all workers of one
    agent; launch.py turns store sharing off for multi-node c10d jobs, whose agents count separately.)
    """
    if not env.init_method.startswith("env://") or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    if os.environ.get("MASTER_ADDR") != env.master_addr or os.environ.get("MASTER_PORT") != str(
        env.master_port
    ):
        return None  # the agent serves its store at exactly MASTER_ADDR:MASTER_PORT
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.TCPStore(env.master_addr, env.master_port, env.world_size, is_master=False, timeout=timeout)
    return dist.PrefixStore(f"ddpkit/attempt_{attempt}/", store)


_RDZV: tuple | None = None  # (store, env) of a by-hand rendezvous, to leave after the group is destroyed


# what must stop before the process group goes away (a heartbeat's thread uses the group's store): each module
# that starts such a thing adds its stop here when it is imported
BEFORE_SHUTDOWN: list[Callable[[], None]] = []


def shutdown() -> None:
    """Destroy the process group if we made one; safe to call twice."""
    global _CONTEXT, _RDZV
    for stop in BEFORE_SHUTDOWN:
        stop()
    if dist.is_available() and dist.is_initialized():
        group_ended(dist.get_rank(), dist.get_world_size())
        try:
            dist.destroy_process_group()
        except Exception:  # teardown after a failure must not mask the failure
            pass
    forget_meshes()
    if _RDZV is not None:
        rendezvous.leave(*_RDZV)
        _RDZV = None
    _CONTEXT = None


def forget_meshes() -> None:
    """Empty DTensor's caches of sharding and redistribution plans, which hold the DeviceMesh they were made on.

    A DeviceMesh equals any other of the same shape, ranks and dim names, whatever its process groups, so after
    the group is destroyed a mesh built on the next group in this process (a second run in one process, a pooled
    test rank) was answered from them with the old mesh, whose group names are gone or now name other groups:
    gathering a sharded parameter then failed ("Could not resolve the process group") or all-gathered over a
    group of another size (placement_types' `orig_size >= logical_dim_size` check)."""
    from torch.distributed.tensor import DTensor, _redistribute

    native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)  # the C++ dispatch's own
    if native is not None:
        native()
    propagator = DTensor._op_dispatcher.sharding_propagator
    for cache in (
        getattr(propagator, "propagate_op_sharding", None),
        getattr(propagator, "_propagate_tensor_meta_cached", None),
        getattr(_redistribute, "_gen_transform_infos", None),
    ):
        if hasattr(cache, "cache_clear"):
            cache.cache_clear()
    clear_planners = getattr(_redistribute, "clear_redistribute_planner_cache", None)
    if clear_planners is not None:
        clear_planners()


# How long the exit waits, with the GIL released, for gloo's worker threads to drop finished work.
EXIT_DRAIN_S = 0.2


def _drain_at_exit() -> None:
    """Let gloo's worker threads finish with Python objects while the interpreter can still serve them.

    A gloo worker thread (`pt_gloo_runloop`) drops its reference to a finished collective, and the tensors
    in it, a moment after the caller's wait() returned, and the group's threads live on after
    destroy_process_group while a DDP model still holds the group. When the process exits in that moment
    (a script whose last line is a collective), the thread asks for the GIL during interpreter finalization,
    Python ends the thread, and the unwinding through a C++ destructor aborts the process ("terminate called
    without an active exception", SIGABRT) after a run that succeeded. A short wait here, before
    finalization starts and with the GIL free, lets the thread finish first. A worker forked from the fork
    server ends with os._exit, without finalization: it need not wait.
    """
    if not channels.FLAGS.forked_worker:  # a worker forked by the warm-start server ends with os._exit
        time.sleep(EXIT_DRAIN_S)


def current() -> DistContext | None:
    """The context of init_distributed, if it was called."""
    return _CONTEXT


def hostname() -> str:
    return socket.gethostname()
