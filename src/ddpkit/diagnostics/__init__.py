"""What `ddpkit comm` runs: every collective checked against closed-form values (collective_check), then timed
like nccl-tests (collective_bench)."""
