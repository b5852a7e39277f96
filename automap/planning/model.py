"""The :class:`Plan`: where every placement unit lives, what each device holds and does, and
what it is predicted to cost. Built by :mod:`automap.planning.layout_plans` or from a user map.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable

from automap.devices import DeviceSpec
from automap.errors import PlanError
from automap.planning.experts import ExpertsPlan
from automap.planning.placement import PlacementTable, placement_table
from automap.profiling import Unit
from automap.profiling.result import Generation
from automap.profiling.units import longest_prefix

JSON_VERSION = 1


class Origin(str, enum.Enum):
    """Where a :class:`Plan` came from. A ``str`` enum, so ``plan.origin == "user"`` reads as it
    should and JSON writes the plain value."""

    STRATEGY = "strategy"  # a registered strategy chose it (``Plan.strategy`` names which)
    USER = "user"  # a device map the user gave
    ACTUAL = "actual"  # automap.placement(model): where a model's tensors really are


# How a plan is turned into text and JSON belongs to automap.report, and how JSON is read back to
# automap.planning.plan_json; each registers its function here when it is imported (``import
# automap`` imports both before it hands out a Plan), so this module names neither.
Renderer = Callable[..., Any]
RENDERERS: dict[str, Renderer] = {}


def register_renderer(kind: str, renderer: Renderer) -> None:
    """Make ``renderer`` the one :meth:`Plan.report` (``"text"``), ``repr(plan)`` (``"line"``),
    :meth:`Plan.to_json` (``"json"``) or :meth:`Plan.from_json` (``"read_json"``) uses."""
    RENDERERS[kind] = renderer


def _render(kind: str, *args: Any, **options: Any) -> Any:
    try:
        renderer = RENDERERS[kind]
    except KeyError:
        raise PlanError(
            f"no {kind} renderer is registered: import automap.report (``import automap`` does) "
            "before drawing a plan"
        ) from None
    return renderer(*args, **options)


# The forms other engines take a plan in (accelerate's device_map, vLLM's layer partition,
# llama.cpp's flags, ...): registered by automap.report.export, found as the renderers are.
EXPORTERS: dict[str, Callable[..., Any]] = {}


def register_exporter(engine: str, exporter: Callable[..., Any]) -> None:
    """Make ``exporter`` what :meth:`Plan.export` gives for ``engine``."""
    EXPORTERS[engine] = exporter


def _export(engine: str, plan: Plan, **options: Any) -> Any:
    if not EXPORTERS:
        raise PlanError(
            "no exporter is registered: import automap.report (``import automap`` does) before "
            "exporting a plan"
        )
    if engine not in EXPORTERS:
        raise PlanError(f"no exporter for engine {engine!r}; the engines are {', '.join(sorted(EXPORTERS))}")
    return EXPORTERS[engine](plan, **options)


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
        return (
            self.weight_bytes
            + self.activation_bytes
            + self.reserve_bytes
            + self.kv_bytes
            + self.overhead_bytes
        )

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
class Provenance:
    """Where a plan came from and what a person should read about it.

    Attributes:
        strategy: the registered strategy that made it; for a user map or an actual placement
            (see ``origin``), the strategy of the plan it came from, or "".
        origin: whether a strategy, a user's device map or a dispatched model's actual
            placement gave it.
        warnings: things the user should know (units offloaded, tied weights split, ...).
        choices: what the planner decided and why, for the report: units split (into how
            many pieces, and the reason), units kept whole, and the alternative chosen by
            predicted forward time.
    """

    strategy: str = ""
    origin: Origin = Origin.STRATEGY
    warnings: tuple[str, ...] = ()
    choices: tuple[str, ...] = ()

    @property
    def source(self) -> str:
        """What the report and JSON call it: the strategy's name, or ``"user"`` / ``"actual"``."""
        return self.strategy if self.origin is Origin.STRATEGY else self.origin.value


@dataclass(frozen=True)
class PlanInputs:
    """What a plan was decided from, beside its units and devices.

    Attributes:
        tie_groups: tensor names that share storage (kept on one device).
        cut_bytes: bytes crossing the boundary before each unit (``cut_bytes[0]`` is the input).
        example: how the profile's example inputs were chosen ("" = bytes only).
        reserves: ``(device name, bytes)`` kept free on a device beyond weights and
            activations: the largest offloaded unit on the execution device, plus the user's
            ``reserve`` (KV cache, optimizer state).
        generation: the generation (batch, max_length) whose cache the units' ``kv_bytes``
            reserve where they compute; None when not planned for one.
        offload_dir: the folder the plan was sized for: the disk budget is the free space
            there (unless ``max_memory`` set it), and dispatch and load write the store of its
            disk units there when given no other folder; None when planned without one.
        activation_peak_bytes: the most activation bytes alive at once in the forward the plan
            is for, from the traced forward's liveness (a model in training mode: with what
            autograd keeps for the backward); 0 when unknown (each unit's own peak stands in).
            :func:`automap.planning.predict.memory` reads it.
        inference_peak_bytes: the same for an inference forward (equal to it unless the model is in
            training mode); the runtime's overhead grows with it.
        load_peak_bytes: the host RAM :func:`automap.load` predicted it would hold at its most
            while loading (``automap.loading.peak``: weights in RAM, automap's state, the
            largest conversion); 0 for a plan no load made.
    """

    tie_groups: tuple[tuple[str, ...], ...] = ()
    cut_bytes: tuple[int, ...] = ()
    example: str = ""
    reserves: tuple[tuple[str, int], ...] = ()
    generation: Generation | None = None
    offload_dir: str | None = None
    activation_peak_bytes: int = 0
    inference_peak_bytes: int = 0
    load_peak_bytes: int = 0


@dataclass(frozen=True)
class Plan:
    """Where every placement unit lives: a record of what was decided and what from. Its
    predicted times are free functions of it (:mod:`automap.planning.predict`), its drawing is
    :mod:`automap.report`'s.

    Attributes:
        units: the profile's units, in execution order.
        devices: the devices the plan could use, fastest tier first.
        placement: the device name of each unit (aligned with ``units``).
        provenance: the strategy or origin that gave it, its warnings and choices.
        inputs: the ties, cuts, reserves, generation, activation and load peaks and the folder it
            was sized for.
        executor: the execution device when the planner chose it (``"cpu"`` while GPUs
            keep some units: the CPU computes the units placed on it and streams those on
            disk); ``""``: the first accelerator used, else the CPU.
        experts: where each layer's routed experts live apart from their layer and how they
            run per phase (:mod:`automap.planning.experts`); None when layers stay whole.
    """

    units: tuple[Unit, ...]
    devices: tuple[DeviceSpec, ...]
    placement: tuple[str, ...]
    provenance: Provenance = Provenance()
    inputs: PlanInputs = PlanInputs()
    executor: str = ""
    experts: ExpertsPlan | None = None

    def __repr__(self) -> str:
        """One line a person can read (the dataclass's own repr lists every unit: thousands of
        characters), drawn by the registered ``"line"`` renderer: ``<Plan auto: 18 units, 44.63 MiB;
        cuda:0 17.74 MiB (8 units), cpu 26.89 MiB (10 units, streamed to cuda:0); predicted
        forward 1.92 ms>``."""
        if "line" in RENDERERS:
            return _render("line", self)
        return f"<Plan {self.source or 'plan'}: {len(self.units)} units on {', '.join(self.used_devices)}>"

    # ------------------------------- moved fields, read-only (``plan.provenance.x``, ``plan.inputs.x``)

    @property
    def strategy(self) -> str:
        return self.provenance.strategy

    @property
    def origin(self) -> Origin:
        return self.provenance.origin

    @property
    def warnings(self) -> tuple[str, ...]:
        return self.provenance.warnings

    @property
    def choices(self) -> tuple[str, ...]:
        return self.provenance.choices

    @property
    def source(self) -> str:
        """What the report and JSON call it: the strategy's name, or ``"user"`` / ``"actual"``."""
        return self.provenance.source

    @property
    def tie_groups(self) -> tuple[tuple[str, ...], ...]:
        return self.inputs.tie_groups

    @property
    def cut_bytes(self) -> tuple[int, ...]:
        return self.inputs.cut_bytes

    @property
    def example(self) -> str:
        return self.inputs.example

    @property
    def reserves(self) -> tuple[tuple[str, int], ...]:
        return self.inputs.reserves

    @property
    def generation(self) -> Generation | None:
        return self.inputs.generation

    @property
    def offload_dir(self) -> str | None:
        return self.inputs.offload_dir

    @property
    def activation_peak_bytes(self) -> int:
        return self.inputs.activation_peak_bytes

    @property
    def inference_peak_bytes(self) -> int:
        return self.inputs.inference_peak_bytes

    @property
    def load_peak_bytes(self) -> int:
        return self.inputs.load_peak_bytes

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

    # Cached: a frozen plan's placement never changes, and dispatch, load, decode and the report read it.
    @cached_property
    def placements(self) -> PlacementTable:
        """The one placement view: each unit's resolved placement (its home, tier, the device it
        computes on and the route its weights take there) and bytes, and how each device's units
        run. Dispatch, load, decode and the report read it instead of resolving device names."""
        return placement_table(
            [(u.name, u.weight_bytes) for u in self.units],
            self.placement,
            [d.name for d in self.devices],
            self.executor,
        )

    @property
    def used_devices(self) -> tuple[str, ...]:
        return self.placements.used_devices

    @property
    def execution_device(self) -> str:
        """Where offloaded units compute: the planner's ``executor`` when it chose one, else
        the first accelerator in the plan, else the CPU."""
        return self.placements.execution_device

    @property
    def offloaded_units(self) -> tuple[str, ...]:
        return self.placements.offloaded_units

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

    # -------------------------------------------------------------- rendering (registered by automap.report)

    def report(self) -> str:
        """A human-readable table: per device bytes, share of FLOPs and unit range."""
        return _render("text", self)

    def export(self, engine: str, **options: Any) -> Any:
        """The plan in the form another engine takes (docs/export.md): ``"accelerate"`` (the
        ``device_map`` dict), ``"split_spec"`` (torch pipelining's), ``"torchtitan"``
        (``module_fqns_per_model_part``), ``"vllm"`` (``VLLM_PP_LAYER_PARTITION``'s value),
        ``"llama.cpp"`` (``-ngl``/``-ot`` arguments for the GGUF of the same model, given
        ``arch=``).

        Raises:
            PlanError: an unknown engine (the message lists them), or a plan the engine
                cannot say (why, and what to plan instead).
        """
        return _export(engine, self, **options)

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
        return _render("read_json", text)  # automap.planning.plan_json registers its reader


def unit_label(unit_name: str) -> str:
    """A unit's name as a person reads it: the whole model (unit ``""``, when no module of it
    is a unit of its own) shows as ``"the whole model"``."""
    return unit_name or "the whole model"
