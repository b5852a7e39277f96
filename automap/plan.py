"""The balancer: which device each placement unit goes to.

Pure and deterministic: a :class:`Plan` is a function of a :class:`~automap.profile.Profile`
and a tuple of :class:`~automap.devices.DeviceSpec`; no I/O, no CUDA calls.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Mapping

from automap.devices import DeviceSpec, canonical_name, make_device
from automap.errors import DeviceMapError, PlanError
from automap.profile import Profile, Unit
from automap.units import format_bytes

STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")
JSON_VERSION = 1


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

    @property
    def used_bytes(self) -> int:
        return self.weight_bytes + self.activation_bytes + self.reserve_bytes


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
        strategy: the strategy that made it (``"user"`` for a given device map).
        tie_groups: tensor names that share storage (kept on one device).
        cut_bytes: bytes crossing the boundary before each unit (``cut_bytes[0]`` is the input).
        example: how the profile's example inputs were chosen ("" = bytes only).
        warnings: things the user should know (units offloaded, tied weights split, ...).
    """

    units: tuple[Unit, ...]
    devices: tuple[DeviceSpec, ...]
    placement: tuple[str, ...]
    strategy: str
    tie_groups: tuple[tuple[str, ...], ...] = ()
    cut_bytes: tuple[int, ...] = ()
    example: str = ""
    warnings: tuple[str, ...] = field(default=())

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

    @property
    def used_devices(self) -> tuple[str, ...]:
        return tuple(d.name for d in self.devices if d.name in set(self.placement))

    @property
    def execution_device(self) -> str:
        """Where offloaded units compute: the first accelerator in the plan, else the CPU."""
        for name in self.used_devices:
            if self.device(name).is_accelerator:
                return name
        return "cpu"

    def is_offloaded(self, device_name: str) -> bool:
        """True when units placed on ``device_name`` are streamed to the execution device."""
        return device_name == "disk" or (device_name == "cpu" and self.execution_device != "cpu")

    @property
    def offloaded_units(self) -> tuple[str, ...]:
        return tuple(u.name for u, d in zip(self.units, self.placement) if self.is_offloaded(d))

    @property
    def device_map(self) -> dict[str, int | str]:
        """The Hugging Face / accelerate form: ``{"model.layers.0": 0, ..., "lm_head": "cpu"}``.

        Keys are unit names, plus the full names of tensors held by non-unit modules; together
        they cover every parameter and buffer. Accepted as-is by ``from_pretrained(device_map=)``
        and ``accelerate.dispatch_model``.
        """
        result: dict[str, int | str] = {}
        for unit, where in zip(self.units, self.placement):
            value = self.device(where).map_value
            result[unit.name] = value
            for tensor in unit.loose:
                result[tensor] = value
        return result

    def bytes_on(self, device_name: str) -> int:
        return sum(u.weight_bytes for u, d in zip(self.units, self.placement) if d == device_name)

    def flops_on(self, device_name: str) -> int:
        return sum(u.flops for u, d in zip(self.units, self.placement) if d == device_name)

    def link_seconds(self, nbytes: int, src: str, dst: str) -> float:
        """Predicted time to move ``nbytes`` between two devices (the slower link bounds it)."""
        if src == dst or nbytes == 0:
            return 0.0
        bandwidth = min(self.device(src).link_bytes_per_second, self.device(dst).link_bytes_per_second)
        return nbytes / max(bandwidth, 1.0)

    def compute_device(self, device_name: str) -> str:
        """Where units placed on ``device_name`` compute (offloaded ones on the execution device)."""
        return self.execution_device if self.is_offloaded(device_name) else device_name

    def cuts(self) -> tuple[Cut, ...]:
        """Every boundary where consecutive units compute on different devices."""
        result = []
        for i in range(1, len(self.units)):
            src, dst = self.compute_device(self.placement[i - 1]), self.compute_device(self.placement[i])
            if src != dst:
                nbytes = self.cut_bytes[i] if i < len(self.cut_bytes) else self.units[i - 1].output_bytes
                result.append(Cut(self.units[i - 1].name, self.units[i].name, src, dst, nbytes,
                                  self.link_seconds(nbytes, src, dst)))
        return tuple(result)

    def summary(self) -> tuple[DeviceSummary, ...]:
        """Per device: units, bytes, FLOPs share and predicted stage time (compute there, plus
        streaming of offloaded weights, plus the transfers into it)."""
        total_flops = sum(u.flops for u in self.units) or 1
        incoming: dict[str, float] = {}
        for cut in self.cuts():
            incoming[cut.dst_device] = incoming.get(cut.dst_device, 0.0) + cut.seconds
        rows = []
        for device in self.devices:
            units = [u for u, d in zip(self.units, self.placement) if d == device.name]
            flops = sum(u.flops for u in units)
            compute = self.device(self.compute_device(device.name))
            seconds = flops / max(compute.flops_per_second, 1.0)
            if self.is_offloaded(device.name):
                seconds += self.link_seconds(sum(u.weight_bytes for u in units), device.name, compute.name)
            seconds += incoming.get(device.name, 0.0) if units else 0.0
            activations = max((u.peak_activation_bytes for u in units), default=0)
            rows.append(DeviceSummary(device, tuple(u.name for u in units), sum(u.weight_bytes for u in units),
                                      0 if self.is_offloaded(device.name) else activations, 0, flops,
                                      flops / total_flops, seconds))
        return tuple(rows)

    @property
    def bottleneck_seconds(self) -> float:
        """The slowest stage's predicted time: the pipeline's steady-state period."""
        return max((s.stage_seconds for s in self.summary()), default=0.0)

    @property
    def forward_seconds(self) -> float:
        """Predicted time of one unpipelined forward: every stage in turn."""
        return sum(s.stage_seconds for s in self.summary())

    # -------------------------------------------------------------- rendering

    def report(self) -> str:
        """A human-readable table: per device bytes, share of FLOPs and unit range."""
        from automap.report import render_text

        return render_text(self)

    def to_json(self, indent: int | None = 2) -> str:
        """Serialise to JSON with a top-level ``"device_map"`` key (stable schema)."""
        return json.dumps(plan_to_dict(self), indent=indent)

    @staticmethod
    def from_json(text: str) -> Plan:
        """Rebuild a plan written by :meth:`to_json`."""
        return plan_from_dict(json.loads(text))


def plan_to_dict(plan: Plan) -> dict[str, Any]:
    total_flops = sum(u.flops for u in plan.units) or 1
    return {
        "version": JSON_VERSION,
        "strategy": plan.strategy,
        "example": plan.example,
        "execution_device": plan.execution_device,
        "device_map": plan.device_map,
        "devices": [
            {**asdict(d), "used_bytes": plan.bytes_on(d.name),
             "flops_share": plan.flops_on(d.name) / total_flops}
            for d in plan.devices
        ],
        "units": [{**asdict(u), "device": d} for u, d in zip(plan.units, plan.placement)],
        "tie_groups": [list(g) for g in plan.tie_groups],
        "cut_bytes": list(plan.cut_bytes),
        "warnings": list(plan.warnings),
    }


def plan_from_dict(data: Mapping[str, Any]) -> Plan:
    if data.get("version") != JSON_VERSION:
        raise PlanError(f"plan JSON has version {data.get('version')!r}; this automap reads version {JSON_VERSION}")
    devices = tuple(
        DeviceSpec(d["name"], d["kind"], int(d["capacity_bytes"]), float(d["flops_per_second"]),
                   float(d["link_bytes_per_second"]))
        for d in data["devices"]
    )
    fields = set(Unit.__dataclass_fields__)
    units = tuple(
        Unit(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in u.items() if k in fields})
        for u in data["units"]
    )
    return Plan(
        units=units,
        devices=devices,
        placement=tuple(u["device"] for u in data["units"]),
        strategy=data["strategy"],
        tie_groups=tuple(tuple(g) for g in data.get("tie_groups", [])),
        cut_bytes=tuple(int(c) for c in data.get("cut_bytes", [])),
        example=data.get("example", ""),
        warnings=tuple(data.get("warnings", [])),
    )


# ------------------------------------------------------------------ strategies


def _unit_cost(unit: Unit, device: DeviceSpec, use_flops: bool) -> float:
    if use_flops:
        return unit.flops / max(device.flops_per_second, 1.0)
    return float(unit.weight_bytes)


def _fill(units: tuple[Unit, ...], devices: list[DeviceSpec], start: int,
          capacity: dict[str, int]) -> list[str]:
    """Place units from ``start`` on, contiguously, filling each device in turn."""
    placement: list[str] = []
    di = 0
    for unit in units[start:]:
        while di < len(devices) and capacity[devices[di].name] < unit.weight_bytes:
            di += 1
        if di == len(devices):
            raise _no_room(unit, devices, capacity)
        capacity[devices[di].name] -= unit.weight_bytes
        placement.append(devices[di].name)
    return placement


def _no_room(unit: Unit, devices: list[DeviceSpec], capacity: dict[str, int]) -> PlanError:
    biggest = max((d.capacity_bytes for d in devices), default=0)
    if unit.weight_bytes > biggest:
        return PlanError(
            f"unit {unit.name!r} needs {format_bytes(unit.weight_bytes)} but the largest device holds "
            f"{format_bytes(biggest)}; raise max_memory for one device, or split the unit further "
            "with no_split=[...]"
        )
    free = ", ".join(f"{d.name} {format_bytes(capacity[d.name])} free of {format_bytes(d.capacity_bytes)}"
                     for d in devices)
    return PlanError(
        f"the model does not fit: unit {unit.name!r} ({format_bytes(unit.weight_bytes)}) finds no room "
        f"({free}); raise max_memory, or allow 'disk' with more space"
    )


def _balanced_partition(units: tuple[Unit, ...], devices: list[DeviceSpec],
                        reserve: dict[str, int], use_flops: bool) -> list[str] | None:
    """Contiguous split of ``units`` over ``devices`` (in order) minimising the largest stage
    cost within every capacity; None when no split fits. Dynamic programme over prefixes."""
    n, k = len(units), len(devices)
    inf = float("inf")
    prefix_bytes = [0]
    for u in units:
        prefix_bytes.append(prefix_bytes[-1] + u.weight_bytes)
    # best[j][i]: minimal bottleneck placing units[:i] on devices[:j]; choice for backtracking.
    best = [[inf] * (n + 1) for _ in range(k + 1)]
    choice = [[0] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0.0
    for j in range(1, k + 1):
        dev = devices[j - 1]
        room = dev.capacity_bytes - reserve.get(dev.name, 0)
        costs = [_unit_cost(u, dev, use_flops) for u in units]
        prefix_cost = [0.0]
        for c in costs:
            prefix_cost.append(prefix_cost[-1] + c)
        for i in range(n + 1):
            lo = i
            while lo > 0 and prefix_bytes[i] - prefix_bytes[lo - 1] <= room:
                lo -= 1
            for s in range(lo, i + 1):
                if best[j - 1][s] == inf:
                    continue
                value = max(best[j - 1][s], prefix_cost[i] - prefix_cost[s])
                if value < best[j][i]:
                    best[j][i], choice[j][i] = value, s
    if best[k][n] == inf:
        return None
    placement = [""] * n
    i = n
    for j in range(k, 0, -1):
        s = choice[j][i]
        for t in range(s, i):
            placement[t] = devices[j - 1].name
        i = s
    return placement


def _tiered(units: tuple[Unit, ...], devices: tuple[DeviceSpec, ...], strategy: str,
            use_flops: bool) -> list[str]:
    accelerators = [d for d in devices if d.is_accelerator]
    capacity = {d.name: d.capacity_bytes for d in devices}
    if accelerators and strategy != "sequential":
        pool = accelerators
        reserve: dict[str, int] = {}
        if strategy == "balanced_low_0" and len(pool) > 1:
            reserve[pool[0].name] = pool[0].capacity_bytes // 2
        placed = _balanced_partition(units, pool, reserve, use_flops)
        if placed is not None:
            return placed
    return _fill(units, list(devices), 0, capacity)


def _colocate_ties(profile: Profile, placement: list[str]) -> list[str]:
    """Put every unit that holds a name of a tie group on the device of the group's owner."""
    where = {u.name: i for i, u in enumerate(profile.units)}
    for group in profile.tie_groups:
        holders = [u.name for u in profile.units
                   if any(t == u.name or t.startswith(u.name + ".") or u.name == "" for t in group)
                   or any(t in u.tensors for t in group)]
        owners = [u.name for u in profile.units if any(t in u.tensors for t in group)]
        if not owners:
            continue
        target = placement[where[owners[0]]]
        for name in holders:
            placement[where[name]] = target
    return placement


def make_plan(profile: Profile, devices: tuple[DeviceSpec, ...], strategy: str = "auto") -> Plan:
    """Place ``profile``'s units on ``devices`` with a named strategy."""
    if strategy not in STRATEGIES:
        raise PlanError(f"unknown strategy {strategy!r}; use one of {', '.join(STRATEGIES)} or a dict")
    if not devices:
        raise PlanError("no devices to place on; give max_memory={'cpu': '8GiB'} or similar")
    placement = _tiered(profile.units, devices, strategy, profile.has_compute)
    placement = _colocate_ties(profile, placement)
    return _finish(profile, devices, placement, strategy)


def _finish(profile: Profile, devices: tuple[DeviceSpec, ...], placement: list[str], strategy: str) -> Plan:
    cuts = tuple(profile.cut_bytes(i) for i in range(len(profile.units)))
    plan = Plan(units=profile.units, devices=devices, placement=tuple(placement), strategy=strategy,
                tie_groups=profile.tie_groups, cut_bytes=cuts, example=profile.example)
    notes: list[str] = []
    if plan.offloaded_units:
        notes.append(f"{len(plan.offloaded_units)} unit(s) offloaded, streamed to "
                     f"{plan.execution_device} when they run")
    if not profile.example:
        notes.append("no example inputs: balanced by bytes, not FLOPs")
    if profile.uncalled:
        notes.append(f"{len(profile.uncalled)} unit(s) never called in the traced forward: {', '.join(profile.uncalled[:3])}")
    return Plan(**{**plan.__dict__, "warnings": tuple(notes)})


# ------------------------------------------------------------------ user maps


def plan_from_device_map(profile: Profile, devices: tuple[DeviceSpec, ...],
                         device_map: Mapping[str, int | str], tensor_names: Iterable[str],
                         module_names: set[str]) -> Plan:
    """Turn a user device map (HF/accelerate form) into a :class:`Plan` after validating it.

    Raises:
        DeviceMapError: a key names no module or tensor, a value names no device, or a
            tensor is left without a device, or one unit is split over several devices.
    """
    normalised: dict[str, str] = {}
    for key, value in device_map.items():
        if not isinstance(key, str):
            raise DeviceMapError(f"device_map key {key!r} is not a module name string")
        if key not in module_names and key not in tensor_names:
            close = sorted(n for n in module_names if n and (n.startswith(key) or key.startswith(n)))[:3]
            raise DeviceMapError(
                f"device_map names {key!r}, which is not a module or tensor of the model"
                + (f"; did you mean {close}?" if close else "; list names with model.named_modules()")
            )
        normalised[key] = canonical_name(value)
    missing = [t for t in tensor_names if _lookup(normalised, t) is None]
    if missing:
        raise DeviceMapError(
            f"device_map leaves {len(missing)} tensor(s) without a device, first {missing[:5]}; "
            "add their modules (or a parent such as '') to the map"
        )
    known = {d.name: d for d in devices}
    extra = [make_device(n, 0) for n in sorted(set(normalised.values())) if n not in known]
    all_devices = tuple(sorted(devices + tuple(extra), key=DeviceSpec.sort_key))
    placement = []
    for unit in profile.units:
        spots = {_lookup(normalised, t) for t in unit.tensors} or {_lookup(normalised, unit.name + ".x")}
        spots.discard(None)
        if len(spots) > 1:
            raise DeviceMapError(
                f"device_map splits unit {unit.name!r} over {sorted(spots)}; automap keeps units whole. "
                f"Map {unit.name!r} to one device, or pass no_split=[] to make its children units"
            )
        placement.append(spots.pop() if spots else all_devices[0].name)
    return _finish(profile, all_devices, placement, "user")


def _lookup(device_map: Mapping[str, str], name: str) -> str | None:
    """Longest dotted-prefix match, as transformers and accelerate read device maps."""
    probe = name
    while True:
        if probe in device_map:
            return device_map[probe]
        if not probe:
            return None
        probe = probe.rpartition(".")[0]
