"""Models by name, one registry entry per family (built-in `cnn`/`mlp`, torchvision classifiers, `timm:NAME`);
pretrained weights; device preparation.

torchvision and timm are imported inside the functions that need them, so `import ddpkit` stays light.
"""

from __future__ import annotations

import difflib
import logging
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ddpkit.config import Config
from ddpkit.entrypoints import entry_object
from ddpkit.errors import UserError
from ddpkit.parallel.sync_bn import convert_gloo_sync_batchnorm

log = logging.getLogger("ddpkit.models")

TIMM_PREFIX = "timm:"
STRIP_PREFIXES = ("module.", "_orig_mod.")  # DDP / DataParallel wrappers, torch.compile


# ----------------------------------------------------------------------------------------------- built-ins


def _conv_bn_relu(cin: int, cout: int, stride: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, kernel_size=3, stride=stride, padding=1, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU(inplace=True),
    )


class SmallCNN(nn.Module):
    """Three conv-BN-ReLU blocks, global average pool, linear head; for 8x8 digits up to 224px images.

    The strides (and an optional parameter-free max pool) follow `image_size`, so the state_dict keys are the
    same for every input size: small inputs (<= 32px) keep full resolution in the first block.
    """

    def __init__(self, num_classes: int, in_channels: int = 3, image_size: int = 32, widths=(32, 64, 128)):
        super().__init__()
        w1, w2, w3 = widths
        first_stride = 1 if image_size <= 32 else 2
        self.block1 = _conv_bn_relu(in_channels, w1, first_stride)
        self.pool1 = nn.MaxPool2d(3, stride=2, padding=1) if image_size > 64 else nn.Identity()
        self.block2 = _conv_bn_relu(w1, w2, 2)
        self.block3 = _conv_bn_relu(w2, w3, 2)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(w3, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of shape (N, num_classes)."""
        x = self.block3(self.block2(self.pool1(self.block1(x))))
        return self.fc(torch.flatten(self.pool(x), 1))


def build_mlp(num_classes: int, in_channels: int, image_size: int, hidden=(256, 128)) -> nn.Sequential:
    """Flatten -> Linear -> ReLU -> Linear -> ReLU -> Linear; no normalisation, no dropout (exactly reproducible)."""
    h1, h2 = hidden
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(in_channels * image_size * image_size, h1),
        nn.ReLU(),
        nn.Linear(h1, h2),
        nn.ReLU(),
        nn.Linear(h2, num_classes),
    )


# ----------------------------------------------------------------------------------------------- families


def torchvision_names() -> list[str]:
    """torchvision's classification model names."""
    import torchvision

    return list(torchvision.models.list_models(module=torchvision.models))


def _import_timm() -> Any:
    try:
        import timm
    except ImportError:
        raise UserError(
            "model.arch timm:... needs the timm package, which is not installed",
            "pip install timm (or pip install 'ddpkit[timm]')",
        ) from None
    return timm


def _check_timm(arch: str) -> None:
    timm, name = _import_timm(), arch[len(TIMM_PREFIX) :]
    if not name:
        raise UserError("model.arch 'timm:' names no model", "write e.g. model.arch=timm:resnet18")
    if timm.is_model(name):
        return
    close = difflib.get_close_matches(name, list(timm.list_models()), n=1, cutoff=0.5)
    hint = f"did you mean 'timm:{close[0]}'?" if close else "see timm.list_models() for the names"
    raise UserError(f"unknown timm model '{name}' in model.arch", hint)


def _repeat_gray_to_rgb(module: nn.Module, args: tuple) -> tuple | None:
    """Forward pre-hook: a 1-channel image batch becomes 3 identical channels (torchvision stems expect RGB)."""
    x = args[0]
    if isinstance(x, torch.Tensor) and x.dim() == 4 and x.shape[1] == 1:
        return (x.repeat(1, 3, 1, 1), *args[1:])
    return None


def _build_torchvision(arch: str, num_classes: int, in_channels: int, image_size: int) -> nn.Module:
    import torchvision

    if in_channels not in (1, 3):
        raise UserError(
            f"torchvision model '{arch}' takes 3-channel (or 1-channel, repeated) images, the data has {in_channels}",
            "use model.arch=cnn or mlp, or timm:NAME (which adapts the first layer)",
        )
    model = torchvision.models.get_model(arch, weights=None, num_classes=num_classes)
    if in_channels == 1:
        # Parameter-free: the state_dict keys stay torchvision's, so its pretrained weights still load.
        model.register_forward_pre_hook(_repeat_gray_to_rgb)
    return model


def _build_timm(arch: str, num_classes: int, in_channels: int, image_size: int) -> nn.Module:
    name = arch[len(TIMM_PREFIX) :]  # checked by _check_timm first
    return _import_timm().create_model(name, pretrained=False, num_classes=num_classes, in_chans=in_channels)


@dataclass(frozen=True)
class ModelFamily:
    """One kind of model.arch: which names it owns, a cheap check of a name, and the builder."""

    name: str
    owns: Callable[[str], bool]
    build: Callable[[str, int, int, int], nn.Module]  # (arch, num_classes, in_channels, image_size)
    check: Callable[[str], None] = lambda arch: None  # UserError for a name it owns but cannot build
    names: Callable[[], list[str]] = list  # names to suggest for a mistyped arch
    torchvision_weights: bool = False  # model.pretrained=torchvision applies
    # a language model's family: (arch, vocab_size, block_size, cfg.model) -> model; `build` is then unused
    build_lm: Callable[[str, int, int, Any], nn.Module] | None = None

    @property
    def tokens(self) -> bool:
        """Trained on token sequences (data.dataset=text), not on labelled images."""
        return self.build_lm is not None


BUILTIN: dict[str, Callable[[int, int, int], nn.Module]] = {"cnn": SmallCNN, "mlp": build_mlp}


def _build_gpt(arch: str, vocab_size: int, block_size: int, m: Any) -> nn.Module:
    from ddpkit.gpt import GPT

    return GPT(vocab_size, block_size, m.n_layer, m.n_head, m.n_embd, m.dropout)


def _no_images(arch: str, num_classes: int, in_channels: int, image_size: int) -> nn.Module:
    raise UserError(
        f"model.arch={arch} is a language model: it reads text, not images", "use data.dataset=text"
    )


ENTRY_POINT_GROUP = "ddpkit.models"

# Adding a model family is one entry (register_model); they are asked in this order (the cheap ones first).
MODEL_FAMILIES: list[ModelFamily] = [
    ModelFamily(
        "builtin",
        owns=lambda arch: arch in BUILTIN,
        build=lambda arch, n, c, size: BUILTIN[arch](n, c, size),
        names=lambda: list(BUILTIN),
    ),
    ModelFamily(
        "gpt", owns=lambda arch: arch == "gpt", build=_no_images, names=lambda: ["gpt"], build_lm=_build_gpt
    ),
    ModelFamily("timm", owns=lambda arch: arch.startswith(TIMM_PREFIX), build=_build_timm, check=_check_timm),
    ModelFamily(
        "torchvision",
        owns=lambda arch: arch in torchvision_names(),
        build=_build_torchvision,
        names=torchvision_names,
        torchvision_weights=True,
    ),
]


def register_model(family: ModelFamily, *, replace: bool = False) -> ModelFamily:
    """Make the names `family` owns valid model.arch values; asked before the built-in families so a family of
    your own can own any name. Refuses a second family of the same name unless replace=True."""
    same = [f for f in MODEL_FAMILIES if f.name == family.name]
    if same and not replace and same[0] is not family:
        raise ValueError(f"model family '{family.name}' is already registered")
    for f in same:
        MODEL_FAMILIES.remove(f)
    MODEL_FAMILIES.insert(0, family)
    return family


def _from_entry_points(arch: str) -> ModelFamily | None:
    """The family an installed package declares for `arch` (entry point group ddpkit.models, named arch)."""
    from importlib.metadata import entry_points

    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == arch:
            family = entry_object(ep, ModelFamily, f"model '{arch}'", "ddpkit.models.ModelFamily")
            return register_model(family, replace=True)
    return None


def model_family(arch: str) -> ModelFamily:
    """The family that owns `arch`, its name checked; a UserError with the closest name when none does."""
    owner = next((f for f in MODEL_FAMILIES if f.owns(arch)), None) or _from_entry_points(arch)
    if owner is not None:
        owner.check(arch)
        return owner
    names = [name for family in MODEL_FAMILIES for name in family.names()]
    close = difflib.get_close_matches(arch.lower(), names, n=1, cutoff=0.5)
    hint = (
        f"did you mean '{close[0]}'?"
        if close
        else "use cnn, mlp, a torchvision classification model such as resnet18"
    )
    raise UserError(f"unknown model.arch '{arch}'", hint + "; timm models are written timm:NAME")


def _check_pretrained(cfg: Config, family: ModelFamily) -> None:
    pretrained = cfg.model.pretrained
    if pretrained == "torchvision" and not family.torchvision_weights:
        raise UserError(
            f"model.pretrained=torchvision needs a torchvision model, but model.arch is '{cfg.model.arch}'",
            "pass a weights file path as model.pretrained, or pick a torchvision arch such as resnet18",
        )
    if pretrained and pretrained != "torchvision":
        _check_weights_path(pretrained)


def _check_data_kind(cfg: Config, family: ModelFamily) -> None:
    """A language model needs token data and a classifier images; the GPT's width fits its heads."""
    from ddpkit.data.registry import get_dataset

    arch, dataset = cfg.model.arch, cfg.data.dataset
    tokens = get_dataset(dataset).tokens
    if family.tokens and not tokens:
        raise UserError(
            f"model.arch={arch} is a language model, but data.dataset={dataset} holds images",
            "use data.dataset=text",
        )
    if tokens and not family.tokens:
        raise UserError(
            f"data.dataset={dataset} holds text, but model.arch={arch} classifies images",
            "use model.arch=gpt",
        )
    m = cfg.model
    if family.tokens and m.n_embd % m.n_head:
        raise UserError(
            f"model.n_embd={m.n_embd} is not a multiple of model.n_head={m.n_head}",
            "pick n_embd = n_head x the width of one head",
        )


def check_arch(cfg: Config) -> None:
    """Cheap pre-launch check of model.arch and model.pretrained; builds nothing, raises UserError."""
    family = model_family(cfg.model.arch)
    _check_data_kind(cfg, family)
    _check_pretrained(cfg, family)


# ----------------------------------------------------------------------------------------------- building


def build_model(
    cfg: Config,
    num_classes: int,
    in_channels: int,
    image_size: int,
    report: Callable[[str], None] | None = None,
    *,
    vocab_size: int | None = None,
    block_size: int | None = None,
) -> nn.Module:
    """The model named by cfg.model.arch, with cfg.model.pretrained weights loaded (on the CPU) when set.

    A language model (model.arch=gpt) takes `vocab_size` and `block_size` (the data's) instead of the classes and
    image shape. `report` receives the line saying what the pretrained weights filled in (default: the
    `ddpkit.models` logger).
    """
    arch, pretrained = cfg.model.arch, cfg.model.pretrained
    family = model_family(arch)
    _check_data_kind(cfg, family)
    _check_pretrained(cfg, family)
    if family.build_lm is not None:
        if vocab_size is None or block_size is None:
            raise UserError(f"model.arch={arch} is a language model: it reads text", "use data.dataset=text")
        model = family.build_lm(arch, vocab_size, block_size, cfg.model)
    else:
        model = family.build(arch, num_classes, in_channels, image_size)
    if pretrained == "torchvision":
        (report or log.info)(
            load_matching(model, _torchvision_weights(arch), f"torchvision's default {arch} weights")
        )
    elif pretrained:
        (report or log.info)(load_matching(model, read_weights(pretrained), pretrained))
    return model


# ----------------------------------------------------------------------------------------------- weights


def _check_weights_path(path: str) -> str:
    full = os.path.expanduser(path)
    if not os.path.exists(full):
        raise UserError(
            f"model.pretrained file '{path}' does not exist",
            "check the path, or leave model.pretrained unset",
        )
    if not os.path.isfile(full):
        raise UserError(
            f"model.pretrained '{path}' is not a file", "give the path of a weights file (.pt/.pth)"
        )
    if not os.access(full, os.R_OK):
        raise UserError(f"model.pretrained file '{path}' is not readable", "check the file's permissions")
    return full


def _torchvision_weights(arch: str) -> dict[str, torch.Tensor]:
    import torchvision

    weights = torchvision.models.get_model_weights(arch).DEFAULT
    try:
        return weights.get_state_dict(progress=False, check_hash=False)
    except OSError as e:  # URLError, socket errors, a read-only cache directory
        hub = os.path.join(torch.hub.get_dir(), "checkpoints")
        raise UserError(
            f"cannot download torchvision's {arch} weights ({getattr(e, 'reason', e)})",
            f"download {weights.url} on a machine with internet access and pass the file as "
            f"model.pretrained=PATH, or put it in {hub}",
        ) from None


def read_weights(path: str) -> dict[str, torch.Tensor]:
    """A state_dict from a weights file or a ddpkit checkpoint, read on the CPU with weights_only=True."""
    full = _check_weights_path(path)
    try:
        obj = torch.load(full, map_location="cpu", weights_only=True)
    except OSError as e:
        raise UserError(
            f"cannot read model.pretrained file '{path}': {e.strerror or e}", "check the file's permissions"
        ) from None
    except Exception as e:
        # Corrupt, truncated, not a torch file, or Python objects that weights_only=True refuses to rebuild.
        text = str(e)
        found = re.search(r"GLOBAL (\S+)", text) or re.search(
            r"[Uu]nsupported global: (?:GLOBAL )?(\S+)", text
        )
        if found:
            reason = (
                f"it holds Python objects ({found.group(1)}) that weights_only=True loading refuses to run"
            )
        else:
            reason = f"not a PyTorch weights file (corrupt, truncated or another format: {type(e).__name__})"
        raise UserError(
            f"cannot read model.pretrained file '{path}': {reason}",
            "give a file saved with torch.save(model.state_dict(), PATH) or a ddpkit checkpoint",
        ) from None
    state = _state_dict_of(obj)
    if state is None:
        raise UserError(
            f"model.pretrained file '{path}' holds no model weights",
            "give a file saved with torch.save(model.state_dict(), PATH) or a ddpkit checkpoint",
        )
    return state


def _state_dict_of(obj: Any) -> dict[str, torch.Tensor] | None:
    if not isinstance(obj, Mapping):
        return None
    for key in ("model", "state_dict", "model_state_dict"):  # ddpkit checkpoint first, then common layouts
        inner = obj.get(key)
        if isinstance(inner, Mapping) and any(isinstance(v, torch.Tensor) for v in inner.values()):
            obj = inner
            break
    state = {str(k): v for k, v in obj.items() if isinstance(v, torch.Tensor)}
    return state or None


def strip_prefixes(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop leading `module.` (DDP/DataParallel) and `_orig_mod.` (torch.compile) from every key."""
    out = {}
    for key, value in state.items():
        changed = True
        while changed:
            changed = False
            for prefix in STRIP_PREFIXES:
                if key.startswith(prefix):
                    key, changed = key[len(prefix) :], True
        out[key] = value
    return out


def _head_keys(model: nn.Module) -> set[str]:
    """The state_dict keys of the last module that owns parameters (the classifier)."""
    last = None
    for name, module in model.named_modules():
        if any(True for _ in module.parameters(recurse=False)):
            last = name
    if last is None:
        return set()
    prefix = f"{last}." if last else ""
    module = model.get_submodule(last)
    return {prefix + k for k in module.state_dict().keys()}


def load_matching(model: nn.Module, state: Mapping[str, torch.Tensor], source: str = "weights") -> str:
    """Copy the tensors of `state` whose names and shapes match into `model`; returns what was done.

    A classifier whose shape differs (num_classes changed) is skipped and named in the message; a UserError
    when nothing matches.
    """
    state = strip_prefixes(state)
    own = model.state_dict()
    matched = {k: v for k, v in state.items() if k in own and tuple(v.shape) == tuple(own[k].shape)}
    mismatched = [k for k in state if k in own and tuple(state[k].shape) != tuple(own[k].shape)]
    missing = [k for k in own if k not in state]
    if not matched:
        sample = ", ".join(list(state)[:3])
        raise UserError(
            f"no tensor in {source} matches the model (file keys: {sample}, ...; model keys: {', '.join(list(own)[:3])}, ...)",
            "check that model.arch is the architecture the weights were saved from",
        )
    with torch.no_grad():
        for k, v in matched.items():
            own[k].copy_(v)  # state_dict() tensors share storage with the parameters and buffers
    parts = [f"loaded {len(matched)}/{len(own)} tensors from {source}"]
    head = _head_keys(model)
    head_skipped = [k for k in mismatched if k in head]
    other_skipped = [k for k in mismatched if k not in head]
    if head_skipped:
        k = head_skipped[0]
        parts.append(
            f"skipped the classifier {', '.join(head_skipped)} (shape {tuple(state[k].shape)} in the file, "
            f"{tuple(own[k].shape)} in the model: num_classes differs), it keeps its fresh initialisation"
        )
    if other_skipped:
        parts.append(
            f"skipped {len(other_skipped)} tensors whose shapes differ: {', '.join(other_skipped[:5])}"
        )
    missing = [k for k in missing if not k.endswith("num_batches_tracked")]
    if missing:
        parts.append(f"{len(missing)} model tensors not in the file: {', '.join(missing[:5])}")
    message = "; ".join(parts)
    if other_skipped or missing:
        log.warning(message)
    return message


# ----------------------------------------------------------------------------------------------- device prep


def prepare_model(model: nn.Module, cfg: Config, device: torch.device, distributed: bool) -> nn.Module:
    """SyncBatchNorm when cfg.model.sync_bn and distributed, then move to `device`, then channels_last if asked."""
    device = torch.device(device)
    if cfg.model.sync_bn and distributed:
        if device.type == "cpu":
            model = convert_gloo_sync_batchnorm(model)
        else:
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = model.to(device)
    if cfg.model.channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model
