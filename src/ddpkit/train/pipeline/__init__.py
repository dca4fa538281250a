"""The pipeline half of the Trainer (`ddpkit train` with dist.pp > 1): this rank's stages and the runner that
feeds them (parallel/pipeline/), the step, the exact evaluation and the checkpoints of a pipeline (`trainer`).
"""
