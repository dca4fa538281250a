"""Activation checkpointing, measured: peak memory and step time of the built-in transformer's training step with
model.activation_checkpointing = none, full, selective (torch's op-level selective recomputation: the matmul and
attention outputs kept, the cheap ops re-computed) and, for comparison, full recomputation of every second block
(the other way to sit between none and full).

Each setting: the model that `ddpkit train` builds (the family's builder, ddpkit's checkpoint_blocks on the blocks
the family names), random tokens, SGD, --warmup steps, then --steps timed steps (wall seconds, and this process's
CPU seconds: with one thread on a busy machine the CPU time is the step's work, the wall time also what other
processes took), then one step whose peak memory is read: the peak bytes of live tensors (weights, gradients,
activations, temporaries), CUDA's max_memory_allocated on a GPU, torch's MemTracker on the CPU (a dispatch mode
following every tensor's storage; the CPU has no allocator statistics). The settings run in alternated rounds
(--rounds); the table gives each setting's median.

    python benchmarks/activation_checkpointing.py
    python benchmarks/activation_checkpointing.py --arch llama --layers 8 --width 512 --rounds 3 --json ac.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

SETTINGS = ("none", "full", "selective", "every2")


def _model(args, setting: str):
    import torch

    from ddpkit.config import load_config
    from ddpkit.models import build_model, model_family
    from ddpkit.parallel.mesh.activation import checkpoint_blocks

    keys = [f"model.arch={args.arch}", "data.dataset=text", f"model.n_layer={args.layers}"]
    keys += [f"model.n_embd={args.width}", f"model.n_head={args.heads}", "model.dropout=0"]
    torch.manual_seed(0)
    model = build_model(load_config(None, keys), 0, 0, 0, vocab_size=args.vocab, block_size=args.context)
    blocks = model_family(args.arch).checkpointed(model)
    if setting in ("full", "selective"):
        checkpoint_blocks(blocks, setting)
    elif setting == "every2":
        checkpoint_blocks(blocks[::2], "full")
    return model


def _peak_bytes(model, opt, step, device) -> int:
    """The peak bytes of live tensors over one step."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(model, opt)
    with tracker:
        step()
    return int(tracker.get_tracker_snapshot("peak")[device]["Total"])


def measure(args, setting: str) -> dict:
    """One setting: {"step_s": median wall seconds, "cpu_s": median CPU seconds of this process, "peak_bytes"}."""
    import torch
    import torch.nn.functional as F

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = _model(args, setting).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, args.vocab, (args.batch, args.context + 1), generator=g).to(device)
    inputs, targets = x[:, :-1], x[:, 1:]

    def step():
        logits = model(inputs)
        F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)

    for _ in range(args.warmup):
        step()
    walls, cpus = [], []
    for _ in range(args.steps):
        w0, c0 = time.perf_counter(), time.process_time()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        walls.append(time.perf_counter() - w0)
        cpus.append(time.process_time() - c0)
    peak = _peak_bytes(model, opt, step, device)
    return {"step_s": statistics.median(walls), "cpu_s": statistics.median(cpus), "peak_bytes": peak}


def table(runs: dict[str, list[dict]]) -> str:
    from _common import md_table

    keys = ("peak_bytes", "step_s", "cpu_s")
    med = {s: {k: statistics.median(r[k] for r in rs) for k in keys} for s, rs in runs.items()}
    first = next(iter(med))
    rows = []
    for s, m in med.items():
        rows.append(
            [s, f"{m['peak_bytes'] / 2**20:.0f}", f"{m['peak_bytes'] / med[first]['peak_bytes']:.2f}"]
            + [f"{m['step_s']:.3f}", f"{m['step_s'] / med[first]['step_s']:.2f}"]
            + [f"{m['cpu_s']:.3f}", f"{m['cpu_s'] / med[first]['cpu_s']:.2f}"]
        )
    ratio = f"x {first}"
    return md_table(["setting", "peak MiB", ratio, "wall s / step", ratio, "CPU s / step", ratio], rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="gpt", choices=["gpt", "llama"])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (CPU)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2, help="alternated rounds over the settings")
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=SETTINGS)
    ap.add_argument("--json", help="also write the runs here")
    args = ap.parse_args(argv)
    import torch
    from _common import machine, machine_line

    torch.set_num_threads(args.threads)
    info = machine()
    runs: dict[str, list[dict]] = {s: [] for s in args.settings}
    for rnd in range(args.rounds):
        for setting in args.settings if rnd % 2 == 0 else args.settings[::-1]:
            r = measure(args, setting)
            runs[setting].append(r)
            print(
                f"  round {rnd + 1} {setting}: {r['step_s']:.3f} s/step ({r['cpu_s']:.3f} s CPU), peak "
                f"{r['peak_bytes'] / 2**20:.0f} MiB",
                flush=True,
            )
    print(machine_line(info))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(
        f"{args.arch}: {args.layers} blocks, width {args.width}, {args.heads} heads, context {args.context}, "
        f"batch {args.batch}, device {device}, {args.threads} thread(s)"
    )
    print(table(runs))
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": info, "args": vars(args), "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
