"""Pipeline parallelism: the plan checked before workers start (`plan`), a model cut into stages (`split`), the
stages run by a torch.distributed.pipelining schedule (`runner`), their full-model state (`stage_state`), and
`ddpkit.prepare(..., pp=N)`'s model (`user_model`). `ddpkit train` with dist.pp > 1 drives the same runner from
train/steps/pipeline.py.
"""
