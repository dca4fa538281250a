"""The device-mesh API the pipeline code is written against (Layout, layout_of, build_mesh), until
ddpkit.parallel.mesh provides it: dims ("pp", "dp", "tp"), rank = (pp_index * dp + dp_index) * tp + tp_index."""

from __future__ import annotations

from dataclasses import dataclass

from ddpkit.errors import UserError


@dataclass(frozen=True)
class Layout:
    dp: int
    tp: int = 1
    pp: int = 1

    def coords(self, rank: int) -> dict:
        return {"pp": rank // (self.dp * self.tp), "dp": rank // self.tp % self.dp, "tp": rank % self.tp}


def layout_of(world_size: int, tp: int, pp: int) -> Layout:
    if world_size % (tp * pp):
        raise UserError(
            f"{world_size} process(es) cannot hold dist.tp={tp} x dist.pp={pp}",
            f"start a multiple of {tp * pp} processes",
        )
    return Layout(world_size // (tp * pp), tp, pp)


def build_mesh(layout: Layout, device_type: str):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (layout.pp, layout.dp, layout.tp), mesh_dim_names=("pp", "dp", "tp"))
