"""Where this process runs: who it is in the job (distenv: the DistEnv value and the checks of a launcher's
variables), which launcher or scheduler started it (launchers: the detector table; env: the table, or the flags
given by hand), Slurm's node lists (slurm_env) and which network interface its process group talks over (netif).

The `ddpkit slurm` and `ddpkit k8s` commands that write job files live in ddpkit.commands; their names stay
importable from here for one release.
"""

from __future__ import annotations

from ddpkit import _moved

__getattr__ = _moved.names(
    __name__,
    {
        "k8s_command": "ddpkit.commands.k8s",
        "pytorchjob_manifest": "ddpkit.commands.k8s",
        "sbatch_script": "ddpkit.commands.slurm",
        "slurm_command": "ddpkit.commands.slurm",
    },
)
