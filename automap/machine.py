"""This machine, measured once and recorded under its hardware fingerprint (CPU and memory
bandwidth, disk read rate, each accelerator's rates; ``AUTOMAP_CALIBRATION`` turns it off or
moves the record; ``automap calibrate`` measures again), so that a plan is a pure function of
recorded figures. Free space is rounded down and recorded, so plans do not change with it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

from automap.errors import AutomapError
from automap.kinds import kind_of, registered_kinds
from automap.disk_probe import measure_disk
from automap.machine_probes import measure_computing
from automap.progress import step
from automap.userfiles import read_json_file

log = logging.getLogger(__name__)

ENV = "AUTOMAP_CALIBRATION"
FORMAT = 4  # 2: the CPU's reads per dtype, its row and op costs; 3: its rate on a large layer; 4: on a large matmul
# A recorded capacity is kept while free space has grown by less than this factor.
GROWTH = 1.5


def record_path() -> Path | None:
    """Where the machine's record is kept; None when ``AUTOMAP_CALIBRATION=off``."""
    value = os.environ.get(ENV, "").strip()
    if value.lower() in ("off", "0", "no", "false", "none"):
        return None
    if value:
        return Path(value).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "automap" / "machine.json"


def fingerprint() -> dict[str, Any]:
    """What identifies this machine's hardware and software for its figures: a record made
    for another fingerprint is measured again."""
    import torch

    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count() or 0,
        "memory_bytes": _memory_total(),
        "accelerators": _accelerator_names(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "Processor", "cpu model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_total() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import psutil

    return int(psutil.virtual_memory().total)


def _accelerator_names() -> list[str]:
    """``["cuda:0 NVIDIA H100 80GB HBM3", ...]``: every accelerator this machine has."""
    names = []
    for kind in registered_kinds():
        count = kind.present_count() if kind.is_accelerator else None
        for i in range(count or 0):
            name = f"{kind.name}:{i}" if kind.indexed else kind.name
            api = kind.torch_api()
            label = api.get_device_name(i) if hasattr(api, "get_device_name") else kind.name
            names.append(f"{name} {label}")
    return names


# ---------------------------------------------------------------------- the record


def fingerprint_key(found: dict[str, Any]) -> str:
    """A short stable name of a fingerprint, the record's key in the file."""
    return hashlib.sha256(json.dumps(found, sort_keys=True).encode()).hexdigest()[:16]


def _read_file(path: Path) -> dict[str, Any]:
    try:
        data = read_json_file(path, "machine record", hint="", error=AutomapError)
    except AutomapError:
        return {}
    if (
        not isinstance(data, dict)
        or not isinstance(data.get("format"), int)
        or not isinstance(data.get("machines"), dict)
    ):
        return {}
    if data["format"] < FORMAT:  # an earlier automap's record: measured again and written over
        return {"format": FORMAT, "machines": {}}
    return data if data["format"] == FORMAT else {}


def read_record() -> dict[str, Any]:
    """The record for this machine as it is now ({} when measuring is off, or none matches):
    the file keeps one per fingerprint (a process with another thread count, another torch)."""
    path = record_path()
    if path is None:
        return {}
    found = fingerprint()
    record = _read_file(path).get("machines", {}).get(fingerprint_key(found))
    return record if isinstance(record, dict) and record.get("fingerprint") == found else {}


def write_record(record: dict[str, Any]) -> None:
    """Write ``record`` into the file under its fingerprint, the file written whole (a
    temporary file renamed over it). A file there that is not automap's record is left as it
    is, and a folder or file that cannot be written leaves the plan on its fresh figures: both
    logged."""
    path = record_path()
    if path is None:
        return
    data = _read_file(path)
    if not data and (path.is_symlink() or path.exists()):
        log.warning(
            "%s is not automap's record of this machine; left as it is (remove it, or point %s "
            "at another file)",
            path,
            ENV,
        )
        return
    data = data or {"format": FORMAT, "machines": {}}
    data["machines"][fingerprint_key(record["fingerprint"])] = record
    temporary = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, temporary = tempfile.mkstemp(prefix=".machine-", suffix=".json", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(temporary, path)
    except OSError as exc:
        log.warning("could not record this machine's figures in %s: %s", path, exc)
        if temporary is not None and os.path.exists(temporary):
            os.unlink(temporary)


def machine_record(folder: str | None = None, *, refresh: bool = False) -> dict[str, Any]:
    """This machine's figures, measured on first use (or with ``refresh``) and recorded; the
    disk's read rate is measured on the file system of ``folder`` (the working directory when
    None) once per file system. {} when measuring is off."""
    if record_path() is None:
        return {}
    data = {} if refresh else read_record()
    changed = False
    if not data:
        started = time.perf_counter()
        with step("automap: measuring this machine (once; 'automap calibrate' measures again)"):
            data = {"fingerprint": fingerprint(), "devices": measure_computing(), "capacities": {}}
        data["seconds"] = round(time.perf_counter() - started, 3)
        log.info("measured this machine in %.1f s: %s", data["seconds"], describe(data).replace("\n", "; "))
        changed = True
    disk = disk_key(folder)
    if disk not in data["devices"]:
        with step("automap: measuring the disk's read rate (once per file system)"):
            rate, cpu = measure_disk(existing_folder(folder))
        data["devices"][disk] = (
            {"read_bytes_per_second": rate, "read_cpu_seconds_per_byte": cpu} if rate else {}
        )
        changed = True
    if changed:
        write_record(data)
    return data


def describe(record: dict[str, Any]) -> str:
    """The record's figures, one device a line: ``cpu: 31.2 GFLOP/s float32, ...``."""
    lines = []
    for name, entry in sorted(record.get("devices", {}).items()):
        parts = [
            f"{rate / 1e9:,.1f} GFLOP/s {dtype}" for dtype, rate in entry.get("flops_per_second", {}).items()
        ]
        parts.extend(
            f"{rate / 1e9:,.1f} GFLOP/s {dtype} on a large matmul"
            for dtype, rate in entry.get("large_flops_per_second", {}).items()
        )
        for key, label in (
            ("memory_bytes_per_second", "memory"),
            ("link_bytes_per_second", "copy in"),
            ("read_bytes_per_second", "read"),
        ):
            value = entry.get(key)
            if isinstance(value, dict):
                parts.extend(f"{label} {rate / 1e9:,.2f} GB/s {dtype}" for dtype, rate in value.items())
            elif value:
                parts.append(f"{label} {value / 1e9:,.2f} GB/s")
        if entry.get("op_seconds"):
            parts.append(f"{entry['op_seconds'] * 1e6:,.2f} us per op")
        lines.append(f"{name}: {', '.join(parts) or 'not measured (defaults)'}")
    return "\n".join(lines)


def measured_figures(
    record: dict[str, Any], name: str, dtype: str | None, folder: str | None
) -> dict[str, float]:
    """The measured figures of the device ``name`` as :class:`~automap.devices.DeviceSpec`
    fields: ``{"flops_per_second": ..., "memory_bytes_per_second": ...}``, those measured per
    dtype at ``dtype`` (float32 when None or not measured); {} for a device this machine lacks
    or one not measured."""
    devices = record.get("devices", {})
    if kind_of(name).stores_only:
        entry = devices.get(disk_key(folder), {})
        rate, cpu = entry.get("read_bytes_per_second"), entry.get("read_cpu_seconds_per_byte")
        figures = {"link_bytes_per_second": rate, "memory_bytes_per_second": rate} if rate else {}
        return {**figures, "read_cpu_seconds_per_byte": cpu} if figures and cpu else figures
    figures = {}
    for key, value in devices.get(name, {}).items():
        if key in _PER_DEVICE and isinstance(value, dict):
            value = value.get(dtype or "float32", value.get("float32"))
        if key in _PER_DEVICE and value:
            figures[key] = value
    return figures


# A device's measured figures, each a number or a number per dtype.
_PER_DEVICE = (
    "flops_per_second",
    "large_flops_per_second",
    "link_bytes_per_second",
    "memory_bytes_per_second",
    "row_seconds",
    "op_seconds",
)


# ---------------------------------------------------------------------- capacities


def rounded_down(nbytes: int) -> int:
    """``nbytes`` rounded down to a sixteenth of its power of two (6 % at most)."""
    if nbytes < 16:
        return max(int(nbytes), 0)
    quantum = 1 << (int(nbytes).bit_length() - 5)
    return int(nbytes) // quantum * quantum


def stable_capacities(record: dict[str, Any], fresh: dict[str, int]) -> dict[str, int]:
    """The capacities a plan uses for free space read as ``fresh`` (bytes by record key): each
    the recorded figure while the fresh reading is at least it and under :data:`GROWTH` times
    it, else the reading less a sixteenth, rounded down (and recorded in ``record``, written
    once): room for the free space to shrink a little without changing the plans. Only rounded
    when there is no record (measuring off)."""
    if not record:
        return {key: rounded_down(value) for key, value in fresh.items()}
    recorded = record.setdefault("capacities", {})
    result, changed = {}, False
    for key, value in fresh.items():
        kept = recorded.get(key)
        if isinstance(kept, int) and kept <= value < GROWTH * kept:
            result[key] = kept
        else:
            result[key] = recorded[key] = rounded_down(value - value // 16)
            changed = True
    if changed:
        write_record(record)
    return result


def existing_folder(folder: str | os.PathLike[str] | None) -> str:
    """``folder``, or its nearest existing parent (the working directory when None)."""
    target = os.fspath(folder) if folder is not None else os.getcwd()
    target = os.path.abspath(target)
    while not os.path.exists(target):
        target = os.path.dirname(target)
    return target


def disk_key(folder: str | os.PathLike[str] | None) -> str:
    """``disk@<file system id>``: the record's key of the disk holding ``folder``."""
    return f"disk@{os.stat(existing_folder(folder)).st_dev}"
