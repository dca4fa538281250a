"""A run directory read back (metrics.jsonl and config.yaml: runs.py) and its curves drawn into curves.png: what
the Trainer's rank 0, the one-node launcher and `ddpkit report` share. matplotlib is imported only when a picture
is drawn (drawing.py).
"""

from __future__ import annotations

import os
from pathlib import Path

from ddpkit import channels
from ddpkit.atomicio import atomic_write
from ddpkit.train.curves.drawing import figure, png_bytes
from ddpkit.train.curves.runs import Run, load_run

__all__ = ["LauncherCurves", "Run", "launcher_draws", "load_run", "write_bytes", "write_curves"]


def write_bytes(path: Path, data: bytes) -> Path:
    """Atomic write (temporary file, fsync, rename): a reader never sees half a picture or table."""
    return atomic_write(path, lambda fh: fh.write(data))  # mode 0666 less the umask, as open() makes it


def write_curves(out_dir: str | os.PathLike) -> Path:
    """Draw one run's curves into out_dir/curves.png; returns the path."""
    run = load_run(out_dir, with_config=False)
    fig = figure([run], [run.path.name or str(run.path)], title=str(run.path))
    return write_bytes(run.path / "curves.png", png_bytes(fig))


LAUNCHER_DRAWS_VAR = channels.LAUNCHER_DRAWS_CURVES  # "1": the launcher draws curves.png, not rank 0


def launcher_draws() -> bool:
    """In a worker: whether the launcher that started it draws curves.png when the workers have finished."""
    return os.environ.get(LAUNCHER_DRAWS_VAR) == "1"


class LauncherCurves:
    """curves.png drawn by a one-node launcher (`ddpkit train --nproc-per-node N`) instead of rank 0.

    The launcher is idle while its workers start and train: it imports matplotlib meanwhile, in a thread, and
    draws the picture once they have finished, instead of rank 0 importing matplotlib (about 0.5 s) at the end of
    the run while the whole job waits. `with LauncherCurves(out_dir): launch...` tells the workers (through
    LAUNCHER_DRAWS_VAR, which they inherit), the launch calls `start()`, and `draw()` follows a launch that
    succeeded. Under any other
    launcher (torchrun, srun, several nodes: a launcher cannot know whether rank 0 is on its node) rank 0 draws.
    """

    def __init__(self, out_dir: str | os.PathLike):
        import threading

        self.out_dir = out_dir
        self._imports = threading.Thread(target=self._import, name="ddpkit-matplotlib", daemon=True)

    def start(self) -> None:
        """Begin the imports; called once the launcher's own imports are done (two threads importing at once
        can trip Python's import-deadlock detection on a module both need)."""
        self._imports.start()

    @staticmethod
    def _import() -> None:
        import matplotlib.backends.backend_agg  # noqa: F401  what figure() and png_bytes() import
        import matplotlib.figure  # noqa: F401
        import matplotlib.ticker  # noqa: F401

    def __enter__(self) -> LauncherCurves:
        os.environ[LAUNCHER_DRAWS_VAR] = "1"
        return self

    def __exit__(self, *exc) -> None:
        os.environ.pop(LAUNCHER_DRAWS_VAR, None)

    def draw(self) -> Path | None:
        """curves.png of the run that just ended (None when it wrote no metrics line: nothing to draw)."""
        from ddpkit.train.metrics import read_metrics

        if self._imports.is_alive():
            self._imports.join()
        if not read_metrics(self.out_dir):
            return None
        return write_curves(self.out_dir)
