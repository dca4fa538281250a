"""Rank 1 waits forever while rank 0 ends: the straggler the launcher must name (test_hostile_inputs.py)."""
import os
import time


def wait_forever():
    time.sleep(600)


if os.environ["RANK"] == "1":
    wait_forever()
print("rank 0 done", flush=True)
