"""Numbers every rendering shares, derived once from a plan (nothing here is re-measured)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

from automap.planning.decode import DecodePrediction, predict_decode
from automap.planning.model import unit_label
from automap.planning.predict import (
    bottleneck_seconds,
    compute_seconds,
    cuts,
    forward_seconds,
    over_capacity_notes,
    summary,
    tie_split_notes,
)
from automap.sizes import format_bytes, format_seconds

if TYPE_CHECKING:
    from automap.planning import Cut, DeviceSummary, Plan
    from automap.profiling import Unit


@dataclass(frozen=True)
class Facts:
    """A plan's per-device summaries, cuts and totals, as the text, JSON and figure show them.

    Attributes:
        rows: one summary per device of the plan, fastest tier first.
        cuts: every boundary where consecutive units compute on different devices.
        weight_bytes: all the model's weight bytes.
        used_devices: devices holding at least one unit.
        has_accelerators: whether the plan could use any GPU-like device.
        spill_bytes: weight bytes placed off the accelerators when there are accelerators.
        bottleneck_device: the computing device with the most predicted seconds per forward
            (its own stage plus the offloaded stages it runs; "" when nothing is placed).
        bottleneck_seconds, forward_seconds: the plan's predictions.
        tie_splits: warnings for tied tensors whose units sit on different devices.
        warnings: the plan's own warnings, then what the report notices (units planned
            without a trace, split ties, overfull devices, a generation planned without a cache).
        untraced: units planned without a trace measuring them (``Unit.untraced``).
        decode: the predicted prefill and decode speed (None: not planned for a generation).
        computed_flops: FLOPs per forward each device computes: its own units' and, for the
            execution device, those of the offloaded units streamed to it. A tier that only
            stores (disk, or CPU RAM streaming to a GPU) computes nothing and has no entry.
        compute_seconds: predicted seconds per forward on each computing device
            (:meth:`Plan.compute_seconds`: its own stage plus the offloaded stages it runs).
    """

    rows: tuple[DeviceSummary, ...]
    cuts: tuple[Cut, ...]
    weight_bytes: int
    used_devices: tuple[str, ...]
    has_accelerators: bool
    spill_bytes: int
    bottleneck_device: str
    bottleneck_seconds: float
    forward_seconds: float
    tie_splits: tuple[str, ...]
    warnings: tuple[str, ...]
    untraced: tuple[str, ...] = ()
    decode: DecodePrediction | None = None
    computed_flops: dict[str, int] = field(default_factory=dict)
    compute_seconds: dict[str, float] = field(default_factory=dict)

    def computed_share(self, device: str) -> float:
        """The share of the model's FLOPs that ``device`` computes (0 for a storage tier)."""
        return self.computed_flops.get(device, 0) / max(sum(self.computed_flops.values()), 1)

    @property
    def kv_bytes(self) -> int:
        """The generation cache reserved over all devices."""
        return sum(r.kv_bytes for r in self.rows)

    @property
    def cut_seconds(self) -> float:
        """Predicted seconds per forward spent moving activations across the cuts."""
        return sum(c.seconds for c in self.cuts)


def facts_of(plan: Plan) -> Facts:
    """Collect what the renderers show about ``plan``."""
    rows = summary(plan)
    has_accelerators = any(d.is_accelerator for d in plan.devices)
    spill = sum(r.weight_bytes for r in rows if not r.device.is_accelerator) if has_accelerators else 0
    per_device = compute_seconds(plan)
    busiest = max(per_device, key=lambda name: per_device[name], default="")
    splits = tuple(tie_split_notes(plan))
    return Facts(
        rows=rows,
        cuts=cuts(plan),
        weight_bytes=sum(u.weight_bytes for u in plan.units),
        used_devices=plan.used_devices,
        has_accelerators=has_accelerators,
        spill_bytes=spill,
        bottleneck_device=busiest,
        bottleneck_seconds=bottleneck_seconds(plan),
        forward_seconds=forward_seconds(plan),
        tie_splits=splits,
        warnings=_warnings(plan, splits),
        untraced=tuple(u.name for u in plan.units if u.untraced),
        decode=predict_decode(plan),
        computed_flops=_computed_flops(plan),
        compute_seconds=per_device,
    )


def _computed_flops(plan: Plan) -> dict[str, int]:
    """FLOPs per computing device: units count where they compute, not where they are stored."""
    flops: dict[str, int] = {}
    for unit, placement in zip(plan.units, plan.placements):
        flops[placement.compute] = flops.get(placement.compute, 0) + unit.flops
    return flops


def unit_ranges(names: Sequence[str]) -> str:
    """Collapse consecutive numbered units into ranges; a name may carry a note after a space
    (``"model.layers.6 (mlp.experts)"``), which a run shares.

    Example:
        >>> unit_ranges(["model.embed_tokens", "model.layers.0", "model.layers.1", "model.layers.2"])
        'model.embed_tokens, model.layers.0-2'
    """
    parts: list[str] = []
    i = 0
    while i < len(names):
        name, note = _noted(names[i])
        stem, _, last = name.rpartition(".")
        j = i
        if last.isdigit():
            while j + 1 < len(names) and _next_in_run(names[j], names[j + 1], stem, note):
                j += 1
        parts.append(names[i] if j == i else f"{name}-{_noted(names[j])[0].rpartition('.')[2]}{note}")
        i = j + 1
    return ", ".join(parts)


def _noted(label: str) -> tuple[str, str]:
    """``("model.layers.6", " (mlp.experts)")`` from ``"model.layers.6 (mlp.experts)"``."""
    name, space, note = label.partition(" ")
    return name, space + note


def _next_in_run(current: str, candidate: str, stem: str, note: str = "") -> bool:
    (name, _), (cand, cand_note) = _noted(current), _noted(candidate)
    cand_stem, _, cand_last = cand.rpartition(".")
    return (
        cand_stem == stem
        and cand_note == note
        and cand_last.isdigit()
        and int(cand_last) == int(name.rpartition(".")[2]) + 1
    )


def layer_labels(plan: Plan, names: Sequence[str]) -> list[str]:
    """``names`` (the units on one device) as a person reads them when routed experts live
    apart from their layers: a layer whose pieces are all here by its name, its other pieces
    as ``"model.layers.6 (all but mlp.experts)"``, its experts as ``"model.layers.6
    (mlp.experts)"``; other units as they are."""
    if plan.experts is None:
        return list(names)
    apart = {layer.layer: layer.unit for layer in plan.experts.layers}
    origin = {u.name: u.split_from for u in plan.units}
    here, shown = set(names), []
    for name in names:
        layer = origin.get(name, "")
        if layer not in apart:
            shown.append(name)
            continue
        part = apart[layer][len(layer) + 1 :]
        whole = apart[layer] in here and any(origin.get(n) == layer and n != apart[layer] for n in here)
        label = (
            layer if whole else f"{layer} ({part})" if name == apart[layer] else f"{layer} (all but {part})"
        )
        if not shown or shown[-1] != label:
            shown.append(label)
    return shown


def device_notes(plan: Plan, row: DeviceSummary) -> list[str]:
    """Short remarks printed under a device's row (offloading, overflow)."""
    notes = []
    if row.units and plan.placements.by_home[row.device.name].offloaded:
        notes.append(
            f"stores only: weights stream to {plan.execution_device}, which computes their units "
            f"({format_seconds(row.stage_seconds)} of its stage)"
        )
    if row.over_capacity:
        notes.append(f"over capacity by {format_bytes(row.used_bytes - row.device.capacity_bytes)}")
    return notes


def untraced_notes(plan: Plan) -> list[str]:
    """One line per reason: which units were planned without a trace, why, and what stands
    in for their FLOPs."""
    by_reason: dict[str, list[Unit]] = {}
    for unit in plan.units:
        if unit.untraced:
            by_reason.setdefault(unit.untraced, []).append(unit)
    notes = []
    for reason, units in by_reason.items():
        if len(units) == len(plan.units):
            notes.append(f"all {len(units)} units planned without a trace, by their bytes ({reason})")
            continue
        flops = (
            "FLOPs estimated from their weight shapes"
            if any(u.flops_estimated for u in units)
            else "FLOPs unknown"
        )
        names = unit_ranges([unit_label(u.name) for u in units])
        notes.append(
            f"{'unit' if len(units) == 1 else 'units'} {names} planned without a trace ({reason}); {flops}"
        )
    return notes


def _warnings(plan: Plan, splits: tuple[str, ...]) -> tuple[str, ...]:
    """The plan's own warnings, then what the report notices (split ties, overfull devices, a
    generation without a cache) that the planner did not already say, in the same words: the
    notes come from one place."""
    notes = list(plan.warnings) + untraced_notes(plan)
    notes += [n for n in (*splits, *over_capacity_notes(plan)) if n not in notes]
    if plan.generation is not None:
        notes += [n for n in plan.generation.notes if n not in notes]
    return tuple(notes)
