"""Step 6: the framework way: a YAML recipe plus KEY VALUE overrides, ddpkit's Trainer doing the rest.

    torchrun --nproc-per-node 8 examples/06_framework_config.py --cfg configs/cifar10_resnet18.yaml \\
        TRAIN.BATCH_SIZE 128 OUT_DIR ./resnet18_1024bs OPTIM.LR 0.4    # needs 8 GPUs, CIFAR-10
    srun --ntasks-per-node=8 -n64 \\
        python -u examples/06_framework_config.py --cfg configs/cifar10_resnet18.yaml \\
        train.batch_size 128 out_dir runs/resnet18_8192bs    # needs Slurm, 64 GPUs, CIFAR-10
    torchrun --nproc-per-node 2 examples/06_framework_config.py --cfg configs/digits.yaml    # CPU, the digits

Keys are ddpkit's (`ddpkit train --help-config`), in any case: TRAIN.BATCH_SIZE 128 is train.batch_size=128.
The lr follows the global batch (optim.lr at optim.ref_batch_size). Turn on model.sync_bn only when the
per-GPU batch is small. The Trainer logs on rank 0, evaluates every sample exactly once and checkpoints to
out_dir.
"""

from __future__ import annotations

import argparse
import sys

import ddpkit


def overrides(opts: list[str]) -> list[str]:
    """KEY VALUE pairs as ddpkit's key=value overrides: TRAIN.BATCH_SIZE 128 -> train.batch_size=128."""
    return [f"{key.lower()}={value}" for key, value in zip(opts[::2], opts[1::2], strict=True)]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cfg", help="a YAML recipe, e.g. configs/cifar10_resnet18.yaml")
    parser.add_argument("opts", nargs=argparse.REMAINDER, help="KEY VALUE pairs, e.g. train.batch_size 128")
    args = parser.parse_args()
    if len(args.opts) % 2:
        parser.error(f"overrides come in KEY VALUE pairs, got {args.opts}")
    from ddpkit.config import load_config
    from ddpkit.train.trainer import Trainer

    try:
        cfg = load_config(args.cfg, overrides(args.opts))
        ctx = ddpkit.init_distributed(cfg.dist.backend, cfg.dist.device, cfg.dist.timeout_s)
        Trainer(cfg, ctx).fit()
    except ddpkit.UserError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)  # as argparse words its own
        return 2
    finally:
        ddpkit.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
