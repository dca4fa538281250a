"""Scripts written for `python -m torch.distributed.launch`: they read their local rank from `--local_rank N`
(or `--local-rank`) on the command line instead of LOCAL_RANK.

`ddpkit run` looks for the script's own `add_argument("--local_rank"...)` (a scan of its source, nothing is
run) and, when it finds one, gives each worker `--local_rank=N` right after the script's name, as that launcher
did. `--pass-local-rank always|never` overrides the scan.
"""

from __future__ import annotations

import os
import re
import sys

from ddpkit import channels

FLAGS = frozenset({"--pass-local-rank", "--pass_local_rank"})
CHOICES = ("auto", "always", "never")
_MAX_SOURCE = 4 << 20  # bytes of the script read for the scan
_DECLARED = re.compile(r"""add_argument\s*\([^)]*?["'](--local[-_]rank)["']""", re.S)


def add_flag(parser) -> None:
    parser.add_argument(
        "--pass-local-rank",
        "--pass_local_rank",
        choices=CHOICES,
        default="auto",
        help="give the script --local_rank=N as torch.distributed.launch did: auto (when its argument parser "
        "declares --local_rank or --local-rank), always, never",
    )


def _source_path(target: list[str]) -> str | None:
    """The file `python TARGET` would run, found without importing anything (for -m, parent packages
    included: PathFinder looks at the folders only)."""
    if target[0] != "-m":
        return target[0]
    from importlib.machinery import PathFinder

    path, spec = [os.getcwd(), *sys.path[1:]], None
    for part in target[1].split("."):
        spec = PathFinder.find_spec(part, path)
        if spec is None:
            return None
        path = list(spec.submodule_search_locations or [])
    if spec is not None and spec.submodule_search_locations:  # a package: -m runs its __main__
        main = os.path.join(path[0], "__main__.py") if path else ""
        return main if os.path.isfile(main) else None
    return spec.origin if spec is not None and spec.origin and spec.origin.endswith(".py") else None


def declared_flag(target: list[str]) -> str | None:
    """The spelling the script's argument parser declares (`--local_rank` or `--local-rank`), else None."""
    path = _source_path(target)
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            text = f.read(_MAX_SOURCE).decode("utf-8", "replace")
    except OSError:
        return None
    found = {m[1] for m in _DECLARED.finditer(text)}
    if "--local_rank" in found or not found:
        return "--local_rank" if found else None
    return "--local-rank"


def arrange(mode: str, target: list[str]) -> None:
    """Tell usermain (in every worker, whatever starts it) whether to pass the local rank, and how spelled."""
    flag = None if mode == "never" else declared_flag(target)
    if mode == "always" and flag is None:
        flag = "--local_rank"
    if flag is None:
        os.environ.pop(channels.LOCAL_RANK_ARG, None)
    else:
        os.environ[channels.LOCAL_RANK_ARG] = flag


def script_args(args: list[str]) -> list[str]:
    """The script's arguments with `FLAG=LOCAL_RANK` first when the launcher asked for it (in the worker)."""
    flag = os.environ.pop(channels.LOCAL_RANK_ARG, None)
    if not flag:
        return args
    return [f"{flag}={os.environ.get('LOCAL_RANK', '0')}", *args]
