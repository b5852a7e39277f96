"""The built-in layout kinds, registered in the order they are tried (resident, packed, streamed,
CPU computes, experts apart; on the CPU alone: resident and streamed), and :func:`layout_options`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping, Sequence

from automap.devices import DeviceSpec
from automap.errors import PlanError
from automap.kinds import is_host_name, kind_of
from automap.planning.items import grouped, sub_chain
from automap.planning.layout_registry import (
    CPU_COMPUTES,
    EXPERTS,
    LAYOUT_KINDS,
    PACKED,
    RESIDENT,
    STREAMED,
    Layout,
    LayoutContext,
    LayoutKind,
    Option,
    register_layout,
    room,
)
from automap.planning.memory import runtime_bytes
from automap.planning.offloading import (
    MAX_OFFLOADED_HEAD,
    Offload,
    choose_offload,
    offload_seconds,
    store,
    store_staged,
)
from automap.planning.packing import pack_out_of_order
from automap.planning.partition import Chain, Range, fill
from automap.planning.residency import Room, keep_resident


@register_layout("resident on cpu")
class CpuResident(LayoutKind):
    """The CPU alone computes, and its RAM holds every item."""

    kind, exclusive = RESIDENT, True

    def fits(self, ctx: LayoutContext) -> bool:
        return not ctx.accelerated and sum(ctx.items.chain.weight) <= ctx.rooms[0]

    def build(self, ctx: LayoutContext) -> list[Layout]:
        return [Layout((ctx.compute[0].name,) * len(ctx.items.chain), dict(ctx.reserve))]


@register_layout("streamed on cpu")
class CpuStreamed(LayoutKind):
    """The CPU alone computes: RAM takes each item, in execution order, that still fits the
    budget; disk the rest. Disk items are memory-mapped views of the store: their pages are
    page cache, not RAM the budget bounds, so they need no staging room."""

    kind = STREAMED

    def fits(self, ctx: LayoutContext) -> bool:
        return not ctx.accelerated

    def build(self, ctx: LayoutContext) -> list[Layout]:
        n = len(ctx.items.chain)
        where = store(ctx.items.chain.weight, range(n), [ctx.compute[0], *ctx.storage], ctx.reserve)
        return [] if where is None else [Layout(tuple(where[i].name for i in range(n)), dict(ctx.reserve))]


@register_layout("resident")
class Resident(LayoutKind):
    """The accelerators hold every group, split over them by the strategy."""

    kind, exclusive = RESIDENT, True

    def fits(self, ctx: LayoutContext) -> bool:
        return ctx.accelerated and fill(ctx.groups.chain, ctx.rooms)[1] == len(ctx.groups.chain)

    def build(self, ctx: LayoutContext) -> list[Layout]:
        return [Layout(ctx.names(ctx.stages(ctx.groups.chain, ctx.rooms)), dict(ctx.reserve))]


@register_layout("packed")
class Packed(LayoutKind):
    """Groups packed on the accelerators out of execution order."""

    kind = PACKED

    def fits(self, ctx: LayoutContext) -> bool:
        return ctx.accelerated and len(ctx.compute) > 1

    def build(self, ctx: LayoutContext) -> list[Layout]:
        packed = pack_out_of_order(ctx.groups.chain, ctx.compute, ctx.rooms)
        if packed is None:
            return []
        owner, cuts = packed
        note = (
            f"no contiguous split fits the accelerators with room for activations; units run out of "
            f"order ({cuts} cuts for {len(ctx.compute)} devices)"
        )
        names = [ctx.compute[j].name for g, j in zip(ctx.groups.items, owner) for _ in g]
        return [Layout(tuple(names), dict(ctx.reserve), (note,))]


@register_layout("streamed")
class AcceleratorStreamed(LayoutKind):
    """Offloaded items in storage, streamed to the execution device; the kept groups split
    over the accelerators. Builds none when no accelerator can execute or storage overflows."""

    kind = STREAMED

    def fits(self, ctx: LayoutContext) -> bool:
        return ctx.accelerated and ctx.total_fits

    def build(self, ctx: LayoutContext) -> list[Layout]:
        chosen = choose_offload(ctx.groups.chain, ctx.groups.stream, ctx.rooms, ctx.strategy.light_first)
        if chosen is None:
            return []
        n = len(ctx.groups.chain)
        off = [i for g in [*range(chosen.head), *range(chosen.point, n)] for i in ctx.groups.items[g]]
        stored = store_staged(ctx.items.chain.weight, off, ctx.storage, ctx.reserve)
        if stored is None:
            return []
        where, staging = stored
        executor = ctx.compute[chosen.executor]
        base = offload_seconds(ctx.items.chain, where, executor)
        kept = ctx.stages(
            sub_chain(ctx.groups.chain, chosen.head, chosen.point),
            chosen.rooms(ctx.rooms),
            base,
            chosen.peak,
            chosen.executor,
        )
        names = resident_extras(ctx, ctx.names(kept, chosen.head, where), chosen, where)
        return [
            Layout(
                names,
                streamed_reserves(ctx, where, staging, executor),
                idle_note(ctx, names, executor),
                executor=_executor_name(ctx, names, executor),
            )
        ]


def streamed_reserves(
    ctx: LayoutContext, where: Mapping[int, DeviceSpec], staging: int, executor: DeviceSpec
) -> dict[str, int]:
    """The user's reserve, plus the streamed weights on the executor (the largest item still
    streamed, once GPUs with room keep some; the offloaded units' activations show as
    activations) and the pinned staging in CPU RAM for items read from disk."""
    weight = ctx.items.chain.weight
    reserves = dict(ctx.reserve)
    reserves[executor.name] = reserves.get(executor.name, 0) + max((weight[i] for i in where), default=0)
    staging = min(
        staging, max((weight[i] for i, d in where.items() if kind_of(d).staged_via_host), default=0)
    )
    if staging:
        host = next(d.name for d in ctx.storage if kind_of(d).is_host)
        reserves[host] = reserves.get(host, 0) + staging
    return reserves


def _executor_name(ctx: LayoutContext, names: Sequence[str], executor: DeviceSpec) -> str:
    """``executor``'s name, or ``""`` where it is the plan's default execution device: its
    first accelerator used."""
    default = next((d.name for d in ctx.compute if d.name in names), "cpu")
    return "" if executor.name == default else executor.name


def idle_note(ctx: LayoutContext, names: Sequence[str], executor: DeviceSpec) -> tuple[str, ...]:
    """The note on accelerators a streamed layout leaves empty, if any."""
    idle = [d.name for d in ctx.compute if d.name not in names and d is not executor]
    if not idle:
        return ()
    return (
        f"{', '.join(idle)} hold nothing while units stream to {executor.name}: each streamed unit is larger "
        f"than their room, or a piece of a unit whose other pieces compute on {executor.name}",
    )


def resident_extras(
    ctx: LayoutContext, names: tuple[str, ...], chosen: Offload, where: dict[int, DeviceSpec]
) -> tuple[str, ...]:
    """``names`` with the offloaded items that a GPU still has room for kept there
    (:mod:`automap.planning.residency`); ``where`` loses them."""
    chain, executor = ctx.items.chain, ctx.compute[chosen.executor]
    state = []
    for j, device in enumerate(ctx.compute):
        mine = [
            i for i, name in enumerate(names) if name == device.name or (device is executor and i in where)
        ]
        weights = sum(chain.weight[i] for i, name in enumerate(names) if name == device.name)
        peak = max(
            [chain.activation[i] for i in mine] + ([chosen.peak] if device is executor else []), default=0
        )
        streamed = chosen.streamed if device is executor else 0
        state.append(Room(ctx.rooms[j] - weights - peak - streamed, peak))
    piece = [False] * len(chain)
    for group in ctx.groups.items:
        for i in group:
            piece[i] = len(group) > 1
    kept = keep_resident(
        sorted(where), chain.weight, chain.activation, chain.cut, piece, state, chosen.executor
    )
    placed = list(names)
    for i, j in kept.items():
        placed[i] = ctx.compute[j].name
        del where[i]
    return tuple(placed)


@register_layout("cpu computes")
class CpuComputes(LayoutKind):
    """The accelerators keep the contiguous run of groups with the most work that fits them;
    the CPU computes the rest from RAM, or from disk (page cache, no budget). Also the whole
    model on the CPU, when the run could be a lone small unit whose cuts cost more than the
    accelerators save (the predicted times decide). None when the rest overflows RAM and disk."""

    kind = CPU_COMPUTES

    def fits(self, ctx: LayoutContext) -> bool:
        return ctx.accelerated and ctx.total_fits and ctx.host_stores

    def build(self, ctx: LayoutContext) -> list[Layout]:
        # The CPU's budget keeps room for the run of the units it computes (any of them: the
        # largest activations, and the runtime's overhead), which shows as its activations and
        # overhead (Plan.memory), not as a reserve.
        extra = {
            d.name: min(runtime_bytes(d, max(ctx.items.chain.activation, default=0)), room(d, ctx.reserve))
            for d in ctx.storage
            if kind_of(d).is_host
        }
        inner = ctx.with_reserve({**ctx.reserve, **{n: ctx.reserve.get(n, 0) + b for n, b in extra.items()}})
        return [
            replace(
                layout,
                reserves={n: b - extra.get(n, 0) for n, b in layout.reserves.items() if b - extra.get(n, 0)},
            )
            for layout in self._layouts(inner)
        ]

    def _layouts(self, ctx: LayoutContext) -> list[Layout]:
        run = cpu_computes_run(ctx)
        if run is None or not is_host_name(run.executor):
            return [run] if run is not None else []
        where = store(ctx.items.chain.weight, range(len(ctx.items.chain)), ctx.storage, ctx.reserve)
        alone = Layout(ctx.names([], 0, where), dict(ctx.reserve)) if where is not None else None
        return [run] + ([alone] if alone is not None else [])


def cpu_computes_run(ctx: LayoutContext) -> Layout | None:
    """:class:`CpuComputes`' run on the accelerators; None when the rest overflows RAM and disk."""
    chain, n = ctx.groups.chain, len(ctx.groups.chain)
    largest = max(ctx.rooms)
    # A run starts at the beginning, after a few leading groups, or after a group too large
    # for any accelerator (which the CPU computes).
    starts = sorted(
        {
            *range(min(MAX_OFFLOADED_HEAD, n - 1) + 1),
            *(i + 1 for i in range(n - 1) if chain.weight[i] + chain.activation[i] > largest),
        }
    )
    spans = [(a, fill(chain, ctx.rooms, a)[1]) for a in starts]
    start, end = max(
        spans, key=lambda s: (sum(chain.work[s[0] : s[1]]), sum(chain.weight[s[0] : s[1]]), -s[0])
    )
    off = [i for g in [*range(start), *range(end, n)] for i in ctx.groups.items[g]]
    where = store(ctx.items.chain.weight, off, ctx.storage, ctx.reserve)
    if where is None:
        return None
    if end == start:  # no group fits an accelerator: the whole model on the CPU
        return Layout(ctx.names([], start, where), dict(ctx.reserve))
    kept: list[Range | None] = ctx.stages(sub_chain(chain, start, end), ctx.rooms)
    return Layout(ctx.names(kept, start, where), dict(ctx.reserve), executor="cpu")


@register_layout("experts apart")
class ExpertsApart(LayoutKind):
    """Every layer's non-expert part on the accelerators, split by the strategy, with room on
    the first one to stream the largest experts unit; routed experts beside their layer while
    room lasts, the rest in CPU RAM, then on disk. Two layouts of one placement: the CPU
    computing the offloaded experts, and the first accelerator streaming them
    (:mod:`automap.planning.experts_choice` keeps the one the cost model picks)."""

    kind = EXPERTS

    def fits(self, ctx: LayoutContext) -> bool:
        return ctx.accelerated and any(ctx.items.routed) and ctx.total_fits and ctx.host_stores

    def build(self, ctx: LayoutContext) -> list[Layout]:
        chain, routed = ctx.items.chain, ctx.items.routed
        stream = max(w for w, r in zip(chain.weight, routed) if r)
        floor = max(a for a, r in zip(chain.activation, routed) if r)
        rest = grouped(replace(ctx.items, chain=without(chain, routed))).chain
        rooms = [r - stream if j == 0 else r for j, r in enumerate(ctx.rooms)]
        if fill(rest, rooms, floors=[floor])[1] < len(rest):
            return []
        names = list(ctx.names(ctx.stages(rest, rooms, floor=floor)))
        off = experts_beside(ctx, names, rooms, floor)
        stored = store_staged(chain.weight, off, ctx.storage, ctx.reserve)
        if stored is None:
            return []
        where, staging = stored
        for i, tier in where.items():
            names[i] = tier.name
        executor = ctx.compute[0]
        reserves = streamed_reserves(ctx, where, staging, executor)
        return [
            Layout(tuple(names), reserves, executor="cpu"),
            Layout(tuple(names), dict(reserves), executor=_executor_name(ctx, names, executor)),
        ]


def without(chain: Chain, routed: Sequence[bool]) -> Chain:
    """``chain`` with the routed experts' items weighing nothing (they are placed apart)."""

    def keep(values: Sequence[Any]) -> list[Any]:
        return [0 if r else v for v, r in zip(values, routed)]

    return Chain(keep(chain.work), keep(chain.weight), keep(chain.activation), chain.cut)


def experts_beside(ctx: LayoutContext, names: Sequence[str], rooms: Sequence[int], floor: int) -> list[int]:
    """Routed experts items kept beside their layer (on the accelerator ``names`` gives them)
    while its room lasts, in execution order; returns the others, to be stored."""
    chain, routed = ctx.items.chain, ctx.items.routed
    free = {}
    for j, device in enumerate(ctx.compute):
        mine = [i for i, n in enumerate(names) if n == device.name and not routed[i]]
        peak = max([chain.activation[i] for i in mine] + ([floor] if j == 0 else []), default=0)
        free[device.name] = rooms[j] - sum(chain.weight[i] for i in mine) - peak
    off = []
    for i, r in enumerate(routed):
        if r and chain.weight[i] <= free.get(names[i], 0):
            free[names[i]] -= chain.weight[i]
        elif r:
            off.append(i)
    return off


def layout_options(ctx: LayoutContext) -> list[Option]:
    """Every kind of layout that works for ``ctx`` (see the module docstring), in the order
    the kinds are registered.

    Raises:
        PlanError: nothing can run the model, or nothing fits.
    """
    if not ctx.compute:
        raise PlanError(
            f"nothing can run the model: the plan's devices are {[d.name for d in ctx.devices]}; "
            "add CPU memory (max_memory={'cpu': '16GiB', ...}) or a GPU"
        )
    options: list[Option] = []
    for kind in LAYOUT_KINDS.values():
        found = [Option(kind.kind, layout) for layout in kind.build(ctx)] if kind.fits(ctx) else []
        if found and kind.exclusive:
            return found
        options += found
    if not options:
        raise ctx.nothing_fits()
    return options
