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
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

from ddpkit import channels
from ddpkit.cluster.env import DistEnv, torch_variables
from ddpkit.diagnostics import stacks, warn_once
from ddpkit.distributed import blame
from ddpkit.errors import UserError, first_line
from ddpkit.launcher.launch import host_store

# How long the other workers get to finish after one failed, before they are killed.
GRACE_S = 5.0


def _interactive(fn: Callable[..., Any]) -> bool:
    """Defined in a notebook or at the interactive prompt: spawned processes could not import it."""
    main = sys.modules.get("__main__")
    return getattr(fn, "__module__", None) == "__main__" and not getattr(main, "__file__", None)


def _worker(
    rank: int,
    nprocs: int,
    rendezvous: dict[str, str],
    fn: Callable[..., Any],
    args: tuple,
    options: dict[str, Any],
    results: Any,
) -> None:
    from ddpkit.distributed.runtime import init_distributed, shutdown

    port = int(rendezvous["MASTER_PORT"])
    env = DistEnv(rank=rank, local_rank=rank, world_size=nprocs, local_world_size=nprocs, master_port=port)
    os.environ.update(torch_variables(env), **rendezvous, **{channels.LAUNCHER: "spawn"})
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nprocs)))

    stacks.arm()  # SIGUSR2 dumps this worker's Python stack to stderr
    warn_once.install(options["warned"])  # a warning every rank gives is printed once for the launch
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


# processes one launch() may start on this machine: far above any machine's GPUs or cores, far below the
# system's process limit
MAX_NPROCS = 1024


def _check_arguments(
    fn: Any, nprocs: Any, backend: Any, device: Any, timeout_s: Any, start_method: Any
) -> None:
    """launch()'s arguments of the right type and range, before any process starts (UserError)."""
    import math

    if not callable(fn):
        raise UserError(
            f"ddpkit.launch: fn must be a function, not a {type(fn).__name__}", "launch(train, nprocs=2)"
        )
    if not isinstance(nprocs, int) or isinstance(nprocs, bool) or not 1 <= nprocs <= MAX_NPROCS:
        raise UserError(
            f"ddpkit.launch: nprocs must be a whole number from 1 to {MAX_NPROCS}, got {nprocs!r}",
            "e.g. nprocs=2",
        )
    if (
        not isinstance(timeout_s, (int, float))
        or isinstance(timeout_s, bool)
        or not math.isfinite(timeout_s)
        or timeout_s <= 0
    ):
        raise UserError(
            f"ddpkit.launch: timeout_s must be a number of seconds > 0, got {timeout_s!r}",
            "e.g. timeout_s=600",
        )
    for name, value, allowed in (
        ("backend", backend, ("auto", "gloo", "nccl")),
        ("device", device, ("auto", "cpu", "cuda")),
        ("start_method", start_method, (None, "spawn", "fork", "forkserver")),
    ):
        if value not in allowed or isinstance(value, bool):
            raise UserError(
                f"ddpkit.launch: {name} must be one of {', '.join(map(str, allowed))}, got {value!r}",
                f"e.g. {name}={allowed[1]!r}",
            )


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

    _check_arguments(fn, nprocs, backend, device, timeout_s, start_method)
    method = start_method or ("fork" if _interactive(fn) else "spawn")
    if method != "fork":
        blame.check_importable(fn)
    if method == "fork":
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            raise UserError(
                "ddpkit.launch cannot fork: CUDA is already initialised in this process",
                "create models and tensors inside fn, or define fn in a module and use start_method='spawn'",
            )
    ctx = mp.get_context(method)
    # where the workers claim the warnings they show (diagnostics.warn_once); named like a launcher's job
    # folder, so that one left by a launch that was killed is swept (it holds no launcher.pid: never a job)
    with tempfile.TemporaryDirectory(
        prefix=f"{stacks.JOB_PREFIX}{os.getpid()}-", ignore_cleanup_errors=True
    ) as warned:
        options = {"backend": backend, "device": device, "timeout_s": timeout_s, "warned": warned}
        return _run_workers(ctx, nprocs, fn, args, options)


def _run_workers(
    ctx: Any, nprocs: int, fn: Callable[..., Any], args: tuple, options: dict[str, Any]
) -> list[Any]:

    results = ctx.Queue()
    store, rendezvous = host_store()  # the workers' store, kept open until they are done
    procs = [
        ctx.Process(target=_worker, args=(r, nprocs, rendezvous, fn, args, options, results), daemon=False)
        for r in range(nprocs)
    ]
    for p in procs:
        p.start()
    ok = False
    try:
        values = _collect(procs, results, options["timeout_s"])
        ok = True
        return values
    finally:
        for p in procs:
            p.join(timeout=GRACE_S if ok else 1.0)
            if p.is_alive():
                p.kill()
                p.join()
        del store  # every worker is gone: stop serving


def _collect(procs: list, results: Any, timeout_s: float) -> list[Any]:
    """The values in rank order, or WorkerFailure naming the culprit (blame.py): once a rank has failed, the
    others get BLAME_S to report; once one has finished, the others get timeout_s to finish."""
    values: dict[int, Any] = {}
    errors: dict[int, tuple[str, str]] = {}
    first: tuple[int, float] | None = None  # (rank, when) of the first rank that finished or failed
    failed_at: float | None = None
    while len(values) + len(errors) < len(procs):
        try:
            rank, status, value = results.get(timeout=0.2)
        except queue.Empty:
            now = time.monotonic()
            dead = [r for r, p in enumerate(procs) if r not in values and r not in errors and p.exitcode]
            if dead and failed_at is None:
                failed_at = now
            if failed_at is not None and now - failed_at > blame.BLAME_S:
                break
            if first is not None and now - first[1] > timeout_s and failed_at is None:
                raise blame.stuck(procs, values, first[0], timeout_s) from None
            continue
        now = time.monotonic()
        first = first or (rank, now)
        if status == "error":
            errors[rank] = value
            failed_at = failed_at or now
        else:
            values[rank] = pickle.loads(value)  # bytes our own worker pickled, not a file of the user's
    if errors or failed_at is not None:
        raise blame.culprit(procs, values, errors)
    return [values[r] for r in range(len(procs))]
