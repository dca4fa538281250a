"""Models by name: the registry of model families (the built-in `cnn`/`mlp`, the GPT, the Llama, `timm:NAME` and
torchvision's classifiers: one folder each, named in `FAMILY_FOLDERS`), the checks of model.arch against the data,
building the model with its pretrained weights (weights.py).

Importing this package imports no torch (a config loads without it): each built-in folder's torch-free keys.py is
read now (its `FamilyCard`: the config keys it owns, declared now, and what the command line asks of it before
torch: `card_of`, `preload_for`, `language_models`); its model.py (the `ModelFamily`, with torch) is imported when
the registry is first asked. torchvision and timm are imported inside the functions that need them.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ddpkit.cluster.machine import machine_memory
from ddpkit.config import Config
from ddpkit.config.declared import before_keys, declare, declare_values, defaults_from
from ddpkit.data.registry import get_dataset
from ddpkit.errors import UserError
from ddpkit.models.family import FamilyCard, ModelFamily
from ddpkit.models.keys import n_experts
from ddpkit.registry import Registry

if TYPE_CHECKING:
    from torch import nn

__all__ = [
    "BUILTIN",
    "CARDS",
    "ENTRY_POINT_GROUP",
    "FAMILY_FOLDERS",
    "MODEL_FAMILIES",
    "STRIP_PREFIXES",
    "TIMM_PREFIX",
    "ModelFamily",
    "SmallCNN",
    "build_mlp",
    "build_model",
    "card_of",
    "check_arch",
    "family_of_module",
    "language_models",
    "load_matching",
    "model_family",
    "preload_for",
    "read_weights",
    "register_model",
    "strip_prefixes",
    "torchvision_names",
]

ENTRY_POINT_GROUP = "ddpkit.models"
# The built-in families, one folder each (keys.py: its card, torch-free; model.py: its family), in the order the
# config reference lists them. Adding one is a folder and its name here.
FAMILY_FOLDERS = (
    *("small", "gpt", "llama", "mixtral", "qwen2", "qwen3", "mistral", "qwen3_moe"),
    *("timm", "torchvision"),
)
CARDS: tuple[FamilyCard, ...] = tuple(
    importlib.import_module(f"{__name__}.{folder}.keys").CARD for folder in FAMILY_FOLDERS
)
_ELSEWHERE = {  # names importable from here, loaded from their modules (which import torch) when first used
    "BUILTIN": "small.model",
    "SmallCNN": "small.model",
    "build_mlp": "small.model",
    "TIMM_PREFIX": "timm.model",
    "torchvision_names": "torchvision.model",
    **dict.fromkeys(
        ("STRIP_PREFIXES", "check_weights_path", "load_matching", "log", "read_weights", "strip_prefixes"),
        "weights",
    ),
}


def __getattr__(name: str) -> Any:
    if name in _ELSEWHERE:
        return getattr(importlib.import_module(f"{__name__}.{_ELSEWHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _builtin_families() -> list[ModelFamily]:
    return [importlib.import_module(f"{__name__}.{folder}.model").FAMILY for folder in FAMILY_FOLDERS]


def _declare_keys(family: ModelFamily) -> None:
    for keys in family.keys:
        declare("model", keys, "model.arch", family.name)


# Adding a model family is one entry (register_model). They are asked in order: families of your own first
# (newest first, so a family of your own can own any name), then the built-ins at their `order` (the cheap first).
MODEL_FAMILIES: Registry[ModelFamily] = Registry(
    "model",
    ENTRY_POINT_GROUP,
    ModelFamily,
    "ddpkit.models.ModelFamily",
    unordered=0,
    newest_first=True,
    builtins=_builtin_families,
    added=_declare_keys,  # a family's own config keys join the schema when it is registered
)
for _card in CARDS:
    for _keys in _card.keys:
        declare("model", _keys, "model.arch", _card.name)
declare_values("model.arch", lambda: [card.summary for card in CARDS])


def card_of(arch: str) -> FamilyCard | None:
    """The card of the built-in family that owns `arch`, told without torch; None when no card can tell (a
    torchvision name, a family of your own)."""
    return next((c for c in CARDS if c.owns is not None and c.owns(arch)), None)


def preload_for(arch: str) -> list[str]:
    """The modules a worker imports to build model.arch=`arch`, besides torch and the trainer (the launch's fork
    server imports them once): its card's; for a name no card tells, those of every family that may own it."""
    card = card_of(arch)
    cards = [card] if card is not None else [c for c in CARDS if c.owns is None]
    return [module for c in cards for module in c.preload]


def language_models() -> list[str]:
    """The built-in language-model families' names, the default first (e.g. for data.dataset=text)."""
    return [card.name for card in CARDS if card.tokens]


@before_keys
def _load_named_family(given: dict[str, Any]) -> None:
    """A config whose model.arch names a family an installed package declares (entry point `ddpkit.models`):
    load it before the keys are checked, so that its own keys are known (their defaults too)."""
    from importlib.metadata import entry_points

    arch = given.get("model.arch")
    if isinstance(arch, str) and card_of(arch) is None and entry_points(group=ENTRY_POINT_GROUP, name=arch):
        model_family(arch)


@defaults_from
def _init_from_shape(given: dict[str, Any]) -> dict[str, tuple[Any, str]]:
    """With model.init_from=DIR, the model's shape keys default to the folder's (model.arch from its model_type,
    the rest from the config.json values its family's converter reads), each checked by its key's rules."""
    path = given.get("model.init_from")
    if not isinstance(path, str) or not path.strip():
        return {}
    from ddpkit.models.hf import folder_defaults, is_hf_folder

    if not is_hf_folder(path):
        return {}  # refused by check_arch, which says what a folder needs
    found = folder_defaults(path, MODEL_FAMILIES.entries())
    if _claimed(given, found):  # model.arch=llama for a Mixtral folder: the name the mixtral family claims
        del found["model.arch"]
    return {key: (value, f"model.init_from '{path}' has {where}") for key, (value, where) in found.items()}


def _claimed(given: dict[str, Any], found: dict[str, tuple[Any, str]]) -> bool:
    """The model.arch the config gives is one the folder's family claims with the folder's values."""
    from types import SimpleNamespace

    arch, theirs = given.get("model.arch"), found["model.arch"][0]
    family = MODEL_FAMILIES.find(theirs)
    if not isinstance(arch, str) or arch == theirs or family is None or family.claims is None:
        return False
    values = {k: v for k, (v, _) in found.items()} | given
    m = SimpleNamespace(**{k.split(".", 1)[1]: v for k, v in values.items() if k.startswith("model.")})
    return family.claims(arch, m)


def register_model(family: ModelFamily, *, replace: bool = False) -> ModelFamily:
    """Make the names `family` owns valid model.arch values; asked before the built-in families (unless it gives
    an `order`). Refuses a second family of the same name unless replace=True."""
    return MODEL_FAMILIES.register(family, replace=replace)


def model_family(arch: str, model_cfg: Any = None) -> ModelFamily:
    """The family that owns `arch`, its name checked; a UserError with the closest name when none does. With the
    config's model section `model_cfg`, a family that claims that config (ModelFamily.claims: model.arch=llama
    with model.n_experts is the mixtral family's) is the one that builds it."""
    if model_cfg is not None:
        claimed = next((f for f in MODEL_FAMILIES.values() if f.claims and f.claims(arch, model_cfg)), None)
        if claimed is not None:
            return claimed
    # the registered families, then the one an installed package declares under that name
    owner = next((f for f in MODEL_FAMILIES.values() if f.owns(arch)), None)
    if owner is None and arch not in MODEL_FAMILIES:
        owner = MODEL_FAMILIES.find(arch)
    if owner is not None:
        owner.check(arch)
        return owner
    names = [name for family in MODEL_FAMILIES.values() for name in family.names()]
    otherwise = "use cnn, mlp, a torchvision classification model such as resnet18"
    hint = MODEL_FAMILIES.hint(arch.lower(), names, cutoff=0.5, otherwise=otherwise)
    raise UserError(f"unknown model.arch '{arch}'", hint + "; timm models are written timm:NAME")


def family_of_module(model: nn.Module) -> ModelFamily | None:
    """The registered family that builds models of `model`'s class (its `module_types`), or None: the one of the
    nearest class in its method resolution order, so a family whose model subclasses another's (Qwen2's of the
    Llama) is found for its own model, whatever order the families are asked in."""
    families = list(MODEL_FAMILIES.values())
    for cls in type(model).__mro__:
        owner = next((f for f in families if cls in f.module_types), None)
        if owner is not None:
            return owner
    return None


def _check_pretrained(cfg: Config, family: ModelFamily) -> None:
    pretrained = cfg.model.pretrained
    if pretrained == "torchvision" and not family.torchvision_weights:
        raise UserError(
            f"model.pretrained=torchvision needs a torchvision model, but model.arch is '{cfg.model.arch}'",
            "pass a weights file path as model.pretrained, or pick a torchvision arch such as resnet18",
        )
    if pretrained and pretrained != "torchvision":
        from ddpkit.models.weights import check_weights_path

        check_weights_path(pretrained)
    if cfg.model.init_from:
        from ddpkit.models.hf import is_hf_folder, open_folder

        if family.hf is None:
            readers = " or ".join(f.name for f in MODEL_FAMILIES.values() if f.hf is not None)
            raise UserError(
                f"model.init_from needs model.arch={readers}, not '{cfg.model.arch}'",
                f"set model.arch={readers}, or use model.pretrained for a weights file",
            )
        if not is_hf_folder(cfg.model.init_from):
            raise UserError(
                f"model.init_from '{cfg.model.init_from}' is not a Hugging Face folder (no config.json in it)",
                "give a folder written by save_pretrained or by ddpkit export --to hf",
            )
        open_folder(
            cfg.model.init_from, MODEL_FAMILIES.entries()
        )  # every check of its files, values and tensors, before workers start


def _check_data_kind(cfg: Config, family: ModelFamily) -> None:
    """A language model needs token data and a classifier images; the family's own keys fit together."""
    arch, dataset = cfg.model.arch, cfg.data.dataset
    tokens = get_dataset(dataset).tokens
    if family.tokens and not tokens:
        raise UserError(
            f"model.arch={arch} is a language model, but data.dataset={dataset} holds images",
            "use data.dataset=text or tokens",
        )
    if tokens and not family.tokens:
        raise UserError(
            f"data.dataset={dataset} holds text, but model.arch={arch} classifies images",
            f"use model.arch={' or '.join(language_models())}",
        )
    family.check_keys(cfg.model)


def _check_experts(m: Any, family: ModelFamily) -> None:
    """model.n_experts asks for routed experts: a family without them (model.arch=gpt) would silently drop them."""
    if n_experts(m) and not family.routed_experts(m):
        owners = [f.name for f in MODEL_FAMILIES.values() if f.claims is not None] or ["a mixture of experts"]
        raise UserError(
            f"model.n_experts={m.n_experts}: model.arch={m.arch} has no routed experts",
            f"use model.arch={' or '.join(owners)}, or drop model.n_experts",
        )


# float32 weights, their gradients and two optimizer tensors (AdamW's moments) per parameter
BYTES_PER_PARAM = 16


def _check_size(cfg: Config, family: ModelFamily) -> None:
    """A language model whose estimated weights, gradients, optimizer state and one micro-batch's activations
    fit this machine's memory: every rank builds the whole model before it is spread, so a size that cannot fit
    is refused before anything is allocated."""
    if family.estimate is None:
        return
    m = cfg.model
    params, activations = family.estimate(m, cfg.data.block_size, cfg.train.batch_size)
    need, have = params * BYTES_PER_PARAM + activations, machine_memory()
    if need > have:
        if activations > params * BYTES_PER_PARAM:
            key = "train.batch_size or data.block_size"
        else:
            key = "model.n_layer" if m.n_layer > 64 else "model.n_embd"
        raise UserError(
            f"model.n_layer={m.n_layer} model.n_embd={m.n_embd} needs about {need / 2**30:.0f} GiB at this "
            f"batch and block size, over this machine's {have / 2**30:.0f} GiB",
            f"make {key} smaller",
        )


def check_arch(cfg: Config) -> None:
    """Cheap pre-launch check of model.arch and model.pretrained; builds nothing, raises UserError."""
    family = model_family(cfg.model.arch, cfg.model)
    _check_data_kind(cfg, family)
    _check_size(cfg, family)
    _check_pretrained(cfg, family)
    _check_experts(cfg.model, family)


def build_model(
    cfg: Config,
    num_classes: int,
    in_channels: int,
    image_size: int,
    report: Callable[[str], None] | None = None,
    *,
    vocab_size: int | None = None,
    block_size: int | None = None,
    meta: bool = False,
) -> nn.Module:
    """The model named by cfg.model.arch, with cfg.model.pretrained weights loaded (on the CPU) when set.

    A language model (model.arch=gpt) takes `vocab_size` and `block_size` (the data's) instead of the classes and
    image shape. `report` receives the line saying what the pretrained weights filled in (default: the
    `ddpkit.models` logger). `meta`: built on the meta device (no values; parallel/materialize.py makes them).
    """
    import torch

    from ddpkit.models.torchvision import model as torchvision_models
    from ddpkit.models.weights import load_matching, log, read_weights

    arch, pretrained = cfg.model.arch, cfg.model.pretrained
    family = model_family(arch, cfg.model)
    _check_data_kind(cfg, family)
    _check_size(cfg, family)
    _check_pretrained(cfg, family)
    _check_experts(cfg.model, family)
    if family.build_lm is not None and (vocab_size is None or block_size is None):
        raise UserError(f"model.arch={arch} is a language model: it reads text", "use data.dataset=text")
    with torch.device("meta") if meta else contextlib.nullcontext():
        if family.build_lm is not None:
            model = family.build_lm(arch, vocab_size, block_size, cfg.model)
        else:
            model = family.build(arch, num_classes, in_channels, image_size)
    if pretrained == "torchvision":
        (report or log.info)(
            load_matching(
                model, torchvision_models.pretrained_weights(arch), f"torchvision's default {arch} weights"
            )
        )
    elif pretrained:
        (report or log.info)(load_matching(model, read_weights(pretrained), pretrained))
    return model
