"""What the ranks agree on before they stop: a preemption signal, a timed checkpoint, a non-finite loss.

Every rank must take the same decision at the same optimizer step, or the next collective hangs: a signal
that reaches one rank, a clock that says "checkpoint now" on one rank, a loss that turns NaN on one rank all
become the same answer everywhere through one small collective.
"""

from __future__ import annotations

import signal
import time
from typing import Any, NamedTuple

import torch

from ddpkit.distributed.collectives import all_reduce_sum, get_rank, get_world_size
from ddpkit.errors import Preempted, TrainingFailure

# How often (optimizer steps) the ranks compare notes on signals and the clock: one 2-element all-reduce. The
# trainer compares them at its log points instead (check_every=0, poll(force=True) there): between two log points
# a step then starts no collective of its own and waits for nothing on the host.
STOP_CHECK_EVERY = 10
SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class Decision(NamedTuple):
    """What every rank does after this optimizer step."""

    stop: bool  # stop now (a signal reached some rank)
    checkpoint: (
        bool  # checkpoint now (checkpoint.every_steps, or rank 0's clock for checkpoint.every_minutes)
    )


class StopAgreement:
    """SIGTERM/SIGUSR1/SIGINT set a flag; the ranks agree on "stop now" and "checkpoint now" every few steps.

    A context manager: the signal handlers are installed inside `with`, the previous ones restored after it,
    unless it ends with the agreed stop (Preempted): the process is then on its way to exit 3 and ignores
    those signals, so that a launcher that sees a first rank exit 3 and SIGTERMs the others (torch's agent
    does) cannot turn their exit 3 into "killed by SIGTERM".
    """

    def __init__(
        self,
        world_size: int,
        is_main: bool,
        every_steps: int = 0,
        every_minutes: float = 0.0,
        check_every: int = STOP_CHECK_EVERY,
    ):
        self.world_size, self.is_main = world_size, is_main
        self.every_steps, self.every_s, self.check_every = every_steps, every_minutes * 60, check_every
        self.signum = 0  # the signal that stopped us (a peer's stop reads as SIGTERM)
        self.agreed = False  # a poll decided "stop now" (on every rank alike; `stopped` is this rank's flag)
        self._last_save = time.monotonic()
        self._old: dict[int, Any] = {}

    def __enter__(self) -> StopAgreement:
        for sig in SIGNALS:
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: signals cannot reach us here
                pass
        return self

    def _handle(self, signum, frame) -> None:
        self.signum = signum

    def __exit__(self, exc_type, *exc) -> None:
        stopping = exc_type is not None and issubclass(exc_type, Preempted)
        for sig, old in self._old.items():
            signal.signal(sig, signal.SIG_IGN if stopping else old)
        self._old.clear()

    @property
    def stopped(self) -> bool:
        return bool(self.signum)

    def checkpointed(self) -> None:
        """A checkpoint was just written: the clock for checkpoint.every_minutes starts again."""
        self._last_save = time.monotonic()

    def poll(self, step: int, force: bool = False) -> Decision:
        """The decision after optimizer step `step`, the same on every rank (collective every check_every
        steps (never with check_every=0), or now when `force`; a single process decides alone every step)."""
        due = bool(self.every_s) and self.is_main and time.monotonic() - self._last_save >= self.every_s
        periodic = bool(self.every_steps) and step % self.every_steps == 0
        stop = self.stopped  # read once: a signal that comes during the collective counts at the next check
        if self.world_size > 1:
            if not force and (not self.check_every or step % self.check_every):
                return Decision(False, periodic)
            stop_any, due_any = all_reduce_sum(torch.tensor([float(stop), float(due)], dtype=torch.float64))
            stop, due = bool(stop_any), bool(due_any)
            if stop and not self.signum:
                self.signum = signal.SIGTERM
        self.agreed = self.agreed or stop
        return Decision(stop, periodic or due)

    def preempted(self, where: str, report: bool) -> Preempted:
        """`stopped by SIGNAL {where}`: the exception that ends a stopped run (`report`: this process prints it)."""
        name = signal.Signals(self.signum).name
        return Preempted(f"stopped by {name} {where}", signum=self.signum, report=report)


class NonFiniteLoss:
    """train.nonfinite: `stop` ends every rank with a line naming the rank(s) and step; `skip` drops the
    optimizer step on every rank when any rank saw a non-finite loss in it.

    Losses are watched on the device (no host sync per micro-batch); `stop` compares notes when asked to check.
    """

    def __init__(self, policy: str, device: torch.device, is_main: bool, warn=print):
        self.policy, self.is_main, self.warn = policy, is_main, warn
        # the sum of the losses since the last look: non-finite when one of them was (one device op a micro-batch)
        self.total = torch.zeros((), dtype=torch.float32, device=device)

    def see(self, loss: torch.Tensor) -> None:
        """Note one micro-batch's loss."""
        self.total.add_(loss.detach())

    @property
    def bad(self) -> torch.Tensor:
        """True (on the device) when a loss since the last look was non-finite."""
        return ~torch.isfinite(self.total)

    def skip_step(self, step: int) -> bool:
        """`skip`: True on every rank when any rank saw a non-finite loss during optimizer step `step`."""
        if self.policy != "skip":
            return False
        skip = all_reduce_sum(self.bad.double().reshape(1)).item() > 0
        self.total.zero_()
        if skip:
            self.warn(f"ddpkit: warning: non-finite loss at step {step}; step skipped (train.nonfinite=skip)")
        return skip

    def check(self, step: int) -> None:
        """`stop`: a TrainingFailure on every rank when any rank saw a non-finite loss (collective)."""
        if self.policy != "stop":
            return
        # every rank's flag in one small all_reduce (an object all-gather is two collectives and a pickle)
        mine = torch.zeros(get_world_size(), dtype=torch.float64, device=self.total.device)
        mine[get_rank()] = self.bad.double()
        flags = all_reduce_sum(mine).tolist()
        if any(flags):
            ranks = ", ".join(str(r) for r, bad in enumerate(flags) if bad)
            raise TrainingFailure(
                f"non-finite loss on rank {ranks} by step {step} (lower optim.lr, enable train.clip_grad_norm, "
                "check the data, or set train.nonfinite=skip)",
                report=self.is_main,
            )
