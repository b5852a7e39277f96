"""Layout: from a profile, devices and a strategy to a :class:`Plan`.

Units become *items* (a unit plus the units tied to it, which must share its device), items
form a chain in execution order, and the chain is split over tiers: accelerators first, then
CPU RAM, then disk.

- When the accelerators can hold every item (weights, activations of the profiled batch, the
  user's reserve) nothing goes to CPU or disk; the registered strategy
  (:mod:`automap.planning.strategies`) splits the chain over them. If no contiguous split of whole units fits but
  the units can be packed out of order, they are (a warning says so): extra cuts cost
  microseconds, streaming offloaded weights costs far more.
- Otherwise the accelerators keep one contiguous run of items (possibly after a few offloaded
  leading ones, such as an embedding), chosen to keep the most bytes, while the execution
  device keeps room to stream the largest offloaded item; CPU RAM takes the offloaded items
  first, disk the rest.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Mapping, Sequence

from automap.devices import DeviceSpec
from automap.errors import PlanError
from automap.planning.model import Origin, Plan
from automap.planning.packing import pack_out_of_order
from automap.planning.partition import Chain, Range, Slot, fill
from automap.planning.strategies import Strategy, get_strategy
from automap.profiling import Profile
from automap.profiling.units import longest_prefix
from automap.sizes import format_bytes

log = logging.getLogger(__name__)



@dataclass(frozen=True)
class Items:
    """The chain the partitioner sees: ``members[i]`` are the unit indices of item ``i``
    (its first member runs first; the others are tied to it)."""

    members: tuple[tuple[int, ...], ...]
    chain: Chain


@dataclass(frozen=True)
class Layout:
    """Device name per item, and the bytes reserved per device beyond weights/activations."""

    devices: tuple[str, ...]
    reserves: dict[str, int]
    notes: tuple[str, ...] = ()


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
    work = [float(sum(units[i].flops if by_flops else units[i].weight_bytes for i in m)) for m in members]
    return Items(members, Chain(
        work=work,
        weight=[sum(units[i].weight_bytes + units[i].kv_bytes for i in m) for m in members],
        activation=[max(units[i].peak_activation_bytes for i in m) for m in members],
        cut=[float(cut_bytes[m[0]]) if by_flops else 0.0 for m in members],
    ))


def _sub(chain: Chain, start: int, end: int) -> Chain:
    return Chain(chain.work[start:end], chain.weight[start:end], chain.activation[start:end],
                 chain.cut[start:end])


def _tiers(devices: Sequence[DeviceSpec]) -> tuple[list[DeviceSpec], list[DeviceSpec]]:
    """Computing devices (accelerators, else the CPU) and storage tiers (CPU RAM, disk)."""
    accelerators = [d for d in devices if d.is_accelerator]
    hosts = [d for d in devices if d.kind == "cpu"]
    disks = [d for d in devices if d.kind == "disk"]
    return (accelerators, hosts + disks) if accelerators else (hosts, disks)


def _room(device: DeviceSpec, reserve: Mapping[str, int]) -> int:
    return max(device.capacity_bytes - reserve.get(device.name, 0), 0)


def _stages(chain: Chain, compute: Sequence[DeviceSpec], rooms: Sequence[int], strategy: Strategy,
            base: float = 0.0, floor: int = 0, anchor_first: bool = False) -> list[Range | None]:
    """Split ``chain`` (known to fit) over the computing devices with ``strategy``; the first
    of them also runs the offloaded units (``base`` seconds, ``floor`` activation bytes)."""
    slots = [Slot(room, d.flops_per_second, d.link_bytes_per_second, base if i == 0 else 0.0, floor if i == 0 else 0)
             for i, (d, room) in enumerate(zip(compute, rooms))]
    return strategy.split(chain, slots, anchor_first)


# Leading items that may be offloaded too, when the execution device cannot keep them beside
# the streaming room (an embedding tied to the LM head): a few suffice, and each try is a pass.
_MAX_OFFLOADED_HEAD = 4


@dataclass(frozen=True)
class _Offload:
    """Items ``[0, head)`` and ``[point, n)`` are offloaded; ``[head, point)`` stay on the
    computing devices from index ``first`` on, whose first keeps ``streamed`` bytes for the
    largest offloaded item and ``peak`` activation bytes for the offloaded items' runs."""

    head: int
    first: int
    point: int
    streamed: int
    peak: int


def _offload_point(chain: Chain, rooms: Sequence[int], weights: int = 0, activations: int = 0) -> tuple[int, int, int]:
    """The longest prefix the computing devices hold while the first of them keeps room for
    the largest offloaded item's weights and activations (which, like its own units', run one
    at a time), starting from at least ``weights``/``activations``. Returns (prefix end,
    weight room, activation floor); both only grow as the prefix shrinks, so this settles in
    a few rounds."""
    while True:
        _, end = fill(chain, [rooms[0] - weights, *rooms[1:]], floors=[activations])
        tail = range(end, len(chain))
        need_w = max([weights, *(chain.weight[i] for i in tail)])
        need_a = max([activations, *(chain.activation[i] for i in tail)])
        if need_w <= weights and need_a <= activations:
            return end, weights, activations
        weights, activations = need_w, need_a


def _choose_offload(chain: Chain, rooms: Sequence[int]) -> _Offload | None:
    """The offload that keeps the most bytes on the computing devices, trying each device as
    the executor and a few leading items offloaded; None when no device can execute."""
    best, kept_best = None, -1
    for head in range(min(_MAX_OFFLOADED_HEAD, len(chain) - 1) + 1):
        rest = _sub(chain, head, len(chain))
        floor_w, floor_a = max(chain.weight[:head], default=0), max(chain.activation[:head], default=0)
        for first in range(len(rooms)):
            point, streamed, peak = _offload_point(rest, rooms[first:], floor_w, floor_a)
            if fill(rest, [rooms[first] - streamed], floors=[peak])[1] == 0:
                continue  # this device cannot hold its first item besides the streaming room
            kept = sum(rest.weight[:point])
            if kept > kept_best:
                best, kept_best = _Offload(head, first, head + point, streamed, peak), kept
    return best


def _store(chain: Chain, items: Sequence[int], storage: Sequence[DeviceSpec],
           reserve: Mapping[str, int]) -> dict[int, DeviceSpec] | None:
    """Offloaded items to storage tiers in order (CPU RAM, then disk); None when they overflow."""
    where: dict[int, DeviceSpec] = {}
    tier, used = 0, 0
    for i in items:
        while tier < len(storage) and used + chain.weight[i] > _room(storage[tier], reserve):
            tier, used = tier + 1, 0
        if tier == len(storage):
            return None
        where[i], used = storage[tier], used + chain.weight[i]
    return where


def _offload_seconds(chain: Chain, where: Mapping[int, DeviceSpec], executor: DeviceSpec) -> float:
    """Seconds the execution device spends running offloaded items: compute plus streaming."""
    total = 0.0
    for i, store in where.items():
        link = max(min(store.link_bytes_per_second, executor.link_bytes_per_second), 1.0)
        total += chain.work[i] / max(executor.flops_per_second, 1.0) + chain.weight[i] / link
    return total


def layout(chain: Chain, devices: Sequence[DeviceSpec], strategy: Strategy, reserve: Mapping[str, int]) -> Layout:
    """Device per item: everything on the computing devices when it fits, else tiers."""
    compute, storage = _tiers(devices)
    if not compute:
        raise PlanError(f"nothing can run the model: the plan's devices are {[d.name for d in devices]}; "
                        "add CPU memory (max_memory={'cpu': '16GiB', ...}) or a GPU")
    if not compute[0].is_accelerator:
        # A CPU budget bounds the weights kept in RAM, as accelerate reads max_memory["cpu"];
        # activations are reserved where running out is fatal: on accelerators.
        chain = Chain(chain.work, chain.weight, [0] * len(chain), chain.cut)
    rooms = [_room(d, reserve) for d in compute]
    _, end = fill(chain, rooms)
    if end == len(chain):
        return _assign(_stages(chain, compute, rooms, strategy, 0.0), compute, len(chain), dict(reserve))
    packed = pack_out_of_order(chain, compute, rooms) if len(compute) > 1 else None
    if packed is not None:
        owner, cuts = packed
        note = (f"no contiguous split fits the accelerators with room for activations; units run out of "
                f"order ({cuts} cuts for {len(compute)} devices) rather than being offloaded")
        return Layout(tuple(compute[j].name for j in owner), dict(reserve), (note,))
    if sum(chain.weight) > sum(_room(d, reserve) for d in [*compute, *storage]):
        raise _does_not_fit(chain, compute, storage, reserve, 0)
    chosen = _choose_offload(chain, rooms)
    if chosen is None:
        if not compute[0].is_accelerator or not any(d.kind == "cpu" for d in storage):
            raise _does_not_fit(chain, compute, storage, reserve, max(chain.weight, default=0),
                                "no computing device can hold a unit and stream the largest offloaded one besides")
        log.debug("the accelerators cannot stream the offloaded units; the CPU runs the model")
        return layout(chain, [d for d in devices if not d.is_accelerator], strategy, reserve)
    return _offloaded(chain, compute[chosen.first:], rooms[chosen.first:], storage, strategy, reserve, chosen)


def _offloaded(chain: Chain, compute: Sequence[DeviceSpec], rooms: Sequence[int], storage: Sequence[DeviceSpec],
               strategy: Strategy, reserve: Mapping[str, int], chosen: _Offload) -> Layout:
    """Place the offloaded items in storage and split the kept ones over the computing devices."""
    n = len(chain)
    where = _store(chain, [*range(chosen.head), *range(chosen.point, n)], storage, reserve)
    if where is None:
        raise _does_not_fit(chain, compute, storage, reserve, chosen.streamed)
    base = _offload_seconds(chain, where, compute[0])
    kept = _stages(_sub(chain, chosen.head, chosen.point), compute, [rooms[0] - chosen.streamed, *rooms[1:]],
                   strategy, base, chosen.peak, True)
    names = [""] * n
    for i, store in where.items():
        names[i] = store.name
    for device, span in zip(compute, kept):
        if span is not None:
            for i in range(chosen.head + span[0], chosen.head + span[1]):
                names[i] = device.name
    reserves = dict(reserve)
    # The streamed weights are a reserve; the offloaded units' activations show as activations.
    reserves[compute[0].name] = reserves.get(compute[0].name, 0) + chosen.streamed
    return Layout(tuple(names), reserves)


def _assign(ranges: Sequence[Range | None], devices: Sequence[DeviceSpec], n: int,
            reserves: dict[str, int]) -> Layout:
    names = [""] * n
    for device, span in zip(devices, ranges):
        if span is not None:
            for i in range(*span):
                names[i] = device.name
    assert all(names), "every item is placed"
    return Layout(tuple(names), reserves)


def _does_not_fit(chain: Chain, compute: Sequence[DeviceSpec], storage: Sequence[DeviceSpec],
                  reserve: Mapping[str, int], extra: int, reason: str = "") -> PlanError:
    weights = sum(chain.weight)
    peak = max(chain.activation, default=0)
    tiers = ", ".join(f"{d.name} {format_bytes(_room(d, reserve))}" for d in [*compute, *storage])
    available = sum(_room(d, reserve) for d in [*compute, *storage])
    short = weights + peak + extra - available
    has_disk = any(d.kind == "disk" for d in storage)
    return PlanError(
        f"the model does not fit even with offloading{': ' + reason if reason else ''}; it needs {format_bytes(weights)} of weights "
        f"+ {format_bytes(peak)} of activations + {format_bytes(extra)} to stream offloaded units, "
        f"but the devices hold {tiers} (total {format_bytes(available)}, about {format_bytes(max(short, 0))} "
        f"short); raise max_memory"
        + (", free space where offload_dir points" if has_disk else ", allow 'disk' in max_memory")
        + ", or load the weights in a smaller dtype (dtype=torch.float16 halves float32 weights)"
    )


def check_items_fit(profile: Profile, items: Items, devices: Sequence[DeviceSpec],
                    reserve: Mapping[str, int]) -> None:
    """Every item must fit, weights plus activations, on some device that can run it."""
    runners = [d for d in devices if d.kind != "disk"]
    if not runners:
        return
    for members, weight, act in zip(items.members, items.chain.weight, items.chain.activation):
        needs = {d.name: weight + (act if d.is_accelerator else 0) for d in runners}
        if any(needs[d.name] <= _room(d, reserve) for d in runners):
            continue
        best = max(runners, key=lambda d: (_room(d, reserve) - needs[d.name], -d.sort_key()[0]))
        names = [profile.units[i].name or "<model>" for i in members]
        what = f"unit {names[0]!r}" + (f" (tied to {names[1:]})" if len(names) > 1 else "")
        detail = (f" ({format_bytes(weight)} of weights + {format_bytes(act)} of activations)"
                  if best.is_accelerator else "")
        raise PlanError(
            f"{what} needs {format_bytes(needs[best.name])}{detail} but the largest device that can run it, "
            f"{best.name}, has {format_bytes(_room(best, reserve))}; raise max_memory for one device, use a "
            "smaller batch or dtype, or let automap split it (no_split without its class)"
        )


def make_plan(profile: Profile, devices: tuple[DeviceSpec, ...], strategy: str = "auto", *,
              reserve: Mapping[str, int] | None = None) -> Plan:
    """Place ``profile``'s units on ``devices`` with a named strategy.

    Args:
        profile: the model's units in execution order.
        devices: where units may go (hypothetical devices are fine), fastest tier first.
        strategy: a registered strategy's name (:mod:`automap.planning.strategies`):
            ``"auto"`` / ``"balanced"``, ``"balanced_low_0"`` or ``"sequential"``.
        reserve: bytes to keep free per device name (KV cache, optimizer state).

    Returns:
        A deterministic :class:`Plan`.

    Raises:
        PlanError: unknown strategy, no devices, a unit larger than every device, or a model
            that does not fit even on disk (the message gives the numbers per tier).

    Example:
        >>> make_plan(prof, (make_device("cuda:0", 2**30), make_device("cuda:1", 2**30)))
    """
    chosen = get_strategy(strategy)
    if not devices:
        raise PlanError("no devices to place on; give max_memory={'cpu': '8GiB'} or similar")
    devices = tuple(sorted(devices, key=DeviceSpec.sort_key))
    reserve = dict(reserve or {})
    cuts = all_cut_bytes(profile)
    items = make_items(profile, cuts)
    try:
        check_items_fit(profile, items, devices, reserve)
        placed = layout(items.chain, devices, chosen, reserve)
        if profile.total_kv_bytes:
            placed = reserve_offloaded_kv(profile, items, devices, chosen, reserve, placed)
    except PlanError as exc:
        if not profile.total_kv_bytes or profile.generation is None:
            raise
        g = profile.generation
        raise PlanError(f"{exc} (the bytes counted as weights include the KV cache of {g.batch} x {g.max_length} "
                        f"tokens, {format_bytes(profile.total_kv_bytes)}; a smaller batch or max_length needs "
                        "less)") from exc
    placement = _unit_devices(items, placed, len(profile.units))
    return build_plan(profile, devices, placement, strategy, placed.reserves, cuts, placed.notes)


def _unit_devices(items: Items, placed: Layout, count: int) -> list[str]:
    placement = [""] * count
    for members, where in zip(items.members, placed.devices):
        for i in members:
            placement[i] = where
    return placement


def reserve_offloaded_kv(profile: Profile, items: Items, devices: tuple[DeviceSpec, ...], strategy: Strategy,
                         reserve: Mapping[str, int], placed: Layout) -> Layout:
    """Lay out again until the execution device keeps room for the generation cache of the
    offloaded units: they compute there, so their cache lives there, not in the tier their
    weights stream from. Each round can only offload more, so a few rounds settle."""
    extra: dict[str, int] = {}
    for _ in range(len(items.members)):
        sketch = Plan(units=profile.units, devices=devices, placement=tuple(_unit_devices(items, placed, len(profile.units))),
                      strategy=strategy.name)
        need = sum(u.kv_bytes for u, d in zip(sketch.units, sketch.placement) if sketch.is_offloaded(d))
        executor = sketch.execution_device
        if need <= extra.get(executor, 0):
            break
        extra[executor] = need
        placed = layout(items.chain, devices, strategy,
                        {name: reserve.get(name, 0) + extra.get(name, 0) for name in {*reserve, *extra}})
    # The cache shows as the execution device's KV, not as a reserve.
    reserves = {name: nbytes - extra.get(name, 0) for name, nbytes in placed.reserves.items()}
    return replace(placed, reserves=reserves)


def build_plan(profile: Profile, devices: tuple[DeviceSpec, ...], placement: Sequence[str], strategy: str,
               reserves: Mapping[str, int], cuts: Sequence[int] | None = None,
               notes: Sequence[str] = (), origin: Origin = Origin.STRATEGY) -> Plan:
    """Assemble a :class:`Plan` and the notes a user should read."""
    plan = Plan(units=profile.units, devices=devices, placement=tuple(placement), strategy=strategy, origin=origin,
                tie_groups=profile.tie_groups, cut_bytes=tuple(all_cut_bytes(profile) if cuts is None else cuts),
                example=profile.example, generation=profile.generation,
                reserves=tuple((d.name, int(reserves[d.name])) for d in devices if reserves.get(d.name)))
    found = list(notes)
    if plan.offloaded_units:
        found.append(f"{len(plan.offloaded_units)} unit(s) offloaded "
                     f"({format_bytes(sum(plan.bytes_on(d.name) for d in devices if plan.is_offloaded(d.name)))}), "
                     f"streamed to {plan.execution_device} when they run")
    if not profile.example:
        found.append("no example inputs: balanced by bytes, not FLOPs")
    if profile.uncalled:
        found.append(f"{len(profile.uncalled)} unit(s) never called in the traced forward: "
                     f"{', '.join(profile.uncalled[:3])}")
    return replace(plan, warnings=tuple(found))
