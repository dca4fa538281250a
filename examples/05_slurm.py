"""Step 5: DDP under Slurm: step 3's script, unchanged, started by srun (no setup_distributed to write).

    srun -N4 --ntasks-per-node=8 --gres=gpu:8 \\
        python -u examples/05_slurm.py --data cifar10    # needs Slurm, 32 GPUs, CIFAR-10
    srun --ntasks=2 python -u examples/05_slurm.py    # needs Slurm (2 CPU tasks on one node)

ddpkit.init_distributed() reads SLURM_PROCID (rank), SLURM_NTASKS (world size), SLURM_LOCALID (local rank)
and SLURM_NODELIST, whose first host (`scontrol show hostnames`) is the master address; the port derives
from SLURM_JOB_ID so that two jobs on one node do not collide. MASTER_ADDR / MASTER_PORT, when set, win, and
outside Slurm the script reads torchrun's variables as step 3 does.
4 nodes x 8 tasks x batch 256 = a global batch of 8192 and lr 0.01 x 8192 / 256 = 0.32.
"""

from __future__ import annotations

import importlib

import _common as common

import ddpkit

ddp_torchrun = importlib.import_module("03_ddp_torchrun")

if __name__ == "__main__":
    args = common.parser(__doc__).parse_args()
    env = ddpkit.detect_env()  # what init_distributed will join, before joining it
    common.print_line(
        f"[{env.launcher}] rank {env.rank} of {env.world_size}, local rank {env.local_rank} of "
        f"{env.local_world_size} on node {env.node_rank}, master {env.master_addr}:{env.master_port}",
    )
    ddp_torchrun.main(args)
