"""Items and groups: the chain of a profile that the layouts and the partitioner see.

Units become *items* (a unit plus the units tied to it, which must share its device); the
items split out of one unit (``Unit.split_from``) form a *group*, which computes on one device,
because the split module's own code (a residual add) runs between its pieces. A piece tied to
units outside its split unit is the exception (:func:`_computes_with`). Groups form a chain in
execution order, which :mod:`automap.planning.layout_kinds` lays out over the tiers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from automap.planning.partition import Chain
from automap.profiling import Profile
from automap.profiling.units import longest_prefix


@dataclass(frozen=True)
class Items:
    """The chain the partitioner sees: ``members[i]`` are the unit indices of item ``i``
    (its first member runs first; the others are tied to it); ``groups`` are runs of
    consecutive item indices that compute on one device (one per item unless split);
    ``routed[i]``: item ``i`` holds a layer's routed experts, which may compute apart from the
    rest of their layer (:mod:`automap.planning.experts`), so they join no group."""

    members: tuple[tuple[int, ...], ...]
    chain: Chain
    groups: tuple[tuple[int, ...], ...] = ()
    routed: tuple[bool, ...] = ()


@dataclass(frozen=True)
class Groups:
    """The chain of groups (work and weights summed, activations the largest: the pieces run
    one at a time) and, per group, its largest item: what streaming it piece by piece stages."""

    chain: Chain
    stream: tuple[int, ...]
    items: tuple[tuple[int, ...], ...]


def all_cut_bytes(profile: Profile) -> tuple[int, ...]:
    """``profile.cut_bytes(i)`` for every ``i`` in one pass over the graph's edges."""
    order = {u.name: i for i, u in enumerate(profile.units)}
    diff = [0] * (len(profile.units) + 1)
    for src, dst, data in profile.graph.edges(data=True):
        first, last = order.get(src, -1), order.get(dst, -1)
        if first < last:
            diff[first + 1] += int(data.get("bytes", 0))
            diff[last + 1] -= int(data.get("bytes", 0))
    cuts, running = [], 0
    for delta in diff[:-1]:
        running += delta
        cuts.append(running)
    return tuple(cuts)


def _holder(name: str, owner: Mapping[str, int], by_name: Mapping[str, int]) -> int | None:
    """The unit holding tensor ``name``: its owner, else the unit with the longest prefix."""
    if name in owner:
        return owner[name]
    return longest_prefix(by_name, name.rpartition(".")[0])


def tie_roots(profile: Profile) -> list[int]:
    """For each unit, the first unit (execution order) it must share a device with."""
    owner = {t: i for i, u in enumerate(profile.units) for t in u.tensors}
    by_name = {u.name: i for i, u in enumerate(profile.units)}
    root = list(range(len(profile.units)))

    def find(i: int) -> int:
        while root[i] != i:
            root[i] = root[root[i]]
            i = root[i]
        return i

    for group in profile.tie_groups:
        holders = {h for h in (_holder(t, owner, by_name) for t in group) if h is not None}
        for other in holders:
            a, b = find(min(holders)), find(other)
            root[max(a, b)] = min(a, b)
    return [find(i) for i in range(len(root))]


def make_items(profile: Profile, cut_bytes: Sequence[int]) -> Items:
    """Merge tied units into items; work is FLOPs, or bytes when the profile has no FLOPs.
    An item's weight is what stays where it computes: its weights and its generation cache."""
    roots = tie_roots(profile)
    groups: dict[int, list[int]] = {}
    for i, r in enumerate(roots):
        groups.setdefault(r, []).append(i)
    members = tuple(tuple(groups[r]) for r in sorted(groups))
    units = profile.units
    by_flops = profile.has_compute
    routed = tuple(any(units[i].experts for i in m) for m in members)
    work = [float(sum(units[i].flops if by_flops else units[i].weight_bytes for i in m)) for m in members]
    return Items(
        members,
        Chain(
            work=work,
            weight=[sum(units[i].weight_bytes + units[i].kv_bytes for i in m) for m in members],
            activation=[max(units[i].peak_activation_bytes for i in m) for m in members],
            cut=[float(cut_bytes[m[0]]) if by_flops else 0.0 for m in members],
        ),
        _split_groups(["" if routed[k] else _computes_with(m, profile) for k, m in enumerate(members)]),
        routed,
    )


def _computes_with(members: Sequence[int], profile: Profile) -> str:
    """The split unit whose pieces item ``members`` must compute beside: their one
    ``split_from``, or ``""`` (it joins no group) when they are not all pieces of one unit: a
    piece tied to units outside it computes where they are, and the runtime sends its outputs
    back to its split unit's device (:func:`automap.runtime.pieces.hook_split_units`).
    Pulling the tied units into the split unit's group instead would put all of them on one
    device, which may hold none of them though the devices together hold them all."""
    origins = {profile.units[i].split_from for i in members}
    return origins.pop() if len(origins) == 1 else ""


def _split_groups(origins: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """Runs of consecutive items split from the same unit; every other item alone."""
    groups: list[list[int]] = []
    for i, origin in enumerate(origins):
        if groups and origin and origins[groups[-1][0]] == origin:
            groups[-1].append(i)
        else:
            groups.append([i])
    return tuple(tuple(g) for g in groups)


def grouped(items: Items) -> Groups:
    """The groups of ``items`` as a chain of their own."""
    c, groups = items.chain, items.groups or tuple((i,) for i in range(len(items.chain)))
    chain = Chain(
        work=[sum(c.work[i] for i in g) for g in groups],
        weight=[sum(c.weight[i] for i in g) for g in groups],
        activation=[max(c.activation[i] for i in g) for g in groups],
        cut=[c.cut[g[0]] for g in groups],
    )
    return Groups(chain, tuple(max(c.weight[i] for i in g) for g in groups), groups)


def sub_chain(chain: Chain, start: int, end: int) -> Chain:
    """Entries ``[start, end)`` of ``chain``."""
    return Chain(
        chain.work[start:end], chain.weight[start:end], chain.activation[start:end], chain.cut[start:end]
    )
