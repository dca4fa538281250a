"""The agreements between ranks (ddpkit.train.stop): signals, timed checkpoints, non-finite losses."""

from __future__ import annotations

import math
import os
import signal
import time

import pytest
import torch

from conftest import run_group
from ddpkit.errors import Preempted, TrainingFailure
from ddpkit.train.stop import NonFiniteLoss, StopAgreement


def test_a_signal_stops_a_single_process_at_the_next_step_and_handlers_come_back():
    before = signal.getsignal(signal.SIGUSR1)
    with StopAgreement(world_size=1, is_main=True) as agreement:
        assert agreement.poll(1) == (False, False)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert agreement.poll(2).stop and agreement.stopped
        err = agreement.preempted("at step 2; checkpoint written", report=True)
    assert signal.getsignal(signal.SIGUSR1) is before
    assert isinstance(err, Preempted) and err.exit_code == 3 and err.report and err.signum == signal.SIGUSR1
    assert str(err).startswith("stopped by SIGUSR1 at step 2")


def test_every_steps_asks_for_a_checkpoint_on_its_multiples():
    agreement = StopAgreement(world_size=1, is_main=True, every_steps=3)
    assert [agreement.poll(s).checkpoint for s in range(1, 8)] == [
        False,
        False,
        True,
        False,
        False,
        True,
        False,
    ]


def _signal_on_rank_1(rank: int, world_size: int) -> list[tuple[int, bool, bool, str]]:
    out = []
    with StopAgreement(world_size, rank == 0, check_every=4) as agreement:
        for step in range(1, 9):
            if rank == 1 and step == 2:
                os.kill(os.getpid(), signal.SIGUSR1)  # only rank 1 is told to stop
            decision = agreement.poll(step)
            out.append((step, decision.stop, decision.checkpoint, agreement.signum))
            if decision.stop:
                break
        report = agreement.preempted(f"at step {step}", report=rank == 0)
    return [*out, (step, report.report, str(report))]


@pytest.mark.slow
def test_a_signal_on_one_rank_stops_every_rank_at_the_same_step():
    rank0, rank1 = run_group(_signal_on_rank_1, 2)
    # both ranks go on until the next agreement (step 4), then both stop there
    assert [d[1] for d in rank0[:-1]] == [False, False, False, True]
    assert [d[1] for d in rank1[:-1]] == [False, False, False, True]
    assert rank1[-2][3] == signal.SIGUSR1 and rank0[-2][3] == signal.SIGTERM  # a peer's stop reads as SIGTERM
    assert rank0[-1][:2] == (4, True) and rank1[-1][:2] == (4, False)  # one line for the job: rank 0's
    assert "stopped by SIGTERM at step 4" in rank0[-1][2]


def _signal_during_the_collective(rank: int, world_size: int) -> list[bool]:
    import ddpkit.train.stop as stop

    real = stop.all_reduce_sum

    def reduce_then_signal(t):  # rank 1's signal lands while its share is already on its way
        out = real(t)
        if rank == 1:
            os.kill(os.getpid(), signal.SIGINT)
        return out

    stop.all_reduce_sum = reduce_then_signal
    try:
        with StopAgreement(world_size, rank == 0, check_every=2) as agreement:
            return [agreement.poll(step).stop for step in (2, 4)] + [agreement.agreed]
    finally:
        stop.all_reduce_sum = real


@pytest.mark.slow
def test_a_signal_during_the_agreement_counts_at_the_next_one_on_every_rank():
    # before: rank 1 read its own flag after the all-reduce and stopped alone at step 2 (a hang for the rest)
    assert run_group(_signal_during_the_collective, 2) == [[False, True, True], [False, True, True]]


def test_after_an_agreed_stop_the_stop_signals_are_ignored_until_exit():
    before = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(Preempted), StopAgreement(world_size=1, is_main=True) as agreement:
            os.kill(os.getpid(), signal.SIGUSR1)
            assert agreement.poll(1).stop
            raise agreement.preempted("at step 1", report=False)
        # the launcher may SIGTERM a rank that is on its way to exit 3: it must not die of it
        assert all(
            signal.getsignal(s) == signal.SIG_IGN for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
        )
    finally:
        for s in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(s, before)
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _timed_checkpoints(rank: int, world_size: int) -> list[bool]:
    agreement = StopAgreement(world_size, rank == 0, every_minutes=0.2 / 60, check_every=2)
    time.sleep(0.3)  # past the interval on every rank's clock
    decisions = [agreement.poll(step).checkpoint for step in (1, 2)]
    agreement.checkpointed()
    decisions.append(agreement.poll(4).checkpoint)  # the clock started again
    return decisions


@pytest.mark.slow
def test_rank_0s_clock_decides_timed_checkpoints_for_every_rank():
    # step 1 is not an agreement step: nobody checkpoints, though rank 0's clock says so; at step 2 all do
    assert run_group(_timed_checkpoints, 2) == [[False, True, False], [False, True, False]]


def _nonfinite(rank: int, world_size: int, policy: str) -> list:
    guard = NonFiniteLoss(policy, torch.device("cpu"), is_main=rank == 0, warn=lambda line: None)
    out = []
    for step in (1, 2):
        guard.see(torch.tensor(1.0))
        if rank == 1 and step == 1:
            guard.see(torch.tensor(math.nan))  # rank 1's first micro-batch of step 1
        guard.see(torch.tensor(2.0))  # the last micro-batch is finite everywhere
        out.append(guard.skip_step(step))
    try:
        guard.check(step=7)
    except TrainingFailure as e:
        out.append((str(e), e.report, e.exit_code))
    return out


@pytest.mark.slow
def test_nonfinite_loss_on_one_rank_is_agreed_by_all():
    # skip: both ranks drop step 1 (any micro-batch counts, not only the last), and only step 1
    assert run_group(_nonfinite, 2, "skip") == [[True, False], [True, False]]
    # stop: both ranks fail, naming rank 1 and the step; only rank 0 prints it; exit code 1, not 2
    rank0, rank1 = run_group(_nonfinite, 2, "stop")
    assert rank0[:2] == [False, False] and rank0[2][0] == rank1[2][0]
    assert (
        rank0[2][0].startswith("non-finite loss on rank 1 by step 7")
        and "train.nonfinite=skip" in rank0[2][0]
    )
    assert (rank0[2][1:], rank1[2][1:]) == ((True, 1), (False, 1))
