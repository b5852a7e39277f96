"""The :class:`Plan`: where every placement unit lives, what each device holds and does, and
what it is predicted to cost. Built by :mod:`automap.planning.layout` or from a user map.
"""
from __future__ import annotations

import enum
import importlib
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable

from automap.devices import DeviceSpec
from automap.errors import PlanError
from automap.planning.cost import flop_seconds, hook_calls, hooks_seconds, stage_seconds, transfer_seconds
from automap.planning.experts import ExpertsPlan
from automap.planning.memory import DeviceMemory, device_memory
from automap.planning.placement import Placement, placements_of, resolve
from automap.profiling import Unit
from automap.profiling.result import Generation
from automap.profiling.units import longest_prefix
from automap.sizes import format_bytes, format_seconds

JSON_VERSION = 1


class Origin(str, enum.Enum):
    """Where a :class:`Plan` came from. A ``str`` enum, so ``plan.origin == "user"`` reads as it
    should and JSON writes the plain value."""

    STRATEGY = "strategy"  # a registered strategy chose it (``Plan.strategy`` names which)
    USER = "user"  # a device map the user gave
    ACTUAL = "actual"  # automap.placement(model): where a model's tensors really are


# How a plan is turned into text and JSON belongs to automap.report, which imports this module;
# report registers its renderers here when it is imported, and the first Plan.report() or
# Plan.to_json() imports it if nothing has (``import automap`` is lazy), so planning never
# imports report at import time.
Renderer = Callable[..., str]
RENDERERS: dict[str, Renderer] = {}


def register_renderer(kind: str, renderer: Renderer) -> None:
    """Make ``renderer`` the one :meth:`Plan.report` (``"text"``) or :meth:`Plan.to_json`
    (``"json"``) uses."""
    RENDERERS[kind] = renderer


def _render(kind: str, plan: Plan, **options: Any) -> str:
    if kind not in RENDERERS:
        importlib.import_module("automap.report")  # registers "text" and "json"
    try:
        renderer = RENDERERS[kind]
    except KeyError:
        raise PlanError(f"no {kind} renderer is registered (automap.report registers text and json)") from None
    return renderer(plan, **options)


@dataclass(frozen=True)
class DeviceSummary:
    """One device's share of a plan (what the report and the JSON show per device)."""

    device: DeviceSpec
    units: tuple[str, ...]
    weight_bytes: int
    activation_bytes: int
    reserve_bytes: int
    flops: int
    flops_share: float
    stage_seconds: float
    kv_bytes: int = 0  # the generation cache of the units computing there
    overhead_bytes: int = 0  # the runtime's own memory where it computes (automap.planning.memory)

    @property
    def used_bytes(self) -> int:
        """The predicted peak: weights, activations, reserve (staging), cache and overhead."""
        return self.weight_bytes + self.activation_bytes + self.reserve_bytes + self.kv_bytes + self.overhead_bytes

    @property
    def over_capacity(self) -> bool:
        """Holds more than its budget (a capacity of 0 means unknown: a device only found)."""
        return 0 < self.device.capacity_bytes < self.used_bytes


@dataclass(frozen=True)
class Cut:
    """A boundary between consecutive units on different devices and what crosses it."""

    before: str
    after: str
    src_device: str
    dst_device: str
    bytes: int
    seconds: float


@dataclass(frozen=True)
class Plan:
    """Where every placement unit lives.

    Attributes:
        units: the profile's units, in execution order.
        devices: the devices the plan could use, fastest tier first.
        placement: the device name of each unit (aligned with ``units``).
        strategy: the registered strategy that made it; for a user map or an actual placement
            (see ``origin``), the strategy of the plan it came from, or "".
        tie_groups: tensor names that share storage (kept on one device).
        cut_bytes: bytes crossing the boundary before each unit (``cut_bytes[0]`` is the input).
        example: how the profile's example inputs were chosen ("" = bytes only).
        warnings: things the user should know (units offloaded, tied weights split, ...).
        reserves: ``(device name, bytes)`` kept free on a device beyond weights and
            activations: the largest offloaded unit on the execution device, plus the user's
            ``reserve`` (KV cache, optimizer state).
        origin: whether a strategy, a user's device map or a dispatched model's actual
            placement gave it.
        generation: the generation (batch, max_length) whose cache the units' ``kv_bytes``
            reserve where they compute; None when not planned for one.
        executor: the execution device when the planner chose it (``"cpu"`` while GPUs
            keep some units: the CPU computes the units placed on it and streams those on
            disk); ``""``: the first accelerator used, else the CPU.
        choices: what the planner decided and why, for the report: units split (into how
            many pieces, and the reason), units kept whole, and the alternative chosen by
            predicted forward time.
        offload_dir: the folder the plan was sized for: the disk budget is the free space
            there (unless ``max_memory`` set it), and dispatch and load write the store of its
            disk units there when given no other folder; None when planned without one.
        experts: where each layer's routed experts live apart from their layer and how they
            run per phase (:mod:`automap.planning.experts`); None when layers stay whole.
        activation_peak_bytes: the most activation bytes alive at once in the forward the plan
            is for, from the traced forward's liveness (a model in training mode: with what
            autograd keeps for the backward); 0 when unknown (each unit's own peak stands in).
            :meth:`memory` reads it.
        inference_peak_bytes: the same for an inference forward (equal to it unless the model is in
            training mode); the runtime's overhead grows with it.
        load_peak_bytes: the host RAM :func:`automap.load` predicted it would hold at its most
            while loading (``automap.loading.peak``: weights in RAM, automap's state, the
            largest conversion); 0 for a plan no load made.
    """

    units: tuple[Unit, ...]
    devices: tuple[DeviceSpec, ...]
    placement: tuple[str, ...]
    strategy: str
    tie_groups: tuple[tuple[str, ...], ...] = ()
    cut_bytes: tuple[int, ...] = ()
    example: str = ""
    warnings: tuple[str, ...] = field(default=())
    reserves: tuple[tuple[str, int], ...] = ()
    origin: Origin = Origin.STRATEGY
    generation: Generation | None = None
    executor: str = ""
    choices: tuple[str, ...] = ()
    offload_dir: str | None = None
    experts: ExpertsPlan | None = None
    activation_peak_bytes: int = 0
    inference_peak_bytes: int = 0
    load_peak_bytes: int = 0

    def __repr__(self) -> str:
        """One line a person can read (the dataclass's own repr lists every unit: thousands of
        characters): ``<Plan auto: 18 units, 44.63 MiB; cuda:0 17.74 MiB (8 units), cpu
        26.89 MiB (10 units, streamed to cuda:0); predicted forward 1.92 ms>``."""
        held = []
        for name in self.used_devices:
            count = sum(1 for d in self.placement if d == name)
            route = f", streamed to {self.execution_device}" if self.is_offloaded(name) else ""
            held.append(f"{name} {format_bytes(self.bytes_on(name))} ({count} unit{'' if count == 1 else 's'}{route})")
        weights = format_bytes(sum(u.weight_bytes for u in self.units))
        units = f"{len(self.units)} unit{'' if len(self.units) == 1 else 's'}"
        return (f"<Plan {self.source or 'plan'}: {units}, {weights}; {', '.join(held) or 'nothing placed'}; "
                f"predicted forward {format_seconds(self.forward_seconds)}>")

    @property
    def source(self) -> str:
        """What the report and JSON call it: the strategy's name, or ``"user"`` / ``"actual"``."""
        return self.strategy if self.origin is Origin.STRATEGY else self.origin.value

    # -------------------------------------------------------------- lookups

    def device(self, name: str) -> DeviceSpec:
        for d in self.devices:
            if d.name == name:
                return d
        raise KeyError(name)

    def device_of(self, unit_name: str) -> str:
        for unit, where in zip(self.units, self.placement):
            if unit.name == unit_name:
                return where
        raise KeyError(unit_name)

    # Cached: dispatch, load and the report ask is_offloaded() once per unit, and a frozen
    # plan's answer never changes.
    @cached_property
    def used_devices(self) -> tuple[str, ...]:
        used = set(self.placement)
        return tuple(d.name for d in self.devices if d.name in used)

    @cached_property
    def execution_device(self) -> str:
        """Where offloaded units compute: the planner's ``executor`` when it chose one, else
        the first accelerator in the plan, else the CPU."""
        if self.executor:
            return self.executor
        for name in self.used_devices:
            if self.device(name).is_accelerator:
                return name
        return "cpu"

    @cached_property
    def placements(self) -> tuple[Placement, ...]:
        """Each unit's resolved placement, aligned with ``units``: its home (tier and device),
        the device it computes on and the route its weights take there. Dispatch, load and the
        report read these instead of working them out again from the device names."""
        return placements_of(self.placement, self.execution_device)

    def is_offloaded(self, device_name: str) -> bool:
        """True when units placed on ``device_name`` are streamed to the execution device."""
        return resolve(device_name, self.execution_device).offloaded

    @property
    def offloaded_units(self) -> tuple[str, ...]:
        return tuple(u.name for u, p in zip(self.units, self.placements) if p.offloaded)

    @property
    def device_map(self) -> dict[str, int | str]:
        """The Hugging Face / accelerate form: ``{"model.layers.0": 0, ..., "lm_head": "cpu"}``.

        Keys are unit names, plus the full names of tensors held by non-unit modules (and of a
        tied tensor's names that no unit holds); together they cover every parameter and buffer
        name, as accelerate's ``check_device_map`` asks. Accepted as-is by ``from_pretrained(device_map=)``
        and ``accelerate.dispatch_model``, which compute its "cpu"/"disk" units on the
        lowest-numbered GPU it names; a plan that streams them elsewhere says so in its
        warnings (``automap.plan(..., map_only=True)`` never returns one).
        """
        result: dict[str, int | str] = {}
        for unit, where in zip(self.units, self.placement):
            value = self.device(where).map_value
            result[unit.name] = value
            for alias in unit.aliases:  # the same module object under another name
                result[alias] = value
            for tensor in unit.loose:
                result[tensor] = value
        for group in self.tie_groups:  # a tied tensor's other names held by no unit (BERT's lm_head.bias)
            placed = [longest_prefix(result, name) for name in group]
            value = next((v for v in placed if v is not None), None)
            result.update({name: value for name, v in zip(group, placed) if v is None and value is not None})
        return result

    def bytes_on(self, device_name: str) -> int:
        return sum(u.weight_bytes for u, d in zip(self.units, self.placement) if d == device_name)

    def link_seconds(self, nbytes: int, src: str, dst: str) -> float:
        """Predicted time to move ``nbytes`` between two devices (the slower link bounds it)."""
        if src == dst or nbytes == 0:
            return 0.0
        return transfer_seconds(nbytes, self.device(src), self.device(dst))

    def compute_device(self, device_name: str) -> str:
        """Where units placed on ``device_name`` compute (offloaded ones on the execution device)."""
        return resolve(device_name, self.execution_device).compute

    def memory(self) -> tuple[DeviceMemory, ...]:
        """Per device, the predicted peak memory of a run and what makes it up: weights, cache,
        staging, activations, the runtime's overhead (:mod:`automap.planning.memory`)."""
        return self._memory

    @cached_property
    def _memory(self) -> tuple[DeviceMemory, ...]:
        return device_memory(self)

    def cuts(self) -> tuple[Cut, ...]:
        """Every boundary where consecutive units compute on different devices."""
        return self._cuts

    def summary(self) -> tuple[DeviceSummary, ...]:
        """Per device: units, bytes, FLOPs share and predicted stage time (compute there, plus
        streaming of offloaded weights, plus the transfers into it). Activations, the runtime's
        overhead and the generation cache count where units compute (offloaded ones' on the
        execution device), the CPU included (:meth:`memory`)."""
        return self._summary

    # Cached like execution_device: the report, the JSON and the predicted times each read them.
    @cached_property
    def _cuts(self) -> tuple[Cut, ...]:
        result = []
        for i in range(1, len(self.units)):
            src, dst = self.compute_device(self.placement[i - 1]), self.compute_device(self.placement[i])
            if src != dst:
                nbytes = self.cut_bytes[i] if i < len(self.cut_bytes) else self.units[i - 1].output_bytes
                result.append(Cut(self.units[i - 1].name, self.units[i].name, src, dst, nbytes,
                                  self.link_seconds(nbytes, src, dst)))
        return tuple(result)

    @cached_property
    def _summary(self) -> tuple[DeviceSummary, ...]:
        total_flops = sum(u.flops for u in self.units) or 1
        incoming: dict[str, float] = {}
        for cut in self.cuts():
            incoming[cut.dst_device] = incoming.get(cut.dst_device, 0.0) + cut.seconds
        memory = {row.device: row for row in self.memory()}
        rows = []
        for device in self.devices:
            units = [u for u, d in zip(self.units, self.placement) if d == device.name]
            flops = sum(u.flops for u in units)
            weights = sum(u.weight_bytes for u in units)
            compute = self.device(self.compute_device(device.name))
            streamed = self.link_seconds(weights, device.name, compute.name) if self.is_offloaded(device.name) else 0.0
            seconds = stage_seconds(flop_seconds(flops, compute.flops_per_second), streamed,
                                    incoming.get(device.name, 0.0) if units else 0.0)
            mem = memory[device.name]  # activations and overhead count where the device computes
            rows.append(DeviceSummary(device, tuple(u.name for u in units), weights, mem.activations, mem.staging,
                                      flops, flops / total_flops, seconds, mem.cache, mem.overhead))
        return tuple(rows)

    def compute_seconds(self) -> dict[str, float]:
        """Predicted seconds per forward on each computing device: its own stage plus the
        offloaded stages it runs."""
        totals: dict[str, float] = {}
        for row in self.summary():
            if row.units:
                where = self.compute_device(row.device.name)
                totals[where] = totals.get(where, 0.0) + row.stage_seconds
        return totals

    @property
    def bottleneck_seconds(self) -> float:
        """The busiest computing device's predicted time per forward: the steady-state period
        of a pipeline over the plan's stages."""
        return max(self.compute_seconds().values(), default=0.0)

    @property
    def hook_seconds(self) -> float:
        """Predicted overhead of automap's hooks per forward: none when the whole model
        computes on one device with nothing streamed (dispatch hooks nothing then), else
        :func:`~automap.planning.cost.hooks_seconds` of every unit's hook calls."""
        placements = self.placements
        if len({p.compute for p in placements}) <= 1 and not any(p.offloaded for p in placements):
            return 0.0
        return hooks_seconds(sum(hook_calls(u.calls, p.offloaded) for u, p in zip(self.units, placements)))

    @property
    def forward_seconds(self) -> float:
        """Predicted time of one unpipelined forward: every stage in turn, plus the hooks'
        overhead (:attr:`hook_seconds`)."""
        return sum(s.stage_seconds for s in self.summary()) + self.hook_seconds

    # -------------------------------------------------------------- rendering

    def report(self) -> str:
        """A human-readable table: per device bytes, share of FLOPs and unit range."""
        return _render("text", self)

    def to_json(self, indent: int | None = 2) -> str:
        """Serialise to JSON (docs/plan-schema.md): the plan's own keys, a top-level
        ``"device_map"``, and the report's per-device summaries, totals and warnings."""
        return _render("json", self, indent=indent)

    @staticmethod
    def from_json(text: str) -> Plan:
        """Rebuild a plan written by :meth:`to_json`.

        Raises:
            PlanError: ``text`` is not JSON, or not a plan's (a field missing or of the wrong
                kind), or of another version.
        """
        # automap.planning.plan_json reads it; it imports this module, so it is found at call time.
        return importlib.import_module("automap.planning.plan_json").plan_from_text(text)


# ------------------------------------------------------------------ notes on a plan (one home each)


def unit_label(unit_name: str) -> str:
    """A unit's name as a person reads it: the whole model (unit ``""``, when no module of it
    is a unit of its own) shows as ``"the whole model"``."""
    return unit_name or "the whole model"


def over_capacity_notes(plan: Plan) -> list[str]:
    """A warning per device that holds more than its budget (its units, or the run of the units
    it computes: their activations and the runtime's overhead)."""
    return [f"{row.device.name} holds {format_bytes(row.used_bytes)} but its budget is "
            f"{format_bytes(row.device.capacity_bytes)}; it may run out of memory"
            for row in plan.summary() if (row.units or row.activation_bytes) and row.over_capacity]


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
        nbytes = unit.weight_bytes if unit is not None else 0  # Unit keeps no per-tensor sizes: an upper bound
        seconds = plan.link_seconds(nbytes, devices[0], devices[1])
        places = ", ".join(f"{name} on {device}" for name, device in held.items())
        notes.append(f"tied weights split: {places} share one tensor; up to {format_bytes(nbytes)} cross devices "
                     f"each forward (~{format_seconds(seconds)}); map their units to one device to avoid it")
    return notes
