"""System tests: real Slurm daemons, real network namespaces, real mpirun (see conftest.py for the fixtures)."""
