"""Where this process runs: who it is in the job (distenv: the DistEnv value and the checks of a launcher's
variables), which launcher or scheduler started it (launchers: the detector table; env: the table, or the flags
given by hand), Slurm's node lists (slurm_env) and which network interface its process group talks over (netif).
"""
