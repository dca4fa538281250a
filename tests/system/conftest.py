"""Session fixtures that install and start the real things: two "hosts" (network namespaces, each with its own
host name, address and /etc/hosts, joined through a bridge on this host; built in infra.py), a two-node Slurm
cluster whose slurmd daemons live in those namespaces, and Open MPI.

Missing Debian packages are installed with apt-get (as root). Everything started here is stopped, and every
temporary file removed, when the session ends, also on SIGINT, SIGTERM or SIGHUP; what a killed session left
behind is swept at the start of the next (tests/system/infra.py). A fixture skips only when the host cannot do
it (not root, no apt-get, namespaces not permitted) and says why; an install or a daemon that fails is a test
failure.
"""

from __future__ import annotations

import atexit
import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import cli_env, free_port

from .helpers import PY, tail
from .infra import NetnsPair, NetworkUnavailable, Session, make_pair, sweep

SBIN = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
REQUEUE_SETTLE_S = 5.0  # how long a requeued job stays held before the tests let it start again


def _which(command: str) -> str | None:
    return shutil.which(command) or shutil.which(command, path=SBIN)


def ensure_installed(command: str, packages: Sequence[str]) -> str:
    """The path of `command`, installing Debian `packages` first when it is missing."""
    found = _which(command)
    if found:
        return found
    if os.geteuid() != 0:
        pytest.skip(f"`{command}` is missing and installing {' '.join(packages)} needs root")
    if _which("apt-get") is None:
        pytest.skip(f"`{command}` is missing and this host has no apt-get to install {' '.join(packages)}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *packages]
    proc = subprocess.run(install, capture_output=True, text=True, env=env, timeout=900)
    if proc.returncode != 0:  # a fresh machine has no package lists yet
        subprocess.run(["apt-get", "update", "-q"], capture_output=True, text=True, env=env, timeout=600)
        proc = subprocess.run(install, capture_output=True, text=True, env=env, timeout=900)
    found = _which(command)
    if proc.returncode != 0 or not found:
        pytest.fail(
            f"`{' '.join(install)}` failed (exit {proc.returncode}):\n{tail(proc.stdout + proc.stderr)}"
        )
    return found


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"received {signal.Signals(signum).name}")


@pytest.fixture(scope="session")
def system_session() -> Iterator[Session]:
    """This session's state folder; SIGTERM/SIGHUP become KeyboardInterrupt (pytest then runs the finalisers),
    and leftovers of earlier, killed sessions are swept first."""
    if os.geteuid() != 0:
        pytest.skip("the system tests need root (network namespaces, daemons, apt-get)")
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)
    sweep()
    session = Session.create()
    atexit.register(session.cleanup)  # if a finaliser itself was interrupted
    try:
        yield session
    finally:
        session.cleanup()


def _start(
    session: Session, argv: Sequence[str], log: Path, env: dict[str, str] | None = None
) -> subprocess.Popen:
    """A daemon in the foreground, as our own child (so teardown stops exactly it), recorded in the session."""
    with open(log, "ab") as fh:
        proc = subprocess.Popen(
            list(argv), stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    session.record("proc", proc.pid)
    return proc


def _stop(procs: Sequence[subprocess.Popen]) -> None:
    """SIGTERM our daemons, SIGKILL what is still there after 10 s."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


# ---------------------------------------------------------------------------------------------- namespaces


@pytest.fixture(scope="session")
def netns(system_session: Session) -> NetnsPair:
    """Two namespaces on a bridge of this host (10.77.N.1, .2; the host is .254), lo up in each."""
    ensure_installed("ip", ["iproute2"])
    if _which("unshare") is None or _which("nsenter") is None:
        pytest.skip("`unshare`/`nsenter` (util-linux) missing: cannot give each namespace its own host name")
    try:
        return make_pair(
            system_session
        )  # the session's cleanup removes the namespaces, links and hosts files
    except NetworkUnavailable as e:
        pytest.skip(str(e))


# ---------------------------------------------------------------------------------------------- Slurm


@dataclass(frozen=True)
class Slurm:
    """A running two-node Slurm cluster (slurmd of `nodes` in the namespaces of `netns`): its config file and the
    environment its commands need."""

    conf: Path
    nodes: tuple[str, str]
    env: dict[str, str]
    root: Path

    @property
    def node(self) -> str:
        """The first node: where one-node jobs run."""
        return self.nodes[0]

    def run(self, *argv: str, timeout: float = 300, cwd: Path | None = None) -> subprocess.CompletedProcess:
        """A Slurm command (srun, sbatch, scontrol, ...) against this cluster."""
        return subprocess.run(
            list(argv), capture_output=True, text=True, timeout=timeout, env=self.env, cwd=cwd
        )

    def popen(self, *argv: str, cwd: Path | None = None) -> subprocess.Popen:
        """The same, without waiting."""
        return subprocess.Popen(
            list(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=self.env, cwd=cwd
        )

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as {key: value}."""
        out = self.run("scontrol", "-o", "show", "job", job_id, timeout=30).stdout
        return dict(tok.split("=", 1) for tok in out.split() if "=" in tok)

    def job_state(self, job_id: str) -> str:
        """JobState (PENDING, RUNNING, COMPLETED, FAILED, ...)."""
        return self.job(job_id).get("JobState", "UNKNOWN")

    def wait_job(self, job_id: str, timeout: float = 240) -> str:
        """Poll until the job has ended; its final state.

        A requeued batch job waits about two minutes before it may start again (Slurm's BeginTime for requeued
        jobs); like an administrator, this lifts that wait (StartTime=now) so that the tests need not sit it out,
        but only after REQUEUE_SETTLE_S: a slurmd asked to start the job again within a second of killing its
        previous run refuses ("Job N already killed, do not launch batch job") and the job ends FAILED.
        """
        deadline = time.monotonic() + timeout
        state, held_since = "UNKNOWN", None
        while time.monotonic() < deadline:
            job = self.job(job_id)
            state = job.get("JobState", "UNKNOWN")
            held = state == "PENDING" and job.get("Reason") == "BeginTime"
            held_since = (held_since or time.monotonic()) if held else None
            if held_since and time.monotonic() - held_since >= REQUEUE_SETTLE_S:
                self.run("scontrol", "update", f"JobId={job_id}", "StartTime=now", timeout=30)
            if state not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "UNKNOWN"):
                return state
            time.sleep(0.5)
        raise AssertionError(f"job {job_id} still {state} after {timeout} s")

    def wait_step(self, job_id: str, timeout: float = 120) -> None:
        """Until the job's first srun step runs (so the batch script is past its set-up)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if f"{job_id}.0 " in self.run("squeue", "-h", "-s", "-j", job_id, "-o", "%i ", timeout=30).stdout:
                return
            time.sleep(0.2)
        raise AssertionError(f"job {job_id} started no step within {timeout} s: {self.job(job_id)}")


SLURM_CONF = """\
ClusterName=ddpkit-test
SlurmctldHost={controller}({controller_addr})
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool-%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# The nodes may promise more CPUs than this machine has: two 2-task jobs fit on one node of a 2-core machine.
SlurmdParameters=config_overrides
ReturnToService=2
MinJobAge=600
KillWait=5
InactiveLimit=0
NodeName={node0} NodeAddr={addr0} CPUs=8 State=UNKNOWN
NodeName={node1} NodeAddr={addr1} CPUs=8 State=UNKNOWN
PartitionName=test Nodes={node0},{node1} Default=YES MaxTime=INFINITE State=UP
"""


@pytest.fixture(scope="session")
def slurm(system_session: Session, netns: NetnsPair) -> Iterator[Slurm]:
    """munged + slurmctld on this host, one slurmd in each namespace; installed from Debian when missing."""
    ensure_installed("slurmctld", ["slurm-wlm", "munge"])
    munged, slurmctld, slurmd = _which("munged"), _which("slurmctld"), _which("slurmd")
    if not (munged and slurmd):
        pytest.fail(f"slurm-wlm/munge installed but munged={munged} slurmd={slurmd}")
    root = system_session.dir / "slurm"
    for sub in ("state", "munge", *(f"spool-{node}" for node in netns.hosts)):
        (root / sub).mkdir(mode=0o700, parents=True)
    key = root / "munge" / "munge.key"
    key.write_bytes(secrets.token_bytes(1024))
    key.chmod(0o400)
    conf = root / "slurm.conf"
    conf.write_text(
        SLURM_CONF.format(
            controller=socket.gethostname().split(".")[0],
            controller_addr=netns.host_addr,
            node0=netns.hosts[0],
            node1=netns.hosts[1],
            addr0=netns.addrs[0],
            addr1=netns.addrs[1],
            root=root,
            ctld_port=free_port(),
            slurmd_port=free_port(),
            munge_socket=root / "munge" / "munge.socket",
        )
    )
    env = cli_env({"SLURM_CONF": str(conf), "PATH": f"{Path(PY).parent}:{os.environ.get('PATH', '')}:{SBIN}"})
    s = system_session
    procs = [
        _start(
            s,
            [
                munged,
                "--foreground",
                "--force",
                f"--key-file={key}",
                f"--socket={root / 'munge' / 'munge.socket'}",
                f"--pid-file={root / 'munge' / 'munged.pid'}",
                f"--seed-file={root / 'munge' / 'munged.seed'}",
                f"--log-file={root / 'munge' / 'munged.log'}",
            ],
            root / "munged.out",
        )
    ]
    cluster = Slurm(conf=conf, nodes=netns.hosts, env=env, root=root)
    try:
        time.sleep(0.5)
        procs.append(_start(s, [slurmctld, "-D", "-i", "-f", str(conf)], root / "slurmctld.out", env))
        for i, node in enumerate(netns.hosts):
            argv = netns.argv(i, slurmd, "-D", "-N", node, "-f", str(conf))
            procs.append(_start(s, argv, root / f"slurmd-{node}.out", env))
        _wait_idle(cluster, procs, root)
        yield cluster
    finally:
        subprocess.run(
            ["scancel", "--full", f"--user={os.geteuid()}"], capture_output=True, env=env, timeout=30
        )
        _stop(procs[::-1])


def _wait_idle(cluster: Slurm, procs: Sequence[subprocess.Popen], root: Path, timeout: float = 60) -> None:
    """Wait until sinfo shows both nodes idle; fail with the daemons' logs otherwise."""
    deadline = time.monotonic() + timeout
    state, dead = "", []
    while time.monotonic() < deadline:
        dead = [p.args[0] for p in procs if p.poll() is not None]
        if dead:
            break
        state = cluster.run("sinfo", "-h", "-N", "-o", "%t", timeout=30).stdout.split()
        if state == ["idle", "idle"]:
            return
        time.sleep(0.5)
    logs = "\n".join(
        f"--- {f.name}\n{tail(f.read_text(errors='replace'), 1500)}"
        for f in sorted(root.glob("*.log")) + sorted(root.glob("*.out"))
    )
    pytest.fail(f"the Slurm nodes did not become idle (sinfo: {state!r}, exited: {dead})\n{logs}")


# ---------------------------------------------------------------------------------------------- Open MPI


@dataclass(frozen=True)
class OpenMPI:
    """mpirun, with the environment ddpkit needs passed to every rank by name (`-x`)."""

    mpirun: str

    def argv(self, np: int, *command: str, env: dict[str, str]) -> list[str]:
        exports = [
            x
            for name in sorted(env)
            if name.startswith(("OMP_", "PYTHON", "GLOO_", "MASTER_", "DDPKIT_")) or name == "PATH"
            for x in ("-x", name)
        ]
        return [
            self.mpirun,
            "--allow-run-as-root",
            "--oversubscribe",
            "--bind-to",
            "none",
            "-np",
            str(np),
            *exports,
            *command,
        ]


@pytest.fixture(scope="session")
def openmpi() -> OpenMPI:
    """Open MPI's mpirun, installed from Debian's openmpi-bin when missing."""
    return OpenMPI(ensure_installed("mpirun", ["openmpi-bin"]))
