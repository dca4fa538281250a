"""The small classifiers' card, torch-free: the names they own, read while the workers start."""

from __future__ import annotations

from ddpkit.models.family import FamilyCard

NAMES = ("cnn", "mlp")

CARD = FamilyCard(
    "builtin",
    "cnn (small built-in CNN), mlp (built-in, no normalisation or dropout layers)",
    owns=lambda arch: arch in NAMES,
)
