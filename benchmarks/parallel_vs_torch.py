"""Each parallel layout of `ddpkit train` against hand-written torch doing the same: tokens/s of training.

The work, on both sides: the built-in GPT (ddpkit.models.gpt.model.GPT: 4 blocks, width 128, 4 heads, context 64) on
ddpkit's `data.dataset=text` samples (the standard library's sources, char tokens), the same global batch
(16 sequences) and steps in every layout, AdamW (lr 1e-3, weight decay 5e-4, constant), no dropout, gloo,
OMP_NUM_THREADS=1 and torch.set_num_threads(1) per rank.

  ddpkit  python -m ddpkit train model.arch=gpt data.dataset=text ... dist.tp=.. dist.pp=.. dist.strategy=..
          --nproc-per-node N
  torch   python -m torch.distributed.run --standalone --nproc-per-node N THIS_FILE --worker ...: the same
          samples in tensors, the same ("pp", "dp", "tp") device mesh, and per layout what a careful user writes
          with torch alone: a Colwise/Rowwise `parallelize_module` plan of the blocks' projections (tp), fully_shard
          on each block and then the root (fsdp; zero2: reshard_after_forward=False), stages cut by hand and run by
          torch.distributed.pipelining's Schedule1F1B with 2 x pp micro-batches (pp: pp_vs_handwritten.py's
          cut_stage and schedule_1f1b), DDP around the stage (dp x pp); loss sums all-reduced once an epoch.

Layouts: tp2, fsdp, zero2, pp2 (2 processes); fsdp_tp2 (dp2 x tp2) and dp2_pp2 (4 processes, oversubscribed on 2
cores); hsdp (4 processes: 2 replicas of 2-rank sharding groups; by hand fully_shard on a 2-D replicate x shard
mesh), fsdp_tp2_pp2 (8 processes) and ep2 (2 processes) only when named with --layouts.

ep2 is expert parallelism: the work is then the Mixtral-shaped llama (model.arch=llama model.n_experts=4
model.experts_per_token=2, the same width, heads and blocks, every block's MLP 4 routed experts) over 2 ranks,
each holding 2 experts, under DDP. By hand: the same model class (ddpkit.models.mixtral.model.Mixtral, its router
and expert SwiGLUs), each rank keeping its slice of the expert tensors as plain parameters, the tokens exchanged
by an all-to-all written here (the counts by all_to_all_single, the rows by torch's autograd all_to_all_single,
sorted expert-major by argsort), DDP over the dense parameters and the experts' gradients divided by dp.

What is timed, the same way on both sides: epochs 2 .. E-1 (epoch 1 warms up; ddpkit evaluates after the last),
each from its start to its loss all-reduce (ddpkit: metrics.jsonl's train_tokens_per_s). The sides run
alternately (A B, B A, ...) per layout; the report gives the medians, their ratio ddpkit/torch (target >= 0.95),
the load average before each run and the CPU other processes used during it.

    python benchmarks/parallel_vs_torch.py                          # 6 layouts, 2 rounds (about 8 min quiet)
    python benchmarks/parallel_vs_torch.py --layouts tp2 fsdp --rounds 3 --json out.json
    python benchmarks/parallel_vs_torch.py --quick                  # smoke test: tiny model, tp2 and fsdp, 1 round
    python benchmarks/parallel_vs_torch.py --dry-run                # the commands, nothing run
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common  # noqa: E402

SEED, LR, WEIGHT_DECAY = 0, 1e-3, 5e-4
GLOBAL_BATCH = 16

# name -> (processes, tp, pp, strategy over the data-parallel ranks: ddp, fsdp, zero2, hsdp)
LAYOUTS: dict[str, tuple[int, int, int, str]] = {
    "tp2": (2, 2, 1, "ddp"),
    "fsdp": (2, 1, 1, "fsdp"),
    "zero2": (2, 1, 1, "zero2"),
    "pp2": (2, 1, 2, "ddp"),
    "fsdp_tp2": (4, 2, 1, "fsdp"),
    "dp2_pp2": (4, 1, 2, "ddp"),
    "fsdp_tp2_pp2": (8, 2, 2, "fsdp"),
    "hsdp": (4, 1, 1, "hsdp"),
    "ep2": (2, 1, 1, "ddp"),
}
EP = {"ep2": 2}  # the expert-parallel degree of an ep layout (its work: the Mixtral-shaped llama)
N_EXPERTS, TOP_K = 4, 2
DP_SHARD = 2  # hsdp: ranks per sharding group (2 replicas of 2 on 4 processes)
SIDES = ("ddpkit", "torch")
DEFAULT_LAYOUTS = ["tp2", "fsdp", "zero2", "pp2", "fsdp_tp2", "dp2_pp2"]


def work_keys(args: argparse.Namespace, layout: str = "") -> list[str]:
    """The Config keys of the model and the data, shared by both sides."""
    experts = [f"model.n_experts={N_EXPERTS}", f"model.experts_per_token={TOP_K}"] if layout in EP else []
    return [
        "model.arch=llama" if experts else "model.arch=gpt",
        *experts,
        f"model.n_layer={args.n_layer}",
        f"model.n_head={args.n_head}",
        f"model.n_embd={args.n_embd}",
        "model.dropout=0",
        "data.dataset=text",
        f"data.block_size={args.block}",
        f"data.text_bytes={args.text_bytes}",
        f"seed={SEED}",
    ]


def ddpkit_command(args: argparse.Namespace, layout: str, out: str) -> list[str]:
    nproc, tp, pp, strategy = LAYOUTS[layout]
    dp = nproc // (tp * pp)
    return [
        common.python(),
        "-m",
        "ddpkit",
        "train",
        *work_keys(args, layout),
        f"train.batch_size={GLOBAL_BATCH // dp}",
        f"train.epochs={args.epochs}",
        "optim.name=adamw",
        f"optim.lr={LR}",
        f"optim.weight_decay={WEIGHT_DECAY}",
        "optim.ref_batch_size=null",
        "optim.schedule=constant",
        "optim.warmup_epochs=0",
        "eval.every=1000",
        "report.curves=false",
        "checkpoint.resume=none",
        f"dist.tp={tp}",
        f"dist.pp={pp}",
        f"dist.strategy={strategy if dp > 1 else 'auto'}",
        *([f"dist.dp_shard={DP_SHARD}"] if strategy == "hsdp" else []),
        *([f"dist.ep={EP[layout]}"] if layout in EP else []),
        f"out_dir={out}",
        "--nproc-per-node",
        str(nproc),
        *(["--oversubscribe"] if nproc > (os.cpu_count() or 1) else []),
    ]


def torch_command(args: argparse.Namespace, layout: str, out: str) -> list[str]:
    nproc = LAYOUTS[layout][0]
    sizes = ("--n-layer", str(args.n_layer), "--n-head", str(args.n_head), "--n-embd", str(args.n_embd))
    return [
        *(common.python(), "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)),
        str(Path(__file__).resolve()),
        "--worker",
        *("--layouts", layout, "--epochs", str(args.epochs), "--block", str(args.block)),
        *(*sizes, "--text-bytes", str(args.text_bytes), "--out", out),
    ]


# ------------------------------------------------------------------------------------------------------
# the hand-written side
# ------------------------------------------------------------------------------------------------------

COLUMN = ("attn.wq", "attn.wk", "attn.wv", "mlp.fc")  # the GPT block's column-parallel projections
ROW = ("attn.wo", "mlp.proj")


def handwritten_plan(module) -> dict:
    """Megatron-LM's plan of the blocks, by hand: q, k, v and fc column-parallel, wo and proj row-parallel."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {}
    for i in module.blocks:
        plan.update({f"blocks.{i}.{n}": ColwiseParallel() for n in COLUMN})
        plan.update({f"blocks.{i}.{n}": RowwiseParallel() for n in ROW})
    return plan


class HandExchange:
    """Expert parallelism's token exchange written with torch.distributed alone (MoE.exchange's interface): this
    rank's rows sorted by expert go to the ranks holding their experts, come back in the order they left."""

    def __init__(self, group, ep: int):
        self.group, self.ep = group, ep

    def dispatch(self, x, counts):
        import torch
        import torch.distributed as dist
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        counts = counts.to(torch.int64)
        got = torch.empty_like(counts)
        dist.all_to_all_single(got, counts, group=self.group)  # [source rank, my expert]: rows coming
        got = got.view(self.ep, -1)
        send, recv = counts.view(self.ep, -1).sum(1).tolist(), got.sum(1).tolist()
        rows = all_to_all_single_autograd(x.contiguous(), recv, send, self.group)
        expert = torch.arange(got.shape[1]).repeat(self.ep).repeat_interleave(got.flatten())
        order = expert.argsort(stable=True)  # rank-major -> expert-major
        return rows[order], got.sum(0), (order, send, recv)

    def combine(self, y, ctx):
        import torch
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        order, send, recv = ctx
        back = torch.empty_like(order)
        back[order] = torch.arange(order.numel())
        return all_to_all_single_autograd(y[back].contiguous(), send, recv, self.group)


def expert_parallel_by_hand(module, group, ep: int, rank: int) -> list:
    """Each MoE block keeps its rank's n_experts / ep experts (plain parameters) and exchanges over `group`;
    returns the DDP-ignored names (the experts and the blocks' per-rank counts)."""
    import torch.nn as nn

    from ddpkit.models.experts import MoE

    ignored = []
    for prefix, m in module.named_modules():
        if isinstance(m, MoE):
            per = m.routing.n_experts // ep
            for name in ("gate", "up", "down"):
                mine = getattr(m.experts, name).detach()[rank * per : (rank + 1) * per].clone()
                setattr(m.experts, name, nn.Parameter(mine))
                ignored.append(f"{prefix}.experts.{name}")
            ignored += [f"{prefix}.{b}" for b in MoE.LOCAL_BUFFERS]
            m.exchange = HandExchange(group, ep)
    return ignored


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from pp_vs_handwritten import cut_stage, schedule_1f1b
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ddpkit.config import load_config
    from ddpkit.data import build_datasets
    from ddpkit.models.gpt.model import GPT, lm_loss

    torch.set_num_threads(1)
    nproc, tp, pp, strategy = LAYOUTS[args.layouts[0]]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    dp = nproc // (tp * pp)
    mesh = init_device_mesh("cpu", (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
    stage, dp_rank = rank // (dp * tp), (rank // tp) % dp

    cfg = load_config(None, work_keys(args, args.layouts[0]))
    train_set, _, spec = build_datasets(cfg)
    xs, ys = zip(*(train_set[i] for i in range(len(train_set))), strict=True)
    xs, ys = torch.stack(xs), torch.stack(ys)
    torch.manual_seed(SEED)
    ep = EP.get(args.layouts[0], 1)
    if ep > 1:  # the Mixtral-shaped llama of the same keys, its experts split by hand
        from ddpkit.models import model_family

        family = model_family(cfg.model.arch, cfg.model)
        module = family.build_lm(cfg.model.arch, spec.vocab_size, args.block, cfg.model)
        ignored = expert_parallel_by_hand(module, mesh["dp"].get_group(), ep, dp_rank)
        experts = [p for n, p in module.named_parameters() if ".experts." in n]
        DDP._set_params_and_buffers_to_ignore_for_model(module, ignored)
    else:
        module, experts = GPT(spec.vocab_size, args.block, args.n_layer, args.n_head, args.n_embd), []
    if pp > 1:
        module = cut_stage(module, stage, pp)
    if tp > 1:
        from torch.distributed.tensor.parallel import parallelize_module

        parallelize_module(module, mesh["tp"], handwritten_plan(module))
    if dp > 1 and strategy in ("fsdp", "zero2", "hsdp"):
        from torch.distributed.fsdp import fully_shard

        # HSDP: FSDP2 on a 2-D mesh, replicas x sharding groups (torch's own form of it)
        shard_mesh = (
            init_device_mesh("cpu", (dp // DP_SHARD, DP_SHARD), mesh_dim_names=("replicate", "shard"))
            if strategy == "hsdp"
            else mesh["dp"]
        )
        keep = {"mesh": shard_mesh, "reshard_after_forward": strategy != "zero2"}
        for block in module.blocks.values():
            fully_shard(block, **keep)
        fully_shard(module, **keep)
    elif dp > 1:
        module = DDP(module, process_group=mesh["dp"].get_group())
    opt = torch.optim.AdamW(module.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    schedule = schedule_1f1b(module, stage, pp, 2 * pp, group=mesh["pp"].get_group()) if pp > 1 else None
    per = GLOBAL_BATCH // dp
    steps = len(xs) // GLOBAL_BATCH
    rows = []
    for epoch in range(1, args.epochs + 1):
        t0 = time.perf_counter()
        order = torch.randperm(len(xs), generator=torch.Generator().manual_seed(SEED + epoch))
        sums = torch.zeros(2, dtype=torch.float64)  # loss sum, batches
        for s in range(steps):
            idx = order[s * GLOBAL_BATCH : (s + 1) * GLOBAL_BATCH][dp_rank * per : (dp_rank + 1) * per]
            x, y = xs[idx], ys[idx]
            if schedule is None:
                loss = lm_loss(module(x), y)
                loss.backward()
                for p in experts:  # each rank's own experts (ep = dp: no other rank holds them): the dp mean
                    p.grad.div_(dp)
            elif stage == 0:
                schedule.step(x)
                loss = None
            else:
                losses: list = []
                schedule.step(target=y, losses=losses)
                loss = torch.stack(losses).mean()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if loss is not None:
                sums += torch.stack([loss.detach().double(), torch.ones((), dtype=torch.float64)])
        dist.all_reduce(sums)
        rows.append(
            {
                "epoch": epoch,
                "epoch_time_s": time.perf_counter() - t0,
                "tokens": steps * GLOBAL_BATCH * args.block,
            }
        )
    if rank == 0:
        Path(args.out).write_text(json.dumps(rows))
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------------
# the driver
# ------------------------------------------------------------------------------------------------------


def tokens_per_s(side: str, out: Path, epochs: int) -> float:
    """Tokens/s of epochs 2 .. epochs-1."""
    if side == "ddpkit":
        rows = [r for r in common.read_jsonl(out / "metrics.jsonl") if 2 <= int(r["epoch"]) <= epochs - 1]
        tokens = sum(r["train_tokens_per_s"] * r["epoch_time_s"] for r in rows)
    else:
        rows = [r for r in json.loads(out.read_text()) if 2 <= int(r["epoch"]) <= epochs - 1]
        tokens = sum(r["tokens"] for r in rows)
    return tokens / sum(r["epoch_time_s"] for r in rows)


def run_side(args: argparse.Namespace, side: str, layout: str) -> dict[str, Any]:
    """One run of one side; a run that fails is run once more, and the failure is kept in the result."""

    def attempt() -> dict[str, Any]:
        with tempfile.TemporaryDirectory(prefix=f"ddpkit-pvt-{side}-") as tmp:
            out = Path(tmp) / ("run" if side == "ddpkit" else "torch.json")
            cmd = (ddpkit_command if side == "ddpkit" else torch_command)(args, layout, str(out))
            run = common.run_measured(cmd, f"{layout} {side}", env={"OMP_NUM_THREADS": "1"}, echo=args.echo)
            rate = tokens_per_s(side, out, args.epochs)
        return {"tokens_per_s": rate, **{k: run[k] for k in ("load1", "other_cores", "wall_s")}}

    result, failures = common.once_more_on_failure(attempt, f"{layout} {side}")
    return {**result, "failed_first": failures}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=DEFAULT_LAYOUTS)
    p.add_argument("--rounds", type=int, default=2, help="alternated runs of each side per layout")
    p.add_argument("--epochs", type=int, default=3, help="epochs per run (2 .. E-1 are timed)")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--block", type=int, default=64, help="tokens of context (data.block_size)")
    p.add_argument(
        "--text-bytes", type=int, default=40000, help="data.text_bytes: 34 steps of 16 sequences an epoch"
    )
    p.add_argument("--quick", action="store_true", help="smoke test: tiny model, tp2 and fsdp, 1 round")
    common.add_run_options(p)
    args, raw = common.parse_run_args(p, argv)
    if args.worker:
        worker(args)
        return 0
    if args.quick:
        args.layouts, args.rounds, args.n_layer, args.n_embd, args.block = ["tp2", "fsdp"], 1, 2, 32, 16
        args.text_bytes = 6000
    if args.dry_run:
        for layout in args.layouts:
            print(f"{layout} ddpkit: OMP_NUM_THREADS=1 {' '.join(ddpkit_command(args, layout, 'OUT'))}")
            print(f"{layout} torch: OMP_NUM_THREADS=1 {' '.join(torch_command(args, layout, 'OUT'))}")
        return 0
    m = common.machine()
    print(f"each layout of ddpkit train vs hand-written torch: {common.machine_line(m)}", flush=True)
    table, raw_runs, ratios = [], [], {}
    for layout in args.layouts:
        runs = common.alternated(
            args.rounds,
            SIDES,
            lambda side, layout=layout: run_side(args, side, layout),
            layout,
            "tokens_per_s",
        )
        med, each, loads = common.compared(runs, SIDES, "tokens_per_s")
        ratios[layout] = med["ddpkit"] / med["torch"]
        table.append(
            [
                layout,
                LAYOUTS[layout][0],
                f"{med['ddpkit']:.0f}",
                f"{med['torch']:.0f}",
                f"**{ratios[layout]:.3f}**",
                each,
                loads,
            ]
        )
        raw_runs.append({"layout": layout, "runs": runs, "ratio": ratios[layout]})
    headers = ["layout", "processes", "ddpkit tokens/s (median)", "torch tokens/s (median)", "ddpkit / torch"]
    headers += ["rounds (ddpkit / torch)", "load average 1 min"]
    low = [k for k, v in ratios.items() if v < 0.95]
    common.report(
        m,
        f"benchmarks/parallel_vs_torch.py {' '.join(raw)}",
        headers,
        table,
        f"below 0.95: {', '.join(low) or 'none'} (target >= 0.95 for every layout)",
        args.json,
        {"layouts": raw_runs},
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
