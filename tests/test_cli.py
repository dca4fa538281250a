"""The command line's edge (ddpkit.cli.main): every way a command ends becomes one line and an exit code."""

from __future__ import annotations

import shutil

import pytest

from ddpkit import cli
from ddpkit.diagnostics import stacks
from ddpkit.errors import CollectiveFailure, Preempted, TrainingFailure, UserError, WorkerFailure
from ddpkit.launcher.launch import _failure

PREEMPTED = "stopped by SIGTERM after epoch 2; rerun the same command to continue"


@pytest.mark.parametrize(
    ("error", "code", "stderr"),
    [
        (UserError("bad key", "fix it"), 2, "ddpkit: error: bad key (fix it)\n"),
        (
            TrainingFailure("non-finite loss on rank 1 by step 3"),
            1,
            "ddpkit: error: non-finite loss on rank 1 by step 3\n",
        ),
        (TrainingFailure("non-finite loss on rank 1 by step 3", report=False), 1, ""),  # another rank says it
        (
            WorkerFailure("worker rank 1 (exit code 7) failed"),
            1,
            "ddpkit: error: worker rank 1 (exit code 7) failed\n",
        ),
        (WorkerFailure("worker rank 0 (exit code 2) failed", exit_code=2, report=False), 2, ""),
        (Preempted(PREEMPTED), 3, f"ddpkit: {PREEMPTED}\n"),
        (Preempted(PREEMPTED, report=False), 3, ""),
        (KeyboardInterrupt(), 130, "ddpkit: interrupted\n"),
    ],
)
def test_each_ending_is_one_line_and_its_exit_code(monkeypatch, capsys, error, code, stderr):
    def fail(argv):
        raise error

    monkeypatch.setattr(cli, "run", fail)
    monkeypatch.setenv("RANK", "1")  # who prints is the raiser's decision, not the environment's
    with pytest.raises(SystemExit) as exit_:
        cli.main(["train"])
    assert exit_.value.code == code
    assert capsys.readouterr().err == stderr


def test_failed_workers_exit_1_and_are_named_unless_all_failed_on_a_user_error():
    err = _failure({1: 7, 0: 3}, 2)
    assert str(err) == "worker rank 0 (exit code 3), rank 1 (exit code 7) failed after 2 restart(s)"
    assert (err.exit_code, err.report) == (1, True)
    # a rank that died of a signal is the cause, named first (rank 5 was killed by SIGKILL), before the others
    assert (
        str(_failure({1: 7, 0: -9}, 2))
        == "rank 0 was killed by SIGKILL after 2 restart(s); then rank 1 (exit code 7)"
    )
    said_why = _failure({0: 2, 1: 2}, 0)  # each worker printed its own `ddpkit: error:` line already
    assert (said_why.exit_code, said_why.report) == (2, False)
    assert (_failure({0: 2, 1: 1}, 0).exit_code, _failure({0: 3, 1: 1}, 0).exit_code) == (1, 1)
    assert (_failure({0: 7, 1: 7}, 0).exit_code, _failure({0: -9, 1: -9}, 0).exit_code) == (7, 1)


def test_the_rank_that_died_is_named_before_the_ranks_that_gave_up_waiting_for_it():
    waited = {
        r: f"rank {r} gave up on a collective at step 8 (Connection reset by peer)" for r in (0, 1, 3, 4)
    }
    codes = {0: 1, 1: 1, 3: 1, 4: 1, 5: -9, 2: -15, 6: -15, 7: -15}
    err = _failure(codes, 0, ended_by_us=frozenset({2, 6, 7}), gave_up=waited)
    assert str(err) == (
        "rank 5 was killed by SIGKILL at step 8; then ranks 0, 1, 3, 4 (exit code 1), ranks 2, 6, 7 (killed by "
        "SIGTERM); the errors of the ranks that waited for it are in log.txt"
    )
    assert err.exit_code == 1
    # a rank that failed on its own while the others waited for it is named first too
    assert str(_failure({0: 1, 1: 1}, 0, gave_up={0: waited[0]})).startswith(
        "rank 1 failed (exit code 1) at step 8"
    )
    # no rank died: the first rank that gave up says which one stopped responding
    stalled = {0: "rank 0 gave up on a collective at step 8 (timed out); stopped responding: rank 1"}
    assert str(_failure({0: 1, 1: -15}, 0, ended_by_us=frozenset({1}), gave_up=stalled)) == stalled[0]


def test_the_line_of_a_rank_that_gave_up_is_said_by_its_launcher_with_one_prefix(monkeypatch, capsys):
    # On a node where no rank died (the peer it waited for is on another node), the launcher's one line is the
    # line its rank left: it printed "ddpkit: error: ddpkit: error: rank 0 gave up ..." (the prefix twice).
    gave_up = "rank 0 gave up on a collective at step 10 (timed out); stopped responding: rank 1 on nodeb"
    watch = stacks.Watch()
    try:
        monkeypatch.setitem(stacks._ARMED, "job", str(watch.job))
        monkeypatch.setitem(stacks._ARMED, "rank", 0)

        def worker(argv):
            raise CollectiveFailure(gave_up)

        monkeypatch.setattr(cli, "run", worker)
        with pytest.raises(SystemExit):
            cli.main(["train"])
        assert capsys.readouterr().err == ""  # the worker leaves its line to its launcher
        monkeypatch.delitem(stacks._ARMED, "job")
        watch.read_errors()
        ended = stacks.job_failure(_failure({0: 1}, 0, gave_up=watch.gave_up), watch)

        def launcher(argv):
            raise ended

        monkeypatch.setattr(cli, "run", launcher)
        with pytest.raises(SystemExit) as exit_:
            cli.main(["train"])
        assert exit_.value.code == 1
        assert capsys.readouterr().err == f"ddpkit: error: {gave_up}\n"
    finally:
        shutil.rmtree(watch.job, ignore_errors=True)


def test_a_command_that_succeeds_exits_0(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--help"])
    assert exit_.value.code == 0 and "ddpkit train --help-config" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("errno_", "path", "expected"),
    [
        (
            28,
            "PATH/checkpoints/last.pt",
            "ddpkit: error: no space left on device writing 'PATH/checkpoints/last.pt' (",
        ),
        (30, "PATH/metrics.jsonl", "ddpkit: error: 'PATH/metrics.jsonl' is on a read-only file system ("),
        (13, "PATH/log.txt", "ddpkit: error: permission denied: 'PATH/log.txt' (give this user write access"),
        (5, "PATH/data/x.png", "ddpkit: error: input/output error on 'PATH/data/x.png' (the disk"),
    ],
)
def test_an_os_error_is_one_line_naming_the_path_and_its_cause(
    monkeypatch, capsys, tmp_path, errno_, path, expected
):
    import os

    path = path.replace("PATH", str(tmp_path))

    def fail(argv):
        raise OSError(errno_, os.strerror(errno_), path)

    monkeypatch.setattr(cli, "run", fail)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["train"])
    err = capsys.readouterr().err
    assert exit_.value.code == 1 and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(expected.replace("PATH", str(tmp_path))), err
    if errno_ == 28:
        assert f"free on {tmp_path}" in err  # how much room the disk has left
