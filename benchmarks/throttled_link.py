"""Gradient compression on a real throttled link: two network-namespace "nodes" joined by a veth pair whose
both ends are shaped by `tc` (a token bucket, tbf), 1 and 2 workers per node, gloo over the veth
(GLOO_SOCKET_IFNAME).

A resnet18 step on this CPU is about 100x slower than on a GPU, so the link is scaled the same way: 100 Mbit/s
here stands for about 10 Gbit/s beside one GPU; 1 Gbit/s is measured too. For each link, workers per node, model
(torchvision resnet18 and the built-in CNN, synthetic 3x32x32 batches of --batch per process) and compression
(dist.grad_compression none, fp16, bf16, powersgd: ddpkit's own DDP hooks), the workers time optimizer steps with
DDP's gradient sync and, interleaved, the same steps under no_sync (compute alone: forward, backward, update);
exposed communication = step - compute. Every compression runs in the same launch, their order rotating each
repetition. Beside each measurement: the alpha-beta model's step time, compute + 2(n-1)/n x bytes / bandwidth +
2(n-1) x alpha per all-reduce, with the link's measured TCP throughput. Then the accuracy each compression costs
on the digits recipe (configs/digits.yaml, 2 processes, final val_acc1 over --seeds), and what the same model
predicts for 8, 64 and 256 GPUs on 10, 100 and 400 Gbit/s links.

Needs root (ip netns, tc). The namespaces (and with them the veth pair and its tc rules) are removed at the end,
also after a failure or Ctrl-C.

    python benchmarks/throttled_link.py                  # everything: about 15 minutes on 2 cores
    python benchmarks/throttled_link.py --quick          # resnet18, 100 Mbit/s, 1 worker per node, 1 rep: ~2 min
    python benchmarks/throttled_link.py --rates 100 --workers 1 --models resnet18 --reps 3 --seeds
"""

from __future__ import annotations

import argparse
import json
import math
import os
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, machine, machine_line, md_table, python, read_jsonl  # noqa: E402

COMPRESSIONS = ["none", "fp16", "bf16", "powersgd"]
ADDRS = ("10.78.0.1", "10.78.0.2")
IFNAME = "ddpkl0"
ALPHA_S = 10e-6  # per-message latency of a GPU cluster's network, for the projections
GPU_SPEEDUP = 100.0  # a resnet18 step on one GPU vs on this CPU (the scaling behind 100 Mbit/s ~ 10 Gbit/s)
WARMUP_STEPS = 3  # untimed steps before PowerSGD compresses (its warm-up: 2 exact steps); the others: 1


# ------------------------------------------------------------------------------------------------ worker


def worker(spec: dict[str, Any]) -> None:
    """One rank under `ddpkit run`: every model x compression, each timed with and without gradient sync."""
    import torch
    import torch.nn.functional as F

    import ddpkit
    from ddpkit import models
    from ddpkit.config import load_config
    from ddpkit.distributed.collectives import all_gather_object, barrier, seed_everything
    from ddpkit.parallel.compression import Compression
    from ddpkit.parallel.plan import build_strategy
    from ddpkit.parallel.strategy import ddp_options

    ctx = ddpkit.init_distributed(backend="gloo", device="cpu")
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(ctx.rank)
    x = torch.randn(spec["batch"], 3, 32, 32, generator=g)
    y = torch.randint(10, (spec["batch"],), generator=g)
    rows = []
    for arch in spec["models"]:
        for rep in range(spec["reps"]):
            k = rep % len(spec["compressions"])
            for kind in spec["compressions"][k:] + spec["compressions"][:k]:
                keys = [f"model.arch={arch}", f"dist.grad_compression={kind}", "dist.powersgd_warmup_steps=2",
                        f"dist.bucket_cap_mb={spec['bucket_cap_mb']}"]  # fmt: skip
                cfg = load_config(None, keys)
                seed_everything(0)
                model = models.build_model(cfg, 10, 3, 32)
                comp = Compression.from_config(cfg.dist)
                strategy = build_strategy("ddp", ctx, {**ddp_options(cfg.dist), "init_sync": False}, comp)
                ddp = strategy.wrap(model)
                opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

                def step(sync: bool, ddp=ddp, opt=opt, strategy=strategy) -> float:
                    barrier()
                    t0 = time.perf_counter()
                    with strategy.sync_context(ddp, sync):
                        F.cross_entropy(ddp(x), y).backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    return time.perf_counter() - t0

                for _ in range(WARMUP_STEPS if kind == "powersgd" else 1):
                    step(True)
                synced, local = [], []
                for i in range(spec["steps"]):
                    for sync in (True, False) if i % 2 == 0 else (False, True):
                        (synced if sync else local).append(step(sync))
                mine = (statistics.median(synced), statistics.median(local))
                both = all_gather_object(mine)
                rows.append(
                    {
                        "model": arch,
                        "compression": kind,
                        "rep": rep,
                        "step_s": max(s for s, _ in both),
                        "compute_s": max(c for _, c in both),
                        "params": sum(p.numel() for p in model.parameters()),
                        "bytes": sync_bytes(model, kind, comp.powersgd_rank),
                    }
                )
                del ddp, opt, strategy, model
    if ctx.rank == 0:
        Path(spec["out"]).write_text("".join(json.dumps(r) + "\n" for r in rows))
    ddpkit.shutdown()


def sync_bytes(model, kind: str, rank: int) -> int:
    """Bytes one rank's gradients put into all-reduces per step (the `bytes` of the alpha-beta model)."""
    import types

    from ddpkit.parallel.powersgd import _plan

    shapes = [p.shape for p in model.parameters()]
    if kind in ("fp16", "bf16"):
        return 2 * sum(math.prod(s) for s in shapes)
    if kind != "powersgd":
        return 4 * sum(math.prod(s) for s in shapes)
    plan = _plan(types.SimpleNamespace(matrix_approximation_rank=rank, min_compression_rate=2), shapes)
    return 4 * sum(
        math.prod(s) if p is None else (p[0] + p[1]) * p[2] for s, p in zip(shapes, plan, strict=True)
    )


# ------------------------------------------------------------------------------------------------ the link


class Link:
    """Two namespaces on one veth pair (`ip netns`), each end shaped by tbf; removed on exit."""

    def __init__(self):
        tag = secrets.token_hex(2)
        self.names = (f"ddpklA-{tag}", f"ddpklB-{tag}")
        self.made: list[str] = []

    def __enter__(self) -> Link:
        try:
            for name in self.names:
                _run("ip", "netns", "add", name)
                self.made.append(name)
            a, b = self.names
            _run("ip", "link", "add", IFNAME, "netns", a, "type", "veth", "peer", "name", IFNAME, "netns", b)
            for name, addr in zip(self.names, ADDRS, strict=True):
                _run("ip", "-n", name, "addr", "add", f"{addr}/24", "dev", IFNAME)
                _run("ip", "-n", name, "link", "set", IFNAME, "up")
                _run("ip", "-n", name, "link", "set", "lo", "up")
                _run("ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", IFNAME, "root", *_tbf(100))
        except BaseException:
            self.__exit__()
            raise
        return self

    def shape(self, mbit: float) -> None:
        """Both directions to `mbit` Mbit/s."""
        for name in self.names:
            _run("ip", "netns", "exec", name, "tc", "qdisc", "change", "dev", IFNAME, "root", *_tbf(mbit))

    def argv(self, node: int, *command: str) -> list[str]:
        """`command` on node 0 or 1: in its namespace, with its address as its host name."""
        return ["ip", "netns", "exec", self.names[node], "unshare", "--uts", "sh", "-c",
                f'hostname {ADDRS[node]} && exec "$@"', "sh", *command]  # fmt: skip

    def __exit__(self, *exc) -> None:
        for name in self.made:
            pids = subprocess.run(
                ["ip", "netns", "pids", name], capture_output=True, text=True
            ).stdout.split()
            for pid in pids:  # only this benchmark's processes live in its namespaces
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        self.made.clear()


def _tbf(mbit: float) -> list[str]:
    burst = max(64 * 1024, int(mbit * 1e6 / 8 / 250))  # at least one kernel tick's worth of tokens
    return ["tbf", "rate", f"{mbit}mbit", "burst", str(burst), "latency", "50ms"]


def _run(*argv: str) -> None:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed: {proc.stderr.strip()}")


_PROBE = """
import socket, sys, time
role, n = sys.argv[1], int(float(sys.argv[2]) * 1e6)
if role == "recv":
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind((sys.argv[3], 5601)); s.listen(1)
    print("ready", flush=True); c, _ = s.accept(); got, t0 = 0, None
    while got < n:
        b = c.recv(1 << 20)
        if not b: break
        t0 = t0 or time.perf_counter(); got += len(b)
    print(got / (time.perf_counter() - t0), flush=True); c.sendall(b"x")
else:
    c = socket.create_connection((sys.argv[3], 5601)); buf = bytes(1 << 20); sent = 0
    while sent < n:
        c.sendall(buf[: min(len(buf), n - sent)]); sent += min(len(buf), n - sent)
    c.recv(1)
"""


def probe(link: Link, mbit: float) -> float:
    """Bytes/s one TCP stream gets from node 0 to node 1 (about 2 s of data)."""
    mb = str(mbit / 8 * 2)
    recv = subprocess.Popen(
        link.argv(1, python(), "-c", _PROBE, "recv", mb, ADDRS[1]), stdout=subprocess.PIPE, text=True
    )
    assert recv.stdout is not None and recv.stdout.readline().strip() == "ready"
    subprocess.run(link.argv(0, python(), "-c", _PROBE, "send", mb, ADDRS[1]), check=True, timeout=120)
    out, _ = recv.communicate(timeout=60)
    return float(out.strip())


def launch(link: Link, spec: dict[str, Any], wpn: int, port: int) -> list[dict[str, Any]]:
    """Both nodes' `ddpkit run` of this file's worker; the rows rank 0 wrote."""
    env = {**os.environ, "GLOO_SOCKET_IFNAME": IFNAME, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}  # fmt: skip
    flags = [
        "--nnodes",
        "2",
        "--nproc-per-node",
        str(wpn),
        "--master-addr",
        ADDRS[0],
        "--master-port",
        str(port),
    ]
    procs = [
        subprocess.Popen(
            link.argv(
                node,
                python(),
                "-m",
                "ddpkit",
                "run",
                *flags,
                "--node-rank",
                str(node),
                __file__,
                "--worker",
                json.dumps(spec),
            ),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for node in (0, 1)
    ]
    outs = [p.communicate(timeout=3600)[0] for p in procs]
    if any(p.returncode for p in procs):
        said = "\n".join(
            f"--- node {i} (exit {p.returncode}):\n{out[-3000:]}"
            for i, (p, out) in enumerate(zip(procs, outs, strict=True))
        )
        raise SystemExit(f"a node failed:\n{said}")
    return read_jsonl(Path(spec["out"]))


# ------------------------------------------------------------------------------------------------ the model


def predicted_step(
    compute_s: float, nbytes: int, n: int, bytes_per_s: float, kind: str, alpha_s: float
) -> float:
    """compute + 2(n-1)/n x bytes / bandwidth + 2(n-1) x alpha per all-reduce (PowerSGD: two per bucket)."""
    if n <= 1:
        return compute_s
    buckets = 1 + math.ceil(max(0, nbytes - 2**20) / (25 * 2**20))  # DDP: a 1 MiB first bucket, then 25 MiB
    calls = buckets * (2 if kind == "powersgd" else 1)
    return compute_s + 2 * (n - 1) / n * nbytes / bytes_per_s + 2 * (n - 1) * alpha_s * calls


def accuracy(seeds: list[int], compressions: list[str]) -> list[dict[str, Any]]:
    """Final val_acc1 of the digits recipe, 2 processes on this host, per compression and seed (alternating)."""
    rows = []
    for i, seed in enumerate(seeds):
        order = compressions if i % 2 == 0 else compressions[::-1]
        for kind in order:
            with tempfile.TemporaryDirectory() as tmp:
                cmd = [python(), "-m", "ddpkit", "train", "-c", "configs/digits.yaml", "--nproc-per-node", "2",
                       f"seed={seed}", f"dist.grad_compression={kind}", "report.curves=false", f"out_dir={tmp}/run"]  # fmt: skip
                proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900,
                                      env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
                if proc.returncode != 0:
                    raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
                final = read_jsonl(Path(tmp) / "run" / "metrics.jsonl")[-1]
            rows.append({"compression": kind, "seed": seed, "val_acc1": final["val_acc1"]})
            print(f"  digits, {kind}, seed {seed}: final val_acc1 {100 * final['val_acc1']:.2f}%", flush=True)
    return rows


# ------------------------------------------------------------------------------------------------ report


def med(rows: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def report(
    results: list[dict[str, Any]], links: dict[float, float], acc: list[dict[str, Any]], spec: dict
) -> str:
    out = ["Link (tbf rate set on both ends; one TCP stream measured from node 0 to node 1):", ""]
    out.append(md_table(["tbf rate", "measured TCP throughput"],
                        [[f"{m:g} Mbit/s", f"{b * 8 / 1e6:.1f} Mbit/s ({b / 1e6:.2f} MB/s)"] for m, b in links.items()]))  # fmt: skip
    head = ["model", "link", "workers/node (n)", "compression", "MB/step", "images/s", "vs none", "step s",
            "compute s", "exposed comm s", "model: step s", "measured/model"]  # fmt: skip
    body, targets = [], []
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in results:
        groups.setdefault((r["model"], r["mbit"], r["wpn"], r["compression"]), []).append(r)
    for (arch, mbit, wpn, kind), rows in groups.items():
        n, step, compute = 2 * wpn, med(rows, "step_s"), med(rows, "compute_s")
        ips = n * spec["batch"] / step
        base = groups.get((arch, mbit, wpn, "none"))
        speedup = (med(base, "step_s") / step) if base else float("nan")
        pred = predicted_step(compute, rows[0]["bytes"], n, links[mbit], kind, 0.0)
        body.append([arch, f"{mbit:g} Mbit/s", f"{wpn} ({n})", kind, f"{rows[0]['bytes'] / 1e6:.2f}",
                     f"{ips:.1f}", f"{speedup:.2f}x", f"{step:.3f}", f"{compute:.3f}", f"{max(0.0, step - compute):.3f}",
                     f"{pred:.3f}", f"{step / pred:.2f}"])  # fmt: skip
        if arch == "resnet18" and mbit == 100 and kind != "none":
            targets.append(f"resnet18, 100 Mbit/s, {wpn} worker(s)/node: {kind} {speedup:.2f}x the uncompressed images/s"
                           + ("" if kind == "powersgd" else f" (target >= 1.6x: {'met' if speedup >= 1.6 else 'NOT met'})"))  # fmt: skip
    out += ["", f"Steps (median over {spec['reps']} repetitions of {spec['steps']} timed steps each, batch "
            f"{spec['batch']} per process; the model uses the measured TCP throughput, no latency term):", ""]  # fmt: skip
    out += [md_table(head, body), "", *targets]
    if acc:
        out += ["", "Accuracy (configs/digits.yaml, 2 processes, final val_acc1):", ""]
        seeds = sorted({a["seed"] for a in acc})
        by = {(a["compression"], a["seed"]): a["val_acc1"] for a in acc}
        kinds = [k for k in COMPRESSIONS if any(a["compression"] == k for a in acc)]
        rows = [[k, *(f"{100 * by[(k, s)]:.2f}%" for s in seeds),
                 f"{100 * statistics.mean(by[(k, s)] for s in seeds):.2f}%"] for k in kinds]  # fmt: skip
        out.append(md_table(["compression", *(f"seed {s}" for s in seeds), "mean"], rows))
    out += ["", projections(results), ""]
    return "\n".join(out)


def projections(results: list[dict[str, Any]]) -> str:
    """The alpha-beta model for resnet18 on GPUs: compute = this CPU's / GPU_SPEEDUP, alpha = ALPHA_S."""
    rows = [r for r in results if r["model"] == "resnet18" and r["wpn"] == 1]
    if not rows:
        return "(no resnet18 runs: no projections)"
    compute = med(rows, "compute_s") / GPU_SPEEDUP
    bytes_of = {r["compression"]: r["bytes"] for r in rows}
    body = []
    for gbit in (10, 100, 400):
        for n in (8, 64, 256):
            cells = []
            for kind in [k for k in COMPRESSIONS if k in bytes_of and k != "bf16"]:
                step = predicted_step(compute, bytes_of[kind], n, gbit * 1e9 / 8, kind, ALPHA_S)
                cells.append(f"{1e3 * step:.1f} ms ({100 * compute / step:.0f}%)")
            body.append([f"{gbit} Gbit/s", n, *cells])
    kinds = [k for k in COMPRESSIONS if k in bytes_of and k != "bf16"]
    return (f"Projection (alpha-beta, ring all-reduce, no overlap with backward): resnet18, batch per GPU as "
            f"measured, compute {1e3 * compute:.1f} ms per step (this CPU's {med(rows, 'compute_s'):.3f} s / "
            f"{GPU_SPEEDUP:g}), alpha {1e6 * ALPHA_S:g} us per message; step time (compute / step):\n\n"
            + md_table(["link per GPU", "GPUs", *kinds], body))  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--rates", type=float, nargs="+", default=[100, 1000], metavar="MBIT")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2], metavar="N", help="workers per node")
    p.add_argument("--models", nargs="+", default=["resnet18", "cnn"])
    p.add_argument("--compressions", nargs="+", default=COMPRESSIONS, choices=COMPRESSIONS)
    p.add_argument("--reps", type=int, default=2, help="repetitions (the compressions' order rotates)")
    p.add_argument("--steps", type=int, default=2, help="timed steps with sync, and as many without, per rep")
    p.add_argument("--batch", type=int, default=32, help="images per process and step")
    p.add_argument(
        "--bucket-cap-mb", type=float, default=64,
        help="DDP's bucket size (default: resnet18 in one bucket, so that every compression sends one message a "
        "step; with several, ddpkit's PowerSGD hook on gloo runs the buckets one after another)",
    )  # fmt: skip
    p.add_argument(
        "--seeds", type=int, nargs="*", default=[0, 1, 2], help="digits accuracy seeds (none: skip)"
    )
    p.add_argument(
        "--quick", action="store_true", help="resnet18, 100 Mbit/s, 1 worker/node, 1 rep, no accuracy"
    )
    p.add_argument("--json", type=Path, help="also write the raw results here")
    args = p.parse_args(argv)
    if args.worker:
        worker(json.loads(args.worker))
        return 0
    if args.quick:
        args.rates, args.workers, args.models, args.reps, args.seeds = [100], [1], ["resnet18"], 1, []
    if os.geteuid() != 0:
        raise SystemExit("needs root: it makes network namespaces and tc rules")
    m = machine()
    print(f"throttled link: {machine_line(m)}", flush=True)
    results: list[dict[str, Any]] = []
    links: dict[float, float] = {}
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the namespaces are removed on SIGTERM too
    with tempfile.TemporaryDirectory() as tmp, Link() as link:
        for mbit in args.rates:
            link.shape(mbit)
            links[mbit] = probe(link, mbit)
            print(f"  link {mbit:g} Mbit/s: TCP {links[mbit] * 8 / 1e6:.1f} Mbit/s", flush=True)
            for wpn in args.workers:
                spec = {"models": args.models, "compressions": args.compressions, "reps": args.reps,
                        "steps": args.steps, "batch": args.batch, "out": f"{tmp}/rows.jsonl",
                        "bucket_cap_mb": args.bucket_cap_mb}  # fmt: skip
                t0 = time.time()
                rows = launch(link, spec, wpn, 29600 + secrets.randbelow(300))
                for r in rows:
                    results.append({**r, "mbit": mbit, "wpn": wpn})
                print(f"  {mbit:g} Mbit/s, {wpn} worker(s)/node: {len(rows)} measurements in {time.time() - t0:.0f} s", flush=True)  # fmt: skip
    acc = accuracy(args.seeds, args.compressions) if args.seeds else []
    spec = {"reps": args.reps, "steps": args.steps, "batch": args.batch}
    print()
    print(f"Machine: {machine_line(m)}")
    print(
        f"Command: python benchmarks/throttled_link.py {' '.join(sys.argv[1:] if argv is None else argv)}".rstrip()
    )
    print()
    print(report(results, links, acc, spec))
    if args.json:
        args.json.write_text(
            json.dumps({"machine": m, "links": links, "results": results, "accuracy": acc}, indent=1)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
