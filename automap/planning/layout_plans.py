"""One profile's plans: every layout that works, with room for the generation cache, as a plan.

:func:`level_plans` turns a profile into items (:mod:`automap.planning.items`), checks that each
has somewhere to run, asks the registered layout kinds (:mod:`automap.planning.layout_kinds`)
for every layout that works, makes room for the generation cache of offloaded units where they
compute, and builds each layout as a :class:`Plan` (:func:`build_plan`, also used for user maps);
:mod:`automap.planning.splitting` keeps the one with the smallest predicted forward time.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping, Sequence

from automap.devices import DeviceSpec
from automap.errors import PlanError, RuntimeBudgetError
from automap.kinds import is_host_name, kind_of
from automap.planning.items import Items, all_cut_bytes, make_items
from automap.planning.layout_kinds import layout_options
from automap.planning.layout_registry import Layout, LayoutContext, Option, room
from automap.planning.memory import runtime_bytes
from automap.planning.model import Origin, Plan, PlanInputs, Provenance, unit_label
from automap.planning.strategies import Strategy
from automap.profiling import Profile
from automap.sizes import format_bytes

__all__ = [
    "Candidate",
    "all_cut_bytes",
    "build_plan",
    "check_items_fit",
    "level_plans",
    "make_items",
    "offloaded_kv_options",
]


@dataclass(frozen=True)
class Candidate:
    """An option built as a plan."""

    kind: str
    plan: Plan


def check_items_fit(
    profile: Profile, items: Items, devices: Sequence[DeviceSpec], reserve: Mapping[str, int]
) -> None:
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
        detail = (
            f" ({format_bytes(weight)} of weights + {format_bytes(act)} of activations)"
            if best.is_accelerator
            else ""
        )
        raise PlanError(
            f"{what} needs {format_bytes(needs[best.name])}{detail} but the largest device that can run it, "
            f"{best.name}, has {format_bytes(room(best, reserve))}; raise max_memory for one device, allow "
            "'cpu' and 'disk' in max_memory (the CPU then computes it), use a smaller batch or dtype, or let "
            "automap split it (no_split without its class)"
        )


def level_plans(
    profile: Profile, devices: tuple[DeviceSpec, ...], strategy: Strategy, reserve: Mapping[str, int]
) -> list[Candidate]:
    """Every option for ``profile``, each built as a plan (``devices`` sorted, fastest first).

    Raises:
        PlanError: a unit fits nowhere, or the model does not fit.
    """
    cuts = all_cut_bytes(profile)
    items = make_items(profile, cuts)
    runtime = runtime_room(profile, devices, reserve)
    try:
        check_runtime_fits(profile, devices, reserve)
        placing = {**reserve, **{name: reserve.get(name, 0) + nbytes for name, nbytes in runtime.items()}}
        check_items_fit(profile, items, devices, placing)
        ctx = LayoutContext.of(items, devices, strategy, placing)
        options = layout_options(ctx)
        if profile.total_kv_bytes:
            options = offloaded_kv_options(profile, ctx, options)
    except PlanError as exc:
        raise _with_runtime_note(_with_kv_note(exc, profile), runtime) from exc
    # The runtime's room shows as the device's activations and overhead (Plan.memory), not as a reserve.
    options = [_less_reserve(option, runtime) for option in options]
    found = []
    for option in options:
        plan = build_plan(
            profile,
            devices,
            _unit_devices(items, option.layout, len(profile.units)),
            strategy.name,
            option.layout.reserves,
            cuts,
            option.layout.notes,
            executor=option.layout.executor,
        )
        found.append(Candidate(option.kind, plan))
    return found


def cpu_activations(profile: Profile, devices: Sequence[DeviceSpec]) -> int:
    """The activation peak the CPU holds when it computes the whole model (no accelerator in the
    plan); 0 otherwise."""
    if any(d.is_accelerator for d in devices):
        return 0
    return max([profile.run_peak_bytes, *(u.peak_activation_bytes for u in profile.units)])


def runtime_room(
    profile: Profile, devices: Sequence[DeviceSpec], reserve: Mapping[str, int]
) -> dict[str, int]:
    """Bytes of the CPU's budget kept from weights where it computes the whole model: the
    forward's activation peak (none known where the forward was not traced) and the runtime's
    overhead (:mod:`automap.planning.memory`), as much of them as the budget holds (a budget below them keeps no weight in RAM, and the plan
    says it goes over: ``Plan.memory()``, the report's warnings)."""
    if any(d.is_accelerator for d in devices):
        return {}
    # An untraced forward has no activation figures, but the runtime's own overhead still counts.
    activations = cpu_activations(profile, devices)
    transient = min(activations, profile.forward_peak_bytes or activations)
    return {
        d.name: min(runtime_bytes(d, activations, transient), room(d, reserve))
        for d in devices
        if kind_of(d).is_host
    }


def check_runtime_fits(profile: Profile, devices: Sequence[DeviceSpec], reserve: Mapping[str, int]) -> None:
    """A CPU budget given for the CPU that computes must hold at least one unit's activations.
    A budget between that and what the run needs (:func:`runtime_room`) keeps no weight in RAM
    and the plan says the run goes over it (``Plan.memory()``, the report's warnings); a budget
    of 0 is accelerate's reading, no weights in RAM, and is not refused either.

    Raises:
        RuntimeBudgetError: a budget smaller than one unit's activations, with the numbers.
    """
    activations = cpu_activations(profile, devices)
    one_unit = max((u.peak_activation_bytes for u in profile.units), default=0)
    for device in devices:
        if not activations or not kind_of(device).is_host:
            continue
        need = runtime_bytes(device, activations, min(activations, profile.forward_peak_bytes or activations))
        if 0 < room(device, reserve) < one_unit:
            raise RuntimeBudgetError(
                f"{device.name} computes {profile.model_name} and needs {format_bytes(need)} while it runs "
                f"({format_bytes(activations)} of activations at the planned inputs, {profile.example or 'unknown'}, "
                f"+ {format_bytes(need - activations)} of runtime overhead) before any weight, but its budget is "
                f"{format_bytes(room(device, reserve))}; raise max_memory[{device.map_value!r}] to at least "
                f"{format_bytes(need + reserve.get(device.name, 0))} (it cannot hold even one unit's "
                f"{format_bytes(one_unit)}), or plan a smaller batch or sequence"
            )


def _with_runtime_note(exc: PlanError, runtime: Mapping[str, int]) -> PlanError:
    if not any(runtime.values()) or isinstance(exc, RuntimeBudgetError):
        return exc
    kept = ", ".join(f"{name} {format_bytes(nbytes)}" for name, nbytes in runtime.items())
    return PlanError(
        f"{exc} (the budgets above are what is left after the forward's activations and the runtime's "
        f"overhead where the CPU computes: {kept})"
    )


def _less_reserve(option: Option, extra: Mapping[str, int]) -> Option:
    if not extra:
        return option
    reserves = {name: nbytes - extra.get(name, 0) for name, nbytes in option.layout.reserves.items()}
    return replace(
        option, layout=replace(option.layout, reserves={k: v for k, v in reserves.items() if v > 0})
    )


def _with_kv_note(exc: PlanError, profile: Profile) -> PlanError:
    if not profile.total_kv_bytes or profile.generation is None or isinstance(exc, RuntimeBudgetError):
        return exc  # the run's bytes come before any weight or cache
    g = profile.generation
    return PlanError(
        f"{exc} (the bytes counted as weights include the KV cache of {g.batch} x {g.max_length} "
        f"tokens, {format_bytes(profile.total_kv_bytes)}; a smaller batch or max_length needs less)"
    )


def _unit_devices(items: Items, placed: Layout, count: int) -> list[str]:
    placement = [""] * count
    for members, where in zip(items.members, placed.devices):
        for i in members:
            placement[i] = where
    return placement


def offloaded_kv_options(profile: Profile, ctx: LayoutContext, options: Sequence[Option]) -> list[Option]:
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
            kept.append(_kv_settled(profile, ctx, option, rank))
        except PlanError as exc:
            error = exc
    if not kept:
        assert error is not None
        raise error
    return kept


def _offloaded_kv(profile: Profile, ctx: LayoutContext, layout: Layout) -> dict[str, int]:
    """Bytes of generation cache per device that computes ``layout``'s offloaded units."""
    sketch = Plan(
        units=profile.units,
        devices=ctx.devices,
        provenance=Provenance(ctx.strategy.name),
        placement=tuple(_unit_devices(ctx.items, layout, len(profile.units))),
        executor=layout.executor,
    )
    need: dict[str, int] = {}
    for unit, where in zip(sketch.units, sketch.placement):
        if sketch.placements.by_home[where].offloaded:
            compute = sketch.placements.by_home[where].compute
            need[compute] = need.get(compute, 0) + unit.kv_bytes
    return need


def _kv_settled(profile: Profile, ctx: LayoutContext, option: Option, rank: int = 0) -> Option:
    """``option`` laid out again (the ``rank``-th option of its kind) with the generation cache
    of its offloaded units reserved where they compute, until that room suffices."""
    extra: dict[str, int] = {}
    for _ in range(len(ctx.items.members) + 1):
        need = _offloaded_kv(profile, ctx, option.layout)
        if all(nbytes <= extra.get(name, 0) for name, nbytes in need.items()):
            break
        for name, nbytes in need.items():
            extra[name] = max(extra.get(name, 0), nbytes)
        reserve = {name: ctx.reserve.get(name, 0) + extra.get(name, 0) for name in {*ctx.reserve, *extra}}
        alike = [o for o in layout_options(ctx.with_reserve(reserve)) if o.kind == option.kind]
        if rank >= len(alike):
            raise PlanError(
                f"no {option.kind} layout keeps room for the generation cache of its offloaded units"
            )
        option = alike[rank]
    # The cache shows as the computing device's KV, not as a reserve.
    reserves = {name: nbytes - extra.get(name, 0) for name, nbytes in option.layout.reserves.items()}
    return replace(option, layout=replace(option.layout, reserves={k: v for k, v in reserves.items() if v}))


def build_plan(
    profile: Profile,
    devices: tuple[DeviceSpec, ...],
    placement: Sequence[str],
    strategy: str,
    reserves: Mapping[str, int],
    cuts: Sequence[int] | None = None,
    notes: Sequence[str] = (),
    origin: Origin = Origin.STRATEGY,
    executor: str = "",
) -> Plan:
    """Assemble a :class:`Plan` and the notes a user should read."""
    inputs = PlanInputs(
        tie_groups=profile.tie_groups,
        cut_bytes=tuple(all_cut_bytes(profile) if cuts is None else cuts),
        example=profile.example,
        generation=profile.generation,
        reserves=tuple((d.name, int(reserves[d.name])) for d in devices if reserves.get(d.name)),
        activation_peak_bytes=profile.run_peak_bytes,
        inference_peak_bytes=profile.forward_peak_bytes,
    )
    plan = Plan(
        units=profile.units,
        devices=devices,
        placement=tuple(placement),
        provenance=Provenance(strategy, origin),
        inputs=inputs,
        executor=executor,
    )
    found = list(notes)
    if plan.offloaded_units:
        count = len(plan.offloaded_units)
        found.append(
            f"{count} unit{'' if count == 1 else 's'} offloaded "
            f"({format_bytes(plan.placements.offloaded_bytes)}), "
            f"streamed to {plan.execution_device} when they run"
        )
    if is_host_name(executor) and any(d.is_accelerator for d in devices):
        found.append(
            "the CPU computes the units placed on 'cpu' (and streams those on 'disk'); accelerate and "
            "from_pretrained read 'cpu' in a device_map as streamed to GPU 0 instead, so pass this Plan, "
            "not its device_map, to automap.dispatch or automap.load"
        )
    if not profile.example:
        found.append("no example inputs: balanced by bytes, not FLOPs")
    if profile.uncalled:
        found.append(
            f"{len(profile.uncalled)} unit{'' if len(profile.uncalled) == 1 else 's'} never called in the "
            "traced forward: "
            f"{', '.join(profile.uncalled[:3])}"
        )
    return replace(plan, provenance=replace(plan.provenance, warnings=tuple(found)))
