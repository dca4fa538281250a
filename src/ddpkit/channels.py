"""Every channel that carries a fact between ddpkit's own processes, declared in one place: the environment
variables a launcher sets for its workers (or a user sets for ddpkit), and the process-wide flags. For each: who
sets it, who reads it, and what it means. No other module spells a `DDPKIT_*` name or keeps such a flag.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Channel:
    name: str
    set_by: str
    read_by: str
    meaning: str


LAUNCHER = "DDPKIT_LAUNCHER"
LAUNCHER_PID = "DDPKIT_LAUNCHER_PID"
START_TIME = "DDPKIT_START_TIME"
LAUNCHER_DRAWS_CURVES = "DDPKIT_LAUNCHER_DRAWS_CURVES"
IFACE_CHOSEN = "DDPKIT_IFACE_CHOSEN"
WARM_START = "DDPKIT_WARM_START"
OVERSUBSCRIBE = "DDPKIT_OVERSUBSCRIBE"
PROBE_S = "DDPKIT_PROBE_S"
DEBUG = "DDPKIT_DEBUG"
COMM_TAMPER = "DDPKIT_COMM_TAMPER"
LOCAL_RANK_ARG = "DDPKIT_LOCAL_RANK_ARG"
JOB_DIR = "DDPKIT_JOB_DIR"
WARNINGS_PER_RANK = "DDPKIT_WARNINGS_PER_RANK"
WORKER_EXITS = "DDPKIT_WORKER_EXITS"
MALLOC_TUNE = "DDPKIT_MALLOC_TUNE"

CHANNELS: tuple[Channel, ...] = (
    Channel(LAUNCHER, "launcher.launch, launcher.spawn (spawn workers)", "cluster.launchers",
            "'spawn': this worker was started by torch.multiprocessing.spawn, not torch's elastic agent"),
    Channel(LAUNCHER_PID, "launcher.launch (for its workers while they start)", "launcher.signals",
            "the launcher's pid: a worker dies with it (PR_SET_PDEATHSIG); each worker takes it out"),
    Channel(START_TIME, "launcher.launch", "train.startup",
            "'EPOCH_SECONDS PID': when the launcher started, so a worker's start-up time counts from it"),
    Channel(LAUNCHER_DRAWS_CURVES, "launcher.launch (one node)", "commands.report, train.trainer",
            "'1': the launcher draws curves.png after the workers end, rank 0 need not"),
    Channel(IFACE_CHOSEN, "cluster.netif (the launcher)", "cluster.netif (workers)",
            "'IFACE ADDR': the interface ddpkit chose, so workers can tell it from one the user set"),
    Channel(WARM_START, "the user", "launcher.warm_start, launcher.warm_server",
            "'0': workers start as fresh interpreters instead of forks of a warm server"),
    Channel(OVERSUBSCRIBE, "the user (or --oversubscribe)", "distributed.runtime",
            "'1': more CPU processes on a node than it has cores is meant, not a typo"),
    Channel(PROBE_S, "the user", "distributed.rendezvous",
            "seconds a rank waits for the master's port to accept a connection (default 30)"),
    Channel(DEBUG, "the user", "launcher.launch, launcher.peers",
            "set: torch's agent and store keep their own log lines"),
    Channel(JOB_DIR, "diagnostics.stacks (the launcher, while workers run)", "diagnostics.stacks (workers)",
            "the launcher's job folder: each worker leaves its pid, its SIGUSR2 stack dumps and its error line"),
    Channel(WORKER_EXITS, "launcher.warm_start (the launcher, for its fork server)", "launcher.warm_server",
            "a folder where the fork server writes each worker's exit status (PID: status), as the launcher cannot wait for its grandchildren"),
    Channel(WARNINGS_PER_RANK, "the user", "diagnostics.warn_once (workers)",
            "'1': every rank prints its own warnings, as plain torchrun does (default: a warning once for the job)"),
    Channel(MALLOC_TUNE, "the user", "distributed.allocator (CPU workers)",
            "a CPU worker's glibc thresholds: unset, 32/64 MiB (steps reuse their temporaries); '1', each tensor above 1 MiB "
            "mapped and returned on free (less memory, slower); '0', glibc's own rule"),
    Channel(COMM_TAMPER, "tests of `ddpkit comm`", "diagnostics.collective_check",
            "a rank whose collective results are tampered with, to prove the check catches it"),
    Channel(LOCAL_RANK_ARG, "distributed.local_rank (ddpkit run)", "distributed.usermain",
            "'--local_rank' or '--local-rank': the script gets FLAG=LOCAL_RANK after its name; taken out"),
)  # fmt: skip


class ProcessFlags:
    """Facts about this process that modules set and read (one instance, FLAGS)."""

    launched = False  # this process started workers (launch_elastic or launch_spawn ran in it)
    forked_worker = False  # this process is a worker forked by the warm-start server: it ends with os._exit


FLAGS = ProcessFlags()
