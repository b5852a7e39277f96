"""Packing whole units on accelerators out of execution order: the last resort before
offloading, for models whose units fit the accelerators only when not kept contiguous (large
activations early, large weights late, as in ResNet-50 at 224x224)."""

from __future__ import annotations

from typing import Sequence

from automap.devices import DeviceSpec
from automap.planning.partition import Chain, Range, Slot, fill, min_bottleneck


def pack_out_of_order(
    chain: Chain, compute: Sequence[DeviceSpec], rooms: Sequence[int]
) -> tuple[list[int], int] | None:
    """Last resort before offloading, when no contiguous split leaves room for activations.

    Starts from the balanced split by weights alone, from the longest prefix that fits, or
    from nothing; moves units off the end of each overfull range; places the rest, largest
    first, where they fit most tightly. Keeps the candidate with the fewest cuts. Extra cuts
    cost microseconds; streaming offloaded weights costs far more.

    Returns:
        The device index of each item and the number of cuts, or None when nothing fits.
    """
    weights_only = Chain(chain.work, chain.weight, [0] * len(chain), chain.cut)
    slots = [Slot(room, d.flops_per_second, d.link_bytes_per_second) for d, room in zip(compute, rooms)]
    starts: list[Sequence[Range | None]] = [
        min_bottleneck(weights_only, slots) or [None] * len(compute),
        fill(chain, rooms)[0],
        [None] * len(compute),
    ]
    found = [owner for owner in (_scatter(chain, rooms, r) for r in starts) if owner is not None]
    if not found:
        return None
    owner = min(found, key=_cut_count)
    return owner, _cut_count(owner)


def _cut_count(owner: Sequence[int]) -> int:
    return sum(1 for a, b in zip(owner, owner[1:]) if a != b)


def _scatter(chain: Chain, rooms: Sequence[int], ranges: Sequence[Range | None]) -> list[int] | None:
    """Device index per item from ``ranges``, trimmed to fit, with the leftovers placed
    best-fit decreasing; None when some item fits nowhere."""
    owner: list[int | None] = [None] * len(chain)
    for j, span in enumerate(ranges):
        if span is None:
            continue
        start, stop = span
        stop = min(stop, fill(chain, [rooms[j]], start)[1])  # the longest part of the range that fits
        for i in range(start, stop):
            owner[i] = j
    weights = [sum(chain.weight[i] for i in range(len(chain)) if owner[i] == j) for j in range(len(rooms))]
    peaks = [
        max((chain.activation[i] for i in range(len(chain)) if owner[i] == j), default=0)
        for j in range(len(rooms))
    ]
    for i in sorted((i for i in range(len(chain)) if owner[i] is None), key=lambda i: (-chain.weight[i], i)):
        free = [
            rooms[j] - weights[j] - max(peaks[j], chain.activation[i]) - chain.weight[i]
            for j in range(len(rooms))
        ]
        fitting = [j for j in range(len(rooms)) if free[j] >= 0]
        if not fitting:
            return None
        j = min(fitting, key=lambda j: (free[j], j))
        owner[i], weights[j], peaks[j] = j, weights[j] + chain.weight[i], max(peaks[j], chain.activation[i])
    return [j for j in owner if j is not None]
