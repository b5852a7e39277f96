"""The plan as text: a per-device table, the cuts, totals and warnings, in 80 columns."""

from __future__ import annotations

import textwrap
from typing import TYPE_CHECKING, Sequence

from automap.kinds import kind_of
from automap.planning.model import Origin, unit_label
from automap.planning.predict import forward_seconds, memory
from automap.report.facts import Facts, device_notes, facts_of, format_seconds, layer_labels, unit_ranges
from automap.sizes import format_bytes, format_rate

if TYPE_CHECKING:
    from automap.planning import Plan

WIDTH = 80
MAX_CUT_LINES = 12  # an interleaved (offloaded) plan can have dozens; the totals count them all


def _head(with_kv: bool) -> str:
    """The device table's header; with a planned generation, a KV column (the cache of the units
    computing there, part of "used"), the stage column one narrower to stay in 80 columns."""
    kv = f" {'kv':>10}" if with_kv else ""
    return (
        f"{'device':<8} {'kind':<5} {'capacity':>10} {'used':>10}{kv} {'use%':>5} {'headroom':>10} "
        f"{'flops%':>6} {'stage':>{_stage_width(with_kv)}}"
    )


def _stage_width(with_kv: bool) -> int:
    return 8 if with_kv else 9


def render_text(plan: Plan) -> str:
    """Render ``plan`` for an 80-column terminal.

    Per device: kind, capacity, bytes used (and of them the KV cache, for a plan made for a
    generation) and %, headroom, the share of the FLOPs it computes and its predicted stage
    time (offloaded units count on the device that computes them, not on the tier that stores
    them), and unit ranges; then every
    cut (units either side, bytes crossing, transfer time); then totals (bottleneck, predicted
    forward time), the generation (prefill time, decode tokens/s and its limit, a hint), the
    planner's choices (units split, the alternative kept by predicted time) and warnings.

    Example:
        >>> print(render_text(automap.plan(model, max_memory={0: "20GiB", 1: "20GiB"})))
    """
    facts = facts_of(plan)
    sections = [
        _header(plan, facts),
        _devices(plan, facts),
        _cuts(facts),
        _totals(facts),
        _generation(plan, facts),
        _experts(plan),
        _choices(plan),
        _figures(plan),
        _warnings(facts),
    ]
    return "\n\n".join(s for s in sections if s)


def render_line(plan: Plan) -> str:
    """``repr(plan)``: one line a person can read (the dataclass's own repr lists every unit):
    ``<Plan auto: 18 units, 44.63 MiB; cuda:0 17.74 MiB (8 units), cpu 26.89 MiB (10 units,
    streamed to cuda:0); predicted forward 1.92 ms>``."""
    table = plan.placements
    held = []
    for name in table.used_devices:
        count = sum(1 for d in plan.placement if d == name)
        route = f", streamed to {table.execution_device}" if table.by_home[name].offloaded else ""
        many = f"{count} unit{'' if count == 1 else 's'}"
        held.append(f"{name} {format_bytes(table.bytes_on[name])} ({many}{route})")
    weights = format_bytes(sum(table.weight_bytes))
    units = f"{len(plan.units)} unit{'' if len(plan.units) == 1 else 's'}"
    return (
        f"<Plan {plan.source or 'plan'}: {units}, {weights}; {', '.join(held) or 'nothing placed'}; "
        f"predicted forward {format_seconds(forward_seconds(plan))}>"
    )


def _wrap(text: str, indent: str = "", first: str = "") -> list[str]:
    return textwrap.wrap(
        text,
        WIDTH,
        initial_indent=first or indent,
        subsequent_indent=indent,
        break_on_hyphens=False,
        break_long_words=True,
    ) or [first.rstrip()]


def _header(plan: Plan, facts: Facts) -> str:
    actual = plan.origin is Origin.ACTUAL
    inputs = "the given example inputs" if plan.example == "given" else plan.example
    if not plan.example or len(facts.untraced) == len(plan.units):
        why = (
            "no unit traced"
            if plan.example
            else "no trace"
            if plan.origin is Origin.USER
            else "no example inputs"
        )
        how = (
            f"bytes only ({why})"
            if actual or plan.origin is Origin.USER
            else f"balanced by bytes only ({why})"
        )
    else:
        how = f"FLOPs counted at {inputs}" if actual else f"balanced by FLOPs at {inputs}"
    checked = sum(len(u.tensors) for u in plan.units)
    title = f"actual placement ({checked} tensors checked)" if actual else f"plan ({plan.source})"
    count = f"{len(plan.units)} unit{'' if len(plan.units) == 1 else 's'}"
    line = (
        f"automap {title}: {count}, {format_bytes(facts.weight_bytes)} of weights, "
        f"execution on {plan.execution_device}; {how}"
    )
    return "\n".join(_wrap(line))


def _devices(plan: Plan, facts: Facts) -> str:
    with_kv = plan.generation is not None
    lines = [_head(with_kv)]
    for s in facts.rows:
        cap = s.device.capacity_bytes
        pct = f"{100 * s.used_bytes / cap:.0f}%" if cap else "-"  # capacity 0: unknown (actual placement)
        headroom = format_bytes(cap - s.used_bytes) if cap else "-"
        computes = s.device.name in facts.compute_seconds
        stage = format_seconds(facts.compute_seconds[s.device.name]) if computes else "-"
        flops = f"{100 * facts.computed_share(s.device.name):.1f}%" if computes else "-"
        kv = f" {format_bytes(s.kv_bytes) if s.kv_bytes else '-':>10}" if with_kv else ""
        lines.append(
            f"{s.device.name:<8} {s.device.kind:<5} {format_bytes(cap):>10} {format_bytes(s.used_bytes):>10}"
            f"{kv} {pct:>5} {headroom:>10} {flops:>6} {stage:>{_stage_width(with_kv)}}"
        )
        for note in [*_memory_note(plan, s.device.name), *device_notes(plan, s)]:
            lines += _wrap(note, " " * 11, first=" " * 9 + "- ")
        span = (
            unit_ranges(layer_labels(plan, [unit_label(n) for n in s.units]))
            if s.units
            else "(nothing placed)"
        )
        lines += _wrap(span, " " * 16, first=" " * 9 + "units: ")
    return "\n".join(lines)


def _memory_note(plan: Plan, device: str) -> list[str]:
    """What makes up a computing device's predicted peak ("used"), as ``memory(plan)`` has it."""
    row = next(m for m in memory(plan) if m.device == device)
    if not (row.activations or row.overhead):
        return []
    parts = [
        (row.weights, "weights"),
        (row.cache, "cache"),
        (row.staging, "staging and reserve"),
        (row.activations, "activations"),
        (row.overhead, "runtime overhead"),
    ]
    return [
        f"peak {format_bytes(row.peak_bytes)} = "
        + " + ".join(f"{format_bytes(n)} {what}" for n, what in parts if n)
    ]


def _cuts(facts: Facts) -> str:
    if not facts.cuts:
        return "cuts: none (every unit computes on one device)"
    lines = [f"cuts ({len(facts.cuts)}): activations crossing between devices each forward"]
    for cut in facts.cuts[:MAX_CUT_LINES]:
        numbers = (
            f"  {cut.src_device:>7} -> {cut.dst_device:<7} {format_bytes(cut.bytes):>10} "
            f"{format_seconds(cut.seconds):>9}  "
        )
        lines += _wrap(
            f"{unit_label(cut.before)} | {unit_label(cut.after)}", " " * len(numbers), first=numbers
        )
    hidden = facts.cuts[MAX_CUT_LINES:]
    if hidden:
        lines.append(
            f"  ... and {len(hidden)} more, {format_bytes(sum(c.bytes for c in hidden))} "
            f"in {format_seconds(sum(c.seconds for c in hidden))}"
        )
    return "\n".join(lines)


def _totals(facts: Facts) -> str:
    used = ", ".join(facts.used_devices) or "none"
    text = [
        f"weights {format_bytes(facts.weight_bytes)} on {used}",
        f"spilled off the accelerators {format_bytes(facts.spill_bytes)}" if facts.has_accelerators else "",
        f"bottleneck {facts.bottleneck_device or '-'} at {format_seconds(facts.bottleneck_seconds)} per forward",
        f"predicted forward {format_seconds(facts.forward_seconds)} "
        f"({format_seconds(facts.cut_seconds)} of it in transfers)",
    ]
    return "\n".join(_wrap("; ".join(t for t in text if t) + ".", " " * 8, first="totals: "))


def _generation(plan: Plan, facts: Facts) -> str:
    generation, decode = plan.generation, facts.decode
    if generation is None:
        return ""
    prompt = (
        f"encoder input {generation.encoder_length} tokens"
        if generation.encoder_length
        else f"prompt {generation.prompt_length}"
    )
    cache = (
        f"{format_bytes(facts.kv_bytes)} of {generation.cache} on "
        f"{', '.join(r.device.name for r in facts.rows if r.kv_bytes)}"
        if facts.kv_bytes
        else "no cache reserved"
    )
    if decode is None:
        return "\n".join(
            _wrap(
                f"{generation.batch} x {generation.max_length:,} tokens; {cache}; no decode "
                "prediction (see warnings).",
                " " * 12,
                first="generation: ",
            )
        )
    text = (
        f"{generation.batch} x {generation.max_length:,} tokens ({prompt}); {cache}; prefill "
        f"~{format_seconds(decode.prefill_seconds)}; {decode.describe()}."
    )
    lines = _wrap(text, " " * 12, first="generation: ")
    if decode.hint:
        lines += _wrap(decode.hint + ".", " " * 12, first="      hint: ")
    return "\n".join(lines)


def _experts(plan: Plan) -> str:
    """Per layer, where its routed experts live apart from it and how they run at the decode
    step and at the prefill (``automap.planning.experts``), and the decode rate against the
    best whole-layer plan's; nothing when layers stay whole."""
    record = plan.experts
    if record is None:
        return ""
    head = (
        f"routed experts apart from their layers: predicted decode "
        f"{format_rate(record.tokens_per_second, 'tokens')} against "
        f"{format_rate(record.whole_layer_tokens_per_second, 'tokens')} for the best whole-layer plan; "
        f"modes at the decode step ({record.decode_tokens} token{'' if record.decode_tokens == 1 else 's'}) "
        f"and the prefill ({record.prefill_tokens} tokens):"
    )
    lines = _wrap(head)
    lines.append(f"  {'layer':<22} {'experts on':<10} {'decode':<13} {'prefill':<13} streamed from")
    for layer in record.layers:
        crossing = (
            f"{layer.stream_from:,} token{'' if layer.stream_from == 1 else 's'}"
            if layer.stream_from
            else "-"
        )
        lines.append(
            f"  {unit_label(layer.layer):<22} {layer.home:<10} {layer.decode.value:<13} "
            f"{layer.prefill.value:<13} {crossing}"
        )
    return "\n".join(lines)


# A device's figures as the report names them.
_FIGURE_NAMES = {
    "capacity_bytes": "free space",
    "flops_per_second": "compute",
    "link_bytes_per_second": "link",
    "memory_bytes_per_second": "memory",
}


# A tier that only stores is read: its link and memory figures are both its read rate.
_STORE_FIGURE_NAMES = {
    **_FIGURE_NAMES,
    "link_bytes_per_second": "read rate",
    "memory_bytes_per_second": "read rate",
}


def _figures(plan: Plan) -> str:
    """Which of each device's figures were measured on this machine; the rest are assumed
    (the kind's defaults, or given: max_memory, speeds, links, bandwidths)."""
    parts = []
    for device in plan.devices:
        names = _FIGURE_NAMES if not kind_of(device).stores_only else _STORE_FIGURE_NAMES
        measured = list(dict.fromkeys(names[f] for f in device.measured if f in names))
        parts.append(f"{device.name} {', '.join(measured)}" if measured else f"{device.name} none")
    text = (
        "measured here: " + "; ".join(parts) + ". Other figures are assumed (defaults or given); "
        "'automap calibrate' measures again."
    )
    return "\n".join(_wrap(text, " " * 9, first="figures: "))


def _choices(plan: Plan) -> str:
    """What the planner split and chose, and why (nothing when it had nothing to choose)."""
    return _bullets("choices", plan.choices) if plan.choices else ""


def _warnings(facts: Facts) -> str:
    return _bullets("warnings", facts.warnings) if facts.warnings else "warnings: none"


def _bullets(title: str, notes: Sequence[str]) -> str:
    lines = [f"{title}:"]
    for note in notes:
        lines += _wrap(note, "    ", first="  - ")
    return "\n".join(lines)
