"""Reading a :class:`~automap.planning.model.Plan` back from the JSON :meth:`Plan.to_json` wrote
(docs/plan-schema.md). The file may come from anywhere, so nothing in it is trusted: every field
is checked against the kind its dataclass declares, every unit must sit on one of the plan's
devices, and anything else is a :class:`~automap.errors.PlanError` naming the field and the fix.
"""

from __future__ import annotations

import math
import types
import typing
from dataclasses import replace
from typing import Any, Mapping

from automap.devices import SPEED_FIELDS, DeviceSpec, canonical_name
from automap.errors import AutomapError, PlanError
from automap.kinds import default_memory_bandwidth, kind_of
from automap.planning.experts import ExpertsPlan
from automap.planning.model import JSON_VERSION, Origin, Plan, PlanInputs, Provenance, register_renderer
from automap.profiling import Unit
from automap.profiling.result import Generation
from automap.sizes import MAX_BYTES, MAX_COUNT, MAX_OP_SECONDS, MAX_RATE, parse_number
from automap.userfiles import load_json


def plan_from_text(text: str) -> Plan:
    """The plan ``text`` (JSON) holds.

    Raises:
        PlanError: ``text`` is not JSON, or not a plan's (a field missing or of the wrong
            kind), or of another version.
    """
    if not isinstance(text, (str, bytes, bytearray)):
        raise PlanError(
            f"Plan.from_json takes the JSON text (a str), not a {type(text).__name__}; "
            "to read a file, "
            "use automap.report.read_json(path)"
        )
    return plan_from_value(load_json(text, "the plan JSON is not JSON", _REWRITE, PlanError))


def plan_from_value(data: Any) -> Plan:
    """The plan a parsed plan JSON value holds (a file's, read by :func:`automap.report.read_json`).

    Raises:
        PlanError: as :func:`plan_from_text`.
    """
    if not isinstance(data, dict):
        raise PlanError(f"the plan JSON holds a {type(data).__name__}, not a plan's object; {_REWRITE}")
    try:
        return plan_from_dict(data)
    except PlanError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError, AutomapError) as exc:
        reason = f"it lacks the field {exc}" if isinstance(exc, KeyError) else str(exc)[:200]
        raise PlanError(f"the plan JSON is not a plan automap wrote ({reason}); {_REWRITE}") from None


_REWRITE = "write it again with plan.to_json() or 'automap plan ... --json FILE'"


def plan_from_dict(data: Mapping[str, Any]) -> Plan:
    """The plan a parsed plan JSON object holds (see :func:`plan_from_text`)."""
    if data.get("version") != JSON_VERSION:
        raise PlanError(
            f"plan JSON has version {data.get('version')!r}; this automap reads version {JSON_VERSION}"
        )
    devices = _devices_of(data["devices"])
    units = tuple(Unit(**_fields_of(Unit, u, f"unit {i}")) for i, u in enumerate(data["units"]))
    origin, strategy = _origin_of(data)
    plan = Plan(
        units=units,
        devices=devices,
        placement=_placement_of(data["units"], devices),
        provenance=Provenance(
            strategy, origin, warnings=tuple(data.get("warnings", [])), choices=tuple(data.get("choices", []))
        ),
        inputs=PlanInputs(
            tie_groups=tuple(tuple(g) for g in data.get("tie_groups", [])),
            cut_bytes=tuple(
                int(_number(c, "cut_bytes", MAX_BYTES, integral=True)) for c in data.get("cut_bytes", [])
            ),
            example=data.get("example", ""),
            reserves=tuple(
                (str(k), int(_number(v, f"reserves[{k!r}]", MAX_BYTES, integral=True)))
                for k, v in data.get("reserves", {}).items()
            ),
            generation=_generation_of(data.get("generation")),
            # Absent (None) in JSON written before the plan recorded it.
            offload_dir=str(data["offload_dir"]) if data.get("offload_dir") else None,
            # 0 in JSON written before they were recorded
            activation_peak_bytes=_bytes_of("activation_peak_bytes", data.get("activation_peak_bytes", 0)),
            inference_peak_bytes=_bytes_of("inference_peak_bytes", data.get("inference_peak_bytes", 0)),
            load_peak_bytes=_bytes_of("load_peak_bytes", data.get("load_peak_bytes", 0)),
        ),
        experts=ExpertsPlan.from_dict(data.get("experts")),
    )
    executor = str(data.get("execution_device", ""))
    # Only a chosen executor is a field; the usual one (first GPU used, else CPU) is derived.
    if not executor or executor == plan.execution_device:
        return plan
    if canonical_name(executor) != executor or kind_of(executor).stores_only:
        raise PlanError(
            f"plan JSON's execution_device {executor!r} is not a device that computes, such as "
            "'cpu' or 'cuda:0'"
        )
    return replace(plan, executor=executor)


def _number(value: Any, field: str, maximum: float, integral: bool = False) -> float:
    """A number of the plan JSON, read as every number a user gives is
    (:func:`~automap.sizes.parse_number`): finite, >= 0, at most ``maximum``."""
    return parse_number(
        value, f"plan JSON's {field}", integral=integral, maximum=maximum, error=PlanError, hint=_REWRITE
    )


def _bytes_of(key: str, value: Any) -> int:
    return int(_number(value, key, MAX_BYTES, integral=True))


def _devices_of(entries: Any) -> tuple[DeviceSpec, ...]:
    devices = tuple(_device_of(d, i) for i, d in enumerate(entries))
    if len({d.name for d in devices}) < len(devices):
        raise PlanError("plan JSON lists one device twice")
    return devices


def _device_of(d: Any, i: int) -> DeviceSpec:
    if not isinstance(d, dict) or not isinstance(d.get("name"), str) or not isinstance(d.get("kind"), str):
        raise PlanError(f"plan JSON's devices[{i}] is not a device's object (a name and a kind); {_REWRITE}")
    where = f"devices[{i}]"
    memory = d.get("memory_bytes_per_second", default_memory_bandwidth(d["kind"]))
    return DeviceSpec(
        d["name"],
        d["kind"],
        int(_number(d["capacity_bytes"], f"{where}.capacity_bytes", MAX_BYTES, integral=True)),
        _number(d["flops_per_second"], f"{where}.flops_per_second", MAX_RATE),
        _number(d["link_bytes_per_second"], f"{where}.link_bytes_per_second", MAX_RATE),
        _number(memory, f"{where}.memory_bytes_per_second", MAX_RATE),
        _measured_of(d.get("measured", [])),
        # 0 (not measured) in JSON written before they were recorded
        _number(d.get("row_seconds", 0.0), f"{where}.row_seconds", MAX_OP_SECONDS),
        _number(d.get("op_seconds", 0.0), f"{where}.op_seconds", MAX_OP_SECONDS),
        _number(
            d.get("read_cpu_seconds_per_byte", 0.0), f"{where}.read_cpu_seconds_per_byte", MAX_OP_SECONDS
        ),
        int(_number(d.get("spare_cores", 1), f"{where}.spare_cores", MAX_COUNT, integral=True)),
        _number(d.get("large_flops_per_second", 0.0), f"{where}.large_flops_per_second", MAX_RATE),
    )


def _measured_of(names: Any) -> tuple[str, ...]:
    """A device's ``measured``: names of its own figures (absent in JSON written before)."""
    fields = set(SPEED_FIELDS)
    if not isinstance(names, list) or not all(isinstance(n, str) and n in fields for n in names):
        raise PlanError(
            f"plan JSON's device 'measured' is {names!r}, not a list of the figures {sorted(fields)}"
        )
    return tuple(names)


def _placement_of(units: Any, devices: tuple[DeviceSpec, ...]) -> tuple[str, ...]:
    """Each unit's device, every one a device of the plan."""
    names = {d.name for d in devices}
    placement = tuple(u.get("device") for u in units)
    for where in placement:
        if not isinstance(where, str) or where not in names:
            raise PlanError(
                f"plan JSON places a unit on {where!r}, which is not one of its devices "
                f"({', '.join(sorted(names))})"
            )
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
            kind = (
                "count (an int >= 0)"
                if hint is int
                else hint.__name__
                if isinstance(hint, type)
                else str(hint)
            )
            raise PlanError(f"plan JSON's {what} has {key}={value!r}, which is not a {kind}")
        found[key] = value
    return found


def _fits(value: Any, hint: Any) -> bool:
    """Whether a JSON value is of the kind ``hint`` (a field's annotation) says."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) is tuple:
        return isinstance(value, tuple) and all(_fits(v, args[0]) for v in value)
    if typing.get_origin(hint) is dict:
        return isinstance(value, dict) and all(
            _fits(k, args[0]) and _fits(v, args[1]) for k, v in value.items()
        )
    if typing.get_origin(hint) in (types.UnionType, typing.Union):
        return any(_fits(value, a) for a in args)
    if hint is bool or hint is str or hint is type(None):
        return type(value) is hint
    if isinstance(value, bool) or not isinstance(value, (int, float) if hint is float else int):
        return False
    return math.isfinite(value) if hint is float else value >= 0


def _origin_of(data: Mapping[str, Any]) -> tuple[Origin, str]:
    """``(origin, strategy)`` from plan JSON; files from before ``"origin"`` existed wrote
    ``"user"`` or ``"actual"`` as the strategy."""
    strategy = str(data.get("strategy", ""))
    try:
        origin = Origin(data.get("origin") or (strategy if strategy in ("user", "actual") else "strategy"))
    except ValueError:
        raise PlanError(
            f"plan JSON has origin {data.get('origin')!r}; expected one of "
            f"{', '.join(o.value for o in Origin)}"
        ) from None
    return origin, ("" if origin is not Origin.STRATEGY and strategy in ("user", "actual") else strategy)


register_renderer("read_json", plan_from_text)
