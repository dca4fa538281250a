"""`ddpkit run`: a user's own torchrun-style script, unchanged, under ddpkit's launchers (real processes)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from conftest import REPO, assert_user_error, cli_env, plain_torchrun, run_cli

SCRIPTS = REPO / "tests" / "scripts"
ENV_PROBE = """\
import json, os, sys, time
keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")
sys.stdout.write(json.dumps({"argv": sys.argv[1:], **{k: os.environ.get(k) for k in keys}}) + "\\n")
sys.stdout.flush()
if os.environ.get("PROBE_DIR"):  # every rank has printed before one fails: the first failure ends the others
    open(os.path.join(os.environ["PROBE_DIR"], os.environ["RANK"]), "w").close()
    deadline = time.monotonic() + 60
    while len(os.listdir(os.environ["PROBE_DIR"])) < int(os.environ["WORLD_SIZE"]) and time.monotonic() < deadline:
        time.sleep(0.02)
sys.exit(int(os.environ.get("PROBE_EXIT", "0")))
"""


def probe(tmp_path: Path) -> Path:
    path = tmp_path / "probe.py"
    path.write_text(ENV_PROBE)
    return path


def records(stdout: str) -> list[dict]:

    return sorted(
        (json.loads(line) for line in stdout.splitlines() if line.startswith("{")), key=lambda r: r["RANK"]
    )


def test_one_process_gets_torchruns_variables_its_arguments_and_exit_code(tmp_path):
    proc = run_cli("run", str(probe(tmp_path)), "--lr", "0.1", "-m", "x", env={"PROBE_EXIT": "7"}, timeout=60)
    assert proc.returncode == 7, proc.stderr
    (rec,) = records(proc.stdout)
    assert rec["argv"] == ["--lr", "0.1", "-m", "x"]  # everything after the script is the script's
    assert (
        rec["RANK"],
        rec["LOCAL_RANK"],
        rec["WORLD_SIZE"],
        rec["LOCAL_WORLD_SIZE"],
        rec["GROUP_RANK"],
    ) == (
        "0",
        "0",
        "1",
        "1",
        "0",
    )
    assert rec["MASTER_ADDR"] and int(rec["MASTER_PORT"]) > 0


def test_module_form_runs_a_module_with_its_arguments(tmp_path):
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "train.py").write_text(ENV_PROBE)
    proc = run_cli("run", "-m", "mypkg.train", "a", "b", env={"PYTHONPATH": str(tmp_path)}, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert records(proc.stdout)[0]["argv"] == ["a", "b"]


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        ([], "needs a script"),
        (["missing.py"], "does not exist"),
        (["."], "is a folder"),
        (["--verbose", "x.py"], "unknown flag '--verbose'"),
        (["--nproc-per-node", "0", "x.py"], "--nproc-per-node must be at least 1"),
        (["--init-method", "tcp://127.0.0.1:1", "--rank", "0", "--world-size", "2", "x.py"], "--init-method"),
        (["-m"], "needs a module name"),
    ],
)
def test_bad_input_is_one_line_before_anything_starts(args, fragment):
    assert_user_error(run_cli("run", *args, timeout=60), fragment)


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["torchrun", "spawn"])
def test_workers_get_ranks_and_the_scripts_exit_code_passes_through(tmp_path, launcher):
    script = probe(tmp_path)
    (tmp_path / "printed").mkdir()
    proc = run_cli(
        "run",
        "--nproc-per-node",
        "2",
        "--launcher",
        launcher,
        str(script),
        "x",
        env={"PROBE_EXIT": "5", "PROBE_DIR": str(tmp_path / "printed")},
    )
    assert proc.returncode == 5, (proc.stdout, proc.stderr)
    recs = records(proc.stdout)
    assert [(r["RANK"], r["LOCAL_RANK"], r["WORLD_SIZE"]) for r in recs] == [("0", "0", "2"), ("1", "1", "2")]
    assert {r["MASTER_PORT"] for r in recs} == {recs[0]["MASTER_PORT"]} and recs[0]["argv"] == ["x"]


WORKER_PROBE = """\
import glob, json, multiprocessing, os, signal, sys, time
import torch
probe = os.path.join(os.environ["PROBE_DIR"], os.environ["RANK"])
with open(probe + ".tmp", "w") as fh:
    json.dump({"env": dict(os.environ), "argv": sys.argv, "name": __name__, "file": __file__,
               "main": sys.modules["__main__"].__file__, "path": sys.path,
               "start_method": multiprocessing.get_start_method(allow_none=True),
               "threads": torch.get_num_threads(), "cli": "ddpkit.cli" in sys.modules,
               "blocked": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
               "forked": b"forkserver" in open(f"/proc/{os.getppid()}/cmdline", "rb").read()}, fh)
os.replace(probe + ".tmp", probe + ".json")
# a rank that fails first makes the launcher end the others: every rank waits until each has written its probe
deadline = time.monotonic() + 120
while len(glob.glob(os.path.join(os.environ["PROBE_DIR"], "*.json"))) < int(os.environ["WORLD_SIZE"]):
    assert time.monotonic() < deadline, "the other ranks never wrote their probe"
    time.sleep(0.05)
sys.exit(4)
"""
PER_LAUNCH = {
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_ERROR_FILE",
    "DDPKIT_START_TIME",
    "DDPKIT_JOB_DIR",
}


@pytest.mark.slow
def test_a_script_worker_forked_warm_sees_what_one_started_as_a_program_sees(tmp_path):
    # `ddpkit run`'s workers are forks of a fork server that imported torch (launcher/warm_start.py); a
    # worker started as `python -u SCRIPT` (DDPKIT_WARM_START=0) is the reference: the same environment,
    # argv, __main__, sys.path, start method, threads, signal mask and exit status, and nothing of ddpkit's
    # command line imported that the script did not import.
    from concurrent.futures import ThreadPoolExecutor

    script = tmp_path / "sub" / "worker_probe.py"
    script.parent.mkdir()
    script.write_text(WORKER_PROBE)

    def launch(warm: str) -> tuple[subprocess.CompletedProcess, dict]:
        out = tmp_path / f"warm{warm}"
        out.mkdir()
        env = {"DDPKIT_WARM_START": warm, "PROBE_DIR": str(out)}
        proc = run_cli("run", "--nproc-per-node", "2", str(script), "a", "--b", env=env, cwd=tmp_path)
        return proc, {int(p.stem): json.loads(p.read_text()) for p in out.glob("*.json")}

    with ThreadPoolExecutor(max_workers=2) as pool:
        (cold_proc, cold), (warm_proc, warm) = pool.map(launch, ["0", "1"])
    assert cold_proc.returncode == warm_proc.returncode == 4, (
        cold_proc.stderr[-2000:],
        warm_proc.stderr[-2000:],
    )
    assert sorted(cold) == sorted(warm) == [0, 1]
    for rank in (0, 1):
        a, b = cold[rank], warm[rank]
        ignored = PER_LAUNCH | {"DDPKIT_WARM_START", "PROBE_DIR"}
        assert {k: v for k, v in a.pop("env").items() if k not in ignored} == {
            k: v for k, v in b.pop("env").items() if k not in ignored
        }
        assert (a.pop("forked"), b.pop("forked")) == (False, True)  # started as a program / forked warm
        assert a == b
        assert b["argv"] == [str(script), "a", "--b"] and b["name"] == "__main__" == b["name"]
        assert b["file"] == b["main"] == str(script) and b["path"][0] == str(script.parent)
        assert b["start_method"] is None and b["blocked"] == [] and not b["cli"]


FIRST_FAILS = """\
import os, sys, time
if os.environ["RANK"] != "0":
    time.sleep(120)  # still running when rank 0 fails: the launcher ends it
sys.exit(5)
"""


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["torchrun", "spawn"])
def test_the_first_failures_code_is_the_jobs_not_that_of_the_workers_the_launcher_ended(tmp_path, launcher):
    # Before: under spawn, rank 1 ended by the launcher's SIGTERM made the job exit 1 instead of rank 0's 5.
    script = tmp_path / "first_fails.py"
    script.write_text(FIRST_FAILS)
    proc = run_cli("run", "--nproc-per-node", "2", "--launcher", launcher, str(script), timeout=100)
    assert proc.returncode == 5, proc.stderr[-2000:]
    assert "rank 0 (exit code 5)" in proc.stderr, proc.stderr[-2000:]


RELEASE_PROBE = """\
import sys
class Probe:
    def __del__(self):
        print(f"released while finalizing: {sys.is_finalizing()}", flush=True)
def keep():  # a function's globals make a reference cycle: only a garbage collection frees them
    return probe
probe = Probe()
"""


@pytest.mark.parametrize(
    "flags",
    [
        [],
        pytest.param(["--nproc-per-node", "2"], marks=pytest.mark.slow),
        pytest.param(["--nproc-per-node", "2", "--launcher", "spawn"], marks=pytest.mark.slow),
    ],
    ids=["exec", "torchrun", "spawn"],
)
def test_the_scripts_objects_are_released_before_the_interpreter_finalizes(tmp_path, flags):
    # A DDP model still holding its gloo group, released during interpreter finalization, can abort a rank
    # that finished its work (SIGABRT, "terminate called without an active exception"): under `python SCRIPT`
    # the script's globals go only then. Before: "released while finalizing: True".
    script = tmp_path / "release.py"
    script.write_text(RELEASE_PROBE)
    proc = run_cli("run", *flags, str(script), timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("released")]
    assert lines == ["released while finalizing: False"] * (2 if flags else 1), proc.stdout


def test_a_scripts_traceback_and_path_are_those_of_python_script(tmp_path):
    script = tmp_path / "sub" / "boom.py"
    script.parent.mkdir()
    script.write_text(
        "import sys\nprint('path0', sys.path[0], flush=True)\n"
        "def inner():\n    raise ValueError('bad value in the script')\ninner()\n"
    )
    proc = run_cli("run", str(script), timeout=60, cwd=tmp_path)
    assert proc.returncode == 1
    assert (
        f"path0 {script.parent}" in proc.stdout
    )  # the script's folder, not the working folder, as python does
    frames = [line for line in proc.stderr.splitlines() if line.lstrip().startswith("File ")]
    assert frames and all(str(script) in f for f in frames), (
        proc.stderr
    )  # no launcher frames before the script's
    assert proc.stderr.rstrip().endswith("ValueError: bad value in the script")


def ddpkit_run(*args: str, cwd: Path, timeout: float = 300, ok: bool = True) -> subprocess.CompletedProcess:
    proc = run_cli("run", *args, timeout=timeout, cwd=cwd)
    if ok:
        assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-3000:])
    return proc


def weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)


def assert_same(a: Path, b: Path) -> None:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa), {k: (wa[k] - wb[k]).abs().max().item() for k in wa}


@pytest.fixture(scope="module")
def torchrun_reference(tmp_path_factory) -> Path:
    """torchrun_ddp.py under torch's own torchrun, 2 processes, 3 epochs: the weights every launcher must give."""
    work = tmp_path_factory.mktemp("torchrun")
    script = str(SCRIPTS / "torchrun_ddp.py")
    plain_torchrun("--nproc-per-node", "2", script, "--out", "w.pt", cwd=work, fresh=("w.pt", "snapshot.pt"))
    return work / "w.pt"


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["torchrun", "spawn"])
def test_torchrun_style_script_unchanged_gives_torchruns_weights(tmp_path, torchrun_reference, launcher):
    script = str(SCRIPTS / "torchrun_ddp.py")
    ddpkit_run("--nproc-per-node", "2", "--launcher", launcher, script, "--out", "w.pt", cwd=tmp_path)
    assert_same(tmp_path / "w.pt", torchrun_reference)


@pytest.mark.slow
def test_torchrun_style_script_resumes_from_its_own_snapshot(tmp_path, torchrun_reference):
    script = str(SCRIPTS / "torchrun_ddp.py")
    ddpkit_run("--nproc-per-node", "2", script, "--stop-after", "1", cwd=tmp_path)
    assert (tmp_path / "snapshot.pt").is_file()
    proc = ddpkit_run("--nproc-per-node", "2", script, "--out", "w.pt", cwd=tmp_path)
    assert "Resuming training from snapshot at Epoch 1" in proc.stdout
    assert_same(tmp_path / "w.pt", torchrun_reference)


@pytest.mark.slow
def test_mp_spawn_script_starts_its_own_workers_under_ddpkit_run(tmp_path, torchrun_reference):
    proc = ddpkit_run(str(SCRIPTS / "spawn_ddp.py"), "--out", "w.pt", cwd=tmp_path)
    assert "rank 0 of 2 saved" in proc.stdout
    assert_same(tmp_path / "w.pt", torchrun_reference)


def test_init_distributed_in_a_multiprocessing_child_without_a_launcher_is_refused(tmp_path):
    script = tmp_path / "spawned.py"
    script.write_text(
        textwrap.dedent(
            """\
            import sys
            import torch.multiprocessing as mp

            import ddpkit


            def worker(rank):
                try:
                    ddpkit.init_distributed()
                except ddpkit.UserError as e:
                    sys.stdout.write(f"refused: {e}\\n")
                    sys.stdout.flush()
                    return
                sys.stdout.write(f"world size {ddpkit.get_world_size()}\\n")


            if __name__ == "__main__":
                mp.spawn(worker, nprocs=1)
            """
        )
    )
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=cli_env()
    )
    assert proc.returncode == 0, proc.stderr
    assert (
        "refused:" in proc.stdout
        and "rank= and world_size=" in proc.stdout
        and "ddpkit.launch" in proc.stdout
    )


# The same script under torchrun, ddpkit run's warm workers and its workers started as programs
# (DDPKIT_WARM_START=0): what `python SCRIPT` gives a script is what each of them gives it.

AS_PYTHON = """\
import faulthandler, json, os, sys
import helper  # beside the script's real file, not beside the symlink it is reached through
rank = os.environ["RANK"]
record = {"argv0": sys.argv[0], "file": __file__, "path0": sys.path[0], "helper": helper.__file__,
          "stdin": sys.stdin.read() if rank == "0" else None, "faulthandler": faulthandler.is_enabled(),
          "forked": b"forkserver" in open(f"/proc/{os.getppid()}/cmdline", "rb").read(),
          "own_session": os.getsid(0) == os.getpid()}
with open(os.path.join(os.environ["PROBE_DIR"], rank + ".json"), "w") as fh:
    json.dump(record, fh)
"""
SETS_THREADS = """\
import json, os, sys
os.environ["OMP_NUM_THREADS"] = "2"  # before torch is imported: torch reads it as it loads
import torch
with open(os.path.join(os.environ["PROBE_DIR"], os.environ["RANK"] + ".json"), "w") as fh:
    json.dump({"threads": torch.get_num_threads(),
               "forked": b"forkserver" in open(f"/proc/{os.getppid()}/cmdline", "rb").read()}, fh)
"""
LAUNCHERS = {
    "torchrun": ([sys.executable, "-m", "torch.distributed.run", "--standalone"], {}),
    "warm": ([sys.executable, "-m", "ddpkit", "run"], {}),
    "cold": ([sys.executable, "-m", "ddpkit", "run"], {"DDPKIT_WARM_START": "0"}),
}


def under_each_launcher(tmp_path: Path, nproc: int, script: str) -> dict[str, dict[int, dict]]:
    """`LAUNCHER --nproc-per-node N SCRIPT` (typed relative to tmp_path, fed 'hello' on stdin) under each of
    LAUNCHERS, two at a time -> each launcher's records by rank."""
    from concurrent.futures import ThreadPoolExecutor

    def launch(name: str) -> dict[int, dict]:
        (tmp_path / name).mkdir()
        command, extra = LAUNCHERS[name]
        proc = subprocess.run(
            [*command, "--nproc-per-node", str(nproc), script],
            input="hello\n",
            capture_output=True,
            text=True,
            timeout=300,
            cwd=tmp_path,
            env=cli_env({"PROBE_DIR": str(tmp_path / name), **extra}),
        )
        assert proc.returncode == 0, (name, proc.stderr[-3000:])
        return {int(p.stem): json.loads(p.read_text()) for p in (tmp_path / name).glob("*.json")}

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(LAUNCHERS, pool.map(launch, LAUNCHERS), strict=True))


@pytest.mark.slow
def test_argv0_the_path_and_stdin_are_those_python_gives_under_torchrun_warm_and_cold(tmp_path):
    # Before: under ddpkit run sys.argv[0] was made absolute, sys.path[0] was the symlink's folder (the import
    # beside the real file failed: exit 1), a warm worker's stdin was /dev/null and faulthandler was enabled,
    # and the warm workers shared the launcher's session (one CPU share for all of them under load).
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "probe.py").write_text(AS_PYTHON)
    (tmp_path / "real" / "helper.py").write_text("")
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "link.py").symlink_to("../real/probe.py")
    runs = under_each_launcher(tmp_path, 2, "scripts/link.py")
    assert [r["forked"] for r in runs["warm"].values()] == [True, True]  # the warm workers are forks
    for name, records in runs.items():
        assert sorted(records) == [0, 1], name
        for rank, record in records.items():
            record.pop("forked")
            assert record == runs["torchrun"][rank], (name, rank)
    assert runs["warm"][0] == {
        "argv0": "scripts/link.py",
        "file": str(tmp_path / "scripts" / "link.py"),
        "path0": str(tmp_path / "real"),
        "helper": str(tmp_path / "real" / "helper.py"),
        "stdin": "hello\n",
        "faulthandler": False,
        "own_session": True,  # a session of its own, as torch's agent starts each worker
    }


@pytest.mark.slow
def test_a_script_that_sets_omp_num_threads_before_torch_gets_them_under_torchrun_warm_and_cold(tmp_path):
    # Before: 1 thread under ddpkit run's warm workers (torch was imported by the fork server), 2 under torchrun.
    (tmp_path / "threads.py").write_text(SETS_THREADS)
    runs = under_each_launcher(tmp_path, 1, "threads.py")
    assert {name: records[0]["threads"] for name, records in runs.items()} == dict.fromkeys(LAUNCHERS, 2)
    assert runs["warm"][0]["forked"] is False  # such a script's workers start as programs
