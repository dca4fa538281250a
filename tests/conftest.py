"""The one module of shared test helpers: run the real CLI in a subprocess, run a function on N real gloo
processes, write data sets in their real formats, run the examples' docstring command lines."""

from __future__ import annotations

import argparse
import ast
import os
import pickle
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
# The suite runs 3 and 4 processes on a 2-core machine on purpose (odd world sizes, prime-sized shards);
# test_more_processes_than_cores_is_refused unsets it.
os.environ.setdefault("DDPKIT_OVERSUBSCRIBE", "1")


# Parallel test workers (pytest-xdist, `--dist loadgroup`): tests that must not overlap with one another (the
# system tests share one Slurm cluster and one pair of network namespaces; a `serial` test measures time or
# scans the machine) all go to one worker, in one group, one after another.
SERIAL_GROUP = "serial"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("system") or item.get_closest_marker("serial"):
            item.add_marker(pytest.mark.xdist_group(SERIAL_GROUP))


PORT_SLOTS = 12  # port ranges on this machine, one per test process running at once (any test run)


def _worker_ports() -> range:
    """This test process's own ports: apart from every other test process's on the machine (an xdist worker of
    this run or of another run beside it), and below the kernel's ephemeral range, from which bind(port 0) and
    every outgoing connection on the machine draw theirs. A range is a slot held by an flock for the
    process's life, so two processes at once can never hold the same one."""
    import fcntl

    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    span = min(400, (min(low, 15000) - 10000) // PORT_SLOTS)  # Slurm's derived ports (15000-34999) stay clear
    slots = Path(tempfile.gettempdir()) / "ddpkit-test-port-slots"
    slots.mkdir(exist_ok=True)
    for index in range(PORT_SLOTS):
        held = open(slots / f"{index}.lock", "a")  # noqa: SIM115  (kept open: the flock lives with the process)
        try:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            held.close()
            continue
        _SLOT.append(held)
        return range(10000 + index * span, 10000 + (index + 1) * span)
    raise RuntimeError(f"all {PORT_SLOTS} test port ranges are held by test processes running now ({slots})")


_SLOT: list = []
_PORTS: list[
    range
] = []  # this process's range, claimed at its first free_port() (a rank of a pool claims none)
_next_port = 0


def free_port() -> int:
    """A port for the code under test to listen on that no other test can be handed while this test runs: each
    test worker draws from its own range in turn (a test worker runs one test at a time), skipping any port
    that something still holds."""
    global _next_port
    if not _PORTS:
        _PORTS.append(_worker_ports())
    ports = _PORTS[0]
    for _ in range(len(ports)):
        port = ports[_next_port % len(ports)]
        _next_port += 1
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"every port of this test process's range {ports} is held")


def cli_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a ddpkit subprocess: no launcher variables leaking in from the test runner."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "OMPI_", "PMI_", "PMIX_", "TORCHELASTIC_"))
        and k
        not in (
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "LOCAL_WORLD_SIZE",
            "MASTER_ADDR",
            "MASTER_PORT",
            "GROUP_RANK",
        )
    }
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 300, cwd=None):
    """`python -m ddpkit ARGS` -> CompletedProcess (text)."""
    return subprocess.run(
        [sys.executable, "-m", "ddpkit", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=cli_env(env),
        cwd=cwd,
    )


def run_clis(*commands: list[str], timeout: float = 300, cwd=None) -> list[subprocess.CompletedProcess]:
    """Several independent one-process `python -m ddpkit ARGS` commands, two at a time (a process starting up
    keeps one core busy: a 2-core machine runs two in the time of one) -> their CompletedProcess, in order."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=2) as pool:
        return list(pool.map(lambda args: run_cli(*args, timeout=timeout, cwd=cwd), commands))


def plain_torchrun(*args: str, cwd: Path, fresh: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """`torchrun --standalone ARGS` (torch's own launcher, a reference for ddpkit's) in `cwd`; must succeed.

    Under plain torchrun a rank sometimes aborts at interpreter exit after a run that succeeded (gloo's threads
    during finalization: "terminate called without an active exception", SIGABRT), which fails the job. That
    is torch's behaviour, not the code under test (`ddpkit run` avoids it: see distributed/usermain.py), so
    such a run is made again from scratch, with the files in `fresh` removed first; any other failure fails.
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", *args]
    for _ in range(3):
        for name in fresh:
            (Path(cwd) / name).unlink(missing_ok=True)
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=cli_env(), cwd=cwd)
        if proc.returncode == 0 or "Signal 6 (SIGABRT)" not in proc.stderr:
            break
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-3000:])
    return proc


def assert_user_error(proc, *fragments: str) -> str:
    """Exit 2, exactly one `ddpkit: error:` line on stderr, no traceback; returns the line."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("ddpkit: error: ")]
    assert len(errors) == 1, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    for frag in fragments:
        assert frag in errors[0], (frag, errors[0])
    return errors[0]


def _join_group(rank: int, world_size: int, init_file: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)


def _group_entry(rank: int, world_size: int, init_file: str, fn, args, results) -> None:
    import torch.distributed as dist

    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        _join_group(rank, world_size, init_file)
        results.put((rank, "ok", fn(rank, world_size, *args)))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _die_with_parent() -> None:
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _pool_rank(rank: int, world_size: int, tasks, results) -> None:
    """One rank of a RankPool: torch imported once, then each task in a fresh gloo group and a reset process."""
    _die_with_parent()
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    seed, signals = torch.initial_seed(), {s: signal.getsignal(s) for s in _RESET_SIGNALS}
    while (task := tasks.get()) is not None:
        init_file, fn, args = task
        if init_file is None:  # a ping: is this rank free for the next test?
            results.put((rank, "ok", fn(*args)))
            continue
        environ, cwd, argv = dict(os.environ), os.getcwd(), list(sys.argv)
        torch.manual_seed(seed)  # the default generator as a fresh process has it
        try:
            _join_group(rank, world_size, init_file)
            results.put((rank, "ok", fn(rank, world_size, *args)))
        except BaseException:
            results.put((rank, "error", traceback.format_exc()))
        finally:  # what a test may have changed in this process, undone before the next one
            runtime = sys.modules.get("ddpkit.distributed.runtime")
            if runtime is not None:
                runtime.shutdown()
            if dist.is_initialized():
                dist.destroy_process_group()
            os.environ.clear()
            os.environ.update(environ)
            os.chdir(cwd)
            sys.argv[:] = argv
            torch.use_deterministic_algorithms(False)
            torch.set_num_threads(1)
            for sig, handler in signals.items():
                signal.signal(sig, handler)


_RESET_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)


class RankPool:
    """`world_size` processes started once per test worker, each with torch imported, that run one test's
    function after another, each time in a fresh gloo group (as torch's MultiProcContinuousTest keeps its
    ranks): a test pays for joining a group, not for starting processes and importing torch. After each
    function a rank leaves the group and undoes what a test may change in its process (environment, working
    folder, argv, signal handlers, the default random generator, deterministic mode); a pool in which any
    rank failed or stalled is ended, and the next test starts a new one."""

    def __init__(self, world_size: int):
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.last = "nothing"
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        self.results = ctx.Queue()
        self.procs = [
            ctx.Process(target=_pool_rank, args=(r, world_size, self.tasks[r], self.results), daemon=False)
            for r in range(world_size)
        ]
        for p in self.procs:
            p.start()

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def ready(self, timeout: float = 10.0) -> bool:
        """Every rank alive and answering: none is still caught in what an earlier test left. A new pool starts
        in about 6 s, so a rank silent for `timeout` s is not waited for longer."""
        if not self.alive():
            return False
        for q in self.tasks:
            q.put((None, os.getpid, ()))
        try:
            _collect_ranks(self.results, self.world_size, timeout, self.alive)
        except AssertionError:
            return False
        return True

    def run(self, fn, args: tuple, timeout: float) -> list:
        self.last = f"{fn.__module__}.{fn.__qualname__}"
        with tempfile.TemporaryDirectory() as tmp:
            for q in self.tasks:
                q.put((os.path.join(tmp, "rdzv"), fn, args))
            return _collect_ranks(self.results, self.world_size, timeout, self.alive)

    def close(self) -> None:
        for q in self.tasks:
            q.put(None)
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()


_POOLS: dict[int, RankPool] = {}


def _pool(world_size: int) -> RankPool:
    pool = _POOLS.get(world_size)
    if pool is None or not pool.ready():
        if pool is not None:
            # A rank still busy with what the last function left (a thread, a collective): the next test pays
            # the whole wait. Named, so that the function can be fixed.
            warnings.warn(
                f"the {world_size}-rank pool was not free after {pool.last}: started again", stacklevel=2
            )
            pool.close()
        pool = _POOLS[world_size] = RankPool(world_size)
    return pool


@pytest.fixture(scope="session", autouse=True)
def _close_rank_pools():
    yield
    while _POOLS:
        _POOLS.popitem()[1].close()


def _collect_ranks(results, world_size: int, timeout: float, alive=lambda: True) -> list:
    """Every rank's (status, value) from the results queue, in rank order; AssertionError naming the first
    rank that failed, or what it waited for when the ranks went silent for `timeout` s."""
    import queue as queue_module

    out: dict[int, object] = {}
    deadline = time.monotonic() + timeout
    while len(out) < world_size:
        try:
            rank, status, value = results.get(timeout=1.0)
        except queue_module.Empty:
            if time.monotonic() > deadline or not alive():
                missing = sorted(set(range(world_size)) - set(out))
                why = f"silent for {timeout:.0f} s" if alive() else "a rank died"
                raise AssertionError(f"ranks {missing} gave no result ({why})") from None
            continue
        if status == "error":
            raise AssertionError(f"rank {rank} failed:\n{value}")
        out[rank] = value
        deadline = time.monotonic() + timeout
    return [out[r] for r in range(world_size)]


def run_group(fn, world_size: int, *args, timeout: float = 120, fresh: bool = False):
    """Run fn(rank, world_size, *args) on `world_size` real processes joined in a gloo group; results by rank.

    fn must be importable (defined at module level); its return value must pickle. The processes are this
    test worker's RankPool of that size (started once, reused by every test); `fresh=True` starts new ones
    for this call alone (a test of what a new process does).
    """
    if not fresh:
        pool = _pool(world_size)
        try:
            return pool.run(fn, args, timeout)
        except BaseException:
            _POOLS.pop(world_size, None)  # a rank failed or stalled: the next test gets new processes
            pool.close()
            raise
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rdzv")
        procs = [
            ctx.Process(target=_group_entry, args=(r, world_size, init_file, fn, args, results))
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        try:
            return _collect_ranks(results, world_size, timeout)
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()


@pytest.fixture
def tmp_run(tmp_path):
    """A fresh out_dir path (not created)."""
    return tmp_path / "run"


# ------------------------------------------------------------------------ helpers shared by several test modules
# (a test module imports helpers from here, never from another test module)

EXAMPLES = REPO / "examples"
EXAMPLE_TIMEOUT = 300


# On-disk data sets in their real formats.


def _cifar_rows(n: int, offset: int) -> np.ndarray:
    """n images, image i constant per channel: R = 10*(i+offset) % 256, G = R + 1, B = R + 2."""
    rows = np.empty((n, 3072), dtype=np.uint8)
    for i in range(n):
        r = (10 * (i + offset)) % 250
        rows[i, :1024], rows[i, 1024:2048], rows[i, 2048:] = r, r + 1, r + 2
    return rows


def write_cifar10(root, per_batch: int = 4, test: int = 6) -> None:
    d = root / "cifar-10-batches-py"
    d.mkdir(parents=True)
    for b in range(1, 6):
        off = (b - 1) * per_batch
        entry = {"data": _cifar_rows(per_batch, off), "labels": [(off + i) % 10 for i in range(per_batch)]}
        (d / f"data_batch_{b}").write_bytes(pickle.dumps(entry))
    (d / "test_batch").write_bytes(pickle.dumps({"data": _cifar_rows(test, 0), "labels": list(range(test))}))
    names = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
    (d / "batches.meta").write_bytes(pickle.dumps({"label_names": names, "num_cases_per_batch": per_batch}))


def write_cifar100(root, train: int = 12, test: int = 5) -> None:
    d = root / "cifar-100-python"
    d.mkdir(parents=True)
    for name, n in (("train", train), ("test", test)):
        labels = [(7 * i) % 100 for i in range(n)]
        entry = {"data": _cifar_rows(n, 0), "fine_labels": labels, "coarse_labels": [y // 5 for y in labels]}
        (d / name).write_bytes(pickle.dumps(entry))
    meta = {
        "fine_label_names": [f"c{i}" for i in range(100)],
        "coarse_label_names": [f"s{i}" for i in range(20)],
    }
    (d / "meta").write_bytes(pickle.dumps(meta))


def write_imagefolder(root, classes=("ant", "bee", "cat"), per_class: int = 3, val_classes=None) -> None:
    """root/train/CLASS/i.png and root/val/CLASS/i.png, 20x24 RGB, each image its own colour."""
    from PIL import Image

    for split, names in (("train", classes), ("val", val_classes or classes)):
        for c, name in enumerate(names):
            d = root / split / name
            d.mkdir(parents=True)
            for i in range(per_class):
                Image.new("RGB", (20, 24), (40 * c, 10 * i, 200)).save(d / f"{i}.png")


def data_cfg(dataset: str = "digits", root=None, **data):
    """The default Config with data.dataset, data.root and other data.* keys set."""
    from ddpkit.config import Config

    cfg = Config()
    cfg.data.dataset = dataset
    if root is not None:
        cfg.data.root = str(root)
    for k, v in data.items():
        setattr(cfg.data, k, v)
    return cfg


# The Trainer in-process (run_group).


def dist_context(rank: int, world_size: int):
    """The DistContext of one process of a run_group (gloo on the CPU)."""
    import torch

    from ddpkit.cluster.env import DistEnv
    from ddpkit.distributed.runtime import DistContext

    launcher = "manual" if world_size > 1 else "none"
    env = DistEnv(
        rank=rank, local_rank=rank, world_size=world_size, local_world_size=world_size, launcher=launcher
    )
    return DistContext(env, "gloo", torch.device("cpu"))


def train_here(*overrides: str) -> None:
    """`ddpkit train OVERRIDES` on one process, in this one: the Trainer that the command runs, with no process
    to start (a reference run, or the runs a test reads), on one thread as the command's processes (cli_env)."""
    import torch

    from ddpkit.config import load_config
    from ddpkit.train.trainer import Trainer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        Trainer(load_config(None, list(overrides)), dist_context(0, 1)).fit()
    finally:
        torch.set_num_threads(threads)


def plain(state: dict) -> dict:
    """A state dict as numpy arrays: what a run_group process can hand back (tensors go through shared memory)."""
    return {k: v.detach().cpu().numpy() for k, v in state.items()}


# `ddpkit slurm` / `ddpkit k8s` in this process.

JOB_TRAIN = ["train.epochs=3", "model.arch=mlp", "optim.ref_batch_size=null", "data.root=my data"]


def cli_in_process(capsys, *argv: str) -> subprocess.CompletedProcess:
    """`ddpkit ARGV` in this process -> exit code, stdout, stderr."""
    from ddpkit.cli import main

    with pytest.raises(SystemExit) as exited:
        main(list(argv))
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(argv, exited.value.code, out, err)


# A `ddpkit train` run as a separate program.


def start(out_dir, *args, env=None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "ddpkit", "train", f"out_dir={out_dir}", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=cli_env(env),
        start_new_session=True,
    )


def finish(proc: subprocess.Popen, timeout: float = 300) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"run hung:\n{err[-3000:]}") from None
    return proc.returncode, out, err


def within(seconds: float, predicate) -> bool:
    """Whether predicate() comes true within `seconds` (polled): a test waits on the event, never for a fixed
    time that a busy machine may not be enough for or that a quiet one wastes."""
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def wait_for(predicate, timeout: float = 120, proc: subprocess.Popen | None = None) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"run ended early (rc {proc.returncode}): {proc.stderr.read()[-3000:]}")
        time.sleep(0.05)
    raise AssertionError("condition not reached in time")


# The command lines of the examples' docstrings.


STARTS = re.compile(r"^(?:[A-Z_]+=\S+ )*(?:python|torchrun|srun) ")


@dataclass(frozen=True)
class DocCommand:
    """One command line of an example's docstring (continuation lines joined), its comment apart."""

    script: str
    text: str
    comment: str

    @property
    def mark(self) -> str | None:
        """What the line needs that this machine lacks (`# ... needs GPUs, CIFAR-10`), or None."""
        m = re.search(r"\bneeds (.+)$", self.comment)
        return m.group(1) if m else None

    def split(self, replace: dict[str, str] | None = None) -> tuple[dict[str, str], str, list[str]]:
        """(VAR=value assignments, program, its arguments), after replacing each `old` (which must occur)."""
        text = self.text
        for old, new in (replace or {}).items():
            assert old in text, (old, text)
            text = text.replace(old, new)
        words = shlex.split(text)
        env = {}
        while re.fullmatch(r"[A-Z_]+=\S+", words[0]):
            key, value = words.pop(0).split("=", 1)
            env[key] = value
        return env, words[0], words[1:]

    def example_args(self) -> list[str]:
        """The arguments the example itself gets (after its path)."""
        _, prog, words = self.split()
        if prog == "torchrun":
            return torchrun_args(words).training_script_args
        at = next(i for i, w in enumerate(words) if w.endswith(".py"))
        return words[at + 1 :]

    def argv(self, *extra: str, replace: dict[str, str] | None = None) -> tuple[list[str], dict[str, str]]:
        """(argv, env) of the line as this machine runs it (torchrun: --standalone, a free port) + `extra`."""
        env, prog, words = self.split(replace)
        assert prog in ("python", "torchrun"), self.text
        launcher = ["-m", "torch.distributed.run", "--standalone"] if prog == "torchrun" else []
        return [sys.executable, *launcher, *words, *extra], env


def doc_commands(script: str) -> list[DocCommand]:
    """The command lines of examples/SCRIPT's docstring, read without importing it."""
    doc = ast.get_docstring(ast.parse((EXAMPLES / script).read_text()), clean=False)
    assert doc, f"{script} has no docstring"
    commands, pending = [], ""
    for line in doc.splitlines():
        if not pending and not (line.startswith("    ") and STARTS.match(line.strip())):
            assert "examples/" not in line, f"{script}: a command this test does not recognise: {line!r}"
            continue
        code, _, comment = line.partition(" # ")
        code = code.strip()
        if code.endswith("\\"):
            assert not comment, f"{script}: a comment inside a continued line: {line!r}"
            pending += code[:-1].strip() + " "
            continue
        commands.append(DocCommand(script, pending + code, comment.strip()))
        pending = ""
    assert commands, f"{script}'s docstring shows no command line"
    return commands


def torchrun_args(words: list[str]) -> argparse.Namespace:
    """torchrun's own parser on WORDS (it exits on a flag torchrun does not know)."""
    from torch.distributed.run import get_args_parser

    return get_args_parser().parse_args(words)


RUN_BY: dict[tuple[str, str], str] = {}  # (script, command) -> the test that runs it


def runs_doc(script: str, *selectors: str, together: bool = False):
    """Mark a test as the one that runs these command lines of SCRIPT's docstring (each selector: the whole
    command, or a unique part of the line); the test gets them as `doc`, one per case or all at once."""
    commands = doc_commands(script)
    chosen = []
    for sel in selectors:
        hits = [c for c in commands if c.text == sel] or [
            c for c in commands if sel in f"{c.text}  # {c.comment}"
        ]
        assert len(hits) == 1, f"{script}: {sel!r} picks {len(hits)} command lines"
        chosen.append(hits[0])

    def decorate(fn):
        for c in chosen:
            RUN_BY[(script, c.text)] = fn.__name__
        params = [tuple(chosen)] if together else chosen
        return pytest.mark.parametrize("doc", params, ids=lambda p: script)(fn)

    return decorate


def check_ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, (proc.returncode, proc.stdout[-3000:], proc.stderr[-3000:])
    return proc.stdout


def run_doc(doc: DocCommand, *extra: str, replace: dict[str, str] | None = None) -> str:
    """Run one docstring command line (+ `extra`) in the repository; its stdout (it must exit 0)."""
    argv, env = doc.argv(*extra, replace=replace)
    proc = subprocess.run(
        argv, capture_output=True, text=True, timeout=EXAMPLE_TIMEOUT, env=cli_env(env), cwd=REPO
    )
    return check_ok(proc)


# The built-in transformer on a small text, trained by `ddpkit train`: sgd at a constant lr 0.5, no dropout, 8
# samples per optimizer step. The weights after N steps are a function of the global batch only, so every layout
# and world size (tests/parallel, tests/checkpoint) must reach those of one process; that single-process run is
# made once per session (gpt_reference) and shared.

GPT_TEXT = "".join(f"def f{i}(x):\n    return x * {i} + {i * i}  # {chr(65 + i % 26)}\n" for i in range(80))
GPT_GLOBAL_BATCH = 8
GPT_RUN = [
    "model.arch=gpt",
    "model.n_layer=2",
    "model.n_head=4",
    "model.n_embd=32",
    "model.dropout=0",
    "data.dataset=text",
    "data.block_size=16",
    "optim.name=sgd",
    "optim.lr=0.5",
    "optim.ref_batch_size=8",  # lr 0.5 as it is: 6 steps move the weights well beyond the tolerances
    "optim.schedule=constant",
    "optim.warmup_epochs=0",
    "train.epochs=1",
    "train.log_every=1",
    "report.curves=false",
]


@pytest.fixture(scope="session")
def gpt_text(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gpt_text") / "corpus.txt"
    path.write_text(GPT_TEXT)
    return path


def gpt_train(
    out: Path, text: Path, nproc: int, *args: str, dp: int | None = None
) -> subprocess.CompletedProcess:
    """`ddpkit train` of GPT_RUN on `nproc` processes, `dp` of them data-parallel replicas (default: all)."""
    launch = ["--nproc-per-node", str(nproc)] if nproc > 1 else []
    batch = f"train.batch_size={GPT_GLOBAL_BATCH // (dp or nproc)}"
    proc = run_cli(
        "train", f"out_dir={out}", f"data.root={text}", *GPT_RUN, batch, *args, *launch, timeout=600
    )
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    return proc


def metrics_rows(out: Path) -> list[dict]:
    import json

    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


@pytest.fixture(scope="session")
def gpt_reference(tmp_path_factory, gpt_text) -> tuple[dict, list[dict]]:
    """One process, 6 optimizer steps, nothing interrupted: (the full weights of last.pt, the metrics rows)."""
    from ddpkit.checkpoint import load_checkpoint

    out = tmp_path_factory.mktemp("gpt_reference") / "run"
    gpt_train(out, gpt_text, 1, "train.max_steps=6")
    return load_checkpoint(out / "checkpoints" / "last.pt", map_location="cpu")["model"], metrics_rows(out)


# A finished 2-epoch run of the digits MLP: the earlier run in out_dir of the tests on resuming, refusing and
# moving runs aside and on damaged checkpoints (tests/train/test_rundir.py, tests/test_hostile_inputs.py,
# tests/test_reliability.py). Made once per session; every test copies it and changes only its copy.

QUICK_MLP = ["model.arch=mlp", "data.augment=false", "report.curves=false"]


@pytest.fixture(scope="session")
def finished_mlp(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("finished_mlp") / "run"
    proc = run_cli("train", f"out_dir={out}", *QUICK_MLP, "train.epochs=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out
