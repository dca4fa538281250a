"""The pipeline bubble, measured: the idle fraction of each pipeline rank per optimizer step under every schedule
(GPipe, 1F1B, interleaved 1F1B, interleaved zero bubble, ZB-V, DualPipeV) at several micro-batch counts m, beside
the theory: (p - 1) / (m + p - 1) for one stage per rank, and for the others the idle fraction of the schedule's
own timetable (torch's action lists) played with the stand-in's costs and free communication.

Each of p processes (gloo, one thread each) runs the same work per micro-batch, fed a batch of `--batch` rows cut
into m micro-batches by ddpkit's PipelineRunner: one stage, or under a schedule of two stages per rank two stages
of half the work each. The work is `--kernel`:
  device   a fixed-time stand-in for an accelerator kernel: a rank's forward of a micro-batch takes --fwd-ms, the
           gradient of its input as long, and the gradient of its weights as long (a sleep, so the stages do not
           compete for the CPU, as stages on their own devices do not; the zero-bubble schedules run the two
           gradients apart, the others together); what is measured is the schedule's bubble plus its
           communication and Python
  matmul   `--layers` Linear(width, width) + GELU layers per rank computed on the CPU (with p processes on fewer
           free cores than p, CPU contention shows up as idle time too)
A rank's busy time is the wall time inside its stages' forward, backward and weight-gradient calls (torch's
PipelineStage methods); its idle fraction is 1 - busy / step time, the step timed between two barriers, so
waiting for a neighbour and sending to it count as idle. The median over --steps measured steps (after --warmup)
is reported.

    python benchmarks/pipeline_bubble.py                          # p=2, m = 2 4 8 16, gpipe and 1f1b
    python benchmarks/pipeline_bubble.py --schedules 1f1b interleaved_1f1b interleaved_zb zbv dualpipev --micro 4 8
    python benchmarks/pipeline_bubble.py --kernel matmul --json bubble.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

SCHEDULES = ["gpipe", "1f1b", "interleaved_1f1b", "interleaved_zb", "zbv", "dualpipev"]


def theory(p: int, m: int) -> float:
    return (p - 1) / (m + p - 1)


def timetable_idle(order: dict, n_stages: int) -> list[float]:
    """Each rank's idle fraction when the schedule's compute actions (`order`: torch's pipeline_order, rank ->
    actions) run with a forward, an input gradient and a weight gradient of one unit each (a full backward: two)
    and communication free: an action starts when its rank is free and what it needs is done (the forward of the
    previous stage, the input gradient of the next, the own input gradient before the weights')."""
    cost = {"F": 1.0, "I": 1.0, "W": 1.0, "B": 2.0}
    done: dict[tuple[str, int, int], float] = {}

    def needs(a) -> list[tuple[str, int, int]]:
        kind, s, mb = a.computation_type.value, a.stage_index, a.microbatch_index
        if kind == "F":
            return [("F", s - 1, mb)] if s > 0 else []
        if kind in ("I", "B"):
            return [("F", s, mb)] + ([("I", s + 1, mb)] if s < n_stages - 1 else [])
        return [("I", s, mb)]  # W

    def parts(a) -> list:
        return list(a.sub_actions) if a.sub_actions else [a]

    compute = ("F", "I", "W", "B", "OVERLAP_F_B")  # (REDUCE_GRAD and the like cost nothing here)
    queues = {
        r: [a for a in acts if a is not None and a.computation_type.value in compute]
        for r, acts in order.items()
    }
    free = dict.fromkeys(queues, 0.0)
    busy = dict.fromkeys(queues, 0.0)
    while any(queues.values()):
        moved = False
        for r, q in queues.items():
            while q and all(k in done for a in parts(q[0]) for k in needs(a)):
                for a in parts(q.pop(0)):
                    start = max([free[r], *(done[k] for k in needs(a))])
                    kind = a.computation_type.value
                    free[r] = start + cost[kind]
                    busy[r] += cost[kind]
                    for name in ("I", "W") if kind == "B" else (kind,):
                        done[(name, a.stage_index, a.microbatch_index)] = free[r]
                moved = True
        if not moved:
            raise RuntimeError("the timetable does not progress")
    end = max(free.values())
    return [1 - busy[r] / end for r in sorted(queues)]


class _Clock:
    """Busy seconds of a rank: the wall time inside its pipeline stages' compute calls."""

    def __init__(self, stages):
        self.busy = 0.0
        for stage in stages:
            for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                setattr(stage, name, self._timed(getattr(stage, name)))

    def _timed(self, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.busy += time.perf_counter() - t0

        return timed


def _stage(args, share: float):
    """One stage doing `share` of a rank's work per micro-batch."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    if args.kernel == "matmul":
        n = max(1, round(args.layers * share))
        return nn.Sequential(*[m for _ in range(n) for m in (nn.Linear(args.width, args.width), nn.GELU())])
    ms = args.fwd_ms * share / 1000

    class Kernel(torch.autograd.Function):  # the forward, and the gradient of the input
        @staticmethod
        def forward(ctx, x):
            time.sleep(ms)
            return x * 1.0

        @staticmethod
        def backward(ctx, grad):
            time.sleep(ms)
            return grad

    class WeightKernel(torch.autograd.Function):  # the gradient of the weights
        @staticmethod
        def forward(ctx, w):
            return w * 1.0

        @staticmethod
        def backward(ctx, grad):
            time.sleep(ms)
            return grad

    class Stage(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(args.width, args.width)

        def forward(self, x):
            return Kernel.apply(F.linear(x, WeightKernel.apply(self.lin.weight), self.lin.bias))

    return Stage()


def measure(schedule: str, m: int, args) -> dict:
    """One setting on this rank: the median idle fraction and step time over the measured steps, and the
    timetable's idle fraction of every rank (None for one stage per rank: the formula)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from ddpkit.parallel.pipeline.plan import stages_per_rank
    from ddpkit.parallel.pipeline.runner import PipelineRunner

    torch.manual_seed(0)
    per_rank = stages_per_rank(schedule)
    stages = [_stage(args, 1 / per_rank) for _ in range(per_rank)]
    runner = PipelineRunner(
        stages,
        schedule=schedule,
        n_microbatches=m,
        loss_fn=lambda out, y: F.mse_loss(out, y),
        pp_group=dist.group.WORLD,
    )
    # the action lists a multi-stage schedule runs (a one-stage schedule's pipeline_order is only a drawing of it)
    table = timetable_idle(runner.schedule.pipeline_order, runner.n_stages) if per_rank > 1 else None
    clock = _Clock(runner.pipe_stages)
    x = torch.randn(args.batch, args.width)
    idle, times = [], []
    for step in range(args.warmup + args.steps):
        dist.barrier()
        clock.busy, t0 = 0.0, time.perf_counter()
        runner.step(x, x)
        dist.barrier()
        elapsed = time.perf_counter() - t0
        for stage in stages:
            stage.zero_grad(set_to_none=True)
        if step >= args.warmup:
            idle.append(1 - clock.busy / elapsed)
            times.append(elapsed)
    return {"idle": statistics.median(idle), "step_s": statistics.median(times), "timetable": table}


def worker(args) -> list[dict]:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rows = []
    for schedule in args.schedules:
        for m in args.micro:
            got = measure(schedule, m, args)
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, got)
            table = got["timetable"]
            rows.append(
                {
                    "schedule": schedule,
                    "m": m,
                    "theory": round(
                        sum(table) / len(table) if table else theory(dist.get_world_size(), m), 4
                    ),
                    "idle_per_stage": [round(r["idle"], 4) for r in every],
                    "step_s": round(max(r["step_s"] for r in every), 4),
                }
            )
    return rows


def table(rows: list[dict], p: int) -> str:
    head = "| schedule | m | theory | " + " | ".join(f"rank {i} idle" for i in range(p))
    lines = [head + " | step (s) |", "|" + "---|" * (p + 4)]
    for r in rows:
        idle = " | ".join(f"{v:.3f}" for v in r["idle_per_stage"])
        lines.append(f"| {r['schedule']} | {r['m']} | {r['theory']:.3f} | {idle} | {r['step_s']:.3f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stages", type=int, default=2, help="pipeline stages = processes (default 2)")
    ap.add_argument("--micro", type=int, nargs="+", default=[2, 4, 8, 16], help="micro-batch counts m")
    ap.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b"], choices=SCHEDULES)
    ap.add_argument("--kernel", choices=["device", "matmul"], default="device")
    ap.add_argument("--fwd-ms", type=float, default=20.0, help="device kernel: forward ms per micro-batch")
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=256, help="rows per step (a multiple of every m)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args(argv)
    bad = [m for m in args.micro if args.batch % m or m < args.stages]
    if bad:
        ap.error(f"m={bad[0]}: m must be at least --stages and divide --batch {args.batch}")
    from ddpkit.errors import UserError
    from ddpkit.parallel.pipeline.plan import check_microbatches

    for schedule in args.schedules:
        for m in args.micro:
            try:
                check_microbatches(m, args.stages, schedule)
            except UserError as e:
                ap.error(e.line())
    os.environ.setdefault("DDPKIT_OVERSUBSCRIBE", "1")
    from _common import machine, machine_line

    import ddpkit

    info = machine()
    rows = ddpkit.launch(worker, args, nprocs=args.stages)[0]
    print(machine_line(info))
    work = (
        f"a {args.fwd_ms:g} ms forward + {args.fwd_ms:g} ms input-gradient + {args.fwd_ms:g} ms weight-gradient "
        "kernel per micro-batch (two stages per rank: half each)"
        if args.kernel == "device"
        else f"{args.layers} x Linear({args.width}, {args.width})"
    )
    print(f"p={args.stages} ranks, each {work}, batch {args.batch}")
    print(table(rows, args.stages))
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": info, "args": vars(args), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
