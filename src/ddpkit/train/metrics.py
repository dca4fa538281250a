"""Rank 0's output: log.txt, metrics.jsonl, TensorBoard scalars, a progress bar or tutorial-style lines.

"step" means an optimizer step throughout (one update after train.grad_accum_steps micro-batches).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import torch

from ddpkit.atomicio import open_own
from ddpkit.checkpoint import save_text
from ddpkit.train.metrics_file import EVERY_LINE, read_lines

METRIC_KEYS = EVERY_LINE  # every metrics.jsonl line has these (metrics_file.FIELDS says what each holds)


class RunningSums:
    """Loss/correct/count sums kept on the device: no host sync per step; reduced over ranks once.

    The count is of samples (classification) or of tokens (a language model, `accuracy=False`: no accuracy).
    A batch costs two device operations besides its accuracy: the loss sum and the hits accumulate in tensors of
    their own, the count (known on the host) in a Python int; `t`, [loss sum, correct, count] (float64), takes
    them in when read.
    """

    def __init__(self, device: torch.device, accuracy: bool = True):
        self._t = torch.zeros(3, dtype=torch.float64, device=device)
        self._loss = torch.zeros((), dtype=torch.float64, device=device)
        self._correct = torch.zeros((), dtype=torch.int64, device=device)
        self._n, self._pending = 0, False
        self.accuracy = accuracy

    @property
    def t(self) -> torch.Tensor:
        """[loss sum, correct, count] so far (float64, on the device); changes to it in place are kept."""
        self._take_in()
        return self._t

    @t.setter
    def t(self, value: torch.Tensor) -> None:
        self._take_in()
        self._t = value

    def _take_in(self) -> None:
        if self._pending:
            self._t[0] += self._loss
            self._t[1] += self._correct
            self._t[2] += self._n
            self._loss.zero_()
            self._correct.zero_()
            self._n, self._pending = 0, False

    def add(self, loss: torch.Tensor, logits: torch.Tensor, target: torch.Tensor) -> None:
        """A classification batch: its mean loss, logits (N, classes) and labels."""
        self.count(loss, (logits.detach().argmax(dim=1) == target).sum(), target.shape[0])

    def count(self, loss: torch.Tensor, correct: torch.Tensor | int, n: int) -> None:
        """A batch of `n` counted units with mean loss `loss`, `correct` of them right."""
        self._loss.add_(loss.detach(), alpha=n)
        if isinstance(correct, torch.Tensor) or correct:
            self._correct.add_(correct)
        self._n += n
        self._pending = True

    def local(self) -> tuple[float, float | None, int]:
        """(mean loss, accuracy or None, count) of this rank so far; one host sync."""
        loss, correct, n = self.t.tolist()
        if not n:
            return math.nan, math.nan if self.accuracy else None, 0
        return loss / n, correct / n if self.accuracy else None, int(n)


def read_metrics(out_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """Every epoch line of out_dir/metrics.jsonl (a torn last line, foreign or damaged lines skipped)."""
    try:
        return read_lines(Path(out_dir) / "metrics.jsonl").rows
    except (OSError, ValueError):
        return []


def silence_stdout() -> None:
    """Point this process's stdout at /dev/null (its reader went away): later writes and the exit flush succeed."""
    try:
        fd = os.open(os.devnull, os.O_WRONLY)
        os.dup2(fd, sys.stdout.fileno())
        os.close(fd)
    except (OSError, ValueError):
        pass


def append_own(path: Path) -> TextIO:
    """Open one of ddpkit's own text files for appending, never through a symlink (atomicio.open_own)."""
    return os.fdopen(open_own(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT), "a", encoding="utf-8")


@contextlib.contextmanager
def naming(path: Path):
    """Re-raise an OSError of a write into `path` with the path in it (a write to an open file names none)."""
    try:
        yield
    except OSError as e:
        if e.filename or e.errno is None:
            raise
        raise OSError(e.errno, e.strerror, str(path)) from None


class RunLog:
    """Everything rank 0 prints or writes while training; on other ranks every method does nothing.

    Nothing is written into out_dir until open() (after every check passed): lines logged before it are printed
    and kept, then written to log.txt first. A console that goes away (`ddpkit train | head`) stops the printing,
    not the run: log.txt keeps every line.
    """

    def __init__(self, out_dir: str | os.PathLike, active: bool, stream: TextIO | None = None):
        self.active = active
        self.out_dir = Path(out_dir)
        self.stream: TextIO | None = stream or sys.stdout
        self.tty = self.stream.isatty()
        self._log: TextIO | None = None
        self._early: list[str] = []  # lines logged before open()
        self._tb = None
        self._bar = None

    def open(self) -> None:
        """Start writing log.txt (appending), with the lines logged so far."""
        if not self.active or self._log is not None:
            return
        path = self.out_dir / "log.txt"
        with naming(path):
            self._log = append_own(path)
            self._log.writelines(self._early)
            self._log.flush()
        self._early = []

    def info(self, msg: str) -> None:
        """A line on the console and in log.txt."""
        if not self.active:
            return
        bar = self._bar
        self._console(
            lambda: bar.write(msg, file=self.stream) if bar else print(msg, file=self.stream, flush=True)
        )
        line = f"{time.strftime('%Y-%m-%d %H:%M:%S')} {msg}\n"
        if self._log is None:
            self._early.append(line)
            return
        with naming(self.out_dir / "log.txt"):
            self._log.write(line)
            self._log.flush()

    def record(self, msg: str) -> None:
        """A line in log.txt only, from any rank (its own failure), once rank 0 has started log.txt; the lines
        of several ranks are appended whole (one write each)."""
        path = self.out_dir / "log.txt"
        if not path.is_file():
            return
        with contextlib.suppress(OSError), append_own(path) as fh:
            fh.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {msg}\n")

    def _console(self, write) -> None:
        """Write to the console unless it went away; a closed pipe ends the printing, never the run."""
        if self.stream is None:
            return
        try:
            write()
        except (BrokenPipeError, ValueError):  # the reader exited / the stream was closed
            self.stream, self.tty, self._bar = None, False, None
            silence_stdout()

    def epoch_start(self, epoch: int, epochs: int, steps: int, initial: int = 0) -> None:
        """A progress bar over the epoch's `steps` optimizer steps (on a terminal), `initial` of them done."""
        if self.active and self.tty and self.stream is not None:
            from tqdm import tqdm

            self._bar = tqdm(
                total=steps,
                initial=initial,
                desc=f"epoch {epoch}/{epochs}",
                file=self.stream,
                dynamic_ncols=True,
                leave=False,
            )

    def step(
        self, step_in_epoch: int, steps: int, epoch: int, epochs: int, sums: RunningSums | None, every: int
    ) -> None:
        """After optimizer step `step_in_epoch` of `steps`: advance the bar; without a terminal, a line shaped
        like the tutorials' every `every` steps and at the epoch's last."""
        if not self.active:
            return
        if self._bar is not None:
            bar = self._bar
            self._console(lambda: bar.update(1))
            if sums is not None and step_in_epoch % every == 0:
                loss, acc, _ = sums.local()
                shown = {"loss": f"{loss:.3f}"} | ({"acc": f"{100 * acc:.2f}%"} if acc is not None else {})
                self._console(lambda: bar.set_postfix(**shown))
        elif sums is not None and (step_in_epoch % every == 0 or step_in_epoch == steps):
            loss, acc, _ = sums.local()
            w = len(str(steps))
            self.info(
                f"== step: [{step_in_epoch:>{w}}/{steps}] [{epoch}/{epochs}] | loss: {loss:.3f}"
                + (f" | acc: {100 * acc:.3f}%" if acc is not None else "")
            )

    def epoch_end(self) -> None:
        if self._bar is not None:
            bar, self._bar = self._bar, None
            self._console(bar.close)

    def metrics(self, row: dict[str, Any]) -> None:
        """Append one epoch's line to metrics.jsonl (fsynced) and its scalars to TensorBoard."""
        if not self.active:
            return
        path = self.out_dir / "metrics.jsonl"
        with naming(path), append_own(path) as fh:
            fh.write(json.dumps(row) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        tb = self._tensorboard()
        if tb is not None:
            for key, value in row.items():
                if key != "epoch" and isinstance(value, (int, float)) and value is not None:
                    tb.add_scalar(key, value, row["epoch"])
            tb.flush()

    def reconcile_metrics(self, epoch: int, row: dict[str, Any] | None) -> None:
        """Make metrics.jsonl hold exactly epochs 1..epoch of the checkpoint we resume from.

        A crash between the checkpoint and its metrics line leaves the line missing (the checkpoint carries
        it); a fallback to an older checkpoint leaves lines of epochs that will be trained again (dropped).
        """
        if not self.active:
            return
        rows = read_metrics(self.out_dir)
        keep = [r for r in rows if int(r.get("epoch", 0)) <= epoch]
        if (
            row is not None
            and int(row.get("epoch", 0)) == epoch
            and all(int(r["epoch"]) != epoch for r in keep)
        ):
            keep.append(row)
        if keep != rows:
            save_text(self.out_dir / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in keep))

    def _tensorboard(self):
        if self._tb is None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # tensorboard is optional at run time
                self._tb = False
                return None
            self._tb = SummaryWriter(log_dir=str(self.out_dir / "tensorboard"))
        return self._tb or None

    def close(self) -> None:
        self.epoch_end()
        if self._tb:
            self._tb.close()
        if self._log is not None:
            self._log.close()
            self._log = None


# ---- the run's own lines in log.txt ---------------------------------------------------------------------


def banner(t: Any) -> str:
    """The line a Trainer `t` starts with: processes, backend, device, strategy and layout, batch, lr, steps."""
    cfg, ctx, d, lay = t.cfg, t.ctx, t.cfg.dist, t.layout
    pipe = f", pipeline {d.pp} stages ({d.pp_schedule})" if lay.pp > 1 else ""
    experts = f" x ep={lay.ep}" if lay.ep > 1 else ""  # the routed experts split over ep of the dp ranks
    over = f" over dp={lay.dp} x tp={lay.tp} x pp={lay.pp}{experts}" if lay.parallel or lay.ep > 1 else ""
    return (
        f"ddpkit: {ctx.world_size} process(es), backend {ctx.backend}, device {t.device.type}, "
        f"strategy {t.strategy.name}{pipe}{over}, global batch {t.global_batch} "
        f"({cfg.train.batch_size} x {t.replicas} x {cfg.train.grad_accum_steps}), lr {t.lr:g}, "
        f"{t.steps_per_epoch} optimizer steps/epoch"
    )


def epoch_line(row: dict[str, Any], epochs: int, task: Any) -> str:
    """`epoch 3/5 | the task's numbers | 2.1s` for a metrics line."""
    return f"epoch {row['epoch']}/{epochs} | {task.epoch_text(row)} | {row['epoch_time_s']:.1f}s"


def final_line(last: dict[str, Any]) -> str | None:
    """The last metrics line's validation result in words (None without one)."""
    if last.get("val_acc1") is not None:
        return f"final val_acc1 {last['val_acc1']:.4f} ({100 * last['val_acc1']:.2f}%) on {last['val_samples']} samples"
    if last.get("val_ppl") is not None:
        return (
            f"final val_loss {last['val_loss']:.4f} (perplexity {last['val_ppl']:.2f}) "
            f"on {last['val_samples']} samples"
        )
    return None
