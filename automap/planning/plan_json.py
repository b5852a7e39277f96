"""Reading a :class:`~automap.planning.model.Plan` back from the JSON :meth:`Plan.to_json` wrote
(docs/plan-schema.md). The file may come from anywhere, so nothing in it is trusted: every field
is checked against the kind its dataclass declares, every unit must sit on one of the plan's
devices, and anything else is a :class:`~automap.errors.PlanError` naming the field and the fix.
"""
from __future__ import annotations

import json
import types
import typing
from dataclasses import replace
from typing import Any, Mapping

from automap.devices import DeviceSpec, canonical_name
from automap.errors import AutomapError, PlanError
from automap.kinds import default_memory_bandwidth, kind_of
from automap.planning.experts import ExpertsPlan
from automap.planning.model import JSON_VERSION, Origin, Plan
from automap.profiling import Unit
from automap.profiling.result import Generation


def plan_from_text(text: str) -> Plan:
    """The plan ``text`` (JSON) holds.

    Raises:
        PlanError: ``text`` is not JSON, or not a plan's (a field missing or of the wrong
            kind), or of another version.
    """
    try:
        data = json.loads(text)
    except (ValueError, TypeError, RecursionError) as exc:  # a huge number is a ValueError too
        raise PlanError(f"the plan JSON is not JSON ({str(exc)[:200]}); {_REWRITE}") from None
    if not isinstance(data, dict):
        raise PlanError(f"the plan JSON holds a {type(data).__name__}, not a plan's object; {_REWRITE}")
    try:
        return plan_from_dict(data)
    except PlanError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, AutomapError) as exc:
        reason = f"it lacks the field {exc}" if isinstance(exc, KeyError) else str(exc)[:200]
        raise PlanError(f"the plan JSON is not a plan automap wrote ({reason}); {_REWRITE}") from None


_REWRITE = "write it again with plan.to_json() or 'automap plan ... --json FILE'"


def plan_from_dict(data: Mapping[str, Any]) -> Plan:
    """The plan a parsed plan JSON object holds (see :func:`plan_from_text`)."""
    if data.get("version") != JSON_VERSION:
        raise PlanError(f"plan JSON has version {data.get('version')!r}; this automap reads version {JSON_VERSION}")
    devices = _devices_of(data["devices"])
    units = tuple(Unit(**_fields_of(Unit, u, f"unit {i}")) for i, u in enumerate(data["units"]))
    origin, strategy = _origin_of(data)
    plan = Plan(
        units=units,
        devices=devices,
        placement=_placement_of(data["units"], devices),
        strategy=strategy,
        origin=origin,
        tie_groups=tuple(tuple(g) for g in data.get("tie_groups", [])),
        cut_bytes=tuple(int(c) for c in data.get("cut_bytes", [])),
        example=data.get("example", ""),
        warnings=tuple(data.get("warnings", [])),
        reserves=tuple((str(k), int(v)) for k, v in data.get("reserves", {}).items()),
        generation=_generation_of(data.get("generation")),
        choices=tuple(data.get("choices", [])),
        # Absent (None) in JSON written before the plan recorded it.
        offload_dir=str(data["offload_dir"]) if data.get("offload_dir") else None,
        experts=ExpertsPlan.from_dict(data.get("experts")),
        # 0 in JSON written before they were recorded
        activation_peak_bytes=_bytes_of("activation_peak_bytes", data.get("activation_peak_bytes", 0)),
        inference_peak_bytes=_bytes_of("inference_peak_bytes", data.get("inference_peak_bytes", 0)),
        load_peak_bytes=_bytes_of("load_peak_bytes", data.get("load_peak_bytes", 0)),
    )
    executor = str(data.get("execution_device", ""))
    # Only a chosen executor is a field; the usual one (first GPU used, else CPU) is derived.
    if not executor or executor == plan.execution_device:
        return plan
    if canonical_name(executor) != executor or kind_of(executor).stores_only:
        raise PlanError(f"plan JSON's execution_device {executor!r} is not a device that computes, such as "
                        "'cpu' or 'cuda:0'")
    return replace(plan, executor=executor)


def _bytes_of(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise PlanError(f"plan JSON's {key} is {value!r}; it must be a count of bytes (an int >= 0)")
    return value


def _devices_of(entries: Any) -> tuple[DeviceSpec, ...]:
    devices = tuple(
        DeviceSpec(d["name"], d["kind"], int(d["capacity_bytes"]), float(d["flops_per_second"]),
                   float(d["link_bytes_per_second"]),
                   float(d.get("memory_bytes_per_second", default_memory_bandwidth(d["kind"]))))
        for d in entries
    )
    if len({d.name for d in devices}) < len(devices):
        raise PlanError("plan JSON lists one device twice")
    return devices


def _placement_of(units: Any, devices: tuple[DeviceSpec, ...]) -> tuple[str, ...]:
    """Each unit's device, every one a device of the plan."""
    names = {d.name for d in devices}
    placement = tuple(u.get("device") for u in units)
    for where in placement:
        if not isinstance(where, str) or where not in names:
            raise PlanError(f"plan JSON places a unit on {where!r}, which is not one of its devices "
                            f"({', '.join(sorted(names))})")
    return placement


def _generation_of(data: Mapping[str, Any] | None) -> Generation | None:
    if not data:
        return None
    return Generation(**_fields_of(Generation, data, "generation"))


def _fields_of(cls: type, data: Any, what: str) -> dict[str, Any]:
    """The fields of the dataclass ``cls`` that the JSON object ``data`` holds (lists read as
    tuples), each of the kind its annotation says; keys ``cls`` lacks are skipped (the report's).

    Raises:
        PlanError: ``data`` is no object, or a field holds a value of another kind (a count
            below zero included: every int of a unit or generation counts something).
    """
    if not isinstance(data, dict):
        raise PlanError(f"plan JSON's {what} is a {type(data).__name__}, not an object")
    hints = typing.get_type_hints(cls)
    found = {}
    for key, value in data.items():
        if key not in hints:
            continue
        value = tuple(value) if isinstance(value, list) else value
        if not _fits(value, hints[key]):
            hint = hints[key]
            kind = "count (an int >= 0)" if hint is int else hint.__name__ if isinstance(hint, type) else str(hint)
            raise PlanError(f"plan JSON's {what} has {key}={value!r}, which is not a {kind}")
        found[key] = value
    return found


def _fits(value: Any, hint: Any) -> bool:
    """Whether a JSON value is of the kind ``hint`` (a field's annotation) says."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) is tuple:
        return isinstance(value, tuple) and all(_fits(v, args[0]) for v in value)
    if typing.get_origin(hint) is dict:
        return isinstance(value, dict) and all(_fits(k, args[0]) and _fits(v, args[1]) for k, v in value.items())
    if typing.get_origin(hint) in (types.UnionType, typing.Union):
        return any(_fits(value, a) for a in args)
    if hint is bool or hint is str or hint is type(None):
        return type(value) is hint
    if isinstance(value, bool) or not isinstance(value, (int, float) if hint is float else int):
        return False
    return hint is float or value >= 0


def _origin_of(data: Mapping[str, Any]) -> tuple[Origin, str]:
    """``(origin, strategy)`` from plan JSON; files from before ``"origin"`` existed wrote
    ``"user"`` or ``"actual"`` as the strategy."""
    strategy = str(data.get("strategy", ""))
    try:
        origin = Origin(data.get("origin") or (strategy if strategy in ("user", "actual") else "strategy"))
    except ValueError:
        raise PlanError(f"plan JSON has origin {data.get('origin')!r}; expected one of "
                        f"{', '.join(o.value for o in Origin)}") from None
    return origin, ("" if origin is not Origin.STRATEGY and strategy in ("user", "actual") else strategy)


