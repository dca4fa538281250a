"""Pretrained weights from a file (`model.pretrained=PATH`): read safely (weights_only=True), wrappers' key
prefixes dropped, copied into the model where names and shapes match (a changed classifier is skipped and named)."""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ddpkit.errors import UserError, first_line, held_warnings

log = logging.getLogger("ddpkit.models")

STRIP_PREFIXES = ("module.", "_orig_mod.")  # DDP / DataParallel wrappers, torch.compile


def check_weights_path(path: str) -> str:
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


def read_weights(path: str) -> dict[str, torch.Tensor]:
    """A state_dict from a weights file or a ddpkit checkpoint, read on the CPU with weights_only=True."""
    full = check_weights_path(path)
    try:
        with held_warnings():  # torch's warnings about a file refused here are not shown
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
            reason = f"it holds code ({first_line(found.group(1), 30)}), which weights_only=True refuses"
        else:
            reason = f"not a PyTorch weights file (damaged or another format: {type(e).__name__})"
        raise UserError(
            f"cannot read model.pretrained file '{path}': {reason}",
            "give a torch.save'd state_dict or a ddpkit checkpoint",
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
