"""Moved to ddpkit.parallel.compression (the registry) and ddpkit.parallel.powersgd; names kept importable."""

from ddpkit.parallel.compression import Compression, CompressionMethod, register_compression
from ddpkit.parallel.powersgd import PowerSGDHook

__all__ = ["Compression", "CompressionMethod", "PowerSGDHook", "register_compression"]
