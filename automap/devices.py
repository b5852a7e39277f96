"""Devices a plan can use: real ones detected on this machine, or hypothetical ones from
``max_memory``. Nothing here places anything; it only describes capacity, speed and links.

torch is imported by the functions that ask it about this machine's hardware, not with the
module: the ``automap`` command checks ``--max-memory`` before it imports torch.
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass, replace
from typing import Any, Mapping, Sequence, Union

from automap.errors import DeviceError, SizeError
from automap.kinds import available_ram_bytes, find_kind, integer_kind, kind_of, registered_kinds
from automap.machine import disk_key, machine_record, measured_figures, stable_capacities
from automap.sizes import MAX_COUNT, MAX_RATE, parse_number, parse_size, shown

log = logging.getLogger(__name__)

MaxMemory = Mapping[Union[int, str], Union[int, float, str]]
Reserve = Union[int, str, Mapping[Union[int, str], Union[int, float, str]], None]

# Sustained compute (FLOP/s) and the bandwidth (bytes/s) of the link that feeds the device,
# per kind: each kind's entry in the registry (automap.kinds) owns them. They are deliberately
# round numbers: what matters to the balancer is their ratio, and a measured profile
# (automap.profiling.calibrated_device and Profile.with_measured_time) replaces them when precision matters.
DEFAULT_FLOPS = {k.name: k.flops_per_second for k in registered_kinds()}
DEFAULT_LINK = {k.name: k.link_bytes_per_second for k in registered_kinds()}
# Bandwidth of the device's own memory (bytes/s): what bounds a decode step, which reads every
# resident weight and the cache once per token.
DEFAULT_MEMORY = {k.name: k.memory_bytes_per_second for k in registered_kinds()}
ACCELERATORS = tuple(k.name for k in registered_kinds() if k.is_accelerator)


@dataclass(frozen=True)
class DeviceSpec:
    """One place a unit's weights can live.

    Attributes:
        name: canonical name: ``"cuda:0"``, ``"xpu:0"``, ``"mps"``, ``"cpu"`` or ``"disk"``.
        kind: ``"cuda"``, ``"xpu"``, ``"mps"``, ``"cpu"`` or ``"disk"``.
        capacity_bytes: how many bytes of weights, activations and reserve may live there.
        flops_per_second: sustained compute; 0 for disk, which never computes. Measured on the
            CPU: the rate of a transformer layer's ops (``machine_probes.LAYER_SHAPE``).
        link_bytes_per_second: bandwidth of the link to the other devices (PCIe/NVLink for a
            GPU, host-to-device for CPU RAM, read bandwidth for disk).
        memory_bytes_per_second: bandwidth of its own memory, read by the computations on it
            (HBM, DDR); for disk, its read bandwidth.
        measured: the figures here measured on this machine (:mod:`automap.machine`); the
            others are the kind's defaults, or given (``max_memory``, ``speeds``, ...).
        row_seconds: what a matrix-vector product pays per row of a weight beside its bytes
            (a dot product's start and its sum); 0: not measured.
        op_seconds: what each op costs beside its work (dispatching it, the code around it);
            0: not measured.
        large_flops_per_second: the rate of a large linear layer's matmul, measured on the
            CPU (a unit of large matmuls runs near it; ``planning.cost.compute_rate``); 0: not
            measured, every op at ``flops_per_second``.
        read_cpu_seconds_per_byte: for a tier read from (disk), the compute time a byte read
            costs a CPU computation on torch's threads beside it (the kernel's page-cache and
            page-table work, read as the offload reader reads, and the threads it holds back:
            ``disk_probe.compute_loss``); 0: not measured.
        spare_cores: for the CPU, the cores torch's threads leave free: 0 when they fill them,
            and then the offloaded reads' CPU time is taken from the compute (1 by default).
    """

    name: str
    kind: str
    capacity_bytes: int
    flops_per_second: float
    link_bytes_per_second: float
    memory_bytes_per_second: float = 0.0
    measured: tuple[str, ...] = ()
    row_seconds: float = 0.0
    op_seconds: float = 0.0
    read_cpu_seconds_per_byte: float = 0.0
    spare_cores: int = 1
    large_flops_per_second: float = 0.0

    @property
    def is_accelerator(self) -> bool:
        return kind_of(self).is_accelerator

    @property
    def index(self) -> int | None:
        return int(self.name.split(":")[1]) if ":" in self.name else None

    @property
    def map_value(self) -> int | str:
        """The value Hugging Face / accelerate device maps use: ``0`` for cuda:0, else the name."""
        return self.index if kind_of(self).integer_keys and self.index is not None else self.name

    def sort_key(self) -> tuple[int, int]:
        return (kind_of(self).rank, self.index or 0)


def canonical_name(key: int | str) -> str:
    """Return the canonical device name of a ``max_memory`` / device-map key.

    Raises:
        DeviceError: the key names no kind of device automap knows.
    """
    if isinstance(key, bool):
        raise DeviceError(f"device key {key!r} is a bool; use 0, 'cuda:0', 'mps', 'cpu' or 'disk'")
    if isinstance(key, int):
        index = parse_number(
            key,
            "device index",
            integral=True,
            maximum=MAX_COUNT,
            error=DeviceError,
            hint="GPU indices start at 0, e.g. 0 or 'cuda:0'",
        )
        return f"{integer_kind().name}:{int(index)}"
    if (
        type(key).__module__ == "torch" and type(key).__name__ == "device"
    ):  # torch.device, torch not imported here
        key = str(key)
    if not isinstance(key, str):
        raise DeviceError(
            f"device key {shown(key)} has type {type(key).__name__}; use 0, 'cuda:0', 'cpu' or 'disk'"
        )
    text = key.strip().lower()
    if len(text) > 40:  # no device name is this long; a long digit string is no index either
        raise DeviceError(
            f"unknown device {shown(key)}; use a GPU index (0), 'cuda:0', 'xpu:0', 'mps', 'cpu' or 'disk'"
        )
    if text.isascii() and text.isdigit():
        return canonical_name(int(text))
    if text == "meta":
        raise DeviceError("'meta' holds no data and cannot be a placement; use 'cpu' or 'disk'")
    name = _kind_name(text)
    if name is None:
        raise DeviceError(
            f"unknown device {key!r}; use a GPU index (0), 'cuda:0', 'xpu:0', 'mps', 'cpu' or 'disk'"
        )
    return name


def _kind_name(text: str) -> str | None:
    """``text`` (lowercase) as its kind writes it, or None: an indexed kind reads ``k`` as
    ``k:0``; an unindexed one takes no index unless it is an alias (``mps:0`` is ``mps``)."""
    base, sep, index = text.partition(":")
    kind = find_kind(base)
    if kind is None or (sep and not (index.isascii() and index.isdigit())):
        return None
    if kind.indexed:
        number = parse_number(
            int(index) if sep else 0,
            f"device index in {text!r}",
            integral=True,
            maximum=MAX_COUNT,
            error=DeviceError,
            hint="GPU indices start at 0, e.g. 'cuda:0'",
        )
        return f"{base}:{int(number)}"
    return base if not sep or kind.index_alias else None


def parse_max_memory(max_memory: MaxMemory, field: str = "max_memory") -> dict[str, int]:
    """Normalise a ``max_memory`` mapping (or another per-device size mapping, named ``field``
    in errors: ``reserve``) to ``{canonical name: bytes}``.

    Raises:
        DeviceError: not a mapping, or a key names no device.
        SizeError: a budget is not a size (a fraction such as ``0.5`` included: budgets are
            bytes), or two keys name the same device (``0`` and ``"cuda:0"``).

    Example:
        >>> parse_max_memory({0: "10GiB", "cpu": "500MB"})
        {'cuda:0': 10737418240, 'cpu': 500000000}
    """
    if not isinstance(max_memory, Mapping):
        raise DeviceError(
            f"{field} must be a dict such as {{0: '20GiB', 'cpu': '64GiB'}}, got {type(max_memory).__name__}"
        )
    result: dict[str, int] = {}
    given: dict[str, Any] = {}
    for key, value in max_memory.items():
        name = canonical_name(key)
        if name in result:
            raise SizeError(
                f"{field} gives {name!r} two budgets ({given[name]!r}: {max_memory[given[name]]!r} "
                f"and {key!r}: {value!r}); keep one"
            )
        result[name], given[name] = parse_size(value, f"{field}[{key!r}]"), key
    return result


def parse_max_memory_text(text: str) -> dict[int | str, str]:
    """Parse the command line's ``0=20GiB,1=20GiB,cpu=64GiB,disk=500GiB`` into the accelerate
    form, checked as :func:`parse_max_memory` checks it (no torch needed).

    Raises:
        DeviceError, SizeError: see :func:`parse_max_memory`; SizeError also for an item that
            is not ``device=size``, a device named twice, or nothing at all.

    Example:
        >>> parse_max_memory_text("0=20GiB,cpu=64GiB")
        {0: '20GiB', 'cpu': '64GiB'}
    """
    result: dict[int | str, str] = {}
    for pair in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = pair.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise SizeError(
                f"--max-memory expects device=size pairs separated by commas, got {pair!r}; "
                "e.g. --max-memory 0=20GiB,1=20GiB,cpu=64GiB,disk=500GiB"
            )
        device: int | str = int(key.strip()) if key.strip().isdigit() else key.strip()
        if device in result:
            raise SizeError(
                f"--max-memory gives {key.strip()!r} two budgets ({result[device]} and "
                f"{value.strip()}); keep one"
            )
        result[device] = value.strip()
    if not result:
        raise SizeError("--max-memory is empty; e.g. --max-memory 0=20GiB,cpu=64GiB")
    parse_max_memory(result)
    return result


def make_device(
    name: str,
    capacity_bytes: int,
    *,
    flops_per_second: float | None = None,
    link_bytes_per_second: float | None = None,
    memory_bytes_per_second: float | None = None,
) -> DeviceSpec:
    """Build a :class:`DeviceSpec` with per-kind default speeds unless given."""
    canonical = canonical_name(name)
    kind = kind_of(canonical)
    return DeviceSpec(
        name=canonical,
        kind=kind.name,
        capacity_bytes=int(capacity_bytes),
        flops_per_second=kind.flops_per_second if flops_per_second is None else float(flops_per_second),
        link_bytes_per_second=kind.link_bytes_per_second
        if link_bytes_per_second is None
        else float(link_bytes_per_second),
        memory_bytes_per_second=kind.memory_bytes_per_second
        if memory_bytes_per_second is None
        else float(memory_bytes_per_second),
    )


def free_disk_bytes(path: str | os.PathLike[str] | None = None) -> int:
    """Free space on the file system holding ``path`` (the working directory when None)."""
    target = os.fspath(path) if path is not None else os.getcwd()
    while target and not os.path.exists(target):
        target = os.path.dirname(target)
    return shutil.disk_usage(target or ".").free


def _detect_accelerators() -> dict[str, int]:
    """Each kind's own detection (the accelerators'; CPU RAM and disk are sized below)."""
    found: dict[str, int] = {}
    for kind in registered_kinds():
        detect = kind.factory("detect")
        if detect is not None:
            found.update(detect())
    return found


def detect_devices(
    max_memory: MaxMemory | None = None,
    *,
    offload_dir: str | None = None,
    speeds: Mapping[str, float] | None = None,
    links: Mapping[str, float] | None = None,
    bandwidths: Mapping[str, float] | None = None,
    dtype: str | None = None,
) -> tuple[DeviceSpec, ...]:
    """The devices a plan may use, fastest tier first.

    With ``max_memory`` the devices are exactly the ones it names (they need not exist on
    this machine: that is how hypothetical hardware is planned), plus ``"disk"`` with the
    free space of ``offload_dir`` unless ``max_memory`` sets it. Without it (None or an empty
    mapping), the real GPUs, CPU RAM and disk of this machine are detected. Free space is read
    as :mod:`automap.machine` records it (rounded down, kept while it holds), and the speeds of
    the devices this machine has are its measured ones (see :func:`automap.machine.machine_record`);
    a device it lacks keeps its kind's defaults.

    Args:
        max_memory: ``{0: "20GiB", "cpu": "64GiB", "disk": "1TB"}`` in the accelerate form.
        offload_dir: where disk offload would go (for its free space).
        speeds: optional FLOP/s per device name or kind, e.g. ``{"cuda": 300e12}``.
        links: optional link bandwidth (bytes/s) per device name or kind, e.g. ``{"cuda": 300e9}``
            for NVLink.
        bandwidths: optional memory bandwidth (bytes/s) per device name or kind, e.g.
            ``{"cuda": 3.35e12, "cpu": 12e9}``: what decode speed predictions read.
        dtype: the dtype the model computes in (``"bfloat16"``): which measured matmul rate
            a device gets (float32 when None).

    Example:
        >>> detect_devices({0: "20GiB", 1: "20GiB", "cpu": "64GiB"}, speeds={"cuda": 300e12})
    """
    detect = max_memory is None or (isinstance(max_memory, Mapping) and not max_memory)  # {}: as None
    if not detect:
        budget = parse_max_memory(max_memory)  # type: ignore[arg-type]
        fresh = {}
    else:
        fresh = {**_detect_accelerators(), "cpu": available_ram_bytes()}
        budget = {}
    fresh.update(
        {
            kind.name: free_disk_bytes(offload_dir)
            for kind in registered_kinds()
            if kind.stores_only and kind.name not in budget
        }
    )  # disk: the free space of offload_dir
    record = machine_record(offload_dir)
    keys = {name: disk_key(offload_dir) if kind_of(name).stores_only else name for name in fresh}
    stable = stable_capacities(record, {keys[name]: value for name, value in fresh.items()})
    budget.update({name: stable[keys[name]] for name in fresh})
    devices = [
        _measured(make_device(name, cap), name in fresh, record, dtype, offload_dir)
        for name, cap in budget.items()
    ]
    devices = [replace(d, spare_cores=_spare_cores()) if kind_of(d.name).is_host else d for d in devices]
    devices = [_override(d, "flops_per_second", speeds) for d in devices]
    devices = [_override(d, "link_bytes_per_second", links) for d in devices]
    devices = [_override(d, "memory_bytes_per_second", bandwidths) for d in devices]
    return tuple(sorted(devices, key=DeviceSpec.sort_key))


def _spare_cores() -> int:
    """The cores this process may run on that torch's threads leave free."""
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(cores - torch.get_num_threads(), 0)


# The argument each DeviceSpec field is given by, for messages.
_ARGUMENTS = {
    "flops_per_second": "speeds",
    "link_bytes_per_second": "links",
    "memory_bytes_per_second": "bandwidths",
}


def parse_rates(values: object, argument: str) -> dict[str, float]:
    """``speeds`` / ``links`` / ``bandwidths`` as ``{device name or kind: per second}``, each
    value read by :func:`~automap.sizes.parse_number` (a number from 0 to
    :data:`~automap.sizes.MAX_RATE`).

    Raises:
        DeviceError: not a mapping, a key names no device, or a value is not such a number.
    """
    if values is None:
        return {}
    if not isinstance(values, Mapping):
        raise DeviceError(
            f"{argument}={shown(values)}: give a dict keyed by device name or kind, "
            f"e.g. {argument}={{'cpu': 20e9}}"
        )
    return {
        (k if isinstance(k, str) and find_kind(k) is not None else canonical_name(k)): parse_number(
            v,
            f"{argument}[{shown(k)}]",
            error=DeviceError,
            hint=f"give per-second figures from 0 to {MAX_RATE:g}, e.g. {argument}={{'cuda': 300e12}}",
        )
        for k, v in values.items()
    }


def _measured(
    device: DeviceSpec, capacity: bool, record: Mapping[str, Any], dtype: str | None, folder: str | None
) -> DeviceSpec:
    """``device`` with the figures this machine's record has for it (none for a device it
    lacks: a hypothetical one keeps its kind's defaults), each named in ``measured``."""
    figures = measured_figures(dict(record), device.name, dtype, folder) if record else {}
    names = (("capacity_bytes",) if capacity else ()) + tuple(figures)
    return replace(device, **figures, measured=tuple(f for f in SPEED_FIELDS if f in names))


SPEED_FIELDS = (
    "capacity_bytes",
    "flops_per_second",
    "link_bytes_per_second",
    "memory_bytes_per_second",
    "row_seconds",
    "op_seconds",
    "read_cpu_seconds_per_byte",
    "large_flops_per_second",
)


# A speed given by hand stands for these measured ones too (the large layer's rate is set aside:
# every op then runs at the given rate).
_GIVEN_TOGETHER = {"flops_per_second": ("flops_per_second", "large_flops_per_second")}


def _override(device: DeviceSpec, field_name: str, values: Mapping[int | str, float] | None) -> DeviceSpec:
    """``device`` with ``field_name`` taken from ``values`` by device name, else by kind."""
    by_name = parse_rates(values, _ARGUMENTS[field_name])
    for key in (device.name, device.kind):
        if key in by_name:
            measured = tuple(
                f for f in device.measured if f not in _GIVEN_TOGETHER.get(field_name, (field_name,))
            )
            given = {f: 0.0 for f in _GIVEN_TOGETHER.get(field_name, ())}
            return replace(device, **{**given, field_name: by_name[key]}, measured=measured)
    return device


def calibrate(
    devices: Sequence[DeviceSpec], flops: int, seconds: Mapping[int | str, float]
) -> tuple[DeviceSpec, ...]:
    """Replace default speeds by measured ones: ``flops`` of work took ``seconds[name]`` there.

    Args:
        devices: the devices to update (others in ``seconds`` are an error).
        flops: the work measured, e.g. ``profile.total_flops`` of one forward.
        seconds: measured time per device name (``{"cuda:0": 0.012, "cpu": 0.9}``).

    Example:
        >>> devices = calibrate(devices, prof.total_flops, {"cpu": median_forward_seconds})
    """
    if not isinstance(seconds, Mapping):
        raise DeviceError(f"seconds={shown(seconds)}: give measured seconds per device, e.g. {{'cpu': 0.9}}")
    measured = {
        canonical_name(k): parse_number(v, f"seconds[{shown(k)}]", error=DeviceError)
        for k, v in seconds.items()
    }
    unknown = sorted(set(measured) - {d.name for d in devices})
    if unknown:
        raise DeviceError(
            f"calibration names {unknown}, which are not among the devices {[d.name for d in devices]}"
        )
    bad = {k: v for k, v in measured.items() if not v > 0}
    if bad:
        raise DeviceError(f"calibration times must be > 0 seconds, got {bad}")
    return tuple(
        replace(d, flops_per_second=flops / measured[d.name], large_flops_per_second=0.0)
        if d.name in measured
        else d
        for d in devices
    )


def parse_reserve(reserve: Reserve, devices: Sequence[DeviceSpec]) -> dict[str, int]:
    """Normalise the ``reserve`` option to ``{device name: bytes}``.

    A single size applies to every device that computes (each accelerator, else the CPU);
    a mapping names devices as ``max_memory`` does.

    Example:
        >>> parse_reserve("2GiB", devices)            # KV cache on every GPU
        >>> parse_reserve({0: "4GiB"}, devices)      # generation's extras on GPU 0
    """
    if reserve is None:
        return {}
    if isinstance(reserve, Mapping):
        return parse_max_memory(reserve, "reserve")
    size = parse_size(reserve, "reserve")
    runners = [d for d in devices if d.is_accelerator] or [d for d in devices if kind_of(d).is_host]
    return {d.name: size for d in runners}


def check_present(name: str) -> None:
    """Raise :class:`DeviceError` unless the device ``name`` exists on this machine."""
    kind, index = kind_of(name), (int(name.split(":")[1]) if ":" in name else 0)
    count = kind.present_count()
    if count is not None and index >= count:
        raise DeviceError(
            f"the plan places weights on {name!r} but this machine has {count} {kind.name} device(s); "
            f"plan for the devices present (omit max_memory to detect them) or run where {name} exists"
        )
