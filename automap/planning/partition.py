"""Contiguous partition of a chain of items over devices in a fixed order, minimising the slowest
stage: the pure algorithm behind the balancer, on plain numpy arrays (no torch, no profile).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from automap.planning.cost import MIN_RATE

Range = tuple[int, int]
# Bisection stops when the bracket is this small relative to the bottleneck; far below any
# difference a cost model of FLOP/s and bytes/s can resolve.
_RELATIVE_TOLERANCE = 1e-12
_MAX_PROBES = 200


@dataclass(frozen=True)
class Chain:
    """Items in execution order. ``cut[i]`` is the bytes crossing into item ``i`` from the
    items before it (``cut[0]`` is ignored: the model's input is not a cut)."""

    work: Sequence[float]
    weight: Sequence[int]
    activation: Sequence[int]
    cut: Sequence[float]

    def __len__(self) -> int:
        return len(self.work)


@dataclass(frozen=True)
class Slot:
    """One device: ``room`` bytes for weights + activations, ``speed`` work/s, ``link``
    bytes/s (a cut between two slots moves at the slower one), ``base`` seconds already
    committed there (offloaded units it runs), ``floor`` activation bytes it needs anyway
    (the offloaded units' peak: they run there, one at a time, like its own)."""

    room: int
    speed: float
    link: float
    base: float = 0.0
    floor: int = 0


def memory_reach(chain: Chain, room: int, floor: int = 0) -> list[int]:
    """``reach[s]``: the largest ``e`` such that items ``s..e-1`` fit in ``room`` bytes
    (weights summed, activations as the largest one, at least ``floor``); ``reach[s] == s``
    when item ``s`` alone does not fit. Non-decreasing in ``s``, computed in O(n)."""
    n = len(chain)
    act = chain.activation
    reach = [0] * (n + 1)
    window: deque[int] = deque()  # indices of the range, activations decreasing
    end, total = 0, 0
    for start in range(n + 1):
        if end < start:
            end, total = start, 0
            window.clear()
        while end < n:
            peak = max(act[window[0]] if window else 0, act[end], floor)
            if total + chain.weight[end] + peak > room:
                break
            total += chain.weight[end]
            while window and act[window[-1]] <= act[end]:
                window.pop()
            window.append(end)
            end += 1
        reach[start] = end
        if end > start:
            total -= chain.weight[start]
            if window and window[0] == start:
                window.popleft()
    return reach


def fill(
    chain: Chain, rooms: Sequence[int], start: int = 0, floors: Sequence[int] = ()
) -> tuple[list[Range], int]:
    """Greedy fill: each room in turn takes as many items as fit. Returns the ranges and the
    end reached; no contiguous split reaches further (feasibility shrinks with the range).
    O(n + k): each item is looked at once, plus once per room where it does not fit."""
    ranges: list[Range] = []
    position, n = start, len(chain)
    for j, room in enumerate(rooms):
        end, total, peak = position, 0, floors[j] if j < len(floors) else 0
        while end < n:
            act = max(peak, chain.activation[end])
            if total + chain.weight[end] + act > room:
                break
            total, peak, end = total + chain.weight[end], act, end + 1
        ranges.append((position, end))
        position = end
    return ranges, position


@dataclass
class _Sweep:
    """One probe's state per slot, kept to rebuild the split."""

    start_ok: list[np.ndarray]
    end_max: list[np.ndarray]
    reach: list[np.ndarray]
    feasible: bool


class _Probe:
    """Evaluates "can every stage finish within T?" for one chain and slot list."""

    def __init__(self, chain: Chain, slots: Sequence[Slot], anchor_first: bool = False) -> None:
        self.n = len(chain)
        self.anchor_first = anchor_first
        self.slots = list(slots)
        self.prefix = np.concatenate([[0.0], np.cumsum(np.asarray(chain.work, dtype=np.float64))])
        cut = np.zeros(self.n + 1)
        cut[1 : self.n] = np.asarray(chain.cut, dtype=np.float64)[1 : self.n]
        self.cut = cut
        self.memory = [np.asarray(memory_reach(chain, s.room, floor=s.floor)) for s in slots]
        self.index = np.arange(self.n + 1)

    def run(self, limit: float) -> _Sweep:
        n = self.n
        before = np.zeros(n + 1, dtype=bool)
        before[0] = True
        # Fastest link from a slot that ends at each position (inf at 0: the input is no cut).
        best_link = np.zeros(n + 1)
        best_link[0] = np.inf
        sweep = _Sweep([], [], [], False)
        for slot, memory in zip(self.slots, self.memory):
            link = np.minimum(best_link, slot.link)
            transfer = np.where(
                self.cut > 0, self.cut / np.maximum(link, MIN_RATE), 0.0
            )  # cost.transfer_seconds
            budget = (limit - slot.base - transfer) * slot.speed
            ends = np.searchsorted(self.prefix, self.prefix + budget, side="right") - 1
            ends = np.minimum(ends, memory)
            ok = before & (budget >= 0) & (ends > self.index)
            reach = self._cover(self.index[ok] + 1, ends[ok] + 1)
            sweep.start_ok.append(ok)
            sweep.end_max.append(ends)
            sweep.reach.append(reach)
            best_link = np.where(reach, np.maximum(best_link, slot.link), best_link)
            before = reach.copy() if self.anchor_first and len(sweep.reach) == 1 else before | reach
        sweep.feasible = bool(before[n]) and n > 0
        return sweep

    def _cover(self, lows: np.ndarray, highs: np.ndarray) -> np.ndarray:
        """Boolean mask of positions covered by the half-open intervals [low, high)."""
        diff = np.zeros(self.n + 2, dtype=np.int64)
        np.add.at(diff, lows, 1)
        np.add.at(diff, highs, -1)
        return np.cumsum(diff)[: self.n + 1] > 0


def _upper_bound(chain: Chain, slots: Sequence[Slot]) -> float:
    """A bottleneck every memory-feasible split meets: all work on the slowest slot, the
    largest cut over the slowest link, plus the largest fixed work."""
    speed = min(max(s.speed, 1e-300) for s in slots)
    link = min(max(s.link, MIN_RATE) for s in slots)
    return (
        float(sum(chain.work)) / speed + float(max(chain.cut, default=0)) / link + max(s.base for s in slots)
    ) * (1 + 1e-9) + 1e-300


def min_bottleneck(
    chain: Chain, slots: Sequence[Slot], anchor_first: bool = False
) -> list[Range | None] | None:
    """The contiguous split of ``chain`` over ``slots`` (in order) with the smallest
    bottleneck, or None when no split fits in memory. With ``anchor_first`` the first slot
    takes at least the first item (it is the execution device of offloaded units).

    Ties are broken deterministically: later slots take as much as the optimum allows, so
    the first slot (GPU 0, where inputs and outputs live) is the lightest; a chain that one
    slot runs alone at the optimum goes to the first slot that can.

    Returns:
        For each slot, its ``(start, end)`` range, or None when it takes nothing.
    """
    if len(chain) == 0:
        return [None] * len(slots)
    probe = _Probe(chain, slots, anchor_first)
    high = _upper_bound(chain, slots)
    best = probe.run(high)
    if not best.feasible:
        return None
    low = 0.0
    for _ in range(_MAX_PROBES):
        if high - low <= _RELATIVE_TOLERANCE * high:
            break
        middle = (low + high) / 2
        sweep = probe.run(middle)
        if sweep.feasible:
            high, best = middle, sweep
        else:
            low = middle
    return _rebuild(best, probe)


def _uses_one_slot(sweep: _Sweep, probe: _Probe) -> bool:
    """True when the default walk back would give the whole chain to its last slot alone."""
    n = probe.n
    last = max(j for j in range(len(probe.slots)) if sweep.reach[j][n])
    return bool(sweep.start_ok[last][0] and sweep.end_max[last][0] >= n)


def _rebuild(sweep: _Sweep, probe: _Probe) -> list[Range | None]:
    """Walk back from the last slot that ends the chain, giving each slot the longest
    feasible range and the predecessor with the fastest link (the one the probe assumed)."""
    n, k = probe.n, len(probe.slots)
    ranges: list[Range | None] = [None] * k
    # A chain that one slot can run alone within the bottleneck goes to the first such slot
    # (GPU 0 rather than the last GPU for a model too small to be worth splitting).
    alone = [j for j in range(k) if sweep.start_ok[j][0] and sweep.end_max[j][0] >= n]
    if alone and _uses_one_slot(sweep, probe):
        ranges[alone[0]] = (0, n)
        return ranges
    slot = max(j for j in range(k) if sweep.reach[j][n])
    end = n
    while True:
        ok = sweep.start_ok[slot] & (sweep.end_max[slot] >= end) & (probe.index < end)
        start = int(np.flatnonzero(ok)[0])
        ranges[slot] = (start, end)
        if start == 0:
            return ranges
        link = max(probe.slots[j].link for j in range(slot) if sweep.reach[j][start])
        slot = max(j for j in range(slot) if sweep.reach[j][start] and probe.slots[j].link == link)
        end = start
