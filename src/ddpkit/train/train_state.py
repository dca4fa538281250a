"""Where a training run stands, saved in every checkpoint so that a rerun continues exactly.

Epoch (finished epochs), optimizer step, the position in the current epoch (the train loader's own
state_dict), the current epoch's partial train sums, the best val_acc1 (classification) or val_loss (language
model) and every rank's RNG streams.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ddpkit.distributed.collectives import all_gather_object, all_reduce_sum, derive_seed, seed_everything
from ddpkit.porting.rng import rng_state, set_rng_state
from ddpkit.train.metrics import RunningSums

if TYPE_CHECKING:
    from ddpkit.data import DistributedLoader

STATE_KEYS = ("epoch", "step", "consumed", "partial_sums", "best_acc1", "best_val_loss", "world_size", "rng")


class TrainState:
    """The resumable part of a run; state_dict() and load_state_dict() carry it through a checkpoint."""

    def __init__(
        self,
        loader: DistributedLoader,
        seed: int,
        rank: int,
        world_size: int,
        device: torch.device,
        accuracy: bool = True,
        stream_rank: int | None = None,
    ):
        self.loader = loader  # its state_dict() is the position in the epoch
        self.seed, self.rank, self.world_size, self.device = seed, rank, world_size, device
        self.accuracy = accuracy  # classification; False: a language model's sums count tokens
        # the rank that seeds the dropout/augmentation streams: tensor-parallel peers share their dp rank's
        self.stream_rank = rank if stream_rank is None else stream_rank
        self.epoch = 0  # finished epochs
        self.step = 0  # optimizer steps taken
        self.best_acc1 = -1.0
        self.best_val_loss: float | None = None
        # This epoch's train loss/correct/count (rank 0 also holds those from before a resume) ...
        self.sums = RunningSums(device, accuracy)
        self.resumed_samples = 0  # ... and how many samples those were

    @property
    def consumed(self) -> int:
        """Samples of epoch `epoch + 1` trained on so far, over all ranks (0 between epochs)."""
        position = self.loader.state_dict()
        return int(position["consumed"]) if position["epoch"] == self.epoch + 1 else 0

    def begin_epoch(self, epoch: int) -> None:
        """Start epoch `epoch` (1-based), or go on with it where a checkpoint left it."""
        if self.consumed:  # resumed mid-epoch: position, RNG and partial sums came from the checkpoint
            return
        # Augmentation and dropout streams: a function of (seed, rank, epoch), so a resumed run repeats them.
        seed_everything(derive_seed(self.seed, self.stream_rank, epoch))
        self.loader.set_epoch(epoch)
        self.sums, self.resumed_samples = RunningSums(self.device, self.accuracy), 0

    def end_epoch(self, epoch: int) -> bool:
        """After the train loop of epoch `epoch`: True (and the epoch counts as finished) unless it stopped early."""
        if self.consumed:
            return False
        self.epoch = epoch
        return True

    def epoch_means(self) -> tuple[float, float | None, int]:
        """(train loss, train acc1 or None, samples or tokens) of this epoch so far, over all ranks (collective)."""
        loss, correct, count = all_reduce_sum(self.sums.t).tolist()
        acc = (correct / count if count else float("nan")) if self.accuracy else None
        return (loss / count if count else float("nan")), acc, int(count)

    def describe(self) -> str:
        """`epoch 2, 640 samples into epoch 3, step 47`."""
        inside = f", {self.consumed} samples into epoch {self.epoch + 1}" if self.consumed else ""
        return f"epoch {self.epoch}{inside}, step {self.step}"

    def state_dict(self) -> dict[str, Any]:
        """The entries of STATE_KEYS; collective (every rank calls it; the partial sums are summed over ranks)."""
        consumed = self.consumed
        return {
            "epoch": self.epoch,
            "step": self.step,
            "consumed": consumed,
            "partial_sums": all_reduce_sum(self.sums.t).tolist() if consumed else None,
            "best_acc1": self.best_acc1,
            "best_val_loss": self.best_val_loss,
            "world_size": self.world_size,
            "rng": all_gather_object(rng_state()),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from state_dict() (checkpoints without the mid-epoch entries start at the next epoch)."""
        self.epoch, self.step = int(state["epoch"]), int(state["step"])
        self.best_acc1 = float(state.get("best_acc1", -1.0))
        best_loss = state.get("best_val_loss")  # absent from older checkpoints
        self.best_val_loss = float(best_loss) if best_loss is not None else None
        consumed = int(state.get("consumed") or 0)
        self.loader.load_state_dict({"epoch": self.epoch + 1, "consumed": consumed})
        self.sums, self.resumed_samples = RunningSums(self.device, self.accuracy), 0
        if not consumed:
            return
        rng = state.get("rng")
        if rng and len(rng) == self.world_size:  # on another world size the streams cannot be continued
            set_rng_state(rng[self.rank])
        partial = state.get("partial_sums")
        if partial:
            self.resumed_samples = int(partial[2])
            if self.rank == 0:  # counted once: by rank 0
                self.sums.t += torch.tensor(partial, dtype=torch.float64, device=self.device)
