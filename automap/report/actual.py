"""Where a model's tensors really are, as a :class:`~automap.planning.Plan` that the text, JSON and
figure render like any other (its origin is ``Origin.ACTUAL``)."""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Mapping

import torch
from torch import nn

from automap.devices import DeviceSpec, canonical_name, detect_devices, make_device
from automap.offload import OffloadStore, SourceStats, store_size
from automap.planning import Origin, Plan, PlanInputs, Provenance
from automap.profiling.units import all_named_tensors, longest_prefix
from automap.errors import OffloadError, ReportError
from automap.runtime import DispatchState, state_of
from automap.sizes import format_bytes

if TYPE_CHECKING:
    from automap.profiling import Unit

log = logging.getLogger(__name__)


def placement(model: nn.Module) -> Plan:
    """Check where every parameter and buffer of ``model`` is and describe it as a plan.

    For a model dispatched by automap, offloaded tensors (real CPU views of their weight
    source between uses) count as living on their offload tier, and a warning line says where
    their bytes are (files, host RAM, pinned memory, pages written copy-on-write); any unit found elsewhere than its plan says,
    or split over devices, is named in the warnings. For any other model (plain, or placed by
    accelerate / ``from_pretrained(device_map=...)``) the model is profiled on meta and each
    unit is put where its tensors are; meta tensors follow ``model.hf_device_map``.

    Returns:
        A :class:`Plan` with ``origin == Origin.ACTUAL``: ``print(placement(model).report())``,
        ``automap.report.figure(placement(model), "actual.png")``.

    Raises:
        ReportError: ``model`` is not a module, or tensors on meta with no device map saying
            where their data lives.

    Example:
        >>> automap.dispatch(model, max_memory={"cpu": "200MB"}, offload_dir="off")
        >>> print(automap.placement(model).report())
    """
    if not isinstance(model, nn.Module):
        raise ReportError(
            f"automap.placement describes an nn.Module, not {type(model).__name__}; pass the model"
        )
    state = state_of(model)
    if state is not None:
        streamed = state.streamed_ids()
        found = _dispatched(model, state.plan, streamed)
        found_notes = (memory_note(state.stats()), unreadable_note(state, streamed), store_note(state))
        notes = tuple(n for n in found_notes if n)
        noted = dataclasses.replace(found.provenance, warnings=found.warnings + notes)
        return dataclasses.replace(found, provenance=noted)
    return _undispatched(model)


def unreadable_note(state: DispatchState, streamed: set[int]) -> str:
    """What the weight source says of the bytes behind the offloaded tensors, when they can no
    longer be read: a file truncated in place under them (their bytes copied into memory
    first where the file was leased; else reading one — ``state_dict()`` saved, a print, a
    forward of torch's own — would kill the process with SIGBUS), or a store
    file rewritten with other bytes. One ``fstat`` per file; nothing is read."""
    names = [i.name for i in state.streamed.values() if id(i.tensor) in streamed]
    if state.source is None or not names:
        return ""
    try:
        state.source.check_unchanged(names)
    except OffloadError as exc:
        return f"offloaded weights cannot be read: {exc}"
    return ""


def store_note(state: DispatchState) -> str:
    """Where the offload store of a dispatched model is, how big, that it stays after
    undispatch to be reused, and how to remove it."""
    stores = [s for s in state.owned if isinstance(s, OffloadStore)]
    if not stores:
        return ""
    where = ", ".join(f"{s.directory} ({format_bytes(store_size(s.directory))})" for s in stores)
    parent = stores[0].directory.parent
    return (
        f"offload store: {where}; kept after undispatch and reused by the next dispatch of the same "
        f"weights (nothing rewritten); remove it once undispatched with automap clean {parent} "
        f"(or automap.clean({str(parent)!r})), which removes automap's stores there and nothing else"
    )


def memory_note(stats: SourceStats) -> str:
    """Where the offloaded tensors' bytes are: files, host RAM (pinned), written in memory."""
    parts = []
    if stats.file_bytes:
        parts.append(
            f"{format_bytes(stats.file_bytes)} read from files in place (page cache, no anonymous memory)"
        )
    if stats.ram_bytes:
        parts.append(f"{format_bytes(stats.ram_bytes)} in host RAM")
    if stats.pinned_bytes:
        parts.append(f"{format_bytes(stats.pinned_bytes)} of pinned host memory (RAM copies and staging)")
    if stats.written_bytes is None:
        parts.append("copy-on-write bytes unknown (no /proc/self/pagemap)")
    elif stats.written_bytes:
        parts.append(
            f"{format_bytes(stats.written_bytes)} written in memory since dispatch (copy-on-write: the "
            "files are unchanged; undispatch keeps the changes)"
        )
    return "offloaded tensors: " + "; ".join(parts) if parts else ""


def _dispatched(model: nn.Module, plan: Plan, streamed: set[int]) -> Plan:
    tensors = dict(all_named_tensors(model, remove_duplicate=False))
    found, notes = [], []
    for unit, planned in zip(plan.units, plan.placement):
        where = {}
        for name in unit.tensors:
            tensor = tensors.get(name)
            if tensor is None:
                notes.append(f"tensor {name!r} of unit {unit.name!r} is missing from the model")
            elif id(tensor) in streamed:
                where[name] = planned  # offloaded: lives in the store, streamed in when the unit runs
            elif tensor.device.type == "meta":
                notes.append(f"tensor {name!r} of unit {unit.name!r} has no data (it is on meta)")
            else:
                where[name] = canonical_name(str(tensor.device))
        found.append(_settle(unit, planned, where, notes))
    return _as_plan(plan, tuple(found), notes)


def _settle(unit: Unit, planned: str, where: Mapping[str, str], notes: list[str]) -> str:
    """The one device a unit is on; disagreements with the plan go into ``notes``."""
    devices = sorted(set(where.values()))
    if not devices:
        return planned
    if len(devices) > 1:
        notes.append(
            f"unit {unit.name!r} is split over {', '.join(devices)}; "
            f"planned on {planned} (was a tensor moved by hand?)"
        )
        return planned if planned in devices else devices[0]
    if devices[0] != planned:
        notes.append(f"unit {unit.name!r} is on {devices[0]} but the plan put it on {planned}")
    return devices[0]


def _as_plan(plan: Plan, found: tuple[str, ...], notes: list[str]) -> Plan:
    known = {d.name for d in plan.devices}
    extra = tuple(make_device(d, 0) for d in sorted(set(found)) if d not in known)
    return dataclasses.replace(
        plan,
        devices=tuple(sorted(plan.devices + extra, key=DeviceSpec.sort_key)),
        placement=found,
        provenance=dataclasses.replace(
            plan.provenance, origin=Origin.ACTUAL, warnings=tuple(plan.warnings) + tuple(notes)
        ),
    )


def _undispatched(model: nn.Module) -> Plan:
    from automap.profiling import profile

    prof = profile(model)
    hf_map = {k: canonical_name(v) for k, v in (getattr(model, "hf_device_map", None) or {}).items()}
    tensors = dict(all_named_tensors(model, remove_duplicate=False))
    notes: list[str] = []
    found = tuple(_device_of_unit(u, tensors, hf_map, notes) for u in prof.units)
    base = Plan(
        units=prof.units,
        devices=detect_devices(),
        placement=found,
        provenance=Provenance(origin=Origin.ACTUAL),
        inputs=PlanInputs(
            tie_groups=prof.tie_groups,
            example=prof.example,
            cut_bytes=tuple(prof.cut_bytes(i) for i in range(len(prof.units))),
        ),
    )
    return _as_plan(base, found, notes)


def _device_of_unit(
    unit: Unit, tensors: Mapping[str, torch.Tensor], hf_map: Mapping[str, str], notes: list[str]
) -> str:
    counts: dict[str, int] = {}
    for name in unit.tensors:
        tensor = tensors[name]
        device = (
            longest_prefix(hf_map, name)
            if tensor.device.type == "meta"
            else canonical_name(str(tensor.device))
        )
        if device is None:
            raise ReportError(
                f"tensor {name!r} is on meta (no data) and the model has no hf_device_map saying where it "
                "lives; load its weights (automap.load) or plan it instead with automap.plan(model)"
            )
        counts[device] = counts.get(device, 0) + tensor.numel() * tensor.element_size()
    if len(counts) > 1:
        notes.append(f"unit {unit.name!r} is split over {', '.join(sorted(counts))}")
    return max(counts, key=lambda d: counts[d]) if counts else "cpu"
