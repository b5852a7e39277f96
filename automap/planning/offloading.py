"""What an offloading layout keeps and where the rest goes: the streamed run, the storage tiers.

:func:`choose_offload` picks the contiguous run of groups the accelerators keep while one of them
(the executor) keeps room to stream the largest offloaded item; :func:`store` and
:func:`store_staged` put the offloaded items in CPU RAM where it has room, else on disk (an item
read from disk passes through pinned staging, counted in the CPU budget). Plain arrays in and
out: :mod:`automap.planning.layout_kinds` turns them into layouts.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping, Sequence

from automap.devices import DeviceSpec
from automap.kinds import kind_of
from automap.planning.cost import flop_seconds, transfer_seconds
from automap.planning.items import sub_chain
from automap.planning.layout_registry import room
from automap.planning.partition import Chain, fill

# Leading items that may be offloaded too, when the execution device cannot keep them beside
# the streaming room (an embedding tied to the LM head): a few suffice, and each try is a pass.
MAX_OFFLOADED_HEAD = 4


@dataclass(frozen=True)
class Offload:
    """Groups ``[0, head)`` and ``[point, n)`` are offloaded and streamed to the computing
    device at index ``executor``, which keeps ``streamed`` bytes for the largest offloaded item
    and ``peak`` activation bytes for their runs; ``[head, point)`` stay on the computing
    devices."""

    head: int
    executor: int
    point: int
    streamed: int
    peak: int

    def rooms(self, rooms: Sequence[int]) -> list[int]:
        """``rooms`` less the streaming room on the executor."""
        return [r - self.streamed if j == self.executor else r for j, r in enumerate(rooms)]

    def floors(self, count: int) -> list[int]:
        """Activation bytes each computing device keeps for the offloaded units' runs."""
        return [self.peak if j == self.executor else 0 for j in range(count)]


def offload_point(
    chain: Chain,
    stream: Sequence[int],
    rooms: Sequence[int],
    executor: int,
    weights: int = 0,
    activations: int = 0,
) -> Offload:
    """The longest prefix the computing devices hold while the executor keeps room for the
    largest offloaded item's weights and activations (which, like its own units', run one at
    a time), starting from at least ``weights``/``activations``. Both only grow as the prefix
    shrinks, so this settles in a few rounds."""
    while True:
        found = Offload(0, executor, 0, weights, activations)
        _, end = fill(chain, found.rooms(rooms), floors=found.floors(len(rooms)))
        tail = range(end, len(chain))
        need_w = max([weights, *(stream[i] for i in tail)])
        need_a = max([activations, *(chain.activation[i] for i in tail)])
        if need_w <= weights and need_a <= activations:
            return replace(found, point=end)
        weights, activations = need_w, need_a


def choose_offload(
    chain: Chain, stream: Sequence[int], rooms: Sequence[int], light_first: bool = False
) -> Offload | None:
    """The offload that keeps the most bytes on the computing devices, trying each device as
    the executor and a few leading groups offloaded; None when no device can execute. With
    ``light_first`` (``balanced_low_0``) the first device executes only when no other can."""
    best, kept_best = None, (False, -1)
    for head in range(min(MAX_OFFLOADED_HEAD, len(chain) - 1) + 1):
        rest, rest_stream = sub_chain(chain, head, len(chain)), stream[head:]
        floor_w, floor_a = max(stream[:head], default=0), max(chain.activation[:head], default=0)
        for executor in range(len(rooms)):
            found = offload_point(rest, rest_stream, rooms, executor, floor_w, floor_a)
            if rooms[executor] < found.streamed + found.peak:
                continue  # this device cannot stream the largest offloaded item
            kept = (not (light_first and executor == 0 and len(rooms) > 1), sum(rest.weight[: found.point]))
            if kept > kept_best:
                best, kept_best = replace(found, head=head, point=head + found.point), kept
    return best


def store(
    weights: Sequence[int],
    order: Sequence[int],
    storage: Sequence[DeviceSpec],
    reserve: Mapping[str, int],
    held: Mapping[str, int] | None = None,
) -> dict[int, DeviceSpec] | None:
    """Items ``order`` to storage tiers, each to the first tier (CPU RAM, then disk) with room
    left for it, less ``held`` bytes per tier; None when one fits none."""
    free = [room(d, reserve) - (held or {}).get(d.name, 0) for d in storage]
    where: dict[int, DeviceSpec] = {}
    for i in order:
        tier = next((t for t, left in enumerate(free) if weights[i] <= left), None)
        if tier is None:
            return None
        where[i], free[tier] = storage[tier], free[tier] - weights[i]
    return where


def store_staged(
    weights: Sequence[int], order: Sequence[int], storage: Sequence[DeviceSpec], reserve: Mapping[str, int]
) -> tuple[dict[int, DeviceSpec], int] | None:
    """:func:`store` for streaming to an accelerator: an item read from disk passes through a
    pinned staging buffer in CPU RAM, as large as the largest such item, so the CPU tier keeps
    that much free. Returns the tiers and the staging bytes (0 when nothing is on disk)."""
    host = next((d.name for d in storage if kind_of(d).is_host), None)
    staging = 0
    while True:
        where = store(weights, order, storage, reserve, {host: staging} if host else None)
        if where is None:
            return None
        need = (
            max((weights[i] for i, d in where.items() if kind_of(d).staged_via_host), default=0)
            if host
            else 0
        )
        if need <= staging:
            return where, staging
        staging = need


def offload_seconds(chain: Chain, where: Mapping[int, DeviceSpec], executor: DeviceSpec) -> float:
    """Seconds the execution device spends running offloaded items: compute plus streaming."""
    total = 0.0
    for i, tier in where.items():
        total += flop_seconds(chain.work[i], executor.flops_per_second) + transfer_seconds(
            chain.weight[i], tier, executor
        )
    return total
