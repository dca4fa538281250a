"""`ddpkit.launch(fn, *args, nprocs=N)`: run a function on N local processes, each already in the process group.

What `mp.spawn(fn, nprocs=N)` plus a hand-written setup does in the tutorials, for a notebook or a test: every
worker gets the variables torchrun would give it (RANK, LOCAL_RANK, WORLD_SIZE, ... on a free port), joins the
group with init_distributed(), runs fn(*args) and leaves the group; the parent gets the return values in rank
order, or a WorkerFailure naming the rank that failed (its traceback is printed).
"""

from __future__ import annotations

import os
import pickle
import queue
import sys
import traceback
from collections.abc import Callable
from typing import Any

from ddpkit import channels
from ddpkit.errors import UserError, WorkerFailure, first_line

# How long the other workers get to finish after one failed, before they are killed.
GRACE_S = 5.0


def _interactive(fn: Callable[..., Any]) -> bool:
    """Defined in a notebook or at the interactive prompt: spawned processes could not import it."""
    main = sys.modules.get("__main__")
    return getattr(fn, "__module__", None) == "__main__" and not getattr(main, "__file__", None)


def _worker(
    rank: int,
    nprocs: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple,
    options: dict[str, Any],
    results: Any,
) -> None:
    from ddpkit.cluster.env import DistEnv, torch_variables
    from ddpkit.distributed.runtime import init_distributed, shutdown

    env = DistEnv(rank=rank, local_rank=rank, world_size=nprocs, local_world_size=nprocs, master_port=port)
    os.environ.update(torch_variables(env), **{channels.LAUNCHER: "spawn"})
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nprocs)))
    from ddpkit.diagnostics import stacks

    stacks.arm()  # SIGUSR2 dumps this worker's Python stack to stderr
    try:
        init_distributed(options["backend"], options["device"], options["timeout_s"])
        value = fn(*args)
        shutdown()
        # Plain pickle bytes, not torch's shared-memory tensors: those vanish when this process exits before
        # the parent has read them.
        results.put((rank, "ok", pickle.dumps(value)))
    except BaseException as e:  # noqa: BLE001  (reported to the parent, which raises)
        results.put((rank, "error", (first_line(e, limit=300), traceback.format_exc())))
        sys.exit(1)


def launch(
    fn: Callable[..., Any],
    *args: Any,
    nprocs: int,
    backend: str = "auto",
    device: str = "auto",
    timeout_s: float = 600.0,
    start_method: str | None = None,
) -> list[Any]:
    """fn(*args) on `nprocs` local processes in one process group; their return values, in rank order.

    start_method: "spawn" (default; fn must be importable) or "fork" (the default for functions defined in a
    notebook, which spawned processes cannot import).
    """
    import torch.multiprocessing as mp

    from ddpkit.launcher.launch import free_port

    if not isinstance(nprocs, int) or nprocs < 1:
        raise UserError(f"ddpkit.launch: nprocs must be a whole number >= 1, got {nprocs!r}", "e.g. nprocs=2")
    method = start_method or ("fork" if _interactive(fn) else "spawn")
    if method == "fork":
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            raise UserError(
                "ddpkit.launch cannot fork: CUDA is already initialised in this process",
                "create models and tensors inside fn, or define fn in a module and use start_method='spawn'",
            )
    ctx = mp.get_context(method)
    results = ctx.Queue()
    options = {"backend": backend, "device": device, "timeout_s": timeout_s}
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, nprocs, port, fn, args, options, results), daemon=False)
        for r in range(nprocs)
    ]
    for p in procs:
        p.start()
    try:
        return _collect(procs, results)
    finally:
        for p in procs:
            p.join(timeout=GRACE_S)
            if p.is_alive():
                p.kill()
                p.join()


def _collect(procs: list, results: Any) -> list[Any]:
    """The values in rank order; WorkerFailure at the first failure (a raised error or a process that died)."""
    from ddpkit.launcher.launch import describe_exit

    values: dict[int, Any] = {}
    while len(values) < len(procs):
        try:
            rank, status, value = results.get(timeout=0.2)
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if r not in values and p.exitcode not in (None, 0)]
            if dead:
                r = dead[0]
                raise WorkerFailure(f"worker rank {r} died ({describe_exit(procs[r].exitcode)})") from None
            continue
        if status == "error":
            line, trace = value
            print(f"--- worker rank {rank} ---\n{trace}", file=sys.stderr, flush=True)
            raise WorkerFailure(f"worker rank {rank} failed: {line}")
        values[rank] = pickle.loads(value)  # bytes our own worker pickled, not a file of the user's
    return [values[r] for r in range(len(procs))]
