"""A llama of about 1B parameters trained with FSDP2 on one CUDA device, written by hand with torch alone: the side
that `ddpkit train ... dist.strategy=fsdp train.amp=bf16` is compared with in benchmarks/gpu_check.py (part
`llama1b`, compile off and on).

The same model (ddpkit.models.llama.model.Llama, 20 blocks, width 2048, 16 heads: 1.01B parameters at a character
vocabulary), built on the meta device, fully_shard on each block and then the root with FSDP2's MixedPrecisionPolicy
(bf16 parameters and compute, float32 gradients' reduction and master weights), `--compile`: each block compiled
(as torchtitan does); AdamW (fused), random token ids. Times steps after `--warmup`, prints one JSON line:
tokens/s, TFLOP/s (6 N + 12 L d T per token, models/flops.py's estimate), MFU against the device's dense bf16 peak,
peak allocated memory, the device.

    torchrun --standalone --nproc-per-node 1 benchmarks/llama_fsdp_gpu.py --compile
    python benchmarks/llama_fsdp_gpu.py --dry-run          # the model's size on the meta device, nothing run
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

SIZE = {"n_layer": 20, "n_embd": 2048, "n_head": 16}  # 1.01B parameters with a character vocabulary
VOCAB = 256  # ids drawn below this (a character vocabulary's size, as data.dataset=text gives)


def build(block_size: int):
    from ddpkit.models.llama.model import Llama

    with torch.device("meta"):
        return Llama(VOCAB, block_size, SIZE["n_layer"], SIZE["n_head"], SIZE["n_embd"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--compile", action="store_true", help="compile each block")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--block", type=int, default=2048)
    p.add_argument("--steps", type=int, default=20, help="timed steps")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args()
    from ddpkit.models.flops import decoder_flops, known_peak

    model = build(args.block)
    per_token = decoder_flops(model, args.block)
    params = sum(t.numel() for t in model.parameters())
    if args.dry_run:
        print(json.dumps({"params": params, "flops_per_token": per_token}))
        return
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dist.init_process_group("nccl")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks.values():
        if args.compile:
            block.compile()
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    model.to_empty(device=device)
    with torch.no_grad():  # the values do not matter to the speed: normal(0, 0.02), norms at one
        for (
            name,
            t,
        ) in model.named_parameters():  # (the model holds no buffers: its rotary tables are made per call)
            t.fill_(1.0) if "norm" in name else t.normal_(0, 0.02)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    x = torch.randint(0, VOCAB, (args.batch, args.block + 1), device=device)

    def step() -> None:
        logits = model(x[:, :-1])
        torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    torch.cuda.synchronize()
    tokens_per_s = args.batch * args.block * args.steps / (time.perf_counter() - t0)
    tflops = per_token * tokens_per_s / 1e12
    peak = known_peak(device, "bf16")
    row = {
        "side": "torch",
        "compile": args.compile,
        "device": torch.cuda.get_device_name(device),
        "params": params,
        "tokens_per_s": round(tokens_per_s),
        "tflops_per_s": round(tflops, 1),
        "mfu": round(tflops / peak, 4) if peak else None,
        "peak_memory_gb": round(torch.cuda.max_memory_allocated(device) / 1e9, 2),
    }
    print(json.dumps(row), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
