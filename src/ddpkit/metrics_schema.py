"""The metrics.jsonl schema: every field of a metrics line, declared once (name, type, which lines hold it, meaning).

The trainer builds each line through `make_row` (which refuses an undeclared field or a missing one), `ddpkit
report` and `ddpkit bench` read their numbers by these names, and docs/run-dir.md's table is `doc_table()`
(a test checks that the two agree). Adding a metric is one `Field` here plus the code that measures it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

Lines = Literal["every", "first", "resumed"]


@dataclass(frozen=True)
class Field:
    """One metrics field. `lines`: every line, only the first line a run (each start of it) writes, or only the
    first line a resumed run writes. `kind`: the JSON type of its value when it is not null."""

    name: str
    kind: type
    meaning: str
    lines: Lines = "every"


_F, _I, _S = float, int, str
FIRST = "first line only: "
FIELDS: tuple[Field, ...] = (
    Field("epoch", _I, "the epoch (1-based)"),
    Field("step", _I, "optimizer steps taken when the epoch ended"),
    Field("world_size", _I, "ranks in the run"),
    Field(
        "global_batch_size",
        _I,
        "samples per optimizer step over all ranks: `train.batch_size x world_size x train.grad_accum_steps`",
    ),
    Field("lr", _F, "the learning rate at the end of the epoch (what the next optimizer step would use)"),
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
        "skipped_samples",
        _I,
        "undecodable training and validation samples left out in the epoch, all ranks (`data.skip_corrupt=true`; "
        "log.txt names their files); always 0 otherwise, since an undecodable sample then stops the run",
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


__all__ = ["BY_NAME", "EVERY_LINE", "FIELDS", "Field", "NUMERIC", "bad_value", "doc_table", "make_row"]
