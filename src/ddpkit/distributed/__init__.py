"""The distributed runtime: launcher detection, process-group setup, launching, collectives helpers."""

from ddpkit.distributed.collectives import (
    all_gather_object,
    all_reduce_mean,
    all_reduce_sum,
    barrier,
    broadcast_object,
    derive_seed,
    gather,
    gather_object,
    get_rank,
    get_world_size,
    is_main_process,
    rank_zero_first,
    seed_everything,
    seed_model_init,
    seed_rank,
)
from ddpkit.distributed.env import DistEnv, detect_env, expand_nodelist, parse_nodelist
from ddpkit.distributed.runtime import DistContext, init_distributed, resolve_device_backend, shutdown

__all__ = [
    "DistContext",
    "DistEnv",
    "all_gather_object",
    "all_reduce_mean",
    "all_reduce_sum",
    "barrier",
    "broadcast_object",
    "derive_seed",
    "detect_env",
    "expand_nodelist",
    "gather",
    "gather_object",
    "get_rank",
    "get_world_size",
    "init_distributed",
    "is_main_process",
    "parse_nodelist",
    "rank_zero_first",
    "resolve_device_backend",
    "seed_everything",
    "seed_model_init",
    "seed_rank",
    "shutdown",
]
