"""Layout: from a profile, devices and a strategy to the plans that could work.

Units become *items* (a unit plus the units tied to it, which must share its device); the
items split out of one unit (``Unit.split_from``) form a *group*, which computes on one device,
because the split module's own code (a residual add) runs between its pieces. Groups form a
chain in execution order, laid out over tiers: accelerators, then CPU RAM, then disk. Each way
that works is an :class:`Option`; :func:`level_plans` builds each as a :class:`Plan`, and
:mod:`automap.planning.splitting` keeps the one with the smallest predicted forward time.

With accelerators:

- ``resident``: the accelerators hold every group (weights, activations of the profiled batch,
  the user's reserve) and the registered strategy (:mod:`automap.planning.strategies`) splits
  the chain over them. When this works it is the only option: nothing goes to CPU or disk.
- ``packed``: no contiguous split fits, but the groups can be packed out of order.
- ``streamed``: the accelerators keep one contiguous run of groups (possibly after a few
  offloaded leading ones, such as an embedding), chosen to keep the most bytes; the rest lives
  in CPU RAM where it has room, else on disk, and is streamed item by item to the execution
  device (the accelerator with which the most bytes stay resident), which keeps room for the
  largest streamed item (a split unit streams piece by piece). Items read from disk pass
  through pinned staging, counted in the CPU budget. GPU room left over then keeps offloaded
  items resident (:mod:`automap.planning.residency`). ``balanced_low_0`` executes on GPU 0
  only when no other GPU can.
- ``cpu computes``: the accelerators keep the contiguous run of groups with the most work that
  fits them; the CPU computes every other group, from RAM or from disk. When no group fits an
  accelerator that is the whole model on the CPU; else the whole model on the CPU is an option
  too, so that a lone small unit whose cuts cost more than the GPU saves is not chosen.

On the CPU alone, RAM takes each item (in execution order) that still fits its budget; the rest
stay on disk, read through the page cache (the store is memory-mapped), which needs no budget.
A CPU budget bounds the weights kept in RAM, as accelerate reads ``max_memory["cpu"]``;
activations are reserved where running out is fatal: on accelerators.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping, Sequence

from automap.devices import DeviceSpec
from automap.errors import PlanError
from automap.kinds import is_host_name, kind_of
from automap.planning.model import Origin, Plan, unit_label
from automap.planning.packing import pack_out_of_order
from automap.planning.partition import Chain, Range, Slot, fill
from automap.planning.residency import Room, keep_resident
from automap.planning.strategies import Strategy
from automap.profiling import Profile
from automap.profiling.units import longest_prefix
from automap.sizes import format_bytes

RESIDENT, PACKED, STREAMED, CPU_COMPUTES = "resident", "packed", "streamed", "cpu computes"


@dataclass(frozen=True)
class Items:
    """The chain the partitioner sees: ``members[i]`` are the unit indices of item ``i``
    (its first member runs first; the others are tied to it); ``groups`` are runs of
    consecutive item indices that compute on one device (one per item unless split)."""

    members: tuple[tuple[int, ...], ...]
    chain: Chain
    groups: tuple[tuple[int, ...], ...] = ()


@dataclass(frozen=True)
class Layout:
    """Device name per item, the bytes reserved per device beyond weights/activations, and the
    execution device when the layout chooses one (``""``: the plan's default)."""

    devices: tuple[str, ...]
    reserves: dict[str, int]
    notes: tuple[str, ...] = ()
    executor: str = ""


@dataclass(frozen=True)
class Option:
    """One layout that works, and which kind it is (``RESIDENT``, ``PACKED``, ...)."""

    kind: str
    layout: Layout


@dataclass(frozen=True)
class Candidate:
    """An option built as a plan."""

    kind: str
    plan: Plan


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
    ), _split_groups([units[m[0]].split_from for m in members]))


def _split_groups(origins: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """Runs of consecutive items split from the same unit; every other item alone."""
    groups: list[list[int]] = []
    for i, origin in enumerate(origins):
        if groups and origin and origins[groups[-1][0]] == origin:
            groups[-1].append(i)
        else:
            groups.append([i])
    return tuple(tuple(g) for g in groups)


@dataclass(frozen=True)
class _Groups:
    """The chain of groups (work and weights summed, activations the largest: the pieces run
    one at a time) and, per group, its largest item: what streaming it piece by piece stages."""

    chain: Chain
    stream: tuple[int, ...]
    items: tuple[tuple[int, ...], ...]


def _grouped(items: Items) -> _Groups:
    c, groups = items.chain, items.groups or tuple((i,) for i in range(len(items.chain)))
    chain = Chain(work=[sum(c.work[i] for i in g) for g in groups],
                  weight=[sum(c.weight[i] for i in g) for g in groups],
                  activation=[max(c.activation[i] for i in g) for g in groups],
                  cut=[c.cut[g[0]] for g in groups])
    return _Groups(chain, tuple(max(c.weight[i] for i in g) for g in groups), groups)


def _sub(chain: Chain, start: int, end: int) -> Chain:
    return Chain(chain.work[start:end], chain.weight[start:end], chain.activation[start:end],
                 chain.cut[start:end])


def _tiers(devices: Sequence[DeviceSpec]) -> tuple[list[DeviceSpec], list[DeviceSpec]]:
    """Computing devices (accelerators, else the CPU) and storage tiers (CPU RAM, disk)."""
    accelerators = [d for d in devices if d.is_accelerator]
    hosts = [d for d in devices if kind_of(d).is_host]
    disks = [d for d in devices if kind_of(d).stores_only]
    return (accelerators, hosts + disks) if accelerators else (hosts, disks)


def room(device: DeviceSpec, reserve: Mapping[str, int]) -> int:
    """Bytes of ``device`` the planner may fill: its capacity less the user's reserve there."""
    return max(device.capacity_bytes - reserve.get(device.name, 0), 0)


def _stages(chain: Chain, compute: Sequence[DeviceSpec], rooms: Sequence[int], strategy: Strategy,
            base: float = 0.0, floor: int = 0, executor: int = 0) -> list[Range | None]:
    """Split ``chain`` (known to fit) over the computing devices with ``strategy``; the one at
    index ``executor`` also runs the offloaded units (``base`` seconds, ``floor`` activation bytes)."""
    slots = [Slot(room, d.flops_per_second, d.link_bytes_per_second, base if i == executor else 0.0,
                  floor if i == executor else 0)
             for i, (d, room) in enumerate(zip(compute, rooms))]
    return strategy.split(chain, slots, False)


# Leading items that may be offloaded too, when the execution device cannot keep them beside
# the streaming room (an embedding tied to the LM head): a few suffice, and each try is a pass.
_MAX_OFFLOADED_HEAD = 4


@dataclass(frozen=True)
class _Offload:
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
        return [self.peak if j == self.executor else 0 for j in range(count)]


def _offload_point(chain: Chain, stream: Sequence[int], rooms: Sequence[int], executor: int, weights: int = 0,
                   activations: int = 0) -> _Offload:
    """The longest prefix the computing devices hold while the executor keeps room for the
    largest offloaded item's weights and activations (which, like its own units', run one at
    a time), starting from at least ``weights``/``activations``. Both only grow as the prefix
    shrinks, so this settles in a few rounds."""
    while True:
        found = _Offload(0, executor, 0, weights, activations)
        _, end = fill(chain, found.rooms(rooms), floors=found.floors(len(rooms)))
        tail = range(end, len(chain))
        need_w = max([weights, *(stream[i] for i in tail)])
        need_a = max([activations, *(chain.activation[i] for i in tail)])
        if need_w <= weights and need_a <= activations:
            return replace(found, point=end)
        weights, activations = need_w, need_a


def _choose_offload(chain: Chain, stream: Sequence[int], rooms: Sequence[int], light_first: bool = False
                    ) -> _Offload | None:
    """The offload that keeps the most bytes on the computing devices, trying each device as
    the executor and a few leading groups offloaded; None when no device can execute. With
    ``light_first`` (``balanced_low_0``) the first device executes only when no other can."""
    best, kept_best = None, (False, -1)
    for head in range(min(_MAX_OFFLOADED_HEAD, len(chain) - 1) + 1):
        rest, rest_stream = _sub(chain, head, len(chain)), stream[head:]
        floor_w, floor_a = max(stream[:head], default=0), max(chain.activation[:head], default=0)
        for executor in range(len(rooms)):
            found = _offload_point(rest, rest_stream, rooms, executor, floor_w, floor_a)
            if rooms[executor] < found.streamed + found.peak:
                continue  # this device cannot stream the largest offloaded item
            kept = (not (light_first and executor == 0 and len(rooms) > 1), sum(rest.weight[:found.point]))
            if kept > kept_best:
                best, kept_best = replace(found, head=head, point=head + found.point), kept
    return best


def _store(weights: Sequence[int], order: Sequence[int], storage: Sequence[DeviceSpec],
           reserve: Mapping[str, int], held: Mapping[str, int] | None = None) -> dict[int, DeviceSpec] | None:
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


def _store_staged(weights: Sequence[int], order: Sequence[int], storage: Sequence[DeviceSpec],
                  reserve: Mapping[str, int]) -> tuple[dict[int, DeviceSpec], int] | None:
    """:func:`_store` for streaming to an accelerator: an item read from disk passes through a
    pinned staging buffer in CPU RAM, as large as the largest such item, so the CPU tier keeps
    that much free. Returns the tiers and the staging bytes (0 when nothing is on disk)."""
    host = next((d.name for d in storage if kind_of(d).is_host), None)
    staging = 0
    while True:
        where = _store(weights, order, storage, reserve, {host: staging} if host else None)
        if where is None:
            return None
        need = max((weights[i] for i, d in where.items() if kind_of(d).staged_via_host), default=0) if host else 0
        if need <= staging:
            return where, staging
        staging = need


def _offload_seconds(chain: Chain, where: Mapping[int, DeviceSpec], executor: DeviceSpec) -> float:
    """Seconds the execution device spends running offloaded items: compute plus streaming."""
    total = 0.0
    for i, store in where.items():
        link = max(min(store.link_bytes_per_second, executor.link_bytes_per_second), 1.0)
        total += chain.work[i] / max(executor.flops_per_second, 1.0) + chain.weight[i] / link
    return total


def layout_options(items: Items, devices: Sequence[DeviceSpec], strategy: Strategy,
                   reserve: Mapping[str, int]) -> list[Option]:
    """Every kind of layout that works for ``items`` (see the module docstring).

    Raises:
        PlanError: nothing can run the model, or nothing fits.
    """
    compute, storage = _tiers(devices)
    if not compute:
        raise PlanError(f"nothing can run the model: the plan's devices are {[d.name for d in devices]}; "
                        "add CPU memory (max_memory={'cpu': '16GiB', ...}) or a GPU")
    if not compute[0].is_accelerator:
        return [_on_cpu(items, compute[0], storage, reserve)]
    groups = _grouped(items)
    rooms = [room(d, reserve) for d in compute]
    if fill(groups.chain, rooms)[1] == len(groups.chain):
        ranges = _stages(groups.chain, compute, rooms, strategy)
        return [Option(RESIDENT, _assign(groups, ranges, compute, dict(reserve)))]
    packed = _packed(groups, compute, rooms, reserve) if len(compute) > 1 else None
    options = [Option(PACKED, packed)] if packed is not None else []
    fits = sum(items.chain.weight) <= sum(room(d, reserve) for d in [*compute, *storage])
    host = any(kind_of(d).is_host for d in storage)
    if fits:
        streamed = _streamed(groups, items, compute, rooms, storage, strategy, reserve)
        options += [Option(STREAMED, streamed)] if streamed else []
        if host:
            options += [Option(CPU_COMPUTES, found) for found in _cpu_computes(groups, items, compute, rooms, storage,
                                                                              strategy, reserve)]
    if not options:
        reason = ("" if not (fits and storage) else "no accelerator can hold its units beside the room to stream the largest "
                  "offloaded one" + ("" if host else ", and no CPU budget lets the CPU compute them (allow 'cpu' "
                                                     "in max_memory)"))
        raise _does_not_fit(items.chain, compute, storage, reserve, max(groups.stream, default=0) if fits else 0,
                            reason)
    return options


def _packed(groups: _Groups, compute: Sequence[DeviceSpec], rooms: Sequence[int],
            reserve: Mapping[str, int]) -> Layout | None:
    """Groups packed on the accelerators out of execution order; None when they do not fit."""
    packed = pack_out_of_order(groups.chain, compute, rooms)
    if packed is None:
        return None
    owner, cuts = packed
    note = (f"no contiguous split fits the accelerators with room for activations; units run out of "
            f"order ({cuts} cuts for {len(compute)} devices)")
    names = [compute[j].name for g, j in zip(groups.items, owner) for _ in g]
    return Layout(tuple(names), dict(reserve), (note,))


def _on_cpu(items: Items, cpu: DeviceSpec, disks: Sequence[DeviceSpec], reserve: Mapping[str, int]) -> Option:
    """CPU execution: RAM takes each item, in execution order, that still fits the budget;
    disk the rest. Disk items are memory-mapped views of the store: their pages are page
    cache, not RAM the budget bounds, so they need no staging room."""
    n = len(items.chain)
    if sum(items.chain.weight) <= room(cpu, reserve):
        return Option(RESIDENT, Layout((cpu.name,) * n, dict(reserve)))
    where = _store(items.chain.weight, range(n), [cpu, *disks], reserve)
    if where is None:
        raise _does_not_fit(items.chain, [cpu], disks, reserve, 0)
    return Option(STREAMED, Layout(tuple(where[i].name for i in range(n)), dict(reserve)))


def _streamed(groups: _Groups, items: Items, compute: Sequence[DeviceSpec], rooms: Sequence[int],
              storage: Sequence[DeviceSpec], strategy: Strategy, reserve: Mapping[str, int]) -> Layout | None:
    """Offloaded items in storage, streamed to the execution device; the kept groups split
    over the accelerators. None when no accelerator can execute or storage overflows."""
    chosen = _choose_offload(groups.chain, groups.stream, rooms, strategy.light_first)
    if chosen is None:
        return None
    n = len(groups.chain)
    off = [i for g in [*range(chosen.head), *range(chosen.point, n)] for i in groups.items[g]]
    stored = _store_staged(items.chain.weight, off, storage, reserve)
    if stored is None:
        return None
    where, staging = stored
    executor = compute[chosen.executor]
    base = _offload_seconds(items.chain, where, executor)
    kept = _stages(_sub(groups.chain, chosen.head, chosen.point), compute, chosen.rooms(rooms), strategy, base,
                   chosen.peak, chosen.executor)
    names = _resident_extras(items, groups, _names(groups, kept, compute, chosen.head, where), compute, rooms,
                             chosen, where)
    reserves = dict(reserve)
    # The streamed weights are a reserve (the largest item still streamed, once GPUs with room
    # keep some); the offloaded units' activations show as activations.
    reserves[executor.name] = reserves.get(executor.name, 0) + max((items.chain.weight[i] for i in where), default=0)
    staging = min(staging, max((items.chain.weight[i] for i, d in where.items() if kind_of(d).staged_via_host),
                               default=0))
    if staging:
        host = next(d.name for d in storage if kind_of(d).is_host)
        reserves[host] = reserves.get(host, 0) + staging
    # A plan's execution device is its first accelerator used unless it names another.
    default = next((d.name for d in compute if d.name in names), "cpu")
    idle = [d.name for d in compute if d.name not in names and d is not executor]
    notes = (f"{', '.join(idle)} hold nothing while units stream to {executor.name}: each streamed unit is larger "
             f"than their room, or a piece of a unit whose other pieces compute on {executor.name}",) if idle else ()
    return Layout(names, reserves, notes, executor="" if executor.name == default else executor.name)


def _resident_extras(items: Items, groups: _Groups, names: tuple[str, ...], compute: Sequence[DeviceSpec],
                     rooms: Sequence[int], chosen: _Offload, where: dict[int, DeviceSpec]) -> tuple[str, ...]:
    """``names`` with the offloaded items that a GPU still has room for kept there
    (:mod:`automap.planning.residency`); ``where`` loses them."""
    chain, executor = items.chain, compute[chosen.executor]
    state = []
    for j, device in enumerate(compute):
        mine = [i for i, name in enumerate(names) if name == device.name or (device is executor and i in where)]
        weights = sum(chain.weight[i] for i, name in enumerate(names) if name == device.name)
        peak = max([chain.activation[i] for i in mine] + ([chosen.peak] if device is executor else []), default=0)
        streamed = chosen.streamed if device is executor else 0
        state.append(Room(rooms[j] - weights - peak - streamed, peak))
    piece = [False] * len(chain)
    for group in groups.items:
        for i in group:
            piece[i] = len(group) > 1
    kept = keep_resident(sorted(where), chain.weight, chain.activation, chain.cut, piece, state, chosen.executor)
    placed = list(names)
    for i, j in kept.items():
        placed[i] = compute[j].name
        del where[i]
    return tuple(placed)


def _cpu_computes(groups: _Groups, items: Items, gpus: Sequence[DeviceSpec], rooms: Sequence[int],
                  storage: Sequence[DeviceSpec], strategy: Strategy, reserve: Mapping[str, int]) -> list[Layout]:
    """The accelerators keep the contiguous run of groups with the most work that fits them;
    the CPU computes the rest from RAM, or from disk (page cache, no budget). Also the whole
    model on the CPU, when the run could be a lone small unit whose cuts cost more than the
    accelerators save (the predicted times decide). Empty when the rest overflows RAM and disk."""
    run = _cpu_computes_run(groups, items, gpus, rooms, storage, strategy, reserve)
    if run is None or not is_host_name(run.executor):
        return [run] if run is not None else []
    where = _store(items.chain.weight, range(len(items.chain)), storage, reserve)
    alone = Layout(_names(groups, [], gpus, 0, where), dict(reserve)) if where is not None else None
    return [run] + ([alone] if alone is not None else [])


def _cpu_computes_run(groups: _Groups, items: Items, gpus: Sequence[DeviceSpec], rooms: Sequence[int],
                      storage: Sequence[DeviceSpec], strategy: Strategy, reserve: Mapping[str, int]) -> Layout | None:
    """:func:`_cpu_computes`'s run on the accelerators; None when the rest overflows RAM and disk."""
    chain, n = groups.chain, len(groups.chain)
    largest = max(rooms)
    # A run starts at the beginning, after a few leading groups, or after a group too large
    # for any accelerator (which the CPU computes).
    starts = sorted({*range(min(_MAX_OFFLOADED_HEAD, n - 1) + 1),
                     *(i + 1 for i in range(n - 1) if chain.weight[i] + chain.activation[i] > largest)})
    spans = [(a, fill(chain, rooms, a)[1]) for a in starts]
    start, end = max(spans, key=lambda s: (sum(chain.work[s[0]:s[1]]), sum(chain.weight[s[0]:s[1]]), -s[0]))
    off = [i for g in [*range(start), *range(end, n)] for i in groups.items[g]]
    where = _store(items.chain.weight, off, storage, reserve)
    if where is None:
        return None
    if end == start:  # no group fits an accelerator: the whole model on the CPU
        return Layout(_names(groups, [], gpus, start, where), dict(reserve))
    kept = _stages(_sub(chain, start, end), gpus, rooms, strategy)
    return Layout(_names(groups, kept, gpus, start, where), dict(reserve), executor="cpu")


def _names(groups: _Groups, kept: Sequence[Range | None], compute: Sequence[DeviceSpec], offset: int,
           where: Mapping[int, DeviceSpec]) -> tuple[str, ...]:
    """Device name per item: stored items where ``where`` says, kept groups ``offset +
    range`` on their computing device."""
    names = [""] * sum(len(g) for g in groups.items)
    for i, store in where.items():
        names[i] = store.name
    for device, span in zip(compute, kept):
        if span is not None:
            for g in range(offset + span[0], offset + span[1]):
                for i in groups.items[g]:
                    names[i] = device.name
    assert all(names), "every item is placed"
    return tuple(names)


def _assign(groups: _Groups, ranges: Sequence[Range | None], devices: Sequence[DeviceSpec],
            reserves: dict[str, int]) -> Layout:
    return Layout(_names(groups, ranges, devices, 0, {}), reserves)


def _does_not_fit(chain: Chain, compute: Sequence[DeviceSpec], storage: Sequence[DeviceSpec],
                  reserve: Mapping[str, int], extra: int, reason: str = "") -> PlanError:
    weights = sum(chain.weight)
    peak = max(chain.activation, default=0) if compute and compute[0].is_accelerator else 0
    tiers = ", ".join(f"{d.name} {format_bytes(room(d, reserve))}" for d in [*compute, *storage])
    available = sum(room(d, reserve) for d in [*compute, *storage])
    short = weights + peak + extra - available
    has_disk = any(kind_of(d).stores_only for d in storage)
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
    """Every item must have somewhere to run: an accelerator that holds its weights and
    activations, or the CPU, from its RAM or from disk (which needs no RAM).

    Raises:
        PlanError: an item fits nowhere; the message names it and the numbers
            (:mod:`automap.planning.splitting` adds the units it could not split, and why).
    """
    runners = [d for d in devices if kind_of(d).computes]
    if not runners:
        return
    has_disk = any(kind_of(d).stores_only for d in devices)
    for members, weight, act in zip(items.members, items.chain.weight, items.chain.activation):
        needs = {d.name: weight + (act if d.is_accelerator else 0) for d in runners}
        if any(needs[d.name] <= room(d, reserve) or (kind_of(d).is_host and has_disk) for d in runners):
            continue
        best = max(runners, key=lambda d: (room(d, reserve) - needs[d.name], -d.sort_key()[0]))
        names = [unit_label(profile.units[i].name) for i in members]
        first = f"unit {names[0]!r}" if profile.units[members[0]].name else names[0]
        what = first + (f" (tied to {names[1:]})" if len(names) > 1 else "")
        detail = (f" ({format_bytes(weight)} of weights + {format_bytes(act)} of activations)"
                  if best.is_accelerator else "")
        raise PlanError(
            f"{what} needs {format_bytes(needs[best.name])}{detail} but the largest device that can run it, "
            f"{best.name}, has {format_bytes(room(best, reserve))}; raise max_memory for one device, allow "
            "'cpu' and 'disk' in max_memory (the CPU then computes it), use a smaller batch or dtype, or let "
            "automap split it (no_split without its class)"
        )


def level_plans(profile: Profile, devices: tuple[DeviceSpec, ...], strategy: Strategy,
                reserve: Mapping[str, int]) -> list[Candidate]:
    """Every option for ``profile``, each built as a plan (``devices`` sorted, fastest first).

    Raises:
        PlanError: a unit fits nowhere, or the model does not fit.
    """
    cuts = all_cut_bytes(profile)
    items = make_items(profile, cuts)
    try:
        check_items_fit(profile, items, devices, reserve)
        options = layout_options(items, devices, strategy, reserve)
        if profile.total_kv_bytes:
            options = offloaded_kv_options(profile, items, devices, strategy, reserve, options)
    except PlanError as exc:
        raise _with_kv_note(exc, profile) from exc
    found = []
    for option in options:
        plan = build_plan(profile, devices, _unit_devices(items, option.layout, len(profile.units)), strategy.name,
                          option.layout.reserves, cuts, option.layout.notes, executor=option.layout.executor)
        found.append(Candidate(option.kind, plan))
    return found


def _with_kv_note(exc: PlanError, profile: Profile) -> PlanError:
    if not profile.total_kv_bytes or profile.generation is None:
        return exc
    g = profile.generation
    return PlanError(f"{exc} (the bytes counted as weights include the KV cache of {g.batch} x {g.max_length} "
                     f"tokens, {format_bytes(profile.total_kv_bytes)}; a smaller batch or max_length needs less)")


def _unit_devices(items: Items, placed: Layout, count: int) -> list[str]:
    placement = [""] * count
    for members, where in zip(items.members, placed.devices):
        for i in members:
            placement[i] = where
    return placement


def offloaded_kv_options(profile: Profile, items: Items, devices: Sequence[DeviceSpec], strategy: Strategy,
                         reserve: Mapping[str, int], options: Sequence[Option]) -> list[Option]:
    """Each option laid out again until the device that computes its offloaded units keeps room
    for their generation cache: they compute there, so their cache lives there, not in the
    tier their weights stream from (items count their cache as weight, which is right for
    resident ones and errs on the safe side for stored ones). Each round can only offload
    more, so a few rounds settle. An option whose kind no longer fits is dropped.

    Raises:
        PlanError: no option keeps room for the cache.
    """
    kept, error = [], None
    for k, option in enumerate(options):
        rank = sum(1 for o in options[:k] if o.kind == option.kind)  # CPU_COMPUTES comes twice
        try:
            kept.append(_kv_settled(profile, items, devices, strategy, reserve, option, rank))
        except PlanError as exc:
            error = exc
    if not kept:
        assert error is not None
        raise error
    return kept


def _kv_settled(profile: Profile, items: Items, devices: Sequence[DeviceSpec], strategy: Strategy,
                reserve: Mapping[str, int], option: Option, rank: int = 0) -> Option:
    extra: dict[str, int] = {}
    for _ in range(len(items.members) + 1):
        sketch = Plan(units=profile.units, devices=tuple(devices), strategy=strategy.name,
                      placement=tuple(_unit_devices(items, option.layout, len(profile.units))),
                      executor=option.layout.executor)
        need: dict[str, int] = {}
        for unit, where in zip(sketch.units, sketch.placement):
            if sketch.is_offloaded(where):
                compute = sketch.compute_device(where)
                need[compute] = need.get(compute, 0) + unit.kv_bytes
        if all(nbytes <= extra.get(name, 0) for name, nbytes in need.items()):
            break
        for name, nbytes in need.items():
            extra[name] = max(extra.get(name, 0), nbytes)
        again = layout_options(items, devices, strategy,
                               {name: reserve.get(name, 0) + extra.get(name, 0) for name in {*reserve, *extra}})
        alike = [o for o in again if o.kind == option.kind]
        same = alike[rank] if rank < len(alike) else None
        if same is None:
            raise PlanError(f"no {option.kind} layout keeps room for the generation cache of its offloaded units")
        option = same
    # The cache shows as the computing device's KV, not as a reserve.
    reserves = {name: nbytes - extra.get(name, 0) for name, nbytes in option.layout.reserves.items()}
    return replace(option, layout=replace(option.layout, reserves={k: v for k, v in reserves.items() if v}))


def build_plan(profile: Profile, devices: tuple[DeviceSpec, ...], placement: Sequence[str], strategy: str,
               reserves: Mapping[str, int], cuts: Sequence[int] | None = None,
               notes: Sequence[str] = (), origin: Origin = Origin.STRATEGY, executor: str = "") -> Plan:
    """Assemble a :class:`Plan` and the notes a user should read."""
    plan = Plan(units=profile.units, devices=devices, placement=tuple(placement), strategy=strategy, origin=origin,
                tie_groups=profile.tie_groups, cut_bytes=tuple(all_cut_bytes(profile) if cuts is None else cuts),
                example=profile.example, generation=profile.generation,
                reserves=tuple((d.name, int(reserves[d.name])) for d in devices if reserves.get(d.name)),
                executor=executor)
    found = list(notes)
    if plan.offloaded_units:
        count = len(plan.offloaded_units)
        found.append(f"{count} unit{'' if count == 1 else 's'} offloaded "
                     f"({format_bytes(sum(plan.bytes_on(d.name) for d in devices if plan.is_offloaded(d.name)))}), "
                     f"streamed to {plan.execution_device} when they run")
    if is_host_name(executor) and any(d.is_accelerator for d in devices):
        found.append("the CPU computes the units placed on 'cpu' (and streams those on 'disk'); accelerate and "
                     "from_pretrained read 'cpu' in a device_map as streamed to GPU 0 instead, so pass this Plan, "
                     "not its device_map, to automap.dispatch or automap.load")
    if not profile.example:
        found.append("no example inputs: balanced by bytes, not FLOPs")
    if profile.uncalled:
        found.append(f"{len(profile.uncalled)} unit{'' if len(profile.uncalled) == 1 else 's'} never called in the "
                     "traced forward: "
                     f"{', '.join(profile.uncalled[:3])}")
    return replace(plan, warnings=tuple(found))
