"""How a model is spread over the ranks: the strategy registry (single, dp, ddp, zero1, fsdp, ...) and the
parts of parallel training built on torch's own DeviceMesh, DTensor, FSDP2 and pipelining."""
