"""`ddpkit slurm` and `ddpkit k8s`: the same training config as `ddpkit train`, as an sbatch script or a PyTorchJob.

Both are local commands: they write or print a job description (and `slurm --submit` hands it to sbatch); the
job itself then runs `python -m ddpkit train` on every node, which joins the launcher like any other run.
"""

from __future__ import annotations

from ddpkit.cluster import k8s, slurm
from ddpkit.cluster.k8s import k8s_command, pytorchjob_manifest
from ddpkit.cluster.slurm import sbatch_script, slurm_command

__all__ = ["add_flags", "k8s_command", "pytorchjob_manifest", "sbatch_script", "slurm_command"]


def add_flags(parser) -> None:
    """The flags of `ddpkit slurm` or `ddpkit k8s` (the parser's prog says which)."""
    (slurm if parser.prog.endswith("slurm") else k8s).add_flags(parser)
