"""A job's processes from start to end: start-up timing from the command's start (startup), the launcher that
starts workers (launch: torch's elastic agent or torch.multiprocessing.spawn), `ddpkit.launch` for a function
(spawn), workers forked warm from a fork server (warm_start, warm_server), a user's script as a worker's
`__main__` (usermain; a `-m` module is found first: usermodule), signals between the launcher and its workers
(signals), and what a node's launcher learns about the other nodes (peers).

Nothing here imports torch at import time: the launcher starts its workers before it pays for torch.
"""
