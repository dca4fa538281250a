"""`ddpkit slurm` writes an editable sbatch script (and submits it); `ddpkit k8s` prints a PyTorchJob manifest.

Both run in-process here (fast); one case goes through the real console entry point. Real Slurm jobs run in
tests/system/test_slurm.py.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from conftest import assert_user_error, run_cli
from ddpkit.cli import main
from ddpkit.config import load_config

TRAIN = ["train.epochs=3", "model.arch=mlp", "optim.ref_batch_size=null", "data.root=my data"]


def cli(capsys, *argv: str) -> subprocess.CompletedProcess:
    """`ddpkit ARGV` in this process -> exit code, stdout, stderr."""
    with pytest.raises(SystemExit) as exited:
        main(list(argv))
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(argv, exited.value.code, out, err)


def directives(script: str) -> dict[str, str]:
    """`#SBATCH --key=value` lines -> {key: value} (flags without a value map to '')."""
    found = re.findall(r"^#SBATCH --([\w-]+)(?:=(.*))?$", script, re.M)
    return {key: value for key, value in found}


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
    proc = cli(
        capsys,
        "slurm",
        *TRAIN,
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
    assert d["time"] == "1-02:00:00" and d["signal"] == "USR1@300" and "requeue" in d, d
    assert d["output"] == str(out_dir / "slurm" / "%x-%j.out") and d["error"] == str(
        out_dir / "slurm" / "%x-%j.err"
    ), d
    assert d["chdir"] == str(Path.cwd()), d
    assert re.search(r'^srun .*"\$PYTHON" -m ddpkit train -c "\$CONFIG"$', text, re.M), text
    assert text.startswith("#!/bin/bash\n") and script.stat().st_mode & 0o111


def test_slurm_script_passes_bash_syntax_check(tmp_path, capsys):
    assert cli(capsys, "slurm", *TRAIN, f"out_dir={tmp_path / 'run'}", "--gpus-per-node", "2").returncode == 0
    bash = shutil.which("bash")
    assert bash, "bash is needed to check the script"
    proc = subprocess.run(
        [bash, "-n", str(tmp_path / "run" / "slurm" / "ddpkit.sbatch")], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr


def test_slurm_config_next_to_the_script_loads_as_the_same_config(tmp_path, capsys):
    out_dir = tmp_path / "run"
    assert (
        cli(capsys, "slurm", *TRAIN, f"out_dir={out_dir}", "--script", str(tmp_path / "job.sh")).returncode
        == 0
    )
    text = (tmp_path / "job.sh").read_text()
    path = config_of(text)
    assert path == tmp_path / "job.yaml"
    assert load_config(str(path)) == load_config(None, [*TRAIN, f"out_dir={out_dir}"])


def test_slurm_without_gpus_asks_for_no_gres_and_one_task_per_node(tmp_path, capsys):
    assert (
        cli(capsys, "slurm", f"out_dir={tmp_path / 'a'}", "--nodes", "3", "--gpus-per-node", "0").returncode
        == 0
    )
    d = directives((tmp_path / "a" / "slurm" / "ddpkit.sbatch").read_text())
    assert "gres" not in d and d["ntasks-per-node"] == "1" and d["nodes"] == "3", d
    assert (
        cli(
            capsys, "slurm", f"out_dir={tmp_path / 'b'}", "--gpus-per-node", "0", "--ntasks-per-node", "2"
        ).returncode
        == 0
    )
    assert directives((tmp_path / "b" / "slurm" / "ddpkit.sbatch").read_text())["ntasks-per-node"] == "2"


def test_slurm_output_flag_sets_both_logs(tmp_path, capsys):
    log = tmp_path / "logs" / "train-%j.out"
    assert cli(capsys, "slurm", f"out_dir={tmp_path / 'run'}", "--output", str(log)).returncode == 0
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
    proc = cli(capsys, "slurm", f"out_dir={tmp_path / 'run'}", "--submit")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "Submitted batch job 4242"
    assert (bin_dir / "args").read_text().split() == [
        "--parsable",
        str(tmp_path / "run" / "slurm" / "ddpkit.sbatch"),
    ]


def test_slurm_submit_errors_are_user_errors(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch at all
    assert_user_error(
        cli(capsys, "slurm", f"out_dir={tmp_path / 'a'}", "--submit"), "sbatch is not installed", "sbatch "
    )
    refusing = fake_sbatch(
        tmp_path / "bin", "echo 'sbatch: error: invalid partition specified: gpu' >&2; exit 1"
    )
    monkeypatch.setenv("PATH", str(refusing))
    assert_user_error(
        cli(capsys, "slurm", f"out_dir={tmp_path / 'b'}", "--submit"), "invalid partition specified"
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
        (["--cpus-per-task", "0"], "--cpus-per-task must be at least 1"),
        (["--nproc-per-node", "2"], "launch flags do not apply"),
        (["train.epoch=3"], "did you mean 'train.epochs'"),
    ],
)
def test_slurm_bad_values_exit_2_with_one_line_and_write_nothing(tmp_path, capsys, flags, fragment):
    out_dir = tmp_path / "run"
    assert_user_error(cli(capsys, "slurm", f"out_dir={out_dir}", *flags), fragment)
    assert not out_dir.exists()


def test_slurm_user_error_from_the_console_script(tmp_path):
    assert_user_error(run_cli("slurm", f"out_dir={tmp_path}", "--nodes", "0"), "--nodes must be at least 1")


# ------------------------------------------------------------------------------------------------ k8s


def manifest(capsys, *flags: str) -> dict:
    proc = cli(capsys, "k8s", *TRAIN, "out_dir=runs/digits", *flags)
    assert proc.returncode == 0, proc.stderr
    return yaml.safe_load(proc.stdout)


def test_k8s_manifest_is_a_pytorchjob_with_master_and_workers(capsys):
    m = manifest(
        capsys, "--nodes", "3", "--gpus-per-node", "2", "--image", "reg.example/ddpkit:1", "--name", "digits"
    )
    assert (m["apiVersion"], m["kind"], m["metadata"]["name"]) == ("kubeflow.org/v1", "PyTorchJob", "digits")
    assert "elasticPolicy" not in m["spec"]
    specs = m["spec"]["pytorchReplicaSpecs"]
    assert set(specs) == {"Master", "Worker"}
    assert (specs["Master"]["replicas"], specs["Worker"]["replicas"]) == (1, 2)
    for spec in specs.values():
        assert spec["restartPolicy"] == "OnFailure"
        pod = spec["template"]["spec"]
        (container,) = pod["containers"]
        assert container["name"] == "pytorch" and container["image"] == "reg.example/ddpkit:1"
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 2
        mounts = {v["name"]: v["mountPath"] for v in container["volumeMounts"]}
        claims = {
            v["name"]: v["persistentVolumeClaim"]["claimName"]
            for v in pod["volumes"]
            if "persistentVolumeClaim" in v
        }
        assert claims == {"runs": "ddpkit-runs"} and mounts["runs"] == "/workspace/runs"
        assert container["workingDir"] == "/workspace"


def pod_argv(m: dict, role: str = "Master", **env: str) -> list[str]:
    """The argv `python -m ddpkit` gets in a pod, after the shell expands the operator's variables."""
    (container,) = m["spec"]["pytorchReplicaSpecs"][role]["template"]["spec"]["containers"]
    shell, dash_c, line = container["command"]
    assert (shell, dash_c) == ("/bin/sh", "-c") and line.startswith("exec python -m ddpkit train ")
    echo = line.replace("exec python -m ddpkit", "printf '%s\\n'", 1)
    proc = subprocess.run(
        ["sh", "-c", echo], capture_output=True, text=True, env={"PATH": "/usr/bin:/bin", **env}, check=True
    )
    return proc.stdout.splitlines()


def test_k8s_command_starts_g_workers_per_pod_from_the_operator_variables(capsys):
    m = manifest(capsys, "--nodes", "2", "--gpus-per-node", "4")
    argv = pod_argv(m, "Worker", RANK="1", WORLD_SIZE="2", MASTER_ADDR="digits-master-0", MASTER_PORT="23456")
    assert argv[0] == "train"
    joined = " ".join(argv)
    assert (
        "--nproc-per-node 4 --nnodes 2 --node-rank 1 --master-addr digits-master-0 --master-port 23456"
        in joined
    )
    overrides = [a for a in argv[1:] if "=" in a and not a.startswith("-")]
    assert load_config(None, overrides) == load_config(None, [*TRAIN, "out_dir=runs/digits"])


def test_k8s_single_cpu_pod_has_no_workers_and_no_gpu_limits(capsys):
    m = manifest(capsys, "--nodes", "1", "--gpus-per-node", "0", "--pvc", "my-claim")
    specs = m["spec"]["pytorchReplicaSpecs"]
    assert set(specs) == {"Master"}
    pod = specs["Master"]["template"]["spec"]
    assert "resources" not in pod["containers"][0]
    assert {v["name"]: v.get("persistentVolumeClaim") for v in pod["volumes"]}["runs"] == {
        "claimName": "my-claim"
    }
    assert "--nproc-per-node 1 --nnodes 1 --node-rank 0" in " ".join(
        pod_argv(m, RANK="0", MASTER_ADDR="x", MASTER_PORT="1")
    )


@pytest.mark.parametrize(
    "flags, fragment",
    [
        (["--nodes", "0"], "--nodes must be at least 1"),
        (["--gpus-per-node", "-2"], "--gpus-per-node must be 0 or more"),
        (["--name", "My_Job"], "--name 'My_Job' is not a valid name"),
        (["--pvc", "bad claim"], "--pvc 'bad claim' is not a valid name"),
        (["--image", "a b"], "is not an image reference"),
        (["--master-addr", "x", "--nnodes", "2"], "launch flags do not apply"),
    ],
)
def test_k8s_bad_values_exit_2_with_one_line(capsys, flags, fragment):
    assert_user_error(cli(capsys, "k8s", *flags), fragment)
