"""timm's card, torch-free: the names it owns (timm:NAME) and what a worker imports to build one."""

from __future__ import annotations

from ddpkit.models.family import FamilyCard

PREFIX = "timm:"

CARD = FamilyCard(
    "timm",
    "timm:NAME when timm is installed",
    owns=lambda arch: arch.startswith(PREFIX),
    preload=("timm",),
)
