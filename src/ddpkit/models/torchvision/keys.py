"""torchvision's card, torch-free: what a worker imports to build one of its models. Which names it owns only
torchvision's list can tell (its family asks it)."""

from __future__ import annotations

from ddpkit.models.family import FamilyCard

CARD = FamilyCard(
    "torchvision",
    "a torchvision classification model (resnet18, resnet50, ...)",
    preload=("torchvision",),
)
