"""What a model family is: the model.arch names it owns, a cheap check of a name, the builder, and its parallel
facts (its tensor-parallel plan, where a pipeline cuts it, the blocks activation checkpointing re-computes), its
FLOPs per token and its own config keys, and optionally its converters to and from other weight formats
(`HFConverter`: Hugging Face folders). Every family, built in or from a package, is one `ModelFamily` in the
registry (ddpkit.models); parallel/, train/, the commands and the weight formats (models/hf.py) ask the family and
name no model. A stack-of-blocks model gets all of its parallel facts from one `ddpkit.models.blocks.BlockStack`.

A built-in family is a folder of models/ (`gpt/`, `llama/`, ...): its torch-free `keys.py` holds its `FamilyCard`
(what the command line asks before torch is imported: its config keys, what its names mean, whether it is a
language model, what a worker imports to build it) and `model.py` its model and its `ModelFamily`."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ddpkit.errors import UserError

if TYPE_CHECKING:
    from pathlib import Path

    from torch import Tensor, nn

    from ddpkit.models.init import Step


@dataclass(frozen=True)
class FamilyCard:
    """What is known of a built-in family before torch is imported (its folder's keys.py): the questions the
    command line asks while the workers start, and the config schema's. Its `ModelFamily` (model.py) takes its
    name and keys from here (`ModelFamily(..., **CARD.fields())`); a test holds the two to the same facts."""

    name: str
    summary: str  # what its model.arch names mean, in the config reference: "gpt (the built-in ...)"
    keys: tuple[type, ...] = ()  # its own config keys (ModelFamily.keys)
    # the names it owns, told without torch (None: only its family can tell, e.g. torchvision's list)
    owns: Callable[[str], bool] | None = None
    tokens: bool = False  # a language model (trained on token sequences): ModelFamily.tokens
    preload: tuple[str, ...] = ()  # modules a worker imports to build it, besides torch and the trainer
    # (model.arch, cfg.model) -> this family builds a config that names another family's arch (the Llama with
    # model.n_experts is the mixtral family's): ModelFamily.claims
    claims: Callable[[str, Any], bool] | None = None

    def fields(self) -> dict[str, Any]:
        """The ModelFamily fields the card gives."""
        return {"name": self.name, "keys": self.keys, "claims": self.claims}


def images_refused(arch: str, num_classes: int, in_channels: int, image_size: int) -> nn.Module:
    """ModelFamily.build of a language model's family: it reads token sequences, not images."""
    raise UserError(
        f"model.arch={arch} is a language model: it reads text, not images", "use data.dataset=text or tokens"
    )


REQUIRED = "required"  # HFKey.default of a value config.json must give


@dataclass(frozen=True)
class HFKey:
    """One value of a Hugging Face config.json that a family reads, and the ddpkit config key it is. The value is
    checked by that key's own rules (its type and bounds, then the family's `check_keys`) before anything is
    allocated, written back under `name` on export, and with model.init_from it is the key's default."""

    key: str  # the config key it is, e.g. "model.n_kv_head" (or "data.vocab_size")
    # config.json's name; several: the first one present is read, all are written; "a.b" is b inside object a
    name: str | tuple[str, ...]
    default: Any = REQUIRED  # in config.json's terms, when config.json lacks it or gives null
    # (config.json's value, the key's): e.g. (("gelu_new", "tanh"), ("gelu", "none")); another value is refused
    values: tuple[tuple[Any, Any], ...] = ()
    init: bool = (
        True  # model.init_from takes it as the run's default (False: only read, e.g. a longest context)
    )

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name,) if isinstance(self.name, str) else self.name


@dataclass(frozen=True)
class HFFixed:
    """A config.json value the family's model holds one way only: `name` is absent, null or one of `allowed`
    (a folder asking for something else is refused, naming `what`)."""

    name: str  # "a.b": b inside object a
    allowed: tuple[Any, ...]
    what: str  # what another value would ask for, e.g. "biases in the attention"


@dataclass(frozen=True)
class HFTensor:
    """Where one tensor of the model lies in a Hugging Face folder: the folder's tensor `name`, transposed when
    `transposed` (a 2-D weight stored (in, out)), and of it the `part`-th of `parts` equal pieces along the
    model's first dimension (GPT-2's q|k|v side by side); or, with `stacked` = n, the n folder tensors `name`
    with `{}` replaced by 0, 1, ..., n - 1, one after the other along the model's first dimension (Mixtral's
    experts: a tensor each in the folder, one (experts, ...) tensor in the model). Reading a slice of the model's
    tensor reads only the matching slice of the file."""

    name: str
    transposed: bool = False
    part: int = 0
    parts: int = 1
    stacked: int = 0

    @property
    def names(self) -> list[str]:
        """The folder tensors it is made of."""
        return [self.name.format(i) for i in range(self.stacked)] if self.stacked else [self.name]


@dataclass(frozen=True)
class HFConverter:
    """A family's Hugging Face weights in and out. models/hf/ reads and writes the folder (config.json and
    safetensors) and asks this for what is the family's own: a folder whose config.json says `model_type` becomes
    the family's model, and the family's model becomes such a folder.

    Declared (`keys` and `tensors`): the folder's values are checked by the config keys' own rules before
    anything is allocated, model.init_from takes them as defaults, every tensor of the folder must be one the
    model uses (`ignored` aside), a sharded layout reads only each rank's slices and export streams tensor by
    tensor. A converter that declares neither gives the functions instead (`shape`, `to_ours`, `build`,
    `config`, `to_theirs`): its folder is read whole, still strictly (a tensor `to_ours` never asked for is
    refused)."""

    model_type: str  # config.json's model_type it reads and writes, e.g. "gpt2"
    label: str  # the architecture's name in messages, e.g. "GPT-2"
    # (config.json, folder) -> build's keyword arguments; a UserError for what the family cannot hold
    shape: Callable[[dict[str, Any], Path], dict[str, Any]] | None = None
    # (the folder's tensors, shape) -> the model's state dict; a KeyError names a tensor the folder lacks
    to_ours: Callable[[dict[str, Tensor], dict[str, Any]], dict[str, Tensor]] | None = None
    build: Callable[..., nn.Module] | None = None  # build(**shape) -> the model
    config: Callable[[nn.Module], dict[str, Any]] | None = None  # model -> its config.json
    to_theirs: Callable[[nn.Module], dict[str, Tensor]] | None = (
        None  # model -> tensors under the folder's names
    )
    # -- declared: the config.json values it reads (each a config key) and those it holds one way only
    keys: tuple[HFKey, ...] = ()
    fixed: tuple[HFFixed, ...] = ()
    # (config.json, the Config its keys made) -> what else config.json asks that the model cannot hold (a line
    # naming config.json's keys), or None; e.g. a head_dim that is not hidden_size / num_attention_heads
    check: Callable[[dict[str, Any], Any], str | None] = lambda raw, cfg: None
    # (the model's keys: cfg.model, or the model itself, which keeps each model.* key it was built with as an
    # attribute of that name) -> {the model's tensor name: where it lies in the folder}
    tensors: Callable[[Any], dict[str, HFTensor]] | None = None
    # (the model's keys) -> regular expressions of folder tensors that are not weights (old causal-mask buffers)
    ignored: Callable[[Any], tuple[str, ...]] = lambda m: ()
    rename: Callable[[str], str] = lambda name: name  # a folder tensor's name as `tensors` writes it
    # (the model) -> what config.json holds besides the keys on export (architectures, the fixed values)
    extra: Callable[[Any], dict[str, Any]] = lambda m: {}

    @property
    def declared(self) -> bool:
        """Its folder values are config keys and its tensors a table (the checks and sliced reads apply)."""
        return bool(self.keys) and self.tensors is not None


@dataclass(frozen=True)
class ModelFamily:
    """One kind of model.arch: which names it owns, a cheap check of a name, and the builder."""

    name: str
    owns: Callable[[str], bool]
    build: Callable[[str, int, int, int], nn.Module]  # (arch, num_classes, in_channels, image_size)
    check: Callable[[str], None] = lambda arch: None  # UserError for a name it owns but cannot build
    names: Callable[[], list[str]] = list  # names to suggest for a mistyped arch
    torchvision_weights: bool = False  # model.pretrained=torchvision applies
    order: int | None = None  # where it is asked (ddpkit.registry): None, before the built-ins (100 to 500)
    # a language model's family: (arch, vocab_size, block_size, cfg.model) -> model; `build` is then unused
    build_lm: Callable[[str, int, int, Any], nn.Module] | None = None
    # the parallel layouts: a family without one of these is refused for that layout, before workers start
    module_types: tuple[type, ...] = ()  # the classes it builds: ddpkit.prepare(model, tp=N) finds its plan
    # (model or a pipeline stage of it, tp) -> torch's parallelize_module plan; a UserError when it cannot split
    tp_plan: Callable[[nn.Module, int], dict[str, Any]] | None = None
    tp_sizes: Callable[[Any], list[tuple[str, int]]] = (
        lambda cfg: []
    )  # (config key, value): multiples of dist.tp
    # (config key, value): multiples of dist.tp where sequence parallelism splits the sequence (the whole model's
    # plan over NCCL, models.blocks.sequence_parallel_pays; not a pipeline stage's)
    sp_sizes: Callable[[Any], list[tuple[str, int]]] = lambda cfg: []
    # a pipeline cut by deleting parts: (model, stage, n_stages) -> the stage, in place, full names kept
    pp_stage: Callable[[nn.Module, int, int], nn.Module] | None = None
    # or cut by torch's tracer: (arch, n_stages) -> the modules where stages 1.. begin (a UserError when none)
    pp_split: Callable[[str, int], list[str]] | None = None
    pp_check: Callable[[Any, int], None] = lambda cfg, n_stages: (
        None
    )  # (cfg, n_stages): a UserError if no cut
    checkpointed: Callable[[nn.Module], list[nn.Module]] | None = (
        None  # the blocks activation checkpointing wraps
    )
    # its own config keys: dataclasses of opt() fields, added to the `model` section when the family is
    # registered (`cfg.model.my_width`) and documented under it in --help-config (config/declared.py)
    keys: tuple[type, ...] = ()
    # (cfg.model) -> a UserError for values of its own keys that do not fit together (models.check_arch, before
    # workers start)
    check_keys: Callable[[Any], None] = lambda model_cfg: None
    # (cfg.model, block_size, micro-batch) -> (parameters, bytes of activations kept for backward), before anything
    # is built: a size this machine cannot hold is refused in one line (models.check_arch); None: not estimated
    estimate: Callable[[Any, int, int], tuple[int, int]] | None = None
    # (the whole language model, built on the meta device; data.block_size) -> its training FLOPs per token
    # (metrics flops_per_token, mfu); None: models.flops.decoder_flops, the 6 N + 12 L d T of a model with
    # n_layer and n_embd
    flops_per_token: Callable[[nn.Module, int], int | None] | None = None
    # Hugging Face folders in and out (ddpkit.load_model, model.init_from, ddpkit export --to hf); another weight
    # format would be one more field like it
    hf: HFConverter | None = None
    # (model.arch, cfg.model) -> this family builds that config although another family owns the name: a family
    # that stands behind another's spelling (model.arch=llama model.n_experts=8 is the mixtral family's model);
    # models.model_family(arch, cfg.model) asks it. None: it builds only the names it owns
    claims: Callable[[str, Any], bool] | None = None
    # (cfg.model) -> the routed experts of each mixture-of-experts block (0: none): dist.ep splits them over its
    # ranks and must divide them (parallel/plan.py, before workers start)
    routed_experts: Callable[[Any], int] = lambda model_cfg: 0
    # a language model's: the tensor whose first dimension is the vocabulary (read from a checkpoint's shapes)
    vocab_tensor: str = "tok_emb.weight"
    # how its constructor initialises it after each of its modules' own reset_parameters() (which their
    # constructors call): (the model) -> its steps (models/init.py Step: a tensor's name, the tensor, what fills a
    # whole one from torch's global stream), in the order they draw. With it, `ddpkit train` builds the model on
    # the meta device, lays it out, and each rank makes only its own shards by replaying the same draws one tensor
    # at a time (parallel/materialize.py): exactly the one-process build's weights on any layout. None: the model
    # is built whole on every rank (torchvision's and timm's classifiers, cnn/mlp: small).
    init_weights: Callable[[nn.Module], Iterable[Step]] | None = None

    @property
    def tokens(self) -> bool:
        """Trained on token sequences (data.dataset=text), not on labelled images."""
        return self.build_lm is not None

    def check_pipeline(self, cfg: Any, n_stages: int) -> None:
        """cfg's model cuts into `n_stages` pipeline stages (a UserError otherwise); builds nothing."""
        if self.pp_stage is not None:
            self.pp_check(cfg, n_stages)
        elif self.pp_split is not None:
            self.pp_split(cfg.model.arch, n_stages)
        else:
            raise UserError(
                f"model.arch={cfg.model.arch} has no pipeline split",
                "its family declares none (ModelFamily.pp_stage, pp_split); your own: ddpkit.prepare(model, "
                "pp=..., pp_split=[...])",
            )
