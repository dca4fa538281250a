"""The Trainer behind `ddpkit train`: build() asks the builders for the parts, fit() reads like the recipe.

Words, used the same way in the code, the logs and the metrics: a micro-batch is what one process feeds
forward at once (train.batch_size samples); an optimizer step is one update after train.grad_accum_steps
micro-batches; the global batch is train.batch_size x world_size x train.grad_accum_steps samples, the samples
of one optimizer step over all ranks. "step" alone always means an optimizer step.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from ddpkit import config as config_mod
from ddpkit import data
from ddpkit.checkpoint import TRAIN_KEYS, CheckpointDir, load_checkpoint, save_text, sharded
from ddpkit.checkpoint.background import Saves, check_async_save
from ddpkit.config import Config
from ddpkit.data.prefetch import DeviceBatches
from ddpkit.data.text import tokenizer
from ddpkit.distributed.collectives import (
    barrier,
    broadcast_object,
    gather_object_to,
)
from ddpkit.distributed.runtime import DistContext
from ddpkit.errors import Preempted
from ddpkit.launcher import startup
from ddpkit.models import flops
from ddpkit.parallel.clip import clip_grad_norm_
from ddpkit.train import curves, optim
from ddpkit.train.builders import (
    init_weights,
    load_weights,
    make_autocast,
    make_datasets,
    make_layout,
    make_model_on_meta,
    split_model,
)
from ddpkit.train.health import Heartbeat, explain_comm_failures
from ddpkit.train.memory import MemoryProbe, largest_peak_memory
from ddpkit.train.metrics import RunLog, banner, epoch_line, final_line, read_metrics
from ddpkit.train.metrics_file import EpochEnd, make_row, measured
from ddpkit.train.rundir import RunDir
from ddpkit.train.steps import StepRunner, build_runner
from ddpkit.train.stop import NonFiniteLoss, StopAgreement
from ddpkit.train.tasks import Task, task_for
from ddpkit.train.train_state import TrainState

VAL_KEYS = ("val_loss", "val_acc1", "val_acc5", "val_ppl", "val_samples")

# ------------------------------------------------------------------------------------------------- trainer


class Trainer:
    """Fit a classifier or a language model on the configured data with the configured parallel strategy.

    `heartbeat`: the caller's (it stays open); without one the Trainer makes its own and closes it after fit().
    """

    def __init__(self, cfg: Config, ctx: DistContext, heartbeat: Heartbeat | None = None):
        self.cfg, self.ctx, self.device = cfg, ctx, ctx.device
        startup.mark("imported", keep=True)  # the command line marks it before the rendezvous
        self.startup: dict[str, float] | None = None  # measured at this process's first optimizer step
        self.resumed_after: int | None = None  # finished epochs of the checkpoint this run continued from
        self.memory = MemoryProbe()  # this rank's parameter, gradient and optimizer-state bytes
        self.log = RunLog(cfg.out_dir, active=ctx.is_main)  # writes nothing before the run dir is claimed
        self.ckpt = CheckpointDir(
            cfg.out_dir, cfg.checkpoint.keep, sharded=cfg.checkpoint.format == "sharded"
        )
        check_async_save(cfg)
        # the seconds checkpoints block training; with checkpoint.async_save, the save in flight
        self.saves = Saves(cfg.checkpoint.async_save, cfg.dist.timeout_s, pinned=self.device.type == "cuda")
        self.run_dir = RunDir(cfg, ctx.is_main, self.log)
        self._own_heartbeat = heartbeat is None
        self.heartbeat = heartbeat or Heartbeat(ctx.rank, ctx.world_size)
        self.build()
        self.state = TrainState(
            self.train_loader,
            cfg.seed,
            ctx.rank,
            ctx.world_size,
            self.device,
            self.task.accuracy,
            stream_rank=self.coords["dp"],
        )
        ck = cfg.checkpoint
        # the ranks agree on a stop or a timed checkpoint at the log points (train.log_every) and epoch ends
        self.stop = StopAgreement(
            ctx.world_size, ctx.is_main, ck.every_steps, ck.every_minutes, check_every=0
        )
        self.nonfinite = NonFiniteLoss(cfg.train.nonfinite, self.device, ctx.is_main, warn=self.log.info)

    def build(self) -> None:
        """Layout, data, model, the step runner (the strategy or the pipeline around the model), loaders,
        optimizer, lr schedule and gradient scaler, each from its builder."""
        cfg, ctx = self.cfg, self.ctx
        self.layout, self.mesh = make_layout(cfg, ctx)  # dp x tp x pp, and its device mesh when tp splits
        self.coords = self.layout.coords(ctx.rank)
        self.train_set, self.val_set, self.spec = make_datasets(cfg)
        startup.mark("data")
        self.criterion = nn.CrossEntropyLoss(label_smoothing=cfg.train.label_smoothing)
        self.task: Task = task_for(self.spec, self.criterion)  # classification, or a language model on text
        self.flops_per_token = flops.model_flops(cfg, self.spec)  # None for a classifier
        self.peak_tflops = cfg.train.peak_tflops or flops.known_peak(self.device, cfg.train.amp)
        self.autocast = make_autocast(self.device, cfg.train.amp)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=cfg.train.amp == "fp16")
        # activation checkpointing, and tensor parallelism over the mesh's "tp" dim (a pipeline applies it to
        # each of its stages); then the runner of this layout's steps, chosen once
        # each rank's shards only of a model built on the meta device are made, once it is laid out (`make`)
        model, make = make_model_on_meta(cfg, ctx, self.spec, report=self.log.info)
        model = split_model(cfg, model, self.mesh)
        self.runner: StepRunner = build_runner(
            cfg, ctx, model, layout=self.layout, mesh=self.mesh, spec=self.spec, make=make, device=self.device,
            task=self.task, autocast=self.autocast, scaler=self.scaler, accum=cfg.train.grad_accum_steps,
            channels_last=cfg.model.channels_last,
        )  # fmt: skip
        # (model.compile: the runner compiled each block, or the whole wrapped model)
        self.model, self.strategy, self.wrapped = self.runner.model, self.runner.strategy, self.runner.wrapped
        init_weights(cfg, self.strategy, self.wrapped, report=self.log.info)  # model.init_from, sliced
        # ranks of one tensor / pipeline group read the same samples: shards by the dp coordinate and degree
        replica, self.replicas = self.runner.replica
        self.train_loader, self.val_loader = data.build_loaders(
            cfg, replica, self.replicas, self.train_set, self.val_set
        )
        # micro-batches reach the device before their step: on CUDA the next one is copied while one computes
        self.train_loader.move = DeviceBatches(self.device, self.runner.channels_last)
        self.steps_per_epoch = self.train_loader.sampler.optimizer_steps_per_epoch
        accum = cfg.train.grad_accum_steps
        self.global_batch = optim.global_batch_size(cfg.train.batch_size, self.replicas, accum)
        self.lr = optim.scaled_lr(cfg.optim.lr, self.global_batch, cfg.optim.ref_batch_size)
        self.total_steps = optim.total_steps(cfg.train.epochs, self.steps_per_epoch, cfg.train.max_steps)
        self.optimizer = self.strategy.build_optimizer(
            self.model, lambda m: optim.build_optimizer(m, cfg, self.lr)
        )
        self.scheduler = optim.build_scheduler(self.optimizer, cfg, self.steps_per_epoch, self.total_steps)
        startup.mark("model")

    # ---- the recipe ---------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        """Train for train.epochs (or train.max_steps): resume, then per epoch train, evaluate, checkpoint, log.

        Returns the last metrics line.
        """
        state = self.state
        failed = explain_comm_failures(self.ctx, self.heartbeat, lambda: state.step, self.log.record)
        with self._closing(), failed, self.stop:
            # every check (out_dir, data, the checkpoint to continue from) passes before the first write
            source, ckpt = self.run_dir.open(config_mod.to_yaml(self.cfg), self._check_inputs)
            self._save_tokenizer()
            if ckpt is not None:
                self._resumed(source, ckpt)
            self.log.info(banner(self))
            last: dict[str, Any] = {}
            while self._more_to_train():
                epoch, t0 = state.epoch + 1, time.perf_counter()
                train = self.train_epoch(epoch)  # ends early on an agreed stop or at train.max_steps
                if self.stop.agreed and state.consumed and self._more_to_train():
                    self.checkpoint()  # mid-epoch: the rerun continues from the next sample
                    where = f"at step {state.step}; checkpoint written, rerun the same command to continue"
                    raise self.stop.preempted(where, self.ctx.is_main)
                val = self.evaluate() if self._eval_due(epoch) else dict.fromkeys(VAL_KEYS)
                last = self._metrics_row(epoch, train, val, time.perf_counter() - t0)
                self.checkpoint(last)  # before the metrics line: the checkpoint carries it
                if not self._more_to_train():
                    self.saves.wait()  # the run's last save is complete before its last line
                last["checkpoint_stall_s"] = self.saves.take()  # its epoch's saves, the one at its end too
                self.log.metrics(last)
                self.log.info(epoch_line(last, self.cfg.train.epochs, self.task))
                if self.stop.poll(state.step, force=True).stop:
                    where = f"after epoch {epoch}; rerun the same command to continue"
                    raise self.stop.preempted(where, self.ctx.is_main)
            return self._finish(last)

    def train_epoch(self, epoch: int) -> tuple[float, float, int]:
        """Optimizer steps over this rank's shard until the epoch ends, a stop is agreed or train.max_steps is
        reached; returns (loss, acc1, samples) of the epoch over all ranks."""
        cfg, state, accum = self.cfg, self.state, self.cfg.train.grad_accum_steps
        state.begin_epoch(epoch)
        self.runner.begin_epoch(state.sums)
        self.runner.train()  # once an epoch (evaluate() switches to eval mode between epochs)
        first = state.consumed // self.global_batch  # optimizer steps of this epoch done before a resume
        self.log.epoch_start(epoch, cfg.train.epochs, self.steps_per_epoch, initial=first)
        with contextlib.closing(iter(self.train_loader)) as micro_batches:
            for done in range(first + 1, first + len(self.train_loader) // accum + 1):
                self.train_step(itertools.islice(micro_batches, accum))
                if self.startup is None:  # this process's first optimizer step: say how long it took
                    startup.mark("first_step")
                    self.startup = startup.measure()
                    self.log.info(startup.describe(self.startup))
                self.log.step(
                    done,
                    self.steps_per_epoch,
                    epoch,
                    cfg.train.epochs,
                    self.runner.shown_sums(state.sums, done, self.steps_per_epoch, cfg.train.log_every),
                    cfg.train.log_every,
                )
                log_point = done % cfg.train.log_every == 0
                if log_point:
                    self.nonfinite.check(state.step)
                self.heartbeat.step = state.step
                decision = self.stop.poll(state.step, force=log_point)
                if decision.stop or state.step >= self.total_steps:
                    break
                if decision.checkpoint and done < self.steps_per_epoch:
                    self.nonfinite.check(state.step)
                    self.checkpoint()
            else:  # the pass ends, also when a resume on more ranks left less than one optimizer step of it
                next(micro_batches, None)
        self.log.epoch_end()
        self.nonfinite.check(state.step)
        result = state.epoch_means()
        state.end_epoch(epoch)
        return result

    def train_step(self, micro_batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """One optimizer step over train.grad_accum_steps micro-batches; gradients sync on the last one only."""
        for loss in self.runner.forward_backward(micro_batches, self.state.sums):
            self.nonfinite.see(loss)  # the ranks compare their notes at the log points
        if self.nonfinite.skip_step(self.state.step + 1):
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.memory.before_step(self.model)
            if self.cfg.train.clip_grad_norm is not None:
                self.scaler.unscale_(self.optimizer)
                # the norm over every gradient of every layout (a pipeline's: over every stage)
                clip_grad_norm_(self.runner.clip_target, self.cfg.train.clip_grad_norm)
            self.saves.staged()  # a background save's copies of what the step changes are made
            self.scaler.step(self.optimizer)
            self.memory.after_step(self.optimizer)
            self.scaler.update()
            self.optimizer.zero_grad(set_to_none=True)
            self.scheduler.step()
        self.state.step += 1

    @torch.no_grad()
    def evaluate(self) -> dict[str, Any]:
        """Exact evaluation: every validation sample scored once, whatever the world size."""
        return self.runner.evaluate(self.val_loader)

    # ---- checkpoints --------------------------------------------------------------------------
    def checkpoint(self, row: dict[str, Any] | None = None) -> None:
        """Save everything a rerun needs (collective): between epochs epoch_NNNN.pt and last.pt, inside an
        epoch last.pt only; best.pt too when `row` (the metrics line it carries) is the best so far (the
        highest val_acc1; for a language model the lowest val_loss).
        checkpoint.format=sharded: .dcp folders instead, every rank writing its shards."""
        with self.saves.blocking():
            self.saves.wait()  # at most one save in flight: the next one waits for it
            self._checkpoint(row)

    def _checkpoint(self, row: dict[str, Any] | None) -> None:
        best = row is not None and self.task.improves(row, self.state)
        rest = {
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            **self.state.state_dict(),
            **self._hook_states(),
            "config": config_mod.to_dict(self.cfg),
            "metrics_row": row,
            **({"tokenizer": self.spec.tokenizer} if self.spec.tokenizer else {}),
        }
        if self.cfg.checkpoint.format == "sharded":  # every rank writes its own shards
            tensors, optim_rest = self.strategy.sharded_state(self.wrapped, self.optimizer)
            background, later = None, frozenset()
            # what only the optimizer step changes is staged until it (train_step); the run's last save is
            # written here, as a blocking one: no step is left to hide it behind, and staging would add a copy
            if self.saves.background and self._more_to_train():
                background, later = self.saves, sharded.changed_by_step(tensors, self.optimizer)
            self.ckpt.save_sharded(tensors, {**rest, **optim_rest}, self.ctx.is_main, best, background, later)
        else:
            model = self.strategy.model_state(self.wrapped)
            full = {
                "model": model,
                "optimizer": self.strategy.optimizer_state(self.wrapped, self.optimizer),
                **rest,
            }
            if self.ctx.is_main:
                if full["consumed"]:
                    self.ckpt.save_step(full, best)
                else:
                    self.ckpt.save_epoch(full, self.state.epoch, best)
        self.stop.checkpointed()
        if not self.saves.in_flight:
            barrier()  # nobody reads a checkpoint before it is complete (a save in flight: its wait)

    def _check_inputs(self, source: str | None) -> dict[str, Any] | None:
        """The checks that need the built parts: a first sample decodes, the checkpoint loads and fits."""
        if self.ctx.is_main:
            data.check_decodable(self.train_set, self.val_set)
        return self._load(source) if source else None

    def resume(self, path: str | None = None) -> None:
        """Continue from `path` (default: the newest complete checkpoint in out_dir, which rank 0 picks)."""
        if path is None:
            found = self.ckpt.newest_complete(warn=self.log.info) if self.ctx.is_main else None
            path = broadcast_object(str(found[0]) if found else None)
        if path is not None:
            self._resumed(path, self._load(path))

    def _load(self, path: str) -> dict[str, Any]:
        """A checkpoint into the model, optimizer, schedule, scaler and train state on every rank (no writes)."""
        ckpt = load_checkpoint(path, map_location="cpu", require=TRAIN_KEYS)
        tokenizer.check_trained_with(self.cfg, self.spec.tokenizer, ckpt.get("tokenizer"), path)
        load_weights(self.strategy, self.wrapped, ckpt, path, self.cfg.model.arch, self.optimizer)
        if "scheduler" in ckpt:
            self.scheduler.load_state_dict(ckpt["scheduler"])
        if ckpt.get("scaler"):
            self.scaler.load_state_dict(ckpt["scaler"])
        self.state.load_state_dict(ckpt)
        note = self.strategy.restore_hook_states(ckpt.get("comm_hook"))
        if note:
            self.log.info(f"ddpkit: {note}")
        return ckpt

    def _resumed(self, path: str, ckpt: dict[str, Any]) -> None:
        row = ckpt.get("metrics_row")
        # metrics.jsonl keeps the lines of the epochs this checkpoint finished; a run that ended mid-epoch at
        # train.max_steps also keeps that epoch's line, unless training goes on (the line comes again, whole).
        ended_here = row is not None and not self._more_to_train()
        self.log.reconcile_metrics(int(row["epoch"]) if ended_here else self.state.epoch, row)
        self.resumed_after = self.state.epoch
        self.log.info(f"resumed from {path} ({self.state.describe()})")

    def _hook_states(self) -> dict[str, Any]:
        """{"comm_hook": [each rank's gradient-hook state]} (collective), or {} without a stateful hook:
        PowerSGD's error feedback is each rank's own."""
        mine = self.strategy.hook_state()
        if mine is None:
            return {}
        return {"comm_hook": gather_object_to(mine)}

    # ---- small parts of the recipe ------------------------------------------------------------
    def _save_tokenizer(self) -> None:
        """out_dir/tokenizer.json: the language model's tokenizer, for eval, a resume and `ddpkit generate`."""
        if self.ctx.is_main and self.spec.tokenizer:
            save_text(Path(self.cfg.out_dir) / tokenizer.FILE, self.spec.tokenizer)

    def _more_to_train(self) -> bool:
        return self.state.epoch < self.cfg.train.epochs and self.state.step < self.total_steps

    def _eval_due(self, epoch: int) -> bool:
        every, last = self.cfg.eval.every, self.cfg.train.epochs
        return epoch % every == 0 or epoch == last or self.state.step >= self.total_steps

    def _metrics_row(
        self, epoch: int, train: tuple[float, float | None, int], val: dict, elapsed: float
    ) -> dict:
        loss, acc1, units = train
        units -= self.state.resumed_samples  # the throughput of this process's part of the epoch
        train_fields = self.task.train_fields(loss, acc1, units, elapsed)
        speed = flops.fields(
            self.flops_per_token, train_fields["train_tokens_per_s"], self.ctx.world_size, self.peak_tflops
        )
        ended = {  # the collective ones in this order on every rank
            "lr": self.optimizer.param_groups[0]["lr"],
            "speed": speed,
            "peak_memory": largest_peak_memory(self.device),
            "skipped": data.skipped_in_epoch(self.train_set, self.val_set, epoch, self.log.info),
            "routing": self.runner.routing_fields(),
            "stall": self.saves.stalled,  # so far: the trainer adds the epoch's own checkpoint once it is saved
        }
        step, world = self.state.step, self.ctx.world_size
        return make_row(
            **measured(EpochEnd(epoch, elapsed, step, world, self.global_batch, **ended)),
            **train_fields,
            **val,
            **self._first_line_only(),
        )

    def _first_line_only(self) -> dict[str, float]:
        """The start-up, device and memory fields (and where a resumed run resumed) for this process's first
        metrics line, nothing for the others."""
        fields = self.startup or {}
        if fields:
            self.startup = {}
            fields = {**fields, "backend": str(self.ctx.backend), "device": self.device.type}
        if self.resumed_after is not None:
            fields["resumed_after"], self.resumed_after = self.resumed_after, None
        return {**fields, **self.memory.take()}

    def _finish(self, last: dict[str, Any]) -> dict[str, Any]:
        if not last:
            rows = read_metrics(self.cfg.out_dir) if self.ctx.is_main else []
            last = rows[-1] if rows else {}
            self.log.info(
                f"nothing to train: the run in {self.cfg.out_dir} already finished ({self.state.describe()})"
            )
        final = final_line(last)
        if final is not None:
            self.log.info(final)
        if self.cfg.report.curves and self.ctx.is_main and not curves.launcher_draws():
            if read_metrics(self.cfg.out_dir):
                self.log.info(f"curves: {curves.write_curves(self.cfg.out_dir)}")
        return last

    @contextlib.contextmanager
    def _closing(self):
        try:
            yield
            self.saves.wait()
        except Preempted:
            self.saves.wait()  # the rerun continues from the checkpoint this stop wrote
            raise
        except BaseException:
            self.saves.abandon()  # a failed run does not wait for its save in flight (a peer may be gone)
            raise
        finally:
            self.saves.close()
            self.log.close()
            self.run_dir.close()
            if self._own_heartbeat:
                self.heartbeat.close()


__all__ = ["Trainer"]
