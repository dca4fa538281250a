"""The schema's own sections: the keys every run has (typed dataclasses, each key's type, bounds and meaning beside
it, `opt()`). A model family's or a compression method's own keys are declared into these sections by their owners
(config/declared.py: model.n_layer by the transformer families, dist.powersgd_rank by PowerSGD); a loaded config's
section is an instance of the section's class with those keys added (`declared.section_class`), built once per
set of declarations; these classes themselves never change."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from ddpkit.config.declared import (
    declared_default,
    generation,
    load_declarers,
    own_sections,
    remade,
    section_class,
    section_of,
)
from ddpkit.config.schema import Spec, opt, spec_of

# torch turns dist.timeout_s into a timedelta: an infinite or huge one crashes the workers (OverflowError)
MAX_TIMEOUT_S = 7 * 24 * 3600


class Section:
    """What every section's class has besides its keys: a key declared after the instance was made reads as its
    default, and a pickled instance is read back as the section's class of the reader's declarations."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return declared_default(section_of(self), name)

    def __reduce__(self) -> tuple[Any, ...]:
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return remade, (section_of(self), values)


@dataclass
class DataConfig(Section):
    """The training and validation data, and how it is loaded."""

    dataset: str = opt(
        "digits",
        "digits (scikit-learn's 8x8 handwritten digits, shipped with it), synthetic (generated), cifar10, "
        "cifar100, mnist, imagefolder (data.root/train/CLASS/* and data.root/val/CLASS/*), text (characters of "
        "data.root, a UTF-8 file or folder; left at its default: the running Python's standard-library sources, "
        "for a language model's model.arch), tokens (data.root/train.bin and val.bin: token ids, nanoGPT's "
        "format), or a data set registered with ddpkit.data.register_dataset or the ddpkit.datasets entry point",
        nonblank=True,
    )
    root: str = opt("data", "the folder that holds the data set's files")
    num_workers: int = opt(0, "DataLoader worker processes per training process (0: load in it)", ge=0)
    download: bool = opt(False, "let torchvision download cifar10, cifar100 or mnist into data.root")
    synthetic_size: int = opt(2048, "training samples of the synthetic data set", gt=0)
    synthetic_val_size: int = opt(512, "validation samples of the synthetic data set", gt=0)
    image_size: int | None = opt(
        None,
        "image side in pixels; null: the data set's own (digits 8, synthetic 32, cifar 32, mnist 28, "
        "imagefolder 224)",
        gt=0,
    )
    augment: bool = opt(
        True,
        "random training augmentation, each rank its own stream; false: the same batches on any world size",
    )
    pin_memory: bool = opt(
        True, "page-locked loader batches for faster copies to the GPU (used only with CUDA)"
    )
    block_size: int = opt(
        128,
        "text, tokens: tokens of context per sample; a multiple of dist.tp where sequence parallelism splits it "
        "(NCCL, no pipeline)",
        gt=1,
    )
    tokenizer: Literal["char", "bpe"] = opt(
        "char",
        "text: char (every distinct character one token) or bpe (a byte-level BPE of data.vocab_size tokens "
        "trained on the training split, or read from data.tokenizer_file); saved as out_dir/tokenizer.json",
    )
    vocab_size: int | None = opt(
        None,
        "bpe: the most tokens to train (at least 256, at most 1048576; null: 1024; a short text may give fewer); "
        "tokens: every id is below it (null: the vocab_size of nanoGPT's meta.pkl beside the files, else 1 + the "
        "largest id of the files)",
        gt=0,
        le=2**32,
    )
    tokenizer_file: str | None = opt(
        None,
        "a tokenizer.json (Hugging Face tokenizers) to use instead of training one (data.tokenizer=bpe), or, "
        "with data.dataset=tokens, the one that made the files (for ddpkit generate; null: nanoGPT's meta.pkl "
        "beside train.bin when there is one)",
    )
    token_dtype: Literal["auto", "uint16", "uint32"] = opt(
        "auto",
        "tokens: the files' integer type; auto: uint16 when data.vocab_size is unset or at most 65536 (as "
        "nanoGPT writes them), uint32 above",
    )
    text_bytes: int = opt(
        1_000_000,
        "text: read at most this many bytes of data.root (or of the default source)",
        gt=0,
        le=2**30,
    )
    skip_corrupt: bool = opt(
        False,
        "false: an undecodable sample (a damaged image file) is an error naming the file; true: it is left "
        "out, counted (metrics field skipped_samples) and named in log.txt",
    )


@dataclass
class ModelConfig(Section):
    """The network."""

    arch: str = opt(
        "cnn",
        "the model: {values}, or a family registered with ddpkit.models.register_model or the ddpkit.models "
        "entry point",
        aka=("type", "name"),
    )
    num_classes: int | None = opt(None, "output classes; null: the data set's", gt=0)
    sync_bn: bool = opt(
        False, "SyncBatchNorm: batch statistics over every process's micro-batch, not each one's own"
    )
    channels_last: bool = opt(
        True,
        "channels_last memory format for the model and its 4-d inputs (faster convolutions; under fsdp and zero2 the parameters stay contiguous, as FSDP2 requires)",
    )
    compile: bool = opt(False, "torch.compile the model")
    pretrained: str | None = opt(
        None, "initial weights: a weights file (read with weights_only=True) or torchvision; null: random"
    )
    activation_checkpointing: Literal["none", "full", "selective"] = opt(
        "none",
        "none; full: every block's activations re-computed in backward (less memory, more compute); selective: "
        "each block keeps its matmul and attention outputs and re-computes the cheap ops between them (torch's "
        "op-level selective recomputation: memory and time between none and full)",
    )


@dataclass
class TrainConfig(Section):
    """The training loop."""

    epochs: int = opt(25, "passes over the training set", gt=0, aka=("max_epoch", "num_epochs"))
    max_steps: int | None = opt(
        None, "stop after this many optimizer steps in the whole run; null: no cap", gt=0
    )
    batch_size: int = opt(64, "samples in one micro-batch: what one process feeds forward at once", gt=0)
    grad_accum_steps: int = opt(
        1, "micro-batches per optimizer step (gradients are synchronised on the last one only)", gt=0
    )
    amp: Literal["none", "bf16", "fp16"] = opt(
        "none", "autocast dtype of the forward pass; fp16 adds a gradient scaler"
    )
    label_smoothing: float = opt(
        0.2, "label smoothing of the classification loss (a language model's loss takes none)", ge=0, lt=1
    )
    deterministic: bool = opt(
        False,
        "deterministic kernels (cuDNN, cuBLAS, torch.use_deterministic_algorithms): a run and a resumed run repeat "
        "bit for bit on GPUs too (on CPUs they do anyway); slower on GPUs",
    )
    clip_grad_norm: float | None = opt(
        None, "clip the gradient norm to this before each optimizer step; null: no clipping", gt=0
    )
    peak_tflops: float | None = opt(
        None,
        "the device's peak TFLOP/s in the training dtype, for the metrics field mfu; null: known for some NVIDIA "
        "GPUs under train.amp=bf16 or fp16 (H100, H200, A100, L40S, L4, A10, V100), else no mfu",
        gt=0,
    )
    log_every: int = opt(10, "log the running loss and accuracy every N optimizer steps", gt=0)
    nonfinite: Literal["stop", "skip"] = opt(
        "stop",
        "on a non-finite loss: stop (every rank, naming the rank and step) or skip (drop that optimizer step)",
    )


@dataclass
class OptimConfig(Section):
    """The optimizer and the learning-rate schedule."""

    name: Literal["sgd", "adamw"] = opt("sgd", "the optimizer")
    lr: float = opt(
        1.0,
        "learning rate at optim.ref_batch_size; the one used is lr x global batch / ref_batch_size",
        gt=0,
        aka=("base_lr", "learning_rate"),
    )
    ref_batch_size: int | None = opt(
        256, "the global batch optim.lr is meant for (linear scaling rule); null: lr as given", gt=0
    )
    schedule: Literal["cosine", "step", "constant"] = opt(
        "cosine",
        "lr per optimizer step after warmup: cosine (down to 0 at the last step), step (x optim.step_gamma "
        "every optim.step_size epochs), constant",
        aka=("lr_policy", "scheduler"),
    )
    warmup_epochs: float = opt(1.0, "linear lr warmup over this many epochs (fractions allowed)", ge=0)
    momentum: float = opt(0.9, "SGD momentum (sgd only)", ge=0)
    nesterov: bool = opt(True, "Nesterov momentum (sgd only, when optim.momentum > 0)")
    weight_decay: float = opt(5e-4, "weight decay, on every trainable parameter", ge=0)
    step_size: int = opt(30, "epochs between lr decays (schedule=step)", gt=0)
    step_gamma: float = opt(0.1, "lr multiplier at each decay (schedule=step)", gt=0)


@dataclass
class DistConfig(Section):
    """The process group and how the model is spread over it."""

    backend: Literal["auto", "gloo", "nccl", "mpi"] = opt(
        "auto", "torch.distributed backend; auto: nccl on CUDA devices, gloo otherwise"
    )
    strategy: str = opt(
        "auto",
        "what happens over the data-parallel ranks: {values}, or one registered with "
        "ddpkit.parallel.register_strategy or the ddpkit.strategies entry point",
        nonblank=True,
    )
    tp: int = opt(1, "tensor-parallel degree: each layer's matrices split over this many ranks", gt=0)
    pp: int = opt(1, "pipeline-parallel degree: the model cut into this many stages", gt=0)
    dp_shard: int | None = opt(None, "hsdp: ranks per sharding group; null: the processes per node", gt=0)
    ep: int = opt(
        1,
        "expert-parallel degree: a mixture of experts' routed experts split over this many of the data-parallel "
        "ranks, each token sent to its experts' rank and back (all-to-all)",
        gt=0,
    )
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b", "interleaved_zb", "zbv", "dualpipev"] = opt(
        "1f1b",
        "pipeline schedule (torch.distributed.pipelining); interleaved_1f1b and interleaved_zb run two stages "
        "per rank in a loop, zbv and dualpipev two per rank in a V; the last three split each backward to fill "
        "the bubble (zero bubble)",
    )
    pp_microbatches: int | None = opt(
        None, "micro-batches per optimizer step through the pipeline; null: 2 x dist.pp", gt=0
    )
    offload: Literal["none", "cpu"] = opt(
        "none", "cpu: parameters, gradients and optimizer state kept in CPU memory (fsdp, zero2)"
    )
    memory: Literal["fast", "lean"] = opt(
        "fast",
        "lean: the least memory per rank under fsdp, hsdp and zero2: each block's attention and MLP gathered "
        "as units of their own, no backward prefetch, and in CPU processes every tensor above 1 MiB given back "
        "on free (DDPKIT_MALLOC_TUNE=1 unless it is set); twice the collectives and more page faults a step",
    )
    timeout_s: float = opt(
        600.0,
        "collective timeout in seconds (7 days at most): a stuck or failed worker ends the job within it",
        gt=0,
        le=MAX_TIMEOUT_S,
    )
    device: Literal["auto", "cpu", "cuda"] = opt("auto", "auto: cuda when a GPU is seen, unless backend=gloo")
    grad_compression: str = opt(
        "none",
        "compress DDP's gradient all-reduce with torch's communication hooks: none, fp16 or bf16 (half the "
        "bytes), powersgd (a low-rank approximation), or a method registered with "
        "ddpkit.parallel.compression.register_compression or the ddpkit.compression entry point (ddp and "
        "zero1 only; one process has nothing to send)",
        nonblank=True,
    )
    bucket_cap_mb: float | None = opt(
        None, "DDP's gradient bucket size in MiB; null: torch's default (25)", gt=0
    )
    static_graph: bool = opt(False, "DDP static_graph=True: the same parameters take part in every step")
    grad_as_bucket_view: bool = opt(
        False, "DDP gradient_as_bucket_view=True: gradients live in the buckets (less memory, one copy fewer)"
    )


@dataclass
class CheckpointConfig(Section):
    """Saving and resuming."""

    resume: str = opt(
        "auto",
        "auto (the newest complete checkpoint in out_dir, if any), none, or a checkpoint file",
        nonblank=True,
    )
    keep: int = opt(3, "epoch checkpoints to keep (last.pt and best.pt besides)", gt=0)
    format: Literal["full", "sharded"] = opt(
        "full",
        "full: one torch.save file written by rank 0; sharded: torch.distributed.checkpoint, one folder in "
        "which each rank writes its own shards (loading reads either, at any world size and layout)",
    )
    async_save: bool = opt(
        False,
        "true (with format=sharded): each checkpoint's state is staged, a copy in memory kept for the run, "
        "during the next forward and backward (the optimizer step waits for it), and written in the background "
        "(torch.distributed.checkpoint.async_save) while training goes on; at most one save in flight, the next "
        "one, a stop and the run's end wait for it",
    )
    path: str | None = opt(None, "the checkpoint that `ddpkit eval` scores")
    every_steps: int = opt(0, "also checkpoint every N optimizer steps (0: only at epoch ends)", ge=0)
    every_minutes: float = opt(0.0, "also checkpoint every N minutes of training (0: off)", ge=0)
    overwrite: bool = opt(
        False,
        "false: an out_dir holding an earlier run is continued (resume=auto) or refused; true: the earlier run "
        "is moved aside into out_dir/previous/DATE-TIME/ (never deleted) and a new run starts",
    )


@dataclass
class EvalConfig(Section):
    """Validation: every validation sample is scored exactly once, whatever the world size."""

    every: int = opt(1, "evaluate every N epochs (and always after the last)", gt=0)
    batch_size: int | None = opt(None, "samples per process per forward; null: train.batch_size", gt=0)


@dataclass
class ReportConfig(Section):
    """What rank 0 draws at the end of training."""

    curves: bool = opt(
        True, "write out_dir/curves.png (loss, accuracy, lr, images/s per epoch) when training ends"
    )


def section(cls: type, *aka: str) -> Any:
    """A config section (a nested dataclass), made once the declaring modules have added their keys to it;
    `aka` are other frameworks' names for it, used in suggestions."""

    def make() -> Any:
        return section_class(section_of_class(cls))()

    return field(default_factory=make, metadata={"aka": aka, "cls": cls})


@dataclass
class Config:
    """A whole run's config: the top-level keys, then one dataclass per section."""

    out_dir: str = opt(
        "runs/default",
        "the run directory: config.yaml, log.txt, metrics.jsonl and checkpoints/",
        nonblank=True,
        aka=("output_dir",),
    )
    seed: int = opt(
        0,
        "base seed: initial weights, data order and each rank's augmentation derive from it",
        ge=-(2**63),
        lt=2**63,  # a 64-bit integer, which torch.manual_seed accepts
    )
    data: DataConfig = section(DataConfig)
    model: ModelConfig = section(ModelConfig)
    train: TrainConfig = section(TrainConfig)
    optim: OptimConfig = section(OptimConfig)
    dist: DistConfig = section(DistConfig)
    checkpoint: CheckpointConfig = section(CheckpointConfig)
    eval: EvalConfig = section(EvalConfig, "test")
    report: ReportConfig = section(ReportConfig)


def section_of_class(cls: type) -> str:
    """The name of the section whose own dataclass is `cls`."""
    return next(n for n, f in _SECTION_FIELDS.items() if f.metadata["cls"] is cls)


def section_fields() -> dict[str, dataclasses.Field]:
    """Section name -> its field in Config (metadata: its dataclass, "cls", and its aka names)."""
    return _SECTION_FIELDS


_SECTION_FIELDS = {f.name: f for f in dataclasses.fields(Config) if "cls" in f.metadata}
own_sections({n: f.metadata["cls"] for n, f in _SECTION_FIELDS.items()})
_specs: dict[int, dict[str, Spec]] = {}


def key_specs() -> dict[str, Spec]:
    """Every dotted leaf key -> its Spec, in schema order: a section's own keys, then those declared into it."""
    load_declarers()
    if generation() not in _specs:
        out: dict[str, Spec] = {}
        for prefix, cls in [("", Config)] + [(f"{n}.", section_class(n)) for n in _SECTION_FIELDS]:
            hints = typing.get_type_hints(cls)
            for f in dataclasses.fields(cls):
                if "cls" not in f.metadata:
                    out[prefix + f.name] = spec_of(prefix + f.name, f, hints[f.name])
        _specs.clear()
        _specs[generation()] = out
    return _specs[generation()]


def valid_keys() -> list[str]:
    """Every dotted leaf key of the schema, in schema order."""
    return list(key_specs())
