"""The Trainer behind `ddpkit train` and `ddpkit eval`: reads top to bottom like the recipe."""

from __future__ import annotations

import contextlib
import math
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from ddpkit import config as config_mod
from ddpkit.checkpoint import TRAIN_KEYS, CheckpointDir, load_checkpoint
from ddpkit.config import Config
from ddpkit.distributed.collectives import (
    all_gather_object,
    all_reduce_sum,
    barrier,
    broadcast_object,
    derive_seed,
    is_dist,
    rank_zero_first,
    seed_everything,
    seed_model_init,
)
from ddpkit.distributed.health import Heartbeat, explain_comm_failures
from ddpkit.distributed.runtime import DistContext
from ddpkit.distributed.strategy import build_strategy
from ddpkit.errors import Preempted, UserError, first_line
from ddpkit.metrics import RunLog, RunningSums, read_metrics

# How often (optimizer steps) the ranks agree on whether a stop signal arrived: one scalar all-reduce.
STOP_CHECK_EVERY = 10


def _rng_state() -> dict[str, Any]:
    """This process's RNG streams, as types torch.load(weights_only=True) accepts."""
    import random

    import numpy as np

    name, keys, pos, has_gauss, cached = np.random.get_state()
    st = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": [name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        st["cuda"] = torch.cuda.get_rng_state()
    return st


def _set_rng_state(st: dict[str, Any]) -> None:
    import random

    import numpy as np

    torch.set_rng_state(st["torch"])
    random.setstate(st["python"])
    name, keys, pos, has_gauss, cached = st["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state(st["cuda"])


class _StopFlag:
    """SIGTERM / SIGUSR1 set a flag; the loop stops at the next step boundary (all ranks agree)."""

    def __init__(self):
        self.signum = 0
        self._old: dict[int, Any] = {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread
                pass
        return self

    def _handle(self, signum, frame):
        self.signum = signum

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


class Trainer:
    """Fit a classifier on the configured data with the configured parallel strategy."""

    def __init__(self, cfg: Config, ctx: DistContext):
        self.cfg = cfg
        self.ctx = ctx
        self.device = ctx.device
        self.log = RunLog(cfg.out_dir, active=ctx.is_main)
        self.ckpt = CheckpointDir(cfg.out_dir, keep=cfg.checkpoint.keep)
        self.strategy = build_strategy(cfg.dist.strategy, ctx)
        self.amp_dtype = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}[cfg.train.amp]
        self.epoch = 0  # finished epochs
        self.step = 0  # optimizer steps taken
        self.consumed = 0  # samples of the current epoch already trained on (mid-epoch checkpoints)
        self.best_acc = -1.0
        self._sums: RunningSums | None = None  # this epoch's running train sums
        self._resume_sums: list[float] | None = None  # all ranks' sums at a mid-epoch checkpoint
        self._last_save = time.monotonic()
        self.heartbeat = Heartbeat.current(ctx)
        self._build()

    # ---- set-up -------------------------------------------------------------------------------
    def _build(self) -> None:
        from ddpkit import data, models, optim

        cfg, ctx = self.cfg, self.ctx
        with rank_zero_first() if cfg.data.download else contextlib.nullcontext():
            self.train_set, self.val_set, self.spec = data.build_datasets(cfg)
        num_classes = cfg.model.num_classes or self.spec.num_classes
        seed_model_init(cfg.seed)  # identical initial weights on every rank
        model = models.build_model(cfg, num_classes, self.spec.in_channels, self.spec.image_size)
        self.model = models.prepare_model(model, cfg, self.device, distributed=ctx.world_size > 1)
        self.wrapped = self.strategy.wrap(self.model)
        if cfg.model.compile:
            # In place (nn.Module.compile): the wrapper stays what the strategy returned, so checkpoints keep
            # their keys (no `_orig_mod.` prefix) and DDP's buckets still split the compiled graph.
            self.wrapped.compile()
        self.train_loader, self.val_loader = data.build_loaders(
            cfg, ctx.rank, ctx.world_size, self.train_set, self.val_set
        )
        accum = cfg.train.grad_accum_steps
        self.steps_per_epoch = self.train_loader.sampler.micro_batches_per_epoch // accum
        self.global_batch = optim.global_batch_size(cfg.train.batch_size, ctx.world_size, accum)
        self.lr = optim.scaled_lr(cfg.optim.lr, self.global_batch, cfg.optim.ref_batch_size)
        self.total_steps = cfg.train.epochs * self.steps_per_epoch
        if cfg.train.max_steps is not None:
            self.total_steps = min(self.total_steps, cfg.train.max_steps)
        self.optimizer = self.strategy.build_optimizer(
            self.model, lambda m: optim.build_optimizer(m, cfg, self.lr)
        )
        self.scheduler = optim.build_scheduler(self.optimizer, cfg, self.steps_per_epoch, self.total_steps)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=cfg.train.amp == "fp16")
        self.criterion = nn.CrossEntropyLoss(label_smoothing=cfg.train.label_smoothing)

    def _autocast(self):
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

    def _to_device(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        nb = self.device.type == "cuda"
        x = x.to(self.device, non_blocking=nb)
        if self.cfg.model.channels_last and x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        return x, y.to(self.device, non_blocking=nb)

    # ---- checkpoints --------------------------------------------------------------------------
    def state(self) -> dict[str, Any] | None:
        """The full training state on rank 0 (None elsewhere). Collective: every rank must call it."""
        model_sd = self.strategy.model_state(self.wrapped)
        optim_sd = self.strategy.optimizer_state(self.wrapped, self.optimizer)
        rng = all_gather_object(_rng_state())
        partial = all_reduce_sum(self._sums.t).tolist() if self.consumed and self._sums is not None else None
        if not self.ctx.is_main:
            return None
        return {
            "model": model_sd,
            "optimizer": optim_sd,
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "epoch": self.epoch,
            "step": self.step,
            "consumed": self.consumed,
            "partial_sums": partial,
            "best_acc1": self.best_acc,
            "world_size": self.ctx.world_size,
            "rng": rng,
            "config": config_mod.to_dict(self.cfg),
        }

    def save(self, epoch_end: bool, is_best: bool = False, row: dict[str, Any] | None = None) -> None:
        self._last_save = time.monotonic()
        state = self.state()
        if state is not None:
            state["metrics_row"] = row
            if epoch_end:
                self.ckpt.save_epoch(state, self.epoch, is_best)
            else:
                self.ckpt.save_step(state)
        barrier()  # nobody reads a checkpoint before it is complete

    def resume(self) -> None:
        """Rank 0 decides which checkpoint (if any) to continue from and tells the others; all load it."""
        choice = self.cfg.checkpoint.resume
        path = None
        if self.ctx.is_main and choice != "none":
            if choice == "auto":
                found = self.ckpt.newest_complete(warn=self.log.info)
                path = str(found[0]) if found else None
            else:
                load_checkpoint(choice, require=TRAIN_KEYS)  # fail here, once, with a clear message
                path = choice
        path = broadcast_object(path)
        if path is None:
            return
        state = load_checkpoint(path, map_location="cpu", require=TRAIN_KEYS)
        try:
            self.strategy.load(self.wrapped, self.optimizer, state["model"], state.get("optimizer"))
        except (RuntimeError, KeyError, ValueError) as e:
            first = first_line(e)
            raise UserError(
                f"checkpoint '{path}' does not fit this model: {first}",
                "resume with the config it was trained with, or checkpoint.resume=none",
            ) from None
        if "scheduler" in state:
            self.scheduler.load_state_dict(state["scheduler"])
        if state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.epoch, self.step = int(state["epoch"]), int(state["step"])
        self.consumed = int(state.get("consumed", 0))
        self.best_acc = float(state.get("best_acc1", -1.0))
        if self.ctx.is_main:
            self.log.reconcile_metrics(self.epoch, state.get("metrics_row"))
        rng = state.get("rng")
        if self.consumed and rng and len(rng) == self.ctx.world_size:
            _set_rng_state(rng[self.ctx.rank])
        if self.consumed and state.get("partial_sums") and self.ctx.is_main:
            self._resume_sums = list(state["partial_sums"])
        where = f"epoch {self.epoch}" + (
            f", {self.consumed} samples into epoch {self.epoch + 1}" if self.consumed else ""
        )
        self.log.info(f"resumed from {path} ({where}, step {self.step})")

    # ---- the loop -----------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        """Train for train.epochs (or train.max_steps), evaluating and checkpointing; returns the last metrics."""
        with explain_comm_failures(self.ctx, self.heartbeat, lambda: self.step):
            try:
                return self._fit()
            finally:
                self.log.close()

    def _fit(self) -> dict[str, Any]:
        cfg, ctx = self.cfg, self.ctx
        self._write_config()
        self.resume()
        self.log.info(
            f"ddpkit: {ctx.world_size} process(es), backend {ctx.backend}, device {self.device.type}, "
            f"strategy {self.strategy.name}, global batch {self.global_batch} "
            f"({cfg.train.batch_size} x {ctx.world_size} x {cfg.train.grad_accum_steps}), lr {self.lr:g}, "
            f"{self.steps_per_epoch} steps/epoch"
        )
        last: dict[str, Any] = {}
        with _StopFlag() as stop:
            while self.epoch < cfg.train.epochs and self.step < self.total_steps:
                epoch = self.epoch + 1
                t0 = time.perf_counter()
                train_loss, train_acc, seen = self.train_epoch(epoch, stop)
                if stop.signum and self.consumed:  # stopped mid-epoch: checkpoint this step, exit
                    self.save(epoch_end=False)
                    raise Preempted(
                        f"stopped by {signal.Signals(stop.signum).name} at step {self.step}; checkpoint written, rerun the same command to continue"
                    )
                elapsed = time.perf_counter() - t0
                self.epoch = epoch
                do_eval = (
                    epoch % cfg.eval.every == 0 or epoch == cfg.train.epochs or self.step >= self.total_steps
                )
                val = (
                    self.evaluate()
                    if do_eval
                    else {"val_loss": None, "val_acc1": None, "val_acc5": None, "val_samples": None}
                )
                is_best = val["val_acc1"] is not None and val["val_acc1"] > self.best_acc
                if is_best:
                    self.best_acc = val["val_acc1"]
                last = {
                    "epoch": epoch,
                    "step": self.step,
                    "world_size": ctx.world_size,
                    "global_batch_size": self.global_batch,
                    "lr": self.optimizer.param_groups[0]["lr"],
                    "train_loss": train_loss,
                    "train_acc1": train_acc,
                    **val,
                    "epoch_time_s": round(elapsed, 4),
                    "train_images_per_s": round(seen / elapsed, 2) if elapsed > 0 else None,
                }
                self.save(epoch_end=True, is_best=is_best, row=last)  # checkpoint first: it carries the row
                self.log.metrics(last)
                self.log.info(
                    f"epoch {epoch}/{cfg.train.epochs} | train loss {train_loss:.4f} acc {100 * train_acc:.2f}% | "
                    + (
                        f"val loss {val['val_loss']:.4f} acc1 {100 * val['val_acc1']:.2f}% | "
                        if do_eval
                        else ""
                    )
                    + f"{last['train_images_per_s']} img/s | {elapsed:.1f}s"
                )
                if self._agree(stop, force=True)[0]:
                    raise Preempted(
                        f"stopped by {signal.Signals(stop.signum).name} after epoch {epoch}; rerun the same command to continue"
                    )
        if not last:
            rows = read_metrics(cfg.out_dir) if ctx.is_main else []
            last = rows[-1] if rows else {}
            self.log.info(
                f"nothing to train: the run in {cfg.out_dir} already finished {self.epoch} epoch(s)"
            )
        if last.get("val_acc1") is not None:
            self.log.info(
                f"final val_acc1 {last['val_acc1']:.4f} ({100 * last['val_acc1']:.2f}%) on {last['val_samples']} samples"
            )
        return last

    def train_epoch(self, epoch: int, stop: _StopFlag) -> tuple[float, float, int]:
        """One pass over this rank's shard; returns (loss, acc1, samples) reduced over all ranks."""
        cfg = self.cfg
        accum = cfg.train.grad_accum_steps
        # Augmentation and dropout streams: a function of (seed, rank, epoch), so a resumed run repeats them.
        if not self.consumed:
            seed_everything(derive_seed(cfg.seed, self.ctx.rank, epoch))
        loader = self.train_loader
        loader.set_epoch(epoch)
        if self.consumed:
            loader.set_start(self.consumed)
        first_step = self.consumed // self.global_batch
        self.wrapped.train()
        sums = self._sums = RunningSums(self.device)
        if (
            self._resume_sums is not None
        ):  # the part of this epoch trained before the checkpoint (rank 0 holds it)
            sums.t += torch.tensor(self._resume_sums, dtype=torch.float64, device=self.device)
            self._resume_sums = None
        self.log.epoch_start(epoch, cfg.train.epochs, self.steps_per_epoch, initial=first_step)
        micro = 0
        step_in_epoch = first_step
        bad = torch.zeros((), dtype=torch.bool, device=self.device)
        for x, y in loader:
            x, y = self._to_device(x, y)
            last_micro = (micro + 1) % accum == 0
            with self.strategy.sync_context(self.wrapped, last_micro):
                with self._autocast():
                    logits = self.wrapped(x)
                loss = self.criterion(logits.float(), y)
                self.scaler.scale(loss / accum).backward()
            sums.add(loss, logits, y)
            bad |= ~torch.isfinite(loss.detach())
            micro += 1
            if not last_micro:
                continue
            if cfg.train.nonfinite == "skip" and self._skip_nonfinite(loss):
                self.optimizer.zero_grad(set_to_none=True)
                bad.zero_()
            else:
                self._optimizer_step()
            self.step += 1
            step_in_epoch += 1
            self.consumed = step_in_epoch * self.global_batch
            self.log.step(
                step_in_epoch, self.steps_per_epoch, epoch, cfg.train.epochs, sums, cfg.train.log_every
            )
            if step_in_epoch % cfg.train.log_every == 0:
                self._check_finite(bad)
            self.heartbeat.step = self.step
            stop_now, save_now = self._agree(stop)
            if stop_now or self.step >= self.total_steps:
                break
            every = cfg.checkpoint.every_steps
            if (save_now or (every and self.step % every == 0)) and step_in_epoch < self.steps_per_epoch:
                self._check_finite(bad)
                self.save(epoch_end=False)
        self.log.epoch_end()
        self._check_finite(bad)
        if not stop.signum or step_in_epoch >= self.steps_per_epoch or self.step >= self.total_steps:
            self.consumed = 0
        loss_sum, correct, count = all_reduce_sum(sums.t).tolist()
        return (loss_sum / count, correct / count, int(count)) if count else (math.nan, math.nan, 0)

    def _optimizer_step(self) -> None:
        if self.cfg.train.clip_grad_norm is not None:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.train.clip_grad_norm)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()

    def _skip_nonfinite(self, loss: torch.Tensor) -> bool:
        """train.nonfinite=skip: every rank agrees to drop this step when any rank saw a non-finite loss."""
        flag = torch.tensor([0.0 if torch.isfinite(loss.detach()).item() else 1.0], dtype=torch.float64)
        if all_reduce_sum(flag).item() > 0:
            self.log.info(
                f"ddpkit: warning: non-finite loss at step {self.step + 1}; step skipped (train.nonfinite=skip)"
            )
            return True
        return False

    def _check_finite(self, bad: torch.Tensor) -> None:
        """train.nonfinite=stop: stop every rank with a message naming the rank(s) and step."""
        flags = all_gather_object(bool(bad.item()))
        if any(flags):
            ranks = ", ".join(str(r) for r, f in enumerate(flags) if f)
            raise UserError(
                f"non-finite loss on rank {ranks} by step {self.step}",
                "lower optim.lr, enable train.clip_grad_norm, check the data, or set train.nonfinite=skip",
            )

    def _agree(self, stop: _StopFlag, force: bool = False) -> tuple[bool, bool]:
        """(stop now, checkpoint now), the same on every rank.

        A signal on any rank stops all ranks at the same step; rank 0's clock decides time-based checkpoints.
        The ranks compare notes every STOP_CHECK_EVERY steps (one 2-element all-reduce).
        """
        every_s = self.cfg.checkpoint.every_minutes * 60
        due = bool(every_s) and self.ctx.is_main and time.monotonic() - self._last_save >= every_s
        if self.ctx.world_size == 1:
            return bool(stop.signum), due
        if self.step % STOP_CHECK_EVERY and not force:
            return False, False
        buf = torch.tensor([float(bool(stop.signum)), float(due)], dtype=torch.float64)
        stop_any, save = all_reduce_sum(buf).tolist()
        if stop_any and not stop.signum:
            stop.signum = signal.SIGTERM
        return bool(stop_any), bool(save)

    @torch.no_grad()
    def evaluate(self) -> dict[str, Any]:
        """Exact evaluation: every validation sample scored once, whatever the world size."""
        return evaluate(
            self.strategy.eval_module(self.wrapped),
            self.val_loader,
            self.device,
            self.criterion,
            self._autocast,
            self.strategy.collective_forward,
            self.cfg.model.channels_last,
        )

    def _write_config(self) -> None:
        if self.ctx.is_main:
            from ddpkit.checkpoint import save_text

            save_text(Path(self.cfg.out_dir) / "config.yaml", config_mod.to_yaml(self.cfg))


@torch.no_grad()
def evaluate(
    model: nn.Module,
    loader,
    device: torch.device,
    criterion: nn.Module | None = None,
    autocast=contextlib.nullcontext,
    collective_forward: bool = False,
    channels_last: bool = False,
) -> dict[str, Any]:
    """Loss, top-1 and top-5 over an exact (duplicate-free) sharded loader, summed over all ranks."""
    criterion = criterion or nn.CrossEntropyLoss()
    was_training = model.training
    model.eval()
    sums = torch.zeros(4, dtype=torch.float64, device=device)
    batches = iter(loader)
    n_local = n_max = len(loader)
    if collective_forward and is_dist():
        t = torch.tensor([n_local], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        n_max = int(t.item())
    dummy = None
    for i in range(n_max):
        if i < n_local:
            x, y = next(batches)
            x, y = x.to(device), y.to(device)
            if channels_last and x.dim() == 4:
                x = x.contiguous(memory_format=torch.channels_last)
            dummy = x[:1]
        else:  # a rank with a shorter shard still joins the collective forward (fsdp)
            model(dummy if dummy is not None else _dummy_input(loader, device))
            continue
        with autocast():
            logits = model(x)
        logits = logits.float()
        k = min(5, logits.shape[1])
        top = logits.topk(k, dim=1).indices
        hit = top == y[:, None]
        sums += torch.stack(
            [
                criterion(logits, y) * y.shape[0],
                hit[:, 0].sum().double(),
                hit.any(dim=1).sum().double(),
                torch.tensor(float(y.shape[0]), device=device, dtype=torch.float64),
            ]
        )
    loss_sum, top1, top5, n = all_reduce_sum(sums).tolist()
    model.train(was_training)
    return {
        "val_loss": loss_sum / n if n else None,
        "val_acc1": top1 / n if n else None,
        "val_acc5": top5 / n if n else None,
        "val_samples": int(n),
    }


def _dummy_input(loader, device: torch.device) -> torch.Tensor:
    x, _ = loader.dataset[0]
    return x.unsqueeze(0).to(device)


__all__ = ["Trainer", "evaluate"]
