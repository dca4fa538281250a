"""Real Slurm jobs on the one-node cluster of the session fixture: srun info and train, two concurrent jobs, and
an sbatch script written by `ddpkit slurm`, submitted, waited for and checked."""

from __future__ import annotations

import re

import pytest

from ddpkit.distributed.env import expand_nodelist, parse_nodelist, slurm_port

from .helpers import PY, TRAIN, assert_trained, finish, ok, rank_lines, tail

pytestmark = pytest.mark.system

# Each task says which job step it belongs to, then becomes `python -m ddpkit ...`.
SAY_JOB = 'echo "job=$SLURM_JOB_ID.$SLURM_STEP_ID"; exec "$@"'


def job_steps(stdout: str) -> set[str]:
    """The JOB.STEP ids the tasks printed."""
    return set(re.findall(r"^job=(\S+)$", stdout, re.M))


def test_srun_info_two_tasks_one_job_port_from_job_id(slurm):
    out = ok(
        slurm.run(
            "srun",
            "-n",
            "2",
            "--export=ALL",
            "sh",
            "-c",
            SAY_JOB,
            "sh",
            PY,
            "-m",
            "ddpkit",
            "info",
            timeout=180,
        )
    )
    (step,) = job_steps(out)
    lines = rank_lines(out)
    assert [(int(x["rank"]), int(x["local_rank"]), int(x["world_size"])) for x in lines] == [
        (0, 0, 2),
        (1, 1, 2),
    ], out
    assert {x["launcher"] for x in lines} == {"slurm"}, out
    assert {x["master"] for x in lines} == {f"{slurm.node}:{slurm_port(step)}"}, out


def test_srun_train_two_tasks_trains_one_job(slurm, tmp_path):
    out_dir = tmp_path / "run"
    ok(
        slurm.run(
            "srun",
            "-n",
            "2",
            "--export=ALL",
            PY,
            "-m",
            "ddpkit",
            "train",
            *TRAIN,
            f"out_dir={out_dir}",
            timeout=300,
        )
    )
    assert_trained(out_dir, world_size=2)


def test_two_concurrent_two_task_jobs_on_one_node_use_different_ports(slurm, tmp_path):
    gate = tmp_path / "gate"
    gate.mkdir()
    # Every task waits until all 4 tasks of both jobs run, so the two rendezvous really happen at the same time.
    together = (
        f'touch "{gate}/$SLURM_JOB_ID.$SLURM_PROCID"; n=0; '
        f'while [ "$(ls "{gate}" | wc -l)" -lt 4 ] && [ $n -lt 600 ]; do sleep 0.1; n=$((n+1)); done; {SAY_JOB}'
    )
    argv = ["srun", "-n", "2", "--export=ALL", "sh", "-c", together, "sh", PY, "-m", "ddpkit", "info"]
    results = finish([slurm.popen(*argv), slurm.popen(*argv)], timeout=240)
    assert len(list(gate.iterdir())) == 4, "the two jobs did not run at the same time"
    masters = {}
    for proc in results:
        out = ok(proc)
        (step,) = job_steps(out)
        lines = rank_lines(out)
        assert [int(x["rank"]) for x in lines] == [0, 1], out
        assert {x["master"] for x in lines} == {f"{slurm.node}:{slurm_port(step)}"}, out
        masters[step] = lines[0]["master"]
    assert len(masters) == 2 and len(set(masters.values())) == 2, masters


def test_sbatch_script_written_by_ddpkit_slurm_runs_and_trains(slurm, tmp_path):
    out_dir = tmp_path / "run"
    flags = [
        "--nodes",
        "1",
        "--gpus-per-node",
        "0",
        "--ntasks-per-node",
        "2",
        "--time",
        "00:10:00",
        "--job-name",
        "sys",
    ]
    out = ok(
        slurm.run(PY, "-m", "ddpkit", "slurm", *TRAIN, f"out_dir={out_dir}", *flags, "--submit", cwd=tmp_path)
    )
    assert "#SBATCH --ntasks-per-node=2" in out, out
    job = re.search(r"^Submitted batch job (\d+)$", out, re.M)
    assert job, out
    state = slurm.wait_job(job[1])
    logs = {p.suffix: p.read_text(errors="replace") for p in (out_dir / "slurm").glob(f"sys-{job[1]}.*")}
    assert state == "COMPLETED", (state, {k: tail(v) for k, v in logs.items()})
    assert "final val_acc1" in logs[".out"] + logs.get(".err", ""), logs
    assert_trained(out_dir, world_size=2)


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [("node[01-03],gpu7", ["node01", "node02", "node03", "gpu7"]), ("n[1,3-4]", ["n1", "n3", "n4"])],
)
def test_scontrol_and_the_fallback_parser_agree(slurm, monkeypatch, nodelist, hosts):
    # With Slurm installed and configured: scontrol itself, ddpkit's path through it and the fallback parser agree.
    scontrol = slurm.run("scontrol", "show", "hostnames", nodelist)
    assert scontrol.stdout.split() == hosts, scontrol.stderr
    monkeypatch.setenv("SLURM_CONF", str(slurm.conf))
    assert expand_nodelist(nodelist) == hosts
    assert parse_nodelist(nodelist) == hosts
