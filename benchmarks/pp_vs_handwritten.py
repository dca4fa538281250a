"""`ddpkit.prepare(model, pp=2, ...)` beside a hand-written torch.distributed.pipelining loop on the same GPT, and
`ddpkit.prepare(model, opt, tp=2)` beside a hand-written `parallelize_module` loop: tokens/s of training steps
and the time to the first step, 2 processes (gloo).

Pipeline: Schedule1F1B, 4 micro-batches. The hand-written pipeline cuts the model at a module boundary by hand
(each rank keeps its half of the blocks and deletes the rest: `cut_stage`); prepare() cuts the user's model where `pp_split` begins
(parallel/pipeline/eager.py). Tensor parallel: both split the model by the same plan (ddpkit's GPT plan).
Every run trains the same model (ddpkit.models.gpt.model.GPT) on the same batches with SGD; the runs take turns in
one process group (`--rounds` alternations, medians reported).

    python benchmarks/pp_vs_handwritten.py                  # n_layer 4, n_embd 128, block 64, batch 16
    python benchmarks/pp_vs_handwritten.py --only pp --steps 40 --n-embd 256
    python benchmarks/pp_vs_handwritten.py --only pp --paired 80   # steps alternated pair by pair
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

import ddpkit
from ddpkit.models.gpt.model import GPT, STACK, lm_loss


def _setup(args):
    torch.manual_seed(0)
    model = GPT(vocab_size=256, block_size=args.block, n_layer=args.n_layer, n_head=4, n_embd=args.n_embd)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 256, (args.batch, args.block), generator=g)
    return model, x, torch.roll(x, -1, dims=1)


def cut_stage(model: GPT, stage: int, n_stages: int) -> GPT:
    """Pipeline stage `stage` of `n_stages` of a GPT, in place, by hand: its consecutive blocks kept, the others
    deleted, the embeddings on the first stage only, the final norm and head on the last only."""
    per = len(model.blocks) // n_stages
    for name in list(model.blocks.keys()):
        if int(name) // per != stage:
            del model.blocks[name]
    if stage > 0:
        model.tok_emb = model.pos_emb = None
    if stage < n_stages - 1:
        model.ln_f = model.head = None
    return model


def schedule_1f1b(stage_module, stage: int, n_stages: int, microbatches: int, group=None):
    """torch.distributed.pipelining's Schedule1F1B over one stage module per rank (lm_loss on the last)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    piped = PipelineStage(stage_module, stage, n_stages, torch.device("cpu"), group=group)
    return Schedule1F1B(piped, microbatches, loss_fn=lm_loss)


def _handwritten(args):
    model, x, y = _setup(args)
    rank = dist.get_rank()
    stage = cut_stage(model, rank, 2)
    opt = torch.optim.SGD(stage.parameters(), lr=0.1)
    schedule = schedule_1f1b(stage, rank, 2, 4)

    def step():
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y)
        opt.step()
        opt.zero_grad()

    return step


def _ported(args):
    model, x, y = _setup(args)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model = ddpkit.prepare(
        model, pp=2, pp_split=[f"blocks.{args.n_layer // 2}"], loss_fn=lm_loss, pp_microbatches=4
    )

    def step():
        model.step(x, y)
        opt.step()
        opt.zero_grad()

    return step


def _tp_handwritten(args):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    model, x, y = _setup(args)
    plan = STACK.tp_plan(model, sequence_parallel=args.sequence_parallel)
    parallelize_module(model, init_device_mesh("cpu", (2,)), plan)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step():
        lm_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    return step


def _tp_ported(args):
    model, x, y = _setup(args)
    # None: prepare's own plan (no sequence parallelism over gloo)
    plan = STACK.tp_plan(model, sequence_parallel=True) if args.sequence_parallel else None
    model, opt = ddpkit.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), tp=2, tp_plan=plan)

    def step():
        lm_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    return step


RUNS = {
    "pp": (("pp handwritten", _handwritten), ("pp prepare", _ported)),
    "tp": (("tp handwritten", _tp_handwritten), ("tp prepare", _tp_ported)),
}


def _measure(args) -> dict:
    out = {}
    runs = [r for kind in (("pp", "tp") if args.only == "both" else (args.only,)) for r in RUNS[kind]]
    for name, make in runs * args.rounds:
        dist.barrier()
        t0 = time.perf_counter()
        step = make(args)
        step()
        dist.barrier()
        first = time.perf_counter() - t0
        for _ in range(args.warmup):
            step()
        times = []
        for _ in range(args.steps):
            dist.barrier()
            t = time.perf_counter()
            step()
            dist.barrier()
            times.append(time.perf_counter() - t)
        row = out.setdefault(name, {"tokens_per_s": [], "first_step_s": []})
        row["tokens_per_s"].append(args.batch * args.block / statistics.median(times))
        row["first_step_s"].append(first)
    return {k: {m: round(statistics.median(v), 3) for m, v in row.items()} for k, row in out.items()}


def _paired(args) -> dict:
    """Each side's step alternated with the other's, `--paired` pairs in one process group (the side that goes
    first alternates too): the load of a shared machine hits both alike. Per kind: the median step times and the
    median over the pairs of hand-written time / prepare time (prepare's tokens/s against the hand-written)."""
    out = {}
    for kind in ("pp", "tp") if args.only == "both" else (args.only,):
        (hand_name, make_hand), (ported_name, make_ported) = RUNS[kind]
        steps = {hand_name: make_hand(args), ported_name: make_ported(args)}
        for step in steps.values():
            for _ in range(args.warmup + 1):
                step()
        times: dict[str, list[float]] = {name: [] for name in steps}
        for i in range(args.paired):
            for name in list(steps)[:: 1 if i % 2 else -1]:
                dist.barrier()
                t = time.perf_counter()
                steps[name]()
                dist.barrier()
                times[name].append(time.perf_counter() - t)
        ratios = [h / p for h, p in zip(times[hand_name], times[ported_name], strict=True)]
        out.update({name: {"step_ms": round(statistics.median(t) * 1000, 2)} for name, t in times.items()})
        out[f"{kind}: prepare/handwritten tokens/s (paired)"] = round(statistics.median(ratios), 3)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2, help="alternations of the runs (medians reported)")
    p.add_argument("--only", choices=("pp", "tp", "both"), default="both")
    p.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="tp: both sides with sequence parallelism (the NCCL plan)",
    )
    p.add_argument(
        "--paired",
        type=int,
        default=0,
        metavar="N",
        help="instead: N pairs of steps, the sides alternated step by step (robust to a shared machine's load)",
    )
    args = p.parse_args()
    if args.paired:
        print(json.dumps(ddpkit.launch(_paired, args, nprocs=2)[0], indent=2))
        return
    result = ddpkit.launch(_measure, args, nprocs=2)[0]
    for kind in ("pp", "tp"):
        if f"{kind} prepare" in result:
            result[f"{kind}: prepare/handwritten tokens/s"] = round(
                result[f"{kind} prepare"]["tokens_per_s"] / result[f"{kind} handwritten"]["tokens_per_s"], 3
            )
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
