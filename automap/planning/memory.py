"""The memory model of a run: what each device of a plan holds at its peak, and what makes it up
(weights, generation cache, staging, activations from the traced forward's liveness, the runtime's
overhead per device kind), from the plan's own inputs: nothing is measured here. The planner
places against the same figures (:func:`runtime_bytes`), and the report shows them
(:func:`automap.planning.predict.memory`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

from automap.devices import DeviceSpec
from automap.kinds import kind_of
from automap.planning.placement import Placement
from automap.profiling import Unit


class Planned(Protocol):
    """What the memory model reads of a :class:`~automap.planning.model.Plan`."""

    units: tuple[Unit, ...]
    devices: tuple[DeviceSpec, ...]
    placement: tuple[str, ...]
    reserves: tuple[tuple[str, int], ...]
    activation_peak_bytes: int
    inference_peak_bytes: int

    @property
    def placements(self) -> Sequence[Placement]: ...

    @property
    def execution_device(self) -> str: ...


@dataclass(frozen=True)
class DeviceMemory:
    """One device's predicted peak and its parts, in bytes (see the module docstring)."""

    device: str
    capacity_bytes: int
    weights: int
    cache: int
    staging: int
    activations: int
    overhead: int

    @property
    def peak_bytes(self) -> int:
        return self.weights + self.cache + self.staging + self.activations + self.overhead

    @property
    def fits(self) -> bool:
        """The peak stays within the budget (a capacity of 0 is unknown, and fits)."""
        return self.capacity_bytes == 0 or self.peak_bytes <= self.capacity_bytes

    def as_dict(self) -> dict[str, int]:
        return {
            "weights": self.weights,
            "cache": self.cache,
            "staging": self.staging,
            "activations": self.activations,
            "overhead": self.overhead,
            "peak": self.peak_bytes,
        }


def runtime_overhead(device: DeviceSpec | str, activations: int, transient: int | None = None) -> int:
    """The runtime's own bytes on ``device`` while it computes with ``activations`` at their peak.
    The allocator's slack grows with what a forward frees and allocates again, ``transient``: the
    inference forward's peak (a training forward keeps its saved tensors, which are never freed
    in it); default ``activations``."""
    kind = kind_of(device)
    return int(
        kind.runtime_base_bytes + kind.runtime_share * (activations if transient is None else transient)
    )


def runtime_bytes(device: DeviceSpec | str, activations: int, transient: int | None = None) -> int:
    """What computing on ``device`` needs beside weights and cache: the activation peak and the
    runtime's overhead."""
    return activations + runtime_overhead(device, activations, transient)


def device_memory(plan: Planned) -> tuple[DeviceMemory, ...]:
    """Every device of ``plan``, its predicted peak and what makes it up."""
    computes: dict[str, list[int]] = {}
    for i, placement in enumerate(plan.placements):
        computes.setdefault(placement.compute, []).append(i)
    reserves = dict(plan.reserves)
    rows = []
    for device in plan.devices:
        mine = computes.get(device.name, [])
        weights = sum(u.weight_bytes for u, d in zip(plan.units, plan.placement) if d == device.name)
        cache = sum(plan.units[i].kv_bytes for i in mine)
        activations = _activations(plan, device, mine)
        transient = min(activations, plan.inference_peak_bytes or activations)
        overhead = runtime_overhead(device, activations, transient) if mine else 0
        rows.append(
            DeviceMemory(
                device.name,
                device.capacity_bytes,
                weights,
                cache,
                reserves.get(device.name, 0),
                activations,
                overhead,
            )
        )
    return tuple(rows)


def streaming_buffers(plan: Planned) -> int | None:
    """How many buffers the size of the largest offloaded unit the execution device has room for:
    its staging reserve plus what its budget leaves beside the predicted peak. None when the
    budget's size is unknown (0) or nothing is offloaded."""
    offloaded = [u.weight_bytes for u, p in zip(plan.units, plan.placements) if p.offloaded]
    row = next((r for r in device_memory(plan) if r.device == plan.execution_device), None)
    if not offloaded or row is None or row.capacity_bytes == 0:
        return None
    return (row.staging + max(row.capacity_bytes - row.peak_bytes, 0)) // max(max(offloaded), 1)


def _activations(plan: Planned, device: DeviceSpec, computed: list[int]) -> int:
    """The activation peak of ``device`` computing the units ``computed`` (indices). The whole
    forward's liveness counts on the host; accelerators are still planned with their units'
    own peaks (the GPU half of the memory model is measured on a GPU, not yet here)."""
    if not computed:
        return 0
    largest = max(plan.units[i].peak_activation_bytes for i in computed)
    if len(computed) == len(plan.units) and plan.activation_peak_bytes and kind_of(device).is_host:
        return max(plan.activation_peak_bytes, largest)
    return largest
