"""A Python warning printed once per job, not once per rank.

torch warns from code that every rank runs (a FutureWarning of a deprecated call, DTensor's UserWarnings): under
N workers each would print the same lines N times. A worker of ddpkit's launcher shows a warning only when it is
the first process of the job to show that warning (the same category, message, file and line): it claims the
warning by creating a file named after it in the launcher's job folder (O_CREAT | O_EXCL, atomic between
processes); the others find it taken and stay silent. A warning that only some ranks give (one naming a rank,
one from a rank's own data) is still printed once by the first of them. Python's own filters run first, so
`-W`/`PYTHONWARNINGS` and warnings.filterwarnings keep working; the folder is per launcher, so a job over several
machines prints a warning once per machine. The workers of `ddpkit train`, `ddpkit run` (either launcher) and
`ddpkit.launch()` claim their warnings so. `DDPKIT_WARNINGS_PER_RANK=1` in the environment gives back torch's way:
every rank prints each of its warnings. Only warnings that pass through Python's `warnings` module are claimed:
a line torch's C++ code prints to stderr itself is each rank's own.
"""

from __future__ import annotations

import hashlib
import os
import warnings

from ddpkit import channels

FOLDER = "warned"


def install(job: str) -> None:
    """Show each warning of this process only if no other worker of the job in folder `job` showed it; with
    DDPKIT_WARNINGS_PER_RANK=1, leave this process's warnings alone."""
    if os.environ.get(channels.WARNINGS_PER_RANK) == "1":
        return
    shown = warnings.showwarning
    folder = os.path.join(job, FOLDER)

    def show_once(message, category, filename, lineno, file=None, line=None):
        key = f"{category.__module__}.{category.__qualname__}\0{filename}\0{lineno}\0{message}"
        name = hashlib.sha256(key.encode("utf-8", "backslashreplace")).hexdigest()[:32]
        try:
            os.makedirs(folder, exist_ok=True)
            os.close(os.open(os.path.join(folder, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        except FileExistsError:
            return  # another rank of this job printed it
        except OSError:
            pass  # the folder is gone or full: printing it again beats losing it
        shown(message, category, filename, lineno, file, line)

    warnings.showwarning = show_once
