"""Expert parallelism (dist.ep): a mixture of experts' routed experts split over ep of the data-parallel ranks, as
torchtitan composes it. The ep ranks are borrowed from the dp dim of the one device mesh (dp = edp x ep, the ep
ranks next to each other: parallel/mesh); each holds 1/ep of every MoE block's experts (each expert weight a
DTensor split over the experts on the "ep" dim: checkpoints and the gradient norm see the whole tensor) and the
block sends each token to its experts' rank and back with torch.distributed's all_to_all_single (autograd-aware:
dispatch.py). The dense parameters stay data-parallel over all dp ranks (ddp, fsdp, zero2, hsdp), the experts'
over the edp ranks that hold the same experts (meshes.py): FSDP2 over the "edp" dim, or under ddp an all-reduce
over it once a step's backward is done (apply.py). Either way an expert's gradient is the sum of its tokens' over
every rank divided by dp: what the mean loss of the global batch gives on one process."""
