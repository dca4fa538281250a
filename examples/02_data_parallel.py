"""Step 2: one node, several GPUs with nn.DataParallel: step 1's script with one line changed.

    python examples/02_data_parallel.py --data cifar10 --data-root data    # needs GPUs, CIFAR-10
    CUDA_VISIBLE_DEVICES=0,1 python examples/02_data_parallel.py --batch-size 512 --lr 0.02    # needs 2 GPUs
    python examples/02_data_parallel.py                                    # no GPU: the module runs as is

One process drives every visible GPU with threads: each batch is split across them, the outputs and gradients
gather on cuda:0, and the GIL serialises the Python side, so it is slower than DDP (step 3).
"""

from __future__ import annotations

import importlib

import _common as common
import torch
from torch import nn

single_gpu = importlib.import_module("01_single_gpu")  # a name that starts with a digit: no import statement


def data_parallel(model: nn.Module) -> nn.Module:
    print(f"nn.DataParallel over {torch.cuda.device_count()} GPU(s)", flush=True)
    return nn.DataParallel(model)  # the one line of change


if __name__ == "__main__":
    single_gpu.main(common.parser(__doc__).parse_args(), wrap=data_parallel)
