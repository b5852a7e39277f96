"""Rendering a :class:`~automap.plan.Plan`: an 80-column text table."""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from automap.units import format_bytes

if TYPE_CHECKING:
    from automap.plan import Plan


def unit_ranges(names: Sequence[str]) -> str:
    """Collapse ``model.layers.0 ... model.layers.19`` into ``model.layers.0-19``."""
    parts: list[str] = []
    i = 0
    while i < len(names):
        stem, _, last = names[i].rpartition(".")
        j = i
        if last.isdigit():
            while (j + 1 < len(names) and names[j + 1].rpartition(".")[0] == stem
                   and names[j + 1].rpartition(".")[2] == str(int(names[j].rpartition(".")[2]) + 1)):
                j += 1
        parts.append(names[i] if j == i else f"{names[i]}-{names[j].rpartition('.')[2]}")
        i = j + 1
    return ", ".join(parts)


def render_text(plan: Plan) -> str:
    """Per device: capacity, bytes used, FLOPs share and unit range; then notes."""
    total_flops = sum(u.flops for u in plan.units) or 1
    lines = [f"automap plan ({plan.strategy}), execution on {plan.execution_device}",
             f"{'device':<8} {'capacity':>11} {'used':>11} {'use%':>5} {'flops%':>6}  units"]
    for device in plan.devices:
        names = [u.name or "<model>" for u, d in zip(plan.units, plan.placement) if d == device.name]
        used = plan.bytes_on(device.name)
        pct = 100 * used / device.capacity_bytes if device.capacity_bytes else 0.0
        share = 100 * plan.flops_on(device.name) / total_flops
        span = unit_ranges(names) if names else "-"
        if len(span) > 34:
            span = span[:31] + "..."
        lines.append(f"{device.name:<8} {format_bytes(device.capacity_bytes):>11} {format_bytes(used):>11} "
                     f"{pct:>4.0f}% {share:>5.1f}%  {span}")
    total = sum(u.weight_bytes for u in plan.units)
    lines.append(f"total {format_bytes(total)} in {len(plan.units)} units")
    lines += [f"note: {w}" for w in plan.warnings]
    return "\n".join(lines)
