"""Step 9: env://, the default rendezvous: MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE say it all.

    MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 WORLD_SIZE=2 RANK=0 python examples/09_env_variables.py
    MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 WORLD_SIZE=2 RANK=1 python examples/09_env_variables.py

This is how Kubeflow's PyTorchJob starts its pods (the master pod is RANK 0) and what torchrun sets for
each worker. ddpkit.init_distributed() with no arguments reads them; the training is step 7's.
"""

from __future__ import annotations

import _common as common

import ddpkit

if __name__ == "__main__":
    args = common.parser(__doc__, batch_size=32, epochs=2, lr=0.4).parse_args()
    ctx = ddpkit.init_distributed()
    if ctx.is_main:
        print(
            f"rank {ctx.rank} of {ctx.world_size} via env:// at {ctx.env.master_addr}:{ctx.env.master_port}"
        )
    common.train_and_evaluate(ctx, args)
    ddpkit.shutdown()
