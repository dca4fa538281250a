"""Peak memory per rank of a transformers LlamaForCausalLM under `ddpkit.prepare(model, opt, strategy="fsdp")`:
FSDP units at its decoder layers (its `_no_split_modules`) against the three units it got before (`<root>`,
`model`, `lm_head`: the whole body gathered at once), 2 processes, gloo on CPU.

Each rank's peak resident set size in the forward and backward of a training step (the kernel's high-water mark,
reset before each; the largest of `--steps` steps after one that makes the optimizer's state), and its growth
above the resident size between steps: what the gathered parameters, their gradients and the activations add to
the sharded state.

    python benchmarks/hf_fsdp_memory.py                      # the markdown table
    python benchmarks/hf_fsdp_memory.py --layers 8 --width 768 --steps 3
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))


def _status(field: str) -> int:
    """A /proc/self/status size in bytes (VmRSS, VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _run(units: str, layers: int, width: int, vocab: int, steps: int) -> dict:
    import torch
    import torch.nn.functional as F
    from torch.distributed.fsdp import FSDPModule
    from transformers import LlamaConfig, LlamaForCausalLM

    import ddpkit
    from ddpkit.parallel.strategies import fsdp

    if units == "children":  # what shard_units gave a transformers model before it read _no_split_modules
        fsdp.repeated_blocks = lambda model: []
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=width,
        intermediate_size=width * 8 // 3 // 64 * 64,
        num_hidden_layers=layers,
        num_attention_heads=width // 64,
        num_key_value_heads=width // 64,
        max_position_embeddings=256,
    )
    model = LlamaForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt = ddpkit.prepare(model, opt, strategy="fsdp")
    n_units = sum(isinstance(m, FSDPModule) for m in model.modules())
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, vocab, (2, 129), generator=g) for _ in range(steps + 1)]
    peaks = []
    for i, seq in enumerate(batches):  # the first step makes the optimizer's state: not measured
        if i == 1:
            before = _status("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # the high-water mark starts again here
        logits = model(input_ids=seq[:, :-1]).logits
        F.cross_entropy(logits.flatten(0, 1), seq[:, 1:].flatten()).backward()
        peaks.append(_status("VmHWM"))  # the forward and backward's peak
        opt.step()
        opt.zero_grad()
    return {"units": n_units, "before": before, "peak": max(peaks[1:])}


def measure(units: str, layers: int, width: int, vocab: int, steps: int) -> list[dict]:
    import ddpkit

    return ddpkit.launch(_run, units, layers, width, vocab, steps, nprocs=2, timeout_s=1800)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--steps", type=int, default=3)
    a = p.parse_args()
    print(
        "| FSDP units | units per rank | rank | RSS between steps (MiB) | peak RSS in forward + backward (MiB) | growth (MiB) |"
    )
    print("|---|---|---|---|---|---|")
    mib = 2**20
    for units, label in (
        ("layers", "each decoder layer (now)"),
        ("children", "`<root>`, `model`, `lm_head` (before)"),
    ):
        for rank, r in enumerate(measure(units, a.layers, a.width, a.vocab, a.steps)):
            print(
                f"| {label} | {r['units']} | {rank} | {r['before'] / mib:.0f} | {r['peak'] / mib:.0f} | "
                f"{(r['peak'] - r['before']) / mib:.0f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
