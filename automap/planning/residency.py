"""Room left on the GPUs of a streamed layout, given to offloaded items (largest first) so they
stop streaming. Pure, on plain arrays, like :mod:`automap.planning.partition`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass
class Room:
    """One computing device's state: ``free`` bytes beyond its weights, reserves and activation
    peak, and that ``peak`` (an item with larger activations raises it)."""

    free: int
    peak: int

    def need(self, weight: int, activation: int) -> int:
        """Bytes an item takes here: its weights, and what its activations add to the peak."""
        return weight + max(0, activation - self.peak)

    def take(self, weight: int, activation: int) -> None:
        self.free -= self.need(weight, activation)
        self.peak = max(self.peak, activation)


def keep_resident(
    order: Sequence[int],
    weight: Sequence[int],
    activation: Sequence[int],
    cut: Sequence[float],
    piece: Sequence[bool],
    rooms: list[Room],
    executor: int,
) -> dict[int, int]:
    """Which offloaded items (``order``) stay on which computing device (index into ``rooms``).

    Args:
        order: the offloaded items.
        weight, activation: per item (of the whole chain), bytes.
        cut: per item, the bytes crossing into it from the item before (``cut[i + 1]`` leaves it).
        piece: per item, whether it was split from a unit (then only ``executor`` may keep it).
        rooms: per computing device; updated as items are kept.
        executor: the index of the device that computes the offloaded items.

    Returns:
        ``{item: device index}`` for the items kept resident.
    """
    kept: dict[int, int] = {}
    for i in sorted(order, key=lambda i: (-weight[i], i)):
        here = rooms[executor]
        if here.need(weight[i], activation[i]) <= here.free:
            here.take(weight[i], activation[i])
            kept[i] = executor
            continue
        crossing = cut[i] + (cut[i + 1] if i + 1 < len(cut) else 0.0)
        if piece[i] or weight[i] <= crossing:
            continue
        fitting = [
            j for j, r in enumerate(rooms) if j != executor and r.need(weight[i], activation[i]) <= r.free
        ]
        if fitting:
            j = min(fitting, key=lambda j: (rooms[j].free, j))
            rooms[j].take(weight[i], activation[i])
            kept[i] = j
    return kept
