"""How fast a language model trains in the field's terms: model FLOPs per token, achieved TFLOP/s per rank, MFU.

FLOPs per token (training: forward and backward) is a question to the model's family (`ModelFamily.flops_per_token`);
a decoder's, and the answer for a family that does not say, is 6 N + 12 L d T, the estimate of the PaLM paper
(appendix B) that nanoGPT and torchtitan use: N the model's parameters (each shared tensor once; those that cost no
multiply, such as the GPT's learned position embedding, left out by its family), L the blocks, d the width (n_head x head dim), T data.block_size (the attention's
QK^T and AV products, 2 x 2 L d T multiply-adds per token forward, x 3 with the backward). Achieved TFLOP/s per rank
= FLOPs per token x training tokens/s over all ranks / world size / 1e12; `mfu` = that / the device's peak:
train.peak_tflops, else the dense bf16/fp16 peak of a known NVIDIA GPU when train.amp is bf16 or fp16, else null.
The trainer writes them into metrics.jsonl (train/metrics_file.py); peak memory is train/memory.py's.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from ddpkit.models import model_family

# dense bf16/fp16 tensor-core TFLOP/s of the GPUs named by torch.cuda.get_device_name (without sparsity)
KNOWN_PEAKS = (
    ("H200", 989.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.0),
    ("A100", 312.0),
    ("L40S", 362.0),
    ("L4", 121.0),
    ("A10", 125.0),
    ("V100", 125.0),
)


def decoder_flops(model: nn.Module, block_size: int, free: tuple[str, ...] = ()) -> int | None:
    """6 N + 12 L d T of a decoder (the whole model, before any split): its `n_layer` blocks of width `n_embd`,
    the parameters whose names start with one of `free` left out of N; None for a model without n_layer and
    n_embd."""
    if not all(hasattr(model, a) for a in ("n_layer", "n_embd")):
        return None
    n = sum(p.numel() for name, p in model.named_parameters() if not name.startswith(free))
    return int(6 * n + 12 * model.n_layer * model.n_embd * block_size)


def model_flops(cfg: Any, spec: Any) -> int | None:
    """FLOPs per training token of the configured language model, its family's answer (built on the meta
    device: no memory, no weights); None for a classifier."""
    family = model_family(cfg.model.arch, cfg.model)
    if not spec.tokens or family.build_lm is None:
        return None
    with torch.device("meta"):
        model = family.build_lm(cfg.model.arch, spec.vocab_size, spec.block_size, cfg.model)
    return (family.flops_per_token or decoder_flops)(model, spec.block_size)


def known_peak(device: torch.device, amp: str) -> float | None:
    """The device's dense TFLOP/s in train.amp's dtype when ddpkit knows it (a named NVIDIA GPU under bf16 or
    fp16), else None."""
    if device.type != "cuda" or amp not in ("bf16", "fp16"):
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in KNOWN_PEAKS if key in name), None)


def fields(per_token: int | None, tokens_per_s: float | None, world_size: int, peak: float | None) -> dict:
    """flops_per_token, tflops_per_s_per_rank and mfu of one epoch (null where they do not apply)."""
    if per_token is None or not tokens_per_s:
        return {"flops_per_token": per_token, "tflops_per_s_per_rank": None, "mfu": None}
    achieved = per_token * tokens_per_s / world_size / 1e12
    return {
        "flops_per_token": per_token,
        "tflops_per_s_per_rank": float(f"{achieved:.6g}"),
        "mfu": float(f"{achieved / peak:.6g}") if peak else None,
    }
