"""User device maps (the Hugging Face / accelerate dict form), validated and turned into a Plan."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Iterable, Mapping, Sequence

from automap.devices import DeviceSpec, canonical_name, make_device
from automap.errors import DeviceError, DeviceMapError
from automap.kinds import is_host_name
from automap.planning.model import Origin, Plan
from automap.planning.predict import over_capacity_notes, tie_split_notes
from automap.planning.layout_plans import build_plan
from automap.profiling import Profile
from automap.profiling.units import longest_prefix


@dataclass(frozen=True)
class UserMap:
    """A user's dict device map, parsed once at the public door (:func:`parse_device_map`): every
    key names a module or tensor of the model under its first name, every value is a canonical
    device name, in the user's order. Only this value travels on; nothing re-reads the raw map.

    Attributes:
        devices: key -> canonical device name (``{"model.layers.0": "cuda:0", "lm_head": "disk"}``).
        tensors: every tensor name of the model, second names of tied tensors included.
        modules: every module name of the model (first names).
    """

    devices: Mapping[str, str]
    tensors: tuple[str, ...]
    modules: frozenset[str]

    def device_of(self, name: str) -> str | None:
        """The device the map gives ``name`` (a module, a tensor) by longest dotted prefix."""
        return longest_prefix(self.devices, name)


def parse_device_map(
    device_map: Mapping[object, object],
    named_modules: Iterable[tuple[str, object]],
    tensor_names: Iterable[str],
) -> UserMap:
    """Parse ``device_map`` (the Hugging Face / accelerate dict form) against a model: keys
    reaching a module through a second name (a module registered twice: ``self.b = self.a``,
    ALBERT's shared layer) are written with its first name, as ``named_modules()`` lists it (``b``
    and ``b.weight`` become ``a`` and ``a.weight``), and values become canonical device names.

    Args:
        device_map: ``{"module.name": 0 | "cuda:0" | "cpu" | "disk"}``.
        named_modules: ``model.named_modules(remove_duplicate=False)``.
        tensor_names: every tensor name of the model, second names included.

    Raises:
        DeviceMapError: a key that is not a string or names no module or tensor of the model, a
            value that names no device, or one module put on two devices under its two names.
    """
    for key in device_map:
        if not isinstance(key, str):
            raise DeviceMapError(f"device_map key {key!r} is not a module name string")
    first, other = _first_names(named_modules)
    aliases = {name: name for name in other}
    tensors = tuple(tensor_names)
    known = set(tensors)
    devices: dict[str, str] = {}
    for key, value in device_map.items():
        assert isinstance(key, str)
        alias = longest_prefix(aliases, key)
        named = key if alias is None else other[alias] + key[len(alias) :]
        if named not in first and named not in known:
            close = sorted(n for n in first if n and (n.startswith(named) or named.startswith(n)))[:3]
            raise DeviceMapError(
                f"device_map names {key!r}, which is not a module or tensor of the model"
                + (f"; did you mean {close}?" if close else "; list names with model.named_modules()")
            )
        try:
            device = canonical_name(value)
        except DeviceError as exc:
            raise DeviceMapError(f"device_map[{key!r}] = {value!r} is not a device: {exc}") from exc
        if named in devices and devices[named] != device:
            raise DeviceMapError(
                f"device_map puts {named!r} on {devices[named]!r} and, under its other name {key!r}, "
                f"on {value!r}: it is one module; map it to one device"
            )
        devices[named] = device
    return UserMap(MappingProxyType(devices), tensors, frozenset(first))


def _first_names(named_modules: Iterable[tuple[str, object]]) -> tuple[dict[str, None], dict[str, str]]:
    """Every module's first name (in order), and each second name -> the first."""
    seen: dict[int, str] = {}
    first: dict[str, None] = {}
    other: dict[str, str] = {}
    for name, module in named_modules:
        if seen.setdefault(id(module), name) != name:
            other[name] = seen[id(module)]
        else:
            first[name] = None
    return first, other


def loose_homes(user_map: UserMap, units: Sequence[str]) -> dict[str, str]:
    """For each tensor held outside every unit (ViT's ``class_token``), the first unit inside
    its holder that ``device_map`` puts on the tensor's device: where a profile without a trace
    attaches it, so that the map's units stay whole.

    Example:
        >>> loose_homes(parse_device_map({"conv_proj": 0, "class_token": 1, "encoder": 1}, ...),
        ...             ["conv_proj", "encoder"])
        {'class_token': 'encoder'}
    """
    where = user_map.devices
    unit_of = {u: u for u in units}
    homes = {}
    for name in user_map.tensors:
        holder = name.rpartition(".")[0]
        if longest_prefix(unit_of, holder) is not None:
            continue  # held by a unit
        device = longest_prefix(where, name)
        for unit in units:
            if (not holder or unit.startswith(holder + ".")) and longest_prefix(where, unit) == device:
                homes[name] = unit
                break
    return homes


def _unit_device(profile: Profile, index: int, normalised: Mapping[str, str], default: str) -> str:
    unit = profile.units[index]
    spots = {longest_prefix(normalised, t) for t in unit.tensors} or {
        longest_prefix(normalised, unit.name + ".x")
    }
    spots.discard(None)
    if len(spots) > 1:
        raise DeviceMapError(_split_message(unit.name, unit.tensors, normalised))
    found = spots.pop() if spots else None
    return found or default


def _split_message(unit: str, tensors: Sequence[str], normalised: Mapping[str, str]) -> str:
    """Why a map that puts the tensors of one unit on several devices is refused, naming one
    tensor on each device, and the fix that applies: a unit that is a module with children can
    be cut into them (``no_split=[]``); tensors a module holds itself stay with it."""
    first: dict[str, str] = {}
    for tensor in tensors:
        first.setdefault(longest_prefix(normalised, tensor) or "?", tensor)
    where = ", ".join(f"{t!r} on {d!r}" for d, t in sorted(first.items()))
    holders = {t.rpartition(".")[0] for t in first.values()}
    below = all(h != unit and (not unit or h.startswith(unit + ".")) for h in holders)
    common = ".".join(os.path.commonprefix([h.split(".") for h in holders]))
    fix = (
        f"map {unit!r} to one device, or pass no_split=[] to make its children units"
        if below
        else f"map {common!r}, which holds them, to one device"
        if common
        else "map them to one device"
    )
    return (
        f"device_map puts {where}, which automap keeps in one unit {unit!r} (a module's own tensors run with it); "
        f"{fix}"
    )


def map_execution_device(plan: Plan) -> str:
    """Where the units of ``plan.device_map`` on ``"cpu"`` and ``"disk"`` compute when the map
    alone is read, as accelerate's ``dispatch_model`` and ``from_pretrained(device_map=...)``
    read it: on the lowest-numbered GPU the map names (accelerate takes the first of the set
    of its GPU values, which for GPU indices is the lowest), or on the CPU when it names none.
    This is a user map's execution device in automap too (:func:`plan_from_device_map`)."""
    return next((d for d in plan.used_devices if plan.device(d).is_accelerator), "cpu")


def expressible(plan: Plan) -> bool:
    """Whether ``plan.device_map`` alone means ``plan`` to every reader of the format: its units
    on ``"cpu"`` and ``"disk"`` compute where :func:`map_execution_device` says. Not so when
    the CPU computes its units while GPUs keep others, or when units stream into a GPU that
    holds none (or is not the lowest-numbered one holding some)."""
    reading = map_execution_device(plan)
    return all(
        plan.placements.by_home[where].compute == reading
        for where in plan.placement
        if not plan.device(where).is_accelerator
    )


def plan_from_device_map(profile: Profile, devices: tuple[DeviceSpec, ...], user_map: UserMap) -> Plan:
    """Turn a parsed user device map into a :class:`Plan`.

    Args:
        profile: the model's profile, with the map's module keys as units.
        devices: the known devices; devices the map names beyond them are added with no budget.
        user_map: the map, parsed by :func:`parse_device_map`. A tensor with several names
            (``profile.tie_groups``: BERT's ``lm_head.bias`` is ``lm_head.decoder.bias``) is
            placed when the map places one of them.

    Raises:
        DeviceMapError: a tensor is left without a device, or one unit is split over several
            devices.
    """
    tensors = user_map.tensors
    normalised = user_map.devices
    ties = {name: group for group in profile.tie_groups for name in group}
    missing = [t for t in tensors if all(longest_prefix(normalised, n) is None for n in ties.get(t, (t,)))]
    if missing:
        raise DeviceMapError(
            f"device_map leaves {len(missing)} tensor(s) without a device, first {missing[:5]}; "
            "add their modules (or a parent such as '') to the map"
        )
    known = {d.name: d for d in devices}
    extra = [make_device(n, 0) for n in sorted(set(normalised.values())) if n not in known]
    if not any(
        is_host_name(n) for n in (*known, *normalised.values())
    ):  # max_memory without "cpu": it computes
        extra.append(make_device("cpu", 0))
    all_devices = tuple(sorted(devices + tuple(extra), key=DeviceSpec.sort_key))
    default = all_devices[0].name
    placement = [_unit_device(profile, i, normalised, default) for i in range(len(profile.units))]
    plan = build_plan(profile, all_devices, placement, "", {}, origin=Origin.USER)
    notes = tie_split_notes(plan) + over_capacity_notes(plan)
    return replace(plan, provenance=replace(plan.provenance, warnings=plan.warnings + tuple(notes)))
