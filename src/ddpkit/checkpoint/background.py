"""The time training spends checkpointing, and checkpoint.async_save=true: sharded checkpoints written in the
background.

`Saves` is what the Trainer holds: it times every moment training is blocked by a save (the metrics field
`checkpoint_stall_s`) and, with async_save, keeps at most one save in flight. A background save
(sharded.write_in_background: torch.distributed.checkpoint.async_save) returns once the state that training
changes before its next optimizer step is copied (state.pt's entries, serialized; buffers such as batch norm's
running statistics, which a forward pass changes); the parameters and the optimizer's state, which only the
optimizer step changes, are staged by one stager kept for the run (torch's DefaultStager on a GPU,
host_copies.HostCopies on a CPU; its copies are made once, reused by every save and freed by close()) in a
thread of its own while the next forward and backward run, and the trainer waits for that staging (`staged()`,
stall time) right before the optimizer step. A thread of its own then waits for every rank's shards, and rank 0
puts the folder in place (state.pt, fsync, rename) and its copies (last.dcp, best.dcp) and prunes the old epoch
folders, exactly as a blocking save does, so a checkpoint is "complete", the rename done, only after its last
byte is durable, and a kill at any moment leaves the newest complete checkpoint as it was. The next save, the
end of the run and a stop (a signal, preemption) wait for the one in flight; the wait is stall time too. The
run's last save is a blocking one (the Trainer's choice: no step is left to hide it behind).
A run that fails for another reason does not wait (a peer may be gone): what was in flight writes on into its
temporary folder, which the next run sweeps, and puts nothing in place once the run has let go of out_dir.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from concurrent.futures import Future
from datetime import timedelta
from typing import Any

from ddpkit.checkpoint.host_copies import HostCopies
from ddpkit.errors import UserError


def check_async_save(cfg: Any) -> None:
    """checkpoint.async_save writes sharded checkpoints only (a full checkpoint is one torch.save file that rank 0
    writes after gathering the whole state on it: that gathering, not the write, is what stalls training)."""
    ck = cfg.checkpoint
    if ck.async_save and ck.format != "sharded":
        raise UserError(
            f"checkpoint.async_save=true writes sharded checkpoints, not checkpoint.format={ck.format}",
            "add checkpoint.format=sharded (each rank writes its shards in the background), or drop async_save",
        )


class Saves:
    """Checkpoint saves as training sees them: `stalled` seconds blocked so far (`take()` returns and resets
    them); `background`: saves run in a thread, at most one at a time."""

    def __init__(self, background: bool = False, timeout_s: float = 600.0, pinned: bool = False):
        self.background = background
        self.stalled = 0.0
        self._timeout = timedelta(seconds=timeout_s)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._group: Any = None
        # a GPU's tensors: staged into page-locked memory, copied on a stream of its own
        self._pinned = pinned
        self._stager: Any = None  # made at the first background save, kept until close()
        self._staging: Future | None = None  # the save in flight's staging, until staged() saw it done
        self.abandoned = False  # the run failed: a save in flight places nothing any more

    @contextlib.contextmanager
    def blocking(self) -> Iterator[None]:
        """Training is blocked by checkpointing inside this block."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.stalled += time.perf_counter() - t0

    def take(self) -> float:
        """The seconds blocked since the last take(), rounded as metrics are."""
        stalled, self.stalled = self.stalled, 0.0
        return round(stalled, 4)

    def group(self) -> Any:
        """The gloo group a background save's collectives run over (made at the first save, on every rank:
        collective), apart from the group training talks over; None without a process group."""
        import torch.distributed as dist

        if self._group is None and dist.is_available() and dist.is_initialized():
            self._group = dist.new_group(backend="gloo", timeout=self._timeout)
        return self._group

    def stager(self) -> Any:
        """The run's one stager: it copies the tensors of every background save in a thread of its own, into
        copies it keeps between saves (allocated at the first save only). On a GPU torch's DefaultStager (pinned
        memory, a copy stream of its own); on a CPU host_copies.HostCopies (copies that leave the GIL free)."""
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        if self._stager is None and not self._pinned:
            self._stager = HostCopies()
        elif self._stager is None:
            options = StagingOptions(
                use_pinned_memory=True,
                use_shared_memory=False,
                use_async_staging=True,
                use_non_blocking_copy=True,
            )
            self._stager = DefaultStager(options)
        return self._stager

    def start(self, finish: Callable[[], None], staging: Future | None = None) -> None:
        """Run finish() (waiting for the written shards, then putting the folder in place) in the background;
        `staging`: done once the stager's copies are made (staged() waits for it)."""
        if self._thread is not None:
            raise RuntimeError("a checkpoint save is already in flight")
        self._staging = staging

        def run() -> None:
            try:
                finish()
            except BaseException as e:  # raised in the training thread by wait()
                self._error = e

        # a daemon thread: a run that fails does not wait for it at exit (its temporary folder is swept later)
        self._thread = threading.Thread(target=run, name="ddpkit-checkpoint", daemon=True)
        self._thread.start()

    def staged(self) -> None:
        """Block (stall time) until the save in flight, if any, has copied the tensors the next optimizer step
        changes (its error, if any, is raised by wait())."""
        if self._staging is None:
            return
        with self.blocking():
            futures.wait([self._staging])
        self._staging = None

    def wait(self) -> None:
        """Block (stall time) until the save in flight, if any, is complete on every rank (rank 0 puts the folder
        in place after the others' shards are written: nobody reads it before); raise its error. Collective."""
        self._staging = None  # its write waits for its staging
        if self._thread is None:
            return
        with self.blocking():
            self._thread.join()
            if self._group is not None:  # every rank, also one whose save failed: none is left waiting
                import torch.distributed as dist

                dist.barrier(group=self._group)
        self._thread, error, self._error = None, self._error, None
        if error is not None:
            raise error

    def abandon(self) -> None:
        """The run failed and lets go of out_dir without waiting: the save in flight, if any, writes on into its
        temporary folder (swept by the next run) but puts nothing in place."""
        self.abandoned = True

    def close(self) -> None:
        """Free the stager's copies (after the staging in flight, if any, is done; a write still in flight keeps
        the copies it reads)."""
        if self._stager is not None:
            self._stager.close()
            self._stager = None

    @property
    def in_flight(self) -> bool:
        return self._thread is not None
