"""`ddpkit slurm` writes an editable sbatch script (and submits it); its batch logic (the time-limit trap, the
requeue) runs here for real, with stand-in `srun`/`scontrol` programs. Real Slurm jobs run in
tests/system/test_slurm.py; `ddpkit k8s` is tested in tests/commands/test_k8s.py.
"""

from __future__ import annotations

import re
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import JOB_TRAIN, assert_user_error, cli_in_process, run_cli
from ddpkit.config import load_config


def sbatch_word(text: str) -> str:
    """One #SBATCH argument as sbatch's directive parser reads it: quotes group, backslash escapes, '#' ends it."""
    out, quote, escaped = "", "", False
    for ch in text:
        if escaped:
            out, escaped = out + ch, False
        elif ch == "\\":
            escaped = True
        elif quote:
            quote, out = ("", out) if ch == quote else (quote, out + ch)
        elif ch in "\"'":
            quote = ch
        elif ch == "#" or ch.isspace():
            break
        else:
            out += ch
    return out


def directives(script: str) -> dict[str, str]:
    """`#SBATCH --key=value` lines -> {key: value as sbatch reads it} (flags without a value map to '')."""
    found = re.findall(r"^#SBATCH --([\w-]+)(?:=(.*))?$", script, re.M)
    return {key: sbatch_word(value) for key, value in found}


def config_of(script: str) -> Path:
    """The config file the script trains with."""
    return Path(shlex.split(re.search(r"^CONFIG=(.*)$", script, re.M)[1])[0])


# ------------------------------------------------------------------------------------------------ slurm


def test_slurm_script_has_the_job_shape_and_preemption_lines(tmp_path, capsys):
    out_dir = tmp_path / "runs" / "digits"
    flags = [
        "--nodes",
        "2",
        "--gpus-per-node",
        "4",
        "--cpus-per-task",
        "8",
        "--partition",
        "gpu",
        "--time",
        "1-02:00:00",
    ]
    proc = cli_in_process(
        capsys,
        "slurm",
        *JOB_TRAIN,
        f"out_dir={out_dir}",
        *flags,
        "--job-name",
        "digits",
        "--signal-before",
        "300",
    )
    assert proc.returncode == 0, proc.stderr
    script = out_dir / "slurm" / "digits.sbatch"
    text = script.read_text()
    assert text in proc.stdout  # printed so the user sees it
    d = directives(text)
    assert d["job-name"] == "digits" and d["nodes"] == "2" and d["ntasks-per-node"] == "4", d
    assert d["gres"] == "gpu:4" and d["cpus-per-task"] == "8" and d["partition"] == "gpu", d
    assert d["time"] == "1-02:00:00" and d["signal"] == "B:USR1@300" and "requeue" in d, d
    assert d["output"] == str(out_dir / "slurm" / "%x-%j.out") and d["error"] == str(
        out_dir / "slurm" / "%x-%j.err"
    ), d
    assert d["chdir"] == str(Path.cwd()), d
    assert re.search(r'^srun --kill-on-bad-exit=0 "\$PYTHON" -m ddpkit train -c "\$CONFIG" &$', text, re.M), (
        text
    )
    assert re.search(r"^trap on_usr1 USR1$", text, re.M), text
    assert text.startswith("#!/bin/bash\n") and script.stat().st_mode & 0o111


def test_slurm_script_passes_bash_syntax_check(tmp_path, capsys):
    assert (
        cli_in_process(
            capsys, "slurm", *JOB_TRAIN, f"out_dir={tmp_path / 'run'}", "--gpus-per-node", "2"
        ).returncode
        == 0
    )
    bash = shutil.which("bash")
    assert bash, "bash is needed to check the script"
    proc = subprocess.run(
        [bash, "-n", str(tmp_path / "run" / "slurm" / "ddpkit.sbatch")], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr


def test_slurm_config_next_to_the_script_loads_as_the_same_config(tmp_path, capsys):
    out_dir = tmp_path / "run"
    assert (
        cli_in_process(
            capsys, "slurm", *JOB_TRAIN, f"out_dir={out_dir}", "--script", str(tmp_path / "job.sh")
        ).returncode
        == 0
    )
    text = (tmp_path / "job.sh").read_text()
    path = config_of(text)
    assert path == tmp_path / "job.yaml"
    assert load_config(str(path)) == load_config(None, [*JOB_TRAIN, f"out_dir={out_dir}"])


def test_slurm_without_gpus_asks_for_no_gres_and_one_task_per_node(tmp_path, capsys):
    assert (
        cli_in_process(
            capsys, "slurm", f"out_dir={tmp_path / 'a'}", "--nodes", "3", "--gpus-per-node", "0"
        ).returncode
        == 0
    )
    d = directives((tmp_path / "a" / "slurm" / "ddpkit.sbatch").read_text())
    assert "gres" not in d and d["ntasks-per-node"] == "1" and d["nodes"] == "3", d
    assert (
        cli_in_process(
            capsys, "slurm", f"out_dir={tmp_path / 'b'}", "--gpus-per-node", "0", "--ntasks-per-node", "2"
        ).returncode
        == 0
    )
    assert directives((tmp_path / "b" / "slurm" / "ddpkit.sbatch").read_text())["ntasks-per-node"] == "2"


def test_slurm_output_flag_sets_both_logs(tmp_path, capsys):
    log = tmp_path / "logs" / "train-%j.out"
    assert (
        cli_in_process(capsys, "slurm", f"out_dir={tmp_path / 'run'}", "--output", str(log)).returncode == 0
    )
    d = directives((tmp_path / "run" / "slurm" / "ddpkit.sbatch").read_text())
    assert (d["output"], d["error"]) == (str(log), str(tmp_path / "logs" / "train-%j.err"))
    assert log.parent.is_dir()  # Slurm does not create the log folder itself


def fake_sbatch(folder: Path, body: str) -> Path:
    """An executable `sbatch` in `folder` that runs `body` (sh) after recording its arguments."""
    folder.mkdir()
    exe = folder / "sbatch"
    exe.write_text(f'#!/bin/sh\necho "$@" > "{folder}/args"\n{body}\n')
    exe.chmod(0o755)
    return folder


def test_slurm_submit_prints_the_job_id(tmp_path, capsys, monkeypatch):
    bin_dir = fake_sbatch(tmp_path / "bin", "echo '4242;cluster'")
    monkeypatch.setenv("PATH", str(bin_dir))
    proc = cli_in_process(capsys, "slurm", f"out_dir={tmp_path / 'run'}", "--submit")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "Submitted batch job 4242"
    assert (bin_dir / "args").read_text().split() == [
        "--parsable",
        str(tmp_path / "run" / "slurm" / "ddpkit.sbatch"),
    ]


def test_slurm_submit_errors_are_user_errors(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch at all
    assert_user_error(
        cli_in_process(capsys, "slurm", f"out_dir={tmp_path / 'a'}", "--submit"),
        "sbatch is not installed",
        "sbatch ",
    )
    refusing = fake_sbatch(
        tmp_path / "bin", "echo 'sbatch: error: invalid partition specified: gpu' >&2; exit 1"
    )
    monkeypatch.setenv("PATH", str(refusing))
    assert_user_error(
        cli_in_process(capsys, "slurm", f"out_dir={tmp_path / 'b'}", "--submit"),
        "invalid partition specified",
    )


@pytest.mark.parametrize(
    "flags, fragment",
    [
        (["--nodes", "0"], "--nodes must be at least 1"),
        (["--gpus-per-node", "-1"], "--gpus-per-node must be 0 or more"),
        (["--time", "2:00"], "--time '2:00' is not a time limit"),
        (["--time", "01:75:00"], "is not a time limit"),
        (["--gpus-per-node", "2", "--ntasks-per-node", "4"], "each rank needs a GPU"),
        (["--job-name", "my job"], "--job-name 'my job' is not a valid name"),
        (["--signal-before", "0"], "--signal-before must be"),
        (["--time", "00:02:00", "--signal-before", "120"], "--signal-before 120 is not shorter than --time"),
        (["--time", "00:01:00", "--signal-before", "300"], "(60 s)"),
        (["--cpus-per-task", "0"], "--cpus-per-task must be at least 1"),
        (["--nproc-per-node", "2"], "launch flags do not apply"),
        (["train.epoch=3"], "did you mean 'train.epochs'"),
    ],
)
def test_slurm_bad_values_exit_2_with_one_line_and_write_nothing(tmp_path, capsys, flags, fragment):
    out_dir = tmp_path / "run"
    assert_user_error(cli_in_process(capsys, "slurm", f"out_dir={out_dir}", *flags), fragment)
    assert not out_dir.exists()


def test_slurm_user_error_from_the_console_script(tmp_path):
    assert_user_error(run_cli("slurm", f"out_dir={tmp_path}", "--nodes", "0"), "--nodes must be at least 1")


@pytest.mark.parametrize("out_dir", ["q b", "it's", 'say "x"', "a#b", "back\\slash", "100%"])
def test_slurm_paths_are_quoted_as_sbatch_reads_them(tmp_path, capsys, out_dir):
    run = tmp_path / out_dir
    assert cli_in_process(capsys, "slurm", f"out_dir={run}", "--gpus-per-node", "0").returncode == 0
    text = (run / "slurm" / "ddpkit.sbatch").read_text()
    d = directives(text)
    log = str(run / "slurm").replace("%", "%%")  # sbatch expands %-patterns in log names
    assert (d["output"], d["error"]) == (f"{log}/%x-%j.out", f"{log}/%x-%j.err"), text
    assert d["chdir"] == str(Path.cwd())
    assert config_of(text) == run / "slurm" / "ddpkit.yaml"


def test_a_line_break_in_a_directive_is_refused_before_anything_is_written(tmp_path, capsys):
    run = tmp_path / "run"
    proc = cli_in_process(capsys, "slurm", f"out_dir={run}", "--output", str(tmp_path / "a\nb.out"))
    assert_user_error(proc, "holds a line break")
    assert not run.exists()


# --------------------------------------------------------------------- the batch script's logic, really run

FAKE_SRUN = """#!/bin/bash
# Stands in for srun and its ranks: runs until SIGUSR1, then checkpoints (unless told not to) and exits 3.
echo "srun $*" >> "$FAKE_LOG"
trap 'echo "srun got USR1" >> "$FAKE_LOG"; [ -n "$FAKE_NO_CKPT" ] || touch "$OUT/checkpoints/last.pt"; exit 3' USR1
[ -n "$FAKE_EXIT" ] && exit "$FAKE_EXIT"
echo started > "$FAKE_LOG.started"
for i in $(seq 300); do sleep 0.1; done
"""
FAKE_SCONTROL = """#!/bin/sh
echo "scontrol $*" >> "$FAKE_LOG"
"""


def batch(tmp_path: Path, capsys, **env: str) -> tuple[subprocess.Popen, Path]:
    """The script `ddpkit slurm` writes, run by bash with stand-in srun/scontrol; (the process, their log)."""
    run = tmp_path / "run"
    flags = ["--gpus-per-node", "0", "--signal-before", "90"]
    assert cli_in_process(capsys, "slurm", f"out_dir={run}", *flags).returncode == 0
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(0o755)
    (run / "checkpoints").mkdir(parents=True)
    log = tmp_path / "fake.log"
    full = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "FAKE_LOG": str(log),
        "OUT": str(run),
        "SLURM_JOB_ID": "77",
        **env,
    }
    script = run / "slurm" / "ddpkit.sbatch"
    proc = subprocess.Popen(
        ["bash", str(script)],
        env=full,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    return proc, log


def wait_started(log: Path, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 30
    while not Path(f"{log}.started").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)


@pytest.mark.parametrize("checkpoint", [True, False])
def test_the_time_limit_signal_reaches_the_ranks_and_the_job_is_requeued(tmp_path, capsys, checkpoint):
    env = {} if checkpoint else {"FAKE_NO_CKPT": "1", "SLURM_RESTART_COUNT": "2"}
    proc, log = batch(tmp_path, capsys, **env)
    wait_started(log, proc)
    proc.send_signal(signal.SIGUSR1)  # what --signal=B:USR1@90 sends to the batch shell
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 3, (out, err)
    calls = log.read_text().splitlines()
    assert calls[0].startswith("srun --kill-on-bad-exit=0 ") and "srun got USR1" in calls, calls
    assert calls[-1] == "scontrol requeue 77", calls
    if checkpoint:
        assert "requeue 1 of job 77 (the ranks exited 3 at the time-limit signal)" in err, err
        assert "the next run continues from its last checkpoint" in err, err
    else:
        assert "requeue 3 of job 77" in err, err
        assert "from the start (the signal came before the first checkpoint)" in err, err


@pytest.mark.parametrize("code", ["0", "1", "3"])
def test_without_the_signal_the_job_is_not_requeued_and_keeps_the_ranks_status(tmp_path, capsys, code):
    proc, log = batch(
        tmp_path, capsys, FAKE_EXIT=code
    )  # 3 without the time-limit signal: scancel, preemption
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == int(code), (out, err)
    assert not any(c.startswith("scontrol") for c in log.read_text().splitlines()), log.read_text()
