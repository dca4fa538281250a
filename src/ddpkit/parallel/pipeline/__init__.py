"""Pipeline parallelism: the plan checked before workers start (`plan`), a model cut into stages (`split`), the
stages run by a torch.distributed.pipelining schedule (`runner`), their full-model state (`stage_state`), and
the two users of it: `ddpkit train` with dist.pp > 1 (`trainer`) and `ddpkit.prepare(..., pp=N)` (`user_model`).
"""
