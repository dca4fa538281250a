"""`ddpkit comm`: placeholder module until the collectives check lands (see the comm issue)."""

from __future__ import annotations

from ddpkit.errors import UserError


def comm_command(cfg, args, ctx) -> int:
    raise UserError("`ddpkit comm` is not built yet", "use `ddpkit info` to check the process group")
