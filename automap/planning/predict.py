"""A plan's predicted times, as free functions of a :class:`~automap.planning.model.Plan`: its
cuts, per-device rows, compute per device, bottleneck, hooks' overhead and forward, built from
:mod:`automap.planning.cost`'s formulas; and the notes that read them.

Each result is computed once per plan (a plan is frozen) and kept while the plan lives.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, TypeVar

from automap.kinds import kind_of
from automap.planning.cost import (
    hook_calls,
    hooks_seconds,
    overlapped_seconds,
    stage_seconds,
    transfer_seconds,
    work_seconds,
)
from automap.planning.memory import DeviceMemory, device_memory
from automap.planning.model import Cut, DeviceSummary, Plan
from automap.profiling.units import longest_prefix
from automap.sizes import format_bytes, format_seconds

T = TypeVar("T")
_KEPT: dict[tuple[int, str], Any] = {}


def _once(plan: Plan, what: str, build: Callable[[Plan], T]) -> T:
    """``build(plan)``, computed on the first call for this plan and kept until it is collected."""
    key = (id(plan), what)
    try:
        return _KEPT[key]
    except KeyError:
        pass
    value = _KEPT[key] = build(plan)
    weakref.finalize(plan, _KEPT.pop, key, None)
    return value


def link_seconds(plan: Plan, nbytes: int, src: str, dst: str) -> float:
    """Predicted time to move ``nbytes`` between two of the plan's devices (the slower link bounds it)."""
    if src == dst or nbytes == 0:
        return 0.0
    return transfer_seconds(nbytes, plan.device(src), plan.device(dst))


def cuts(plan: Plan) -> tuple[Cut, ...]:
    """Every boundary where consecutive units compute on different devices."""
    return _once(plan, "cuts", _cuts)


def _cuts(plan: Plan) -> tuple[Cut, ...]:
    result = []
    rows = plan.placements.rows
    for i in range(1, len(plan.units)):
        src, dst = rows[i - 1].compute, rows[i].compute
        if src != dst:
            nbytes = plan.cut_bytes[i] if i < len(plan.cut_bytes) else plan.units[i - 1].output_bytes
            result.append(
                Cut(
                    plan.units[i - 1].name,
                    plan.units[i].name,
                    src,
                    dst,
                    nbytes,
                    link_seconds(plan, nbytes, src, dst),
                )
            )
    return tuple(result)


def memory(plan: Plan) -> tuple[DeviceMemory, ...]:
    """Per device, the predicted peak memory of a run and what makes it up: weights, cache,
    staging, activations, the runtime's overhead (:mod:`automap.planning.memory`)."""
    return _once(plan, "memory", device_memory)


def summary(plan: Plan) -> tuple[DeviceSummary, ...]:
    """Per device: units, bytes, FLOPs share and predicted stage time (compute there, plus
    streaming of offloaded weights, plus the transfers into it). Activations, the runtime's
    overhead and the generation cache count where units compute (offloaded ones' on the
    execution device), the CPU included (:func:`memory`)."""
    return _once(plan, "summary", _summary)


def _summary(plan: Plan) -> tuple[DeviceSummary, ...]:
    total_flops = sum(u.flops for u in plan.units) or 1
    incoming: dict[str, float] = {}
    for cut in cuts(plan):
        incoming[cut.dst_device] = incoming.get(cut.dst_device, 0.0) + cut.seconds
    table = plan.placements
    held = {row.device: row for row in memory(plan)}
    rows = []
    for device in plan.devices:
        units = [u for u, d in zip(plan.units, plan.placement) if d == device.name]
        flops = sum(u.flops for u in units)
        weights = sum(u.weight_bytes for u in units)
        placed = table.by_home[device.name]
        compute = plan.device(placed.compute)
        streamed = link_seconds(plan, weights, device.name, compute.name) if placed.offloaded else 0.0
        seconds = stage_seconds(
            work_seconds(flops, sum(u.ops for u in units), compute),
            streamed,
            incoming.get(device.name, 0.0) if units else 0.0,
        )
        mem = held[device.name]  # activations and overhead count where the device computes
        rows.append(
            DeviceSummary(
                device,
                tuple(u.name for u in units),
                weights,
                mem.activations,
                mem.staging,
                flops,
                flops / total_flops,
                seconds,
                mem.cache,
                mem.overhead,
            )
        )
    return tuple(rows)


def compute_seconds(plan: Plan) -> dict[str, float]:
    """Predicted seconds per forward on each computing device: its own stage plus the
    offloaded stages it runs."""
    totals: dict[str, float] = {}
    by_home = plan.placements.by_home
    for row in summary(plan):
        if row.units:
            where = by_home[row.device.name].compute
            totals[where] = totals.get(where, 0.0) + row.stage_seconds
    return totals


def bottleneck_seconds(plan: Plan) -> float:
    """The busiest computing device's predicted time per forward: the steady-state period
    of a pipeline over the plan's stages."""
    return max(compute_seconds(plan).values(), default=0.0)


def hook_seconds(plan: Plan) -> float:
    """Predicted overhead of automap's hooks per forward: none when the whole model
    computes on one device with nothing streamed (dispatch hooks nothing then), else
    :func:`~automap.planning.cost.hooks_seconds` of every unit's hook calls."""
    placements = plan.placements
    if len({p.compute for p in placements}) <= 1 and not any(p.offloaded for p in placements):
        return 0.0
    return hooks_seconds(sum(hook_calls(u.calls, p.offloaded) for u, p in zip(plan.units, placements)))


def forward_seconds(plan: Plan) -> float:
    """Predicted time of one unpipelined forward: every unit in turn, each after the
    activations it receives, with offloaded weights read ahead while earlier units compute
    (:func:`~automap.planning.cost.overlapped_seconds`), plus the hooks' overhead
    (:func:`hook_seconds`). At most the sum of the stages (:func:`summary`)."""
    return _once(plan, "forward", lambda p: _unit_timeline(p) + hook_seconds(p))


def _unit_timeline(plan: Plan) -> float:
    incoming = [0.0] * len(plan.units)
    names = {u.name: i for i, u in enumerate(plan.units)}
    for cut in cuts(plan):
        incoming[names[cut.after]] += cut.seconds
    computes, reads = [], []
    for i, (unit, row) in enumerate(zip(plan.units, plan.placements.rows)):
        device = plan.device(row.compute)
        computes.append(work_seconds(unit.flops, unit.ops, device) + incoming[i])
        reads.append(link_seconds(plan, unit.weight_bytes, row.home, row.compute) if row.offloaded else 0.0)
        if row.offloaded and kind_of(device).is_host and not device.spare_cores:
            # torch's threads fill the cores: the read's CPU time is taken from the compute
            computes[-1] += unit.weight_bytes * plan.device(row.home).read_cpu_seconds_per_byte
    ahead = kind_of(plan.execution_device).read_ahead
    return overlapped_seconds(computes, reads, ahead)


# ------------------------------------------------------------------ notes on a plan (one home each)


def over_capacity_notes(plan: Plan) -> list[str]:
    """A warning per device that holds more than its budget (its units, or the run of the units
    it computes: their activations and the runtime's overhead)."""
    return [
        f"{row.device.name} holds {format_bytes(row.used_bytes)} but its budget is "
        f"{format_bytes(row.device.capacity_bytes)}; it may run out of memory"
        for row in summary(plan)
        if (row.units or row.activation_bytes) and row.over_capacity
    ]


def tie_split_notes(plan: Plan) -> list[str]:
    """A warning per group of tied names whose units sit on different devices, with the bytes
    that cross each forward and their cost."""
    where = {u.name: d for u, d in zip(plan.units, plan.placement)}
    owner = {t: u for u in plan.units for t in u.tensors}
    notes = []
    for group in plan.tie_groups:
        held = {name: longest_prefix(where, name.rpartition(".")[0]) for name in group}
        devices = sorted({d for d in held.values() if d is not None})
        if len(devices) < 2:
            continue
        unit = next((owner[n] for n in group if n in owner), None)
        nbytes = (
            unit.weight_bytes if unit is not None else 0
        )  # Unit keeps no per-tensor sizes: an upper bound
        seconds = link_seconds(plan, nbytes, devices[0], devices[1])
        places = ", ".join(f"{name} on {device}" for name, device in held.items())
        notes.append(
            f"tied weights split: {places} share one tensor; up to {format_bytes(nbytes)} cross devices "
            f"each forward (~{format_seconds(seconds)}); map their units to one device to avoid it"
        )
    return notes
