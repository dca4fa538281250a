"""Session fixtures that install and start the real things: a one-node Slurm cluster, two network namespaces
joined by a veth pair (two "hosts" with their own addresses), and Open MPI.

Missing Debian packages are installed with apt-get (as root). Everything started here is stopped, and every
temporary file removed, when the session ends. A fixture skips only when the host cannot do it (not root,
no apt-get, namespaces not permitted) and says why; an install or a daemon that fails is a test failure.
"""

from __future__ import annotations

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

from conftest import cli_env
from ddpkit.distributed.launch import free_port

from .helpers import PY, tail

SBIN = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


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


def _start(argv: Sequence[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """A daemon in the foreground, as our own child (so teardown stops exactly it)."""
    with open(log, "ab") as fh:
        return subprocess.Popen(
            list(argv), stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )


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


# ---------------------------------------------------------------------------------------------- Slurm


@dataclass(frozen=True)
class Slurm:
    """A running one-node Slurm cluster: its config file and the environment its commands need."""

    conf: Path
    node: str
    env: dict[str, str]

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

    def job_state(self, job_id: str) -> str:
        """JobState from `scontrol show job` (PENDING, RUNNING, COMPLETED, FAILED, ...)."""
        out = self.run("scontrol", "show", "job", job_id, timeout=30).stdout
        for token in out.split():
            if token.startswith("JobState="):
                return token.split("=", 1)[1]
        return "UNKNOWN"

    def wait_job(self, job_id: str, timeout: float = 240) -> str:
        """Poll until the job has ended; its final state."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.job_state(job_id)
            if state not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "UNKNOWN"):
                return state
            time.sleep(0.5)
        raise AssertionError(f"job {job_id} still {state} after {timeout} s")


SLURM_CONF = """\
ClusterName=ddpkit-test
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
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
# The node may promise more CPUs than it has: 4 tasks of 2 concurrent 2-task jobs fit on a 2-core machine.
SlurmdParameters=config_overrides
ReturnToService=2
MinJobAge=600
KillWait=5
InactiveLimit=0
NodeName={node} NodeAddr=127.0.0.1 CPUs=8 State=UNKNOWN
PartitionName=test Nodes={node} Default=YES MaxTime=INFINITE State=UP
"""


@pytest.fixture(scope="session")
def slurm(tmp_path_factory) -> Iterator[Slurm]:
    """munged + slurmctld + slurmd on this host, installed from Debian's packages when missing."""
    ensure_installed("slurmctld", ["slurm-wlm", "munge"])
    munged, slurmctld, slurmd = _which("munged"), _which("slurmctld"), _which("slurmd")
    if not (munged and slurmd):
        pytest.fail(f"slurm-wlm/munge installed but munged={munged} slurmd={slurmd}")
    root = tmp_path_factory.mktemp("slurm")
    for sub in ("state", "spool", "munge"):
        (root / sub).mkdir(mode=0o700)
    key = root / "munge" / "munge.key"
    key.write_bytes(secrets.token_bytes(1024))
    key.chmod(0o400)
    node = socket.gethostname().split(".")[0]
    conf = root / "slurm.conf"
    conf.write_text(
        SLURM_CONF.format(
            node=node,
            root=root,
            ctld_port=free_port(),
            slurmd_port=free_port(),
            munge_socket=root / "munge" / "munge.socket",
        )
    )
    env = cli_env({"SLURM_CONF": str(conf), "PATH": f"{Path(PY).parent}:{os.environ.get('PATH', '')}:{SBIN}"})
    procs = [
        _start(
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
    cluster = Slurm(conf=conf, node=node, env=env)
    try:
        time.sleep(0.5)
        procs.append(_start([slurmctld, "-D", "-i", "-f", str(conf)], root / "slurmctld.out", env))
        procs.append(_start([slurmd, "-D", "-f", str(conf)], root / "slurmd.out", env))
        _wait_idle(cluster, procs, root)
        yield cluster
    finally:
        subprocess.run(
            ["scancel", "--full", f"--user={os.geteuid()}"], capture_output=True, env=env, timeout=30
        )
        _stop(procs[::-1])
        shutil.rmtree(root, ignore_errors=True)


def _wait_idle(cluster: Slurm, procs: Sequence[subprocess.Popen], root: Path, timeout: float = 60) -> None:
    """Wait until sinfo shows the node idle; fail with the daemons' logs otherwise."""
    deadline = time.monotonic() + timeout
    state = ""
    while time.monotonic() < deadline:
        dead = [p.args[0] for p in procs if p.poll() is not None]
        if dead:
            break
        state = cluster.run("sinfo", "-h", "-N", "-o", "%t", timeout=30).stdout.strip()
        if state == "idle":
            return
        time.sleep(0.5)
    logs = "\n".join(
        f"--- {f.name}\n{tail(f.read_text(errors='replace'), 1500)}"
        for f in sorted(root.glob("*.log")) + sorted(root.glob("*.out"))
    )
    pytest.fail(f"the Slurm node did not become idle (sinfo: {state!r}, exited: {dead})\n{logs}")


# ---------------------------------------------------------------------------------------------- namespaces


@dataclass(frozen=True)
class NetnsPair:
    """Two network namespaces joined by one veth link; `ifname` is the link's name inside both."""

    names: tuple[str, str]
    addrs: tuple[str, str] = ("10.77.0.1", "10.77.0.2")
    ifname: str = "ddpk0"

    def argv(self, node: int, *command: str) -> list[str]:
        """`command` on node 0 or 1: inside its namespace, with its address as the host name (own UTS namespace)."""
        set_host = f'hostname {self.addrs[node]} && exec "$@"'
        return [
            "ip",
            "netns",
            "exec",
            self.names[node],
            "unshare",
            "--uts",
            "sh",
            "-c",
            set_host,
            "sh",
            *command,
        ]

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """cli_env with gloo pinned to the veth link."""
        return cli_env({"GLOO_SOCKET_IFNAME": self.ifname, **(extra or {})})

    def ddpkit(self, node: int, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        """Start `python -m ddpkit ARGS` on a node."""
        argv = self.argv(node, PY, "-m", "ddpkit", *args)
        return subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=self.env(env)
        )


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


@pytest.fixture(scope="session")
def netns() -> Iterator[NetnsPair]:
    """Two namespaces (10.77.0.1 and 10.77.0.2 on a veth pair, lo up in each); deleted at the end."""
    ensure_installed("ip", ["iproute2"])
    if _which("unshare") is None:
        pytest.skip("`unshare` (util-linux) is missing: cannot give each namespace its own host name")
    tag = f"{os.getpid()}-{secrets.token_hex(2)}"
    pair = NetnsPair(names=(f"ddpkA-{tag}", f"ddpkB-{tag}"))
    made: list[str] = []
    try:
        for name in pair.names:
            proc = _ip("netns", "add", name)
            if proc.returncode != 0:
                pytest.skip(f"`ip netns add` is not permitted here: {proc.stderr.strip()}")
            made.append(name)
        a, b = pair.names
        proc = _ip(
            "link", "add", pair.ifname, "netns", a, "type", "veth", "peer", "name", pair.ifname, "netns", b
        )
        if proc.returncode != 0:
            pytest.skip(f"cannot create a veth pair here: {proc.stderr.strip()}")
        for name, addr in zip(pair.names, pair.addrs, strict=True):
            for step in (
                ["addr", "add", f"{addr}/24", "dev", pair.ifname],
                ["link", "set", pair.ifname, "up"],
                ["link", "set", "lo", "up"],
            ):
                proc = _ip("-n", name, *step)
                assert proc.returncode == 0, f"ip -n {name} {' '.join(step)}: {proc.stderr}"
        yield pair
    finally:
        for name in made:
            pids = _ip("netns", "pids", name).stdout.split()  # only our own processes live in our namespaces
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            _ip("netns", "del", name)


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
