"""Start workers: torch's elastic launcher (what torchrun runs, launcher/elastic.py), torch.multiprocessing.spawn
(here), or nothing; and what both share: a free port, the threads per worker, how the workers' exit statuses
become the job's.

Each worker runs `python -m ddpkit CMD ...` (elastic) or the same CLI function (spawn) with the launch flags
removed; it then finds its rank in the environment like under any other launcher. The launch flags and their
checks: launcher/spec.py.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from ddpkit import channels
from ddpkit.diagnostics import stacks
from ddpkit.distributed import reaper
from ddpkit.distributed.blame import describe_exit
from ddpkit.errors import Preempted, UserError, WorkerFailure
from ddpkit.launcher import signals, warm_start
from ddpkit.launcher.spec import LaunchSpec

PREEMPTED_EXIT = Preempted.exit_code


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def host_store(host: str = "127.0.0.1") -> tuple[Any, dict[str, str]]:
    """A TCPStore that this process serves on a port the OS gives it, for its local workers to join as clients,
    as torch's elastic agent serves its workers: -> (the store, the variables that send the workers to it).
    No port is chosen first and then lost to another job starting at the same moment."""
    import torch.distributed as dist

    store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
    return store, {
        "MASTER_ADDR": host,
        "MASTER_PORT": str(store.port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }


def set_thread_env(nproc: int) -> None:
    """As torchrun does: several CPU workers on one node must not each start a thread per core."""
    if "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))


def start_warm(spec: Any, modules: list[str], script: list[str] | None = None) -> bool:
    """Start the fork server that imports `modules` for the workers while this launcher imports torch for the
    agent (launcher/warm_start.py); False where workers start as programs (spawn, DDPKIT_WARM_START=0, a
    program of the user's own that calls ddpkit's command line, a `script` that sets a thread variable such as
    OMP_NUM_THREADS, which torch reads only as it is imported)."""
    if spec.launcher == "spawn" or not warm_start.main_is_ddpkit():
        return False
    if script is not None and warm_start.sets_thread_variable(script):
        return False
    set_thread_env(spec.nproc_per_node or 1)  # before the fork server starts: its torch reads it
    return warm_start.start(modules)


def _ended_by_us(codes: dict[int, int], e: Any, forwarder: signals.Forwarder) -> frozenset[int]:
    """Ranks the agent SIGTERMed after the first failure (it ends the others): not the job's status. Also when
    this launcher passed a signal on, if the first rank to end did not die of SIGTERM: the script handled the
    signal (exit 7 from its handler, say), so a rank killed by SIGTERM got the agent's second one while it was
    already ending from the first."""
    first, _ = e.get_first_failure()
    handled = codes.get(first) != -signal.SIGTERM
    return frozenset(
        r
        for r, c in codes.items()
        if r != first and c == -signal.SIGTERM and (not forwarder.signum or handled)
    )


def _cause(
    failures: dict[int, int], forwarded: int, ended_by_us: frozenset[int], gave_up: dict[int, str]
) -> int | None:
    """The rank whose end is the job's cause: one killed by a signal this launcher did not send (or, when others
    gave up on a collective, one that failed without giving up), never a rank that only waited for it."""
    own = [
        r
        for r, c in sorted(failures.items())
        if r not in ended_by_us and r not in gave_up and c != -forwarded
    ]
    killed = [r for r in own if failures[r] < 0]
    if killed:
        return killed[0]
    return own[0] if own and gave_up else None


def _step(gave_up: dict[int, str]) -> int | None:
    """The step at which the ranks that gave up were waiting (the one most of them name)."""
    steps = [int(m[1]) for line in gave_up.values() if (m := re.search(r"collective at step (\d+)", line))]
    return max(set(steps), key=lambda s: (steps.count(s), s)) if steps else None


def _grouped(codes: dict[int, int]) -> str:
    """`rank 1 (exit code 1), ranks 0, 3 (killed by SIGTERM)`."""
    by: dict[str, list[int]] = {}
    for r, c in sorted(codes.items()):
        by.setdefault(describe_exit(c), []).append(r)
    return ", ".join(
        f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))} ({d})" for d, rs in by.items()
    )


def _caused(cause: int, failures: dict[int, int], gave_up: dict[int, str], after: str) -> str:
    """`rank 2 was killed by SIGKILL at step 8; then ...`: the cause first, the others after it."""
    code, step = failures[cause], _step(gave_up)
    lead = (
        f"rank {cause} was {describe_exit(code)}"
        if code < 0
        else f"rank {cause} failed ({describe_exit(code)})"
    )
    lead += (f" at step {step}" if step is not None else "") + after
    rest = {r: c for r, c in failures.items() if r != cause}
    line = lead + (f"; then {_grouped(rest)}" if rest else "")
    return line + ("; the errors of the ranks that waited for it are in log.txt" if gave_up else "")


def _failure(
    failures: dict[int, int],
    restarts: int,
    forwarded: int = 0,
    ended_by_us: frozenset[int] = frozenset(),
    script: bool = False,
    gave_up: dict[int, str] | None = None,
) -> WorkerFailure | Preempted:
    """How the launch ends when workers failed; `forwarded`: the signal this launcher passed on to them;
    `ended_by_us`: ranks the launcher itself terminated after the first failure (named, but their status is not
    the job's); `script`: a user's script, whose exit 3 means preempted only when this launcher stopped it;
    `gave_up`: {rank: line} of the ranks that gave up on a collective (a rank that died is named first)."""
    gave_up = gave_up or {}
    codes = {c for r, c in failures.items() if r not in ended_by_us} or set(failures.values())
    if codes == {PREEMPTED_EXIT} and (
        forwarded or not script
    ):  # every worker that ended stopped after the agreed checkpoint
        return Preempted(
            "workers stopped at a step boundary after a checkpoint; rerun the same command to continue"
        )
    ranks = ", ".join(f"rank {r} ({describe_exit(c)})" for r, c in sorted(failures.items()))
    after = f" after {restarts} restart(s)" if restarts else ""
    cause = _cause(failures, forwarded, ended_by_us, gave_up)
    if cause is not None:
        what = _caused(cause, failures, gave_up, after)
    elif gave_up:  # no rank died: the first that gave up says which one stopped responding (heartbeats)
        what = gave_up[min(gave_up)] + (
            f" ({len(gave_up)} ranks gave up: log.txt)" if len(gave_up) > 1 else ""
        )
    else:
        what = f"worker {ranks} failed{after}"
    # The workers' own status when they agree on one, else 1; exit 2 means they all met a user error and said
    # why, one line each, so the launcher adds none; 128 + N when they all died of the signal N passed on.
    code = next(iter(codes)) if len(codes) == 1 and min(codes) > 0 else 1
    if forwarded and set(failures.values()) == {-forwarded}:
        code = 128 + forwarded
    return WorkerFailure(what, exit_code=code, report=code != 2)


def _launched() -> None:
    channels.FLAGS.launched = True


def launched() -> bool:
    """Whether this process started workers (launch_elastic or launch_spawn ran in it)."""
    return channels.FLAGS.launched


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
    store, rendezvous = None, {"MASTER_ADDR": addr, "MASTER_PORT": str(spec.master_port or 29500)}
    if spec.nnodes == 1 and spec.master_port is None:
        store, rendezvous = host_store(addr)  # kept open until the workers are done
    env = {
        **rendezvous,
        "WORLD_SIZE": str(nproc * spec.nnodes),
        "LOCAL_WORLD_SIZE": str(nproc),
        "GROUP_RANK": str(spec.node_rank),
        channels.LAUNCHER: "spawn",
        signals.PARENT_VAR: str(os.getpid()),
    }
    # torch warns "Terminating process N via signal SIGTERM" for each rank it ends after one failed: ddpkit's
    # own line names the failure once
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
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
            ranks.read_errors()  # which ranks gave up on a collective: the one that died is named first
            err = _failure(failed, 0, forwarder.signum, ours, script, ranks.gave_up)
            raise stacks.job_failure(err, ranks) from None
        finally:
            del store  # every worker is gone: stop serving
