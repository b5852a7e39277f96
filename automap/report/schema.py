"""The plan as JSON for scripts and CI: the plan's own keys, per-device summaries, cuts
and totals. Documented in ``docs/plan-schema.md``; keys are only ever added, never renamed."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from automap.planning import JSON_VERSION, Plan
from automap.errors import PlanError, ReportError
from automap.planning.model import unit_label
from automap.planning.plan_json import plan_from_value
from automap.planning.predict import bottleneck_seconds, forward_seconds
from automap.report.facts import Facts, facts_of
from automap.report.output import replace_whole
from automap.report.text import unit_ranges
from automap.userfiles import as_path, check_output_path, read_json_file

_REWRITE = (
    "give a plan JSON that automap.report.write_json(plan, path) or 'automap plan ... --json FILE' wrote"
)

if TYPE_CHECKING:
    from automap.planning import DeviceSummary


def plan_dict(plan: Plan) -> dict[str, Any]:
    """``plan`` as a JSON-ready dict, as documented in ``docs/plan-schema.md``: the plan's own
    keys (what :meth:`Plan.from_json` reads back), per-device summaries with what the report
    shows (headroom, units, ranges, ...), ``"totals"`` and ``"report_warnings"``. The one place
    the schema is written.

    Example:
        >>> data = plan_dict(plan)
        >>> data["device_map"]["model.layers.0"], data["totals"]["spill_bytes"]
        (0, 0)
    """
    facts = facts_of(plan)
    return {
        "version": JSON_VERSION,
        "strategy": plan.source,
        "origin": plan.origin.value,
        "example": plan.example,
        "execution_device": plan.execution_device,
        "offload_dir": plan.offload_dir,
        "device_map": plan.device_map,
        "devices": [_device_dict(plan, facts, row) for row in facts.rows],
        "bottleneck_seconds": bottleneck_seconds(plan),
        "forward_seconds": forward_seconds(plan),
        "cuts": [asdict(cut) for cut in facts.cuts],
        "units": [
            {**asdict(u), "device": p.home, "placement": p.as_dict()}
            for u, p in zip(plan.units, plan.placements)
        ],
        "tie_groups": [list(g) for g in plan.tie_groups],
        "cut_bytes": list(plan.cut_bytes),
        "warnings": list(plan.warnings),
        "choices": list(plan.choices),
        "reserves": {name: nbytes for name, nbytes in plan.reserves},
        "activation_peak_bytes": plan.activation_peak_bytes,
        "inference_peak_bytes": plan.inference_peak_bytes,
        "load_peak_bytes": plan.load_peak_bytes,
        "totals": _totals_dict(plan, facts),
        "report_warnings": list(facts.warnings),
        "generation": _generation_dict(plan, facts),
        "experts": plan.experts.as_dict() if plan.experts is not None else None,
    }


def _generation_dict(plan: Plan, facts: Facts) -> dict[str, Any] | None:
    """The planned generation (what :meth:`Plan.from_json` reads back) and, for the report,
    its predicted speed."""
    if plan.generation is None:
        return None
    decode = facts.decode
    speed: dict[str, Any] = {
        "decode_step_seconds": None,
        "decode_tokens_per_second": None,
        "decode_limit": None,
        "decode_summary": "",
        "decode_hint": "",
        "decode_steps": [],
    }
    if decode is not None:
        limit = decode.limit
        speed = {
            "decode_step_seconds": decode.step_seconds,
            "decode_tokens_per_second": decode.tokens_per_second,
            "decode_limit": asdict(limit) if limit is not None else None,
            "decode_summary": decode.describe(),
            "decode_hint": decode.hint,
            "decode_steps": [
                {"device": s.device, "seconds": s.seconds, "terms": [asdict(t) for t in s.terms]}
                for s in decode.steps
            ],
        }
    return {
        **asdict(plan.generation),
        "kv_bytes": facts.kv_bytes,
        "prefill_seconds": facts.forward_seconds,
        **speed,
    }


def _device_dict(plan: Plan, facts: Facts, row: DeviceSummary) -> dict[str, Any]:
    """One device: ``flops``/``flops_share``/``stage_seconds`` are of the units stored there
    (offloaded ones compute elsewhere: ``compute_device``); ``computed_flops``/
    ``computed_flops_share``/``compute_seconds`` are what the device itself computes (0 for a
    tier that only stores), as the text report's flops% and stage columns show."""
    capacity = row.device.capacity_bytes
    name = row.device.name
    return {
        **asdict(row.device),
        "map_value": row.device.map_value,
        "weight_bytes": row.weight_bytes,
        "activation_bytes": row.activation_bytes,
        "reserve_bytes": row.reserve_bytes,
        "kv_bytes": row.kv_bytes,
        "overhead_bytes": row.overhead_bytes,
        "used_bytes": row.used_bytes,
        "used_fraction": row.used_bytes / capacity if capacity else 0.0,
        "headroom_bytes": capacity - row.used_bytes,
        "flops": row.flops,
        "flops_share": row.flops_share,
        "stage_seconds": row.stage_seconds,
        "computed_flops": facts.computed_flops.get(name, 0),
        "computed_flops_share": facts.computed_share(name),
        "compute_seconds": facts.compute_seconds.get(name, 0.0),
        "offloaded": bool(row.units) and plan.placements.by_home[row.device.name].offloaded,
        "compute_device": plan.placements.by_home[row.device.name].compute,
        "units": list(row.units),
        "unit_ranges": unit_ranges([unit_label(n) for n in row.units]),
    }


def _totals_dict(plan: Plan, facts: Facts) -> dict[str, Any]:
    return {
        "units": len(plan.units),
        "weight_bytes": facts.weight_bytes,
        "kv_bytes": facts.kv_bytes,
        "flops": sum(u.flops for u in plan.units),
        "used_devices": list(facts.used_devices),
        "spill_bytes": facts.spill_bytes,
        "offloaded_units": list(plan.offloaded_units),
        "cut_bytes": sum(c.bytes for c in facts.cuts),
        "cut_seconds": facts.cut_seconds,
        "bottleneck_device": facts.bottleneck_device,
        "bottleneck_seconds": facts.bottleneck_seconds,
        "forward_seconds": facts.forward_seconds,
        "tied_splits": list(facts.tie_splits),
        "untraced_units": list(facts.untraced),
    }


def to_json(plan: Plan, indent: int | None = 2) -> str:
    """:func:`plan_dict` as JSON text."""
    return json.dumps(plan_dict(plan), indent=indent)


def check_json_path(path: str | Path) -> Path:
    """Return ``path`` if a plan JSON can be written there (:func:`~automap.userfiles.check_output_path`).

    Raises:
        ReportError: the folder is missing or not writable; the name is a folder, a link loop,
            too long.
    """
    return check_output_path(path, "plan JSON")


def write_json(plan: Plan, path: str | Path) -> Path:
    """Write :func:`to_json` to ``path`` and return it: whole or not at all (a file that was
    there stays as it was when the write fails).

    Raises:
        ReportError: the file cannot be written.
    """
    target = check_json_path(path)
    try:
        text = (to_json(plan) + "\n").encode()
        replace_whole(target, lambda file: file.write(text))
    except OSError as exc:
        raise ReportError(
            f"cannot write the plan JSON to {str(target)!r}: {exc.strerror or exc}; choose a writable path"
        ) from exc
    return target


def read_json(path: str | Path) -> Plan:
    """Read a plan written by :func:`write_json` (or :meth:`Plan.to_json`), through the one reader
    of files users name (:func:`~automap.userfiles.read_json_file`: no FIFO hangs, size-capped).

    Raises:
        PlanError: the path is missing, a folder, not a regular file, too large, not UTF-8
            JSON, or not a plan (the message names the path and the field).
    """
    source = as_path(path, "read_json path", PlanError)
    data = read_json_file(source, "plan JSON", hint=_REWRITE, error=PlanError)
    return plan_from_value(data)
