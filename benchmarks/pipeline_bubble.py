"""The pipeline bubble, measured: the idle fraction of each stage per optimizer step under GPipe and 1F1B at
several micro-batch counts m, beside the theory (p - 1) / (m + p - 1) for p stages of equal cost.

Each of p processes (gloo, one thread each) runs one stage of the same cost, fed a batch of `--batch` rows cut
into m micro-batches by ddpkit's PipelineRunner (torch's ScheduleGPipe / Schedule1F1B). The stage's work is
`--kernel`:
  device   a fixed-time stand-in for an accelerator kernel: each micro-batch's forward takes --fwd-ms and its
           backward twice that (a sleep, so the stages do not compete for the CPU, as stages on their own
           devices do not); what is measured is the schedule's bubble plus its communication
  matmul   `--layers` Linear(width, width) + GELU layers computed on the CPU (with p processes on fewer free
           cores than p, CPU contention shows up as idle time too)
A stage's busy time is the wall time inside its forward and backward
(module hooks: forward pre/post, full backward pre/post); its idle fraction is 1 - busy / step time, the
step timed between two barriers, so waiting for a neighbour and sending to it count as idle. The median over
--steps measured steps (after --warmup) is reported.

    python benchmarks/pipeline_bubble.py                          # p=2, m = 2 4 8 16, gpipe and 1f1b
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


def theory(p: int, m: int) -> float:
    return (p - 1) / (m + p - 1)


class _Clock:
    """Busy seconds of one module: forward and backward, through its hooks."""

    def __init__(self, module):
        self.busy, self._t = 0.0, 0.0
        module.register_forward_pre_hook(lambda *_: self._start())
        module.register_forward_hook(lambda *_: self._stop())
        module.register_full_backward_pre_hook(lambda *_: self._start())
        module.register_full_backward_hook(lambda *_: self._stop())

    def _start(self):
        self._t = time.perf_counter()

    def _stop(self):
        self.busy += time.perf_counter() - self._t


def _stage(args):
    import torch
    import torch.nn as nn

    if args.kernel == "matmul":
        return nn.Sequential(
            *[m for _ in range(args.layers) for m in (nn.Linear(args.width, args.width), nn.GELU())]
        )

    class Kernel(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            time.sleep(args.fwd_ms / 1000)
            return x * 1.0

        @staticmethod
        def backward(ctx, grad):
            time.sleep(2 * args.fwd_ms / 1000)
            return grad

    class Stage(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(args.width, args.width)

        def forward(self, x):
            return Kernel.apply(self.lin(x))

    return Stage()


def measure(schedule: str, m: int, args) -> dict:
    """One setting on this rank: the median idle fraction and step time over the measured steps."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from ddpkit.parallel.pipeline.runner import PipelineRunner

    torch.manual_seed(0)
    stage = _stage(args)
    clock = _Clock(stage)
    runner = PipelineRunner(
        [stage],
        schedule=schedule,
        n_microbatches=m,
        loss_fn=lambda out, y: F.mse_loss(out, y),
        pp_group=dist.group.WORLD,
    )
    # the first stage's input asks for a gradient too, so that its full backward hook fires at the end of its
    # backward (with no input needing one it fires at the start, and the backward would count as idle)
    x = torch.randn(args.batch, args.width, requires_grad=True)
    idle, times = [], []
    for step in range(args.warmup + args.steps):
        dist.barrier()
        clock.busy, t0 = 0.0, time.perf_counter()
        runner.step(x, x.detach())
        dist.barrier()
        elapsed = time.perf_counter() - t0
        for p in [*stage.parameters(), x]:
            p.grad = None
        if step >= args.warmup:
            idle.append(1 - clock.busy / elapsed)
            times.append(elapsed)
    return {"idle": statistics.median(idle), "step_s": statistics.median(times)}


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
            rows.append(
                {
                    "schedule": schedule,
                    "m": m,
                    "theory": round(theory(dist.get_world_size(), m), 4),
                    "idle_per_stage": [round(r["idle"], 4) for r in every],
                    "step_s": round(max(r["step_s"] for r in every), 4),
                }
            )
    return rows


def table(rows: list[dict], p: int) -> str:
    head = "| schedule | m | theory (p-1)/(m+p-1) | " + " | ".join(f"stage {i} idle" for i in range(p))
    lines = [head + " | step (s) |", "|" + "---|" * (p + 4)]
    for r in rows:
        idle = " | ".join(f"{v:.3f}" for v in r["idle_per_stage"])
        lines.append(f"| {r['schedule']} | {r['m']} | {r['theory']:.3f} | {idle} | {r['step_s']:.3f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stages", type=int, default=2, help="pipeline stages = processes (default 2)")
    ap.add_argument("--micro", type=int, nargs="+", default=[2, 4, 8, 16], help="micro-batch counts m")
    ap.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b"], choices=["gpipe", "1f1b"])
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
    os.environ.setdefault("DDPKIT_OVERSUBSCRIBE", "1")
    from _common import machine, machine_line

    import ddpkit

    info = machine()
    rows = ddpkit.launch(worker, args, nprocs=args.stages)[0]
    print(machine_line(info))
    work = (
        f"a {args.fwd_ms:g} ms forward + {2 * args.fwd_ms:g} ms backward kernel per micro-batch"
        if args.kernel == "device"
        else f"{args.layers} x Linear({args.width}, {args.width})"
    )
    print(f"p={args.stages} stages, each {work}, batch {args.batch}")
    print(table(rows, args.stages))
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": info, "args": vars(args), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
