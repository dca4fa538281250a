"""What Slurm tells a task about its job: the node list (expanded), the job step, the tasks on each node, and a
port derived from the job id. The launcher (for its agents) and the Slurm detector read Slurm through these,
so the two agree on which variable wins."""

from __future__ import annotations

import re
import shutil
import subprocess
import zlib
from collections.abc import Mapping

from ddpkit.errors import UserError


def expand_nodelist(nodelist: str, use_scontrol: bool = True) -> list[str]:
    """Slurm node list -> host names, via `scontrol show hostnames` when present, else our own parser."""
    if use_scontrol and shutil.which("scontrol"):
        try:
            out = subprocess.run(
                ["scontrol", "show", "hostnames", nodelist],
                capture_output=True,
                text=True,
                timeout=30,
                check=True,
            ).stdout.split()
            if out:
                return out
        except (subprocess.SubprocessError, OSError):
            pass
    return parse_nodelist(nodelist)


def _split_top(s: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    parts, depth, cur = [], 0, ""
    for ch in s:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if depth != 0:
        raise UserError(f"malformed Slurm node list '{s}'", "check SLURM_NODELIST")
    parts.append(cur)
    return [p for p in parts if p]


def parse_nodelist(nodelist: str) -> list[str]:
    """Expand Slurm's compressed host list syntax: `node[01-03,7],gpu7` -> node01 node02 node03 node7 gpu7."""
    hosts: list[str] = []
    for item in _split_top(nodelist.strip()):
        m = re.search(r"\[([^\]]*)\]", item)
        if not m:
            hosts.append(item)
            continue
        head, tail = item[: m.start()], item[m.end() :]
        for sub in m.group(1).split(","):
            if "-" in sub:
                lo, hi = sub.split("-", 1)
                if not (lo.isdigit() and hi.isdigit()) or int(hi) < int(lo):
                    raise UserError(
                        f"malformed Slurm node range '{sub}' in '{nodelist}'", "check SLURM_NODELIST"
                    )
                width = len(lo)
                for i in range(int(lo), int(hi) + 1):
                    hosts.extend(parse_nodelist(f"{head}{i:0{width}d}{tail}"))
            elif sub:
                hosts.extend(parse_nodelist(f"{head}{sub}{tail}"))
    return hosts


def slurm_port(job_id: str) -> int:
    """A port derived from the job id, so two jobs on one node do not collide."""
    try:
        n = int(job_id)
    except ValueError:
        n = zlib.crc32(job_id.encode())
    return 15000 + n % 20000


def slurm_nodelist(env: Mapping[str, str]) -> str | None:
    """The nodes of this Slurm step: SLURM_STEP_NODELIST, else SLURM_NODELIST, else SLURM_JOB_NODELIST."""
    return next(
        (env[v] for v in ("SLURM_STEP_NODELIST", "SLURM_NODELIST", "SLURM_JOB_NODELIST") if v in env), None
    )


def slurm_job_step(env: Mapping[str, str]) -> str:
    """`JOB.STEP` of this Slurm step (SLURM_STEPID is the older spelling of SLURM_STEP_ID)."""
    return env.get("SLURM_JOB_ID", "0") + "." + env.get("SLURM_STEP_ID", env.get("SLURM_STEPID", "0"))


def tasks_per_node(spec: str, node_id: int) -> int | None:
    """SLURM_STEP_TASKS_PER_NODE like `2(x3),1` -> tasks on node `node_id`."""
    counts: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            return None
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return counts[node_id] if node_id < len(counts) else None
