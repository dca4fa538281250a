"""Files a command writes where the user points it (`report --out/--html/--json`, `bench --json/--out`,
`slurm --script` and the config beside it): never one of the command's inputs, and never a file that ddpkit did
not write unless the user says `--force`.

Each file ddpkit writes this way carries MARKER (a PNG text chunk, an HTML comment, a JSON key, a shell or YAML
comment), so a later run can tell its own earlier output, which it replaces, from a user's file, which it refuses.
"""

from __future__ import annotations

import os
from pathlib import Path

from ddpkit.atomicio import NotRegularFile, check_regular, open_regular
from ddpkit.errors import UserError
from ddpkit.train.curves.drawing import MARKER  # the mark, defined where pictures are drawn

__all__ = ["MARKER"]

_JSON_MARKER = b'"generated_by": "ddpkit'
_EARLIER = b"# Written by `ddpkit slurm`"  # scripts written before MARKER existed
_SNIFF_BYTES = 1 << 16  # every marker sits in a file's first bytes


def add_force_flag(group) -> None:
    """`--force` on an argparse group."""
    group.add_argument(
        "--force",
        action="store_true",
        help="replace output files that ddpkit did not write (default: refuse)",
    )


def written_by_ddpkit(path: Path) -> bool:
    """The file at `path` carries ddpkit's marker in its first bytes."""
    try:
        with os.fdopen(open_regular(path), "rb") as fh:
            head = fh.read(_SNIFF_BYTES)
    except OSError:
        return False
    return any(m in head for m in (MARKER.encode(), _JSON_MARKER, _EARLIER))


def _same(a: Path, b: str | os.PathLike) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return Path(os.path.abspath(a)) == Path(os.path.abspath(b))


def check_output(
    path: str | os.PathLike | None,
    suffix: str | None,
    flag: str,
    force: bool = False,
    inputs: tuple[str | os.PathLike, ...] = (),
) -> Path | None:
    """An output path the user named: right suffix, an existing writable folder, not a folder itself, not an
    input, and not a file ddpkit did not write (unless `force`). UserError otherwise; reads only."""
    if path is None:
        return None
    path = Path(path)
    if suffix is not None and path.suffix.lower() != suffix:
        raise UserError(f"{flag} '{path}' does not end in {suffix}", f"name a {suffix} file")
    if path.is_dir():
        raise UserError(f"{flag} '{path}' is a directory", f"name a {suffix or 'new'} file")
    try:
        check_regular(path)
    except NotRegularFile as e:
        raise UserError(
            f"{flag} '{path}' is {e.strerror}, not a file", f"name a {suffix or 'new'} file"
        ) from None
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise UserError(f"{flag} '{path}': folder '{parent}' does not exist", "create it first")
    if not os.access(parent, os.W_OK):
        raise UserError(f"{flag} '{path}': folder '{parent}' is not writable", "choose another place")
    for given in inputs:
        if given is not None and os.path.lexists(path) and _same(path, given):
            raise UserError(f"{flag} '{path}' is also an input of this command", "name another output file")
    if os.path.lexists(path) and not force and not written_by_ddpkit(path):
        raise UserError(
            f"{flag} '{path}' exists and ddpkit did not write it",
            "name another file, or add --force to replace it",
        )
    return path
