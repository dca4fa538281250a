"""metrics.jsonl without torch: its schema, and reading the epoch lines ddpkit wrote.

The schema declares every field of a metrics line once (name, type, which lines hold it, meaning, and how the
trainer reads its value when an epoch ends): the trainer builds each line through `make_row` (which refuses an
undeclared field or a missing one) from `measured(EpochEnd(...))`, `ddpkit report` and `ddpkit bench` read their
numbers by these names, and docs/run-dir.md's table is `doc_table()` (a test checks that the two agree). Adding
a metric is one `Field` here, its `value` taking it from the `EpochEnd` the trainer hands over at the epoch's end
(one value there); no field reads the trainer. Reading keeps the epoch
lines and skips and counts every other line (foreign text, a damaged or torn line, one nested too deeply, an
epoch that is not a number), never fatal."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ddpkit.config.bounded import loads_json

Lines = Literal["every", "first", "resumed"]


@dataclass(frozen=True)
class Field:
    """One metrics field. `lines`: every line, only the first line a run (each start of it) writes, or only the
    first line a resumed run writes. `kind`: the JSON type of its value when it is not null."""

    name: str
    kind: type
    meaning: str
    lines: Lines = "every"
    # its value at the end of an epoch, taken from an EpochEnd; None: the task gives it (train_*), the evaluation
    # (val_*), or the run's first line (start-up, device and memory: measured once, train/trainer.py)
    value: Callable[[EpochEnd], Any] | None = None


@dataclass(frozen=True)
class EpochEnd:
    """The values an epoch's metrics line records, handed over by the trainer when the epoch ends."""

    epoch: int
    elapsed: float  # the epoch's own seconds
    step: int  # optimizer steps taken
    world_size: int
    global_batch: int  # samples per optimizer step over all ranks
    lr: float  # what the next optimizer step would use
    speed: dict[str, Any]  # flops_per_token, tflops_per_s_per_rank and mfu (models.flops.fields)
    peak_memory: int  # the largest peak memory of the ranks (train.memory.largest_peak_memory: collective)
    skipped: int  # undecodable samples left out in the epoch, all ranks (data.skipped_in_epoch: collective)
    # a mixture of experts' moe_aux_loss, moe_balance_max, moe_balance_mean (train/steps/experts.py: collective);
    # empty for a dense model
    routing: dict[str, Any] = field(default_factory=dict)
    stall: float = 0.0  # seconds training was blocked by checkpointing in the epoch so far


_F, _I, _S = float, int, str
FIRST = "first line only: "
FIELDS: tuple[Field, ...] = (
    Field("epoch", _I, "the epoch (1-based)", value=lambda e: e.epoch),
    Field("step", _I, "optimizer steps taken when the epoch ended", value=lambda e: e.step),
    Field("world_size", _I, "ranks in the run", value=lambda e: e.world_size),
    Field(
        "global_batch_size",
        _I,
        "samples per optimizer step over all ranks: `train.batch_size x world_size x train.grad_accum_steps`",
        value=lambda e: e.global_batch,
    ),
    Field(
        "lr",
        _F,
        "the learning rate at the end of the epoch (what the next optimizer step would use)",
        value=lambda e: e.lr,
    ),
    Field(
        "train_loss",
        _F,
        "mean training loss over the epoch's samples, all ranks (a language model: per token)",
    ),
    Field(
        "train_acc1",
        _F,
        "training top-1 accuracy over the epoch's samples, all ranks, a fraction in [0, 1]; `null` for a "
        "language model",
    ),
    Field(
        "val_loss",
        _F,
        "mean validation loss (a language model: next-token cross-entropy per token, in nats); `null` in epochs "
        "without evaluation (`eval.every`)",
    ),
    Field(
        "val_acc1",
        _F,
        "validation top-1 accuracy, a fraction in [0, 1]; `null` without evaluation and for a language model",
    ),
    Field(
        "val_acc5",
        _F,
        "validation top-5 accuracy, a fraction in [0, 1]; `null` without evaluation and for a language model",
    ),
    Field(
        "val_ppl",
        _F,
        "a language model's validation perplexity, `exp(val_loss)`; `null` without evaluation and for classifiers",
    ),
    Field(
        "val_samples",
        _I,
        "validation samples scored, each exactly once whatever the world size; `null` without evaluation",
    ),
    Field(
        "epoch_time_s",
        _F,
        "seconds of the epoch: training and evaluation (after a resume: the resumed part)",
        value=lambda e: round(e.elapsed, 4),
    ),
    Field(
        "train_images_per_s",
        _F,
        "training samples over all ranks divided by `epoch_time_s` (after a resume: those of the resumed part); "
        "a language model's samples are its blocks of `data.block_size` tokens",
    ),
    Field(
        "train_tokens_per_s",
        _F,
        "a language model's training tokens over all ranks divided by `epoch_time_s`; `null` for classifiers",
    ),
    Field(
        "flops_per_token",
        _I,
        "a language model's training FLOPs per token, 6 N + 12 L d T (parameters N, blocks L, width d, context T: "
        "docs/language-model.md); `null` for classifiers",
        value=lambda e: e.speed["flops_per_token"],
    ),
    Field(
        "tflops_per_s_per_rank",
        _F,
        "achieved model TFLOP/s per rank: `flops_per_token x train_tokens_per_s / world_size / 1e12`; `null` for "
        "classifiers",
        value=lambda e: e.speed["tflops_per_s_per_rank"],
    ),
    Field(
        "mfu",
        _F,
        "model FLOPs utilization: `tflops_per_s_per_rank` / the device's peak (`train.peak_tflops`, or a known "
        "GPU's bf16/fp16 peak under `train.amp`); `null` when no peak is known",
        value=lambda e: e.speed["mfu"],
    ),
    Field(
        "moe_aux_loss",
        _F,
        "a mixture of experts' load-balancing loss over the epoch's training sequences, the mean over its MoE "
        "blocks (E x sum_i f_i P_i of a sequence: 1 when its tokens are spread evenly; `model.moe_aux_loss` x this "
        "joins the loss); `null` for a dense model",
        value=lambda e: e.routing.get("moe_aux_loss"),
    ),
    Field(
        "moe_balance_max",
        _F,
        "a mixture of experts' load over the epoch's training tokens: the tokens of a block's busiest expert over "
        "the mean of its experts (1: even), the largest of the MoE blocks; `null` for a dense model",
        value=lambda e: e.routing.get("moe_balance_max"),
    ),
    Field(
        "moe_balance_mean",
        _F,
        "the same load (busiest expert over the mean), the mean of the MoE blocks; `null` for a dense model",
        value=lambda e: e.routing.get("moe_balance_mean"),
    ),
    Field(
        "peak_memory_bytes_per_rank",
        _I,
        "the largest peak memory of the ranks so far: CUDA's max allocated bytes on a GPU, the process's peak "
        "resident set size on a CPU",
        value=lambda e: e.peak_memory,
    ),
    Field(
        "skipped_samples",
        _I,
        "undecodable training and validation samples left out in the epoch, all ranks (`data.skip_corrupt=true`; "
        "log.txt names their files); always 0 otherwise, since an undecodable sample then stops the run",
        value=lambda e: e.skipped,
    ),
    Field(
        "checkpoint_stall_s",
        _F,
        "seconds training was blocked by checkpointing in the epoch (rank 0's): its checkpoints inside it (checkpoint.every_*) "
        "and the one at its end; with `checkpoint.async_save=true` only the waits for the save in flight (the next "
        "save, a stop and the run's end wait for it), the start of each save, and the wait before the next "
        "optimizer step for its staging, the write itself running in the background (the line a checkpoint "
        "carries, restored after a crash, counts up to that checkpoint)",
        value=lambda e: round(e.stall, 4),
    ),
    Field(
        "startup_s",
        _F,
        "only in the first line a run writes: seconds from the command's start to the end of its first "
        "optimizer step (rank 0's); the sum of the six parts below",
        "first",
    ),
    Field(
        "startup_launcher_s",
        _F,
        FIRST + "from the command's start until this worker process started (the launcher's imports, its "
        "rendezvous, starting the workers, and the imports that the fork server made for them, see "
        "docs/launching.md; 0 without a ddpkit launcher, e.g. under `torchrun` or `srun`, where the count starts "
        "at the process's own start). After a restart (`--max-restarts`) it includes the attempts before",
        "first",
    ),
    Field(
        "startup_import_s",
        _F,
        FIRST
        + "from the worker's start until it joins the process group (Python, imports, arguments, config, "
        "checks)",
        "first",
    ),
    Field(
        "startup_rendezvous_s",
        _F,
        FIRST + "joining the process group (0 when the script made it itself)",
        "first",
    ),
    Field("startup_data_s", _F, FIRST + "building the data sets", "first"),
    Field(
        "startup_model_s",
        _F,
        FIRST + "the model, its parallel wrapper, the loaders and the optimizer",
        "first",
    ),
    Field(
        "startup_first_step_s",
        _F,
        FIRST
        + "the rest until the first optimizer step has ended (resume check, first micro-batches, forward, "
        "backward, gradient sync, update)",
        "first",
    ),
    Field(
        "param_bytes_per_rank",
        _I,
        FIRST + "bytes of the parameters this rank holds, measured just before its first optimizer step (a "
        "sharded parameter counts its local shard; every storage once)",
        "first",
    ),
    Field(
        "grad_bytes_per_rank",
        _I,
        FIRST + "bytes of the gradients this rank holds just before its first optimizer step (local shards; "
        "DDP's bucket views counted once)",
        "first",
    ),
    Field(
        "optim_bytes_per_rank",
        _I,
        FIRST
        + "bytes of the optimizer state this rank holds just after its first optimizer step (zero1: its "
        "own partition's; fsdp: its shards)",
        "first",
    ),
    Field(
        "backend",
        _S,
        FIRST + "the backend the run talks over (`gloo`, `nccl`; also named on one process)",
        "first",
    ),
    Field("device", _S, FIRST + "the device type the run trained on (`cpu`, `cuda`)", "first"),
    Field(
        "resumed_after",
        _I,
        "only in the first line a resumed run writes: the epochs its checkpoint had finished (`ddpkit report` "
        "marks the resume there)",
        "resumed",
    ),
)

BY_NAME = {f.name: f for f in FIELDS}
EVERY_LINE = tuple(f.name for f in FIELDS if f.lines == "every")
NUMERIC = tuple(f.name for f in FIELDS if f.kind in (int, float))


def measured(end: EpochEnd) -> dict[str, Any]:
    """{name: value} of every field the schema reads itself at the end of an epoch (in schema order)."""
    return {f.name: f.value(end) for f in FIELDS if f.value is not None}


def make_row(**values: Any) -> dict[str, Any]:
    """A metrics line in schema order; ValueError for an undeclared field or a missing every-line field."""
    unknown = sorted(set(values) - set(BY_NAME))
    missing = [name for name in EVERY_LINE if name not in values]
    if unknown or missing:
        raise ValueError(f"metrics line: undeclared fields {unknown}, missing fields {missing}")
    return {f.name: values[f.name] for f in FIELDS if f.name in values}


def bad_value(row: dict[str, Any]) -> str | None:
    """The first declared field of `row` whose value has the wrong JSON type (None when all fit)."""
    for name, value in row.items():
        field = BY_NAME.get(name)
        if field is None or value is None:
            continue
        if field.kind is str:
            ok = isinstance(value, str)
        else:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not ok:
            return name
    return None


def doc_table() -> str:
    """docs/run-dir.md's table of the fields (one row each)."""
    rows = [f"| `{f.name}` | {f.meaning} |" for f in FIELDS]
    return "\n".join(["| field | meaning |", "| --- | --- |", *rows])


MAX_METRICS_BYTES = 64 << 20  # a run of 10,000 epochs writes about 5 MiB
MAX_LINE_BYTES = 1 << 20


@dataclass
class MetricsLines:
    """The epoch lines of one metrics.jsonl in file order, and the numbers of the lines that were skipped."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    numbers: list[int] = field(default_factory=list)  # each row's 1-based line number
    skipped: list[int] = field(default_factory=list)  # 1-based line numbers
    torn_last: bool = False  # the last line is cut short (a run killed mid-write): not counted as skipped

    def note(self, path: Path) -> str | None:
        """A warning line naming the skipped lines, or None."""
        if not self.skipped:
            return None
        skipped = sorted(self.skipped)
        shown = ", ".join(map(str, skipped[:5])) + (", ..." if len(self.skipped) > 5 else "")
        n = len(self.skipped)
        return (
            f"ddpkit: warning: '{path}': {n} line{'s' if n > 1 else ''} ({shown}) not ddpkit metrics, skipped"
        )


def epoch_of(row: Any) -> int | None:
    """A metrics line's epoch number (an int >= 1), or None when the line is not one of ddpkit's."""
    epoch = row.get("epoch") if isinstance(row, dict) else None
    return epoch if isinstance(epoch, int) and not isinstance(epoch, bool) and epoch >= 1 else None


def read_lines(path: str | os.PathLike) -> MetricsLines:
    """Every epoch line of `path` (missing: none). OSError when it cannot be read; ValueError when it is larger
    than MAX_METRICS_BYTES."""
    path = Path(path)
    out = MetricsLines()
    if not path.is_file():
        return out
    if path.stat().st_size > MAX_METRICS_BYTES:
        raise ValueError(f"is larger than {MAX_METRICS_BYTES >> 20} MiB")
    lines = path.read_bytes().split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    for i, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            if len(raw) > MAX_LINE_BYTES:
                raise ValueError("too long")
            row = loads_json(raw.decode("utf-8"))
        except ValueError:  # not JSON, not UTF-8, nested too deeply
            if i == len(lines):
                out.torn_last = True
            else:
                out.skipped.append(i)
            continue
        if epoch_of(row) is None:
            out.skipped.append(i)
            continue
        out.rows.append(row)
        out.numbers.append(i)
    return out
