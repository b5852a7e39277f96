"""This machine's figures: measured once and recorded under its fingerprint, where
AUTOMAP_CALIBRATION or XDG_CACHE_HOME say; read as measured for the devices it has, defaults for
those it lacks; free space recorded so that plans do not change with it; ``automap calibrate``."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest
from conftest import pin_machine
from hypothesis import given
from hypothesis import strategies as st

from automap import machine
from automap.devices import DEFAULT_FLOPS, DEFAULT_LINK, detect_devices


def test_the_record_lives_where_the_environment_says(tmp_path, monkeypatch):
    monkeypatch.delenv("AUTOMAP_CALIBRATION", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert machine.record_path() == tmp_path / "cache" / "automap" / "machine.json"
    monkeypatch.setenv("AUTOMAP_CALIBRATION", str(tmp_path / "mine.json"))
    assert machine.record_path() == tmp_path / "mine.json"
    monkeypatch.setenv("AUTOMAP_CALIBRATION", "off")
    assert machine.record_path() is None


def test_measuring_off_leaves_every_speed_at_its_default(monkeypatch):
    monkeypatch.setenv("AUTOMAP_CALIBRATION", "off")
    cpu = next(d for d in detect_devices() if d.name == "cpu")
    assert cpu.flops_per_second == DEFAULT_FLOPS["cpu"] and cpu.measured == ("capacity_bytes",)


def test_recorded_figures_are_read_as_measured_and_absent_devices_keep_defaults(tmp_path, monkeypatch):
    pin_machine(
        tmp_path / "machine.json", monkeypatch, tmp_path, cpu_flops=33e9, cpu_memory=7e9, disk_read=9e8
    )
    devices = {
        d.name: d
        for d in detect_devices({0: "1GiB", "cpu": "2GiB"}, offload_dir=str(tmp_path), dtype="bfloat16")
    }
    cpu, disk, gpu = devices["cpu"], devices["disk"], devices["cuda:0"]
    assert (cpu.flops_per_second, cpu.memory_bytes_per_second) == (33e9 / 2, 7e9)
    assert cpu.measured == ("flops_per_second", "memory_bytes_per_second")  # its budget was given
    assert disk.link_bytes_per_second == disk.memory_bytes_per_second == 9e8
    assert "capacity_bytes" in disk.measured
    if gpu.measured == ():  # this machine lacks it (hypothetical): its kind's defaults
        assert (gpu.flops_per_second, gpu.link_bytes_per_second) == (
            DEFAULT_FLOPS["cuda"],
            DEFAULT_LINK["cuda"],
        )


def test_given_speeds_win_over_measured_ones(tmp_path, monkeypatch):
    pin_machine(tmp_path / "machine.json", monkeypatch, cpu_flops=33e9)
    cpu = next(d for d in detect_devices({"cpu": "1GiB"}, speeds={"cpu": 1e9}) if d.name == "cpu")
    assert cpu.flops_per_second == 1e9 and cpu.measured == ("memory_bytes_per_second",)


def test_a_record_for_another_fingerprint_is_not_read(tmp_path, monkeypatch):
    record = pin_machine(tmp_path / "machine.json", monkeypatch)
    assert machine.read_record() == record
    other = {**record, "fingerprint": {**record["fingerprint"], "cpu": "another CPU"}}
    (tmp_path / "machine.json").write_text(
        json.dumps(
            {"format": machine.FORMAT, "machines": {machine.fingerprint_key(other["fingerprint"]): other}}
        )
    )
    assert machine.read_record() == {}
    (tmp_path / "machine.json").write_text("{not json")
    assert machine.read_record() == {}


def test_an_earlier_automaps_record_is_measured_again_and_replaced(tmp_path, monkeypatch):
    """A record of an earlier format lacks figures this automap reads: it is not read, and the
    next measurement replaces it (a plan measured the machine in every process while an old
    record sat there, never overwritten). One of a later format is left to the automap that
    wrote it."""
    path = tmp_path / "machine.json"
    monkeypatch.setenv("AUTOMAP_CALIBRATION", str(path))
    record = {"fingerprint": machine.fingerprint(), "devices": {}, "capacities": {}}
    key = machine.fingerprint_key(record["fingerprint"])
    path.write_text(json.dumps({"format": machine.FORMAT - 1, "machines": {key: record}}))
    assert machine.read_record() == {}
    machine.write_record(record)
    assert json.loads(path.read_text())["format"] == machine.FORMAT and machine.read_record() == record
    later = json.dumps({"format": machine.FORMAT + 1, "machines": {key: record}})
    path.write_text(later)
    assert machine.read_record() == {}
    machine.write_record(record)
    assert path.read_text() == later


def test_a_file_that_is_not_a_record_is_never_overwritten(tmp_path, monkeypatch):
    mine = tmp_path / "notes.json"
    mine.write_text("my own notes")
    monkeypatch.setenv("AUTOMAP_CALIBRATION", str(mine))
    machine.write_record({"fingerprint": machine.fingerprint(), "devices": {}, "capacities": {}})
    assert mine.read_text() == "my own notes" and sorted(p.name for p in tmp_path.iterdir()) == ["notes.json"]


@given(st.integers(0, 2**50))
def test_capacities_round_down_by_at_most_a_sixteenth(nbytes):
    value = machine.rounded_down(nbytes)
    assert value <= nbytes and value >= nbytes * (1 - 1 / 16) and machine.rounded_down(value) == value


def test_a_recorded_capacity_holds_while_free_space_stays_above_it(tmp_path, monkeypatch):
    record = pin_machine(tmp_path / "machine.json", monkeypatch)
    first = machine.stable_capacities(record, {"cpu": 10_000_000_000})["cpu"]
    for fresh in (10_000_000_000 - 300_000_000, 10_000_000_000 + 3_000_000_000):  # noise either way
        assert machine.stable_capacities(record, {"cpu": fresh})["cpu"] == first
    assert machine.read_record()["capacities"]["cpu"] == first
    smaller = machine.stable_capacities(record, {"cpu": first - 1})["cpu"]  # never more than is free
    assert smaller < first and smaller == machine.rounded_down(first - 1 - (first - 1) // 16)
    assert machine.stable_capacities(record, {"cpu": 10 * first})["cpu"] <= 10 * first * 15 / 16


def test_first_use_measures_and_calibrate_refreshes(tmp_path):
    """``automap calibrate`` in a fresh process: the record under AUTOMAP_CALIBRATION (never
    the user's cache), the CPU's and the disk's figures measured; a plan after it reads them."""
    env = {
        **os.environ,
        "AUTOMAP_CALIBRATION": str(tmp_path / "m.json"),
        "XDG_CACHE_HOME": str(tmp_path / "x"),
    }
    done = subprocess.run(
        [sys.executable, "-m", "automap", "calibrate", "--offload-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    assert "cpu:" in done.stdout and "GFLOP/s float32" in done.stdout and "read" in done.stdout
    data = json.loads((tmp_path / "m.json").read_text())
    (record,) = data["machines"].values()
    assert record["devices"]["cpu"]["flops_per_second"]["float32"] > 0
    cpu = record["devices"]["cpu"]
    for figure in ("memory_bytes_per_second", "row_seconds"):  # per dtype, as the compute rate
        assert set(cpu[figure]) == {"float32", "bfloat16", "float16"}
    assert cpu["memory_bytes_per_second"]["float32"] > 0 and cpu["row_seconds"]["float32"] >= 0
    assert cpu["op_seconds"] > 0
    (disk,) = (entry for name, entry in record["devices"].items() if name.startswith("disk"))
    assert disk["read_bytes_per_second"] > 0 and disk["read_cpu_seconds_per_byte"] > 0
    assert not (tmp_path / "x").exists() and not list(tmp_path.glob("automap-calibration-*"))
    off = subprocess.run(
        [sys.executable, "-m", "automap", "calibrate"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**env, "AUTOMAP_CALIBRATION": "off"},
    )
    assert off.returncode == 2 and "measuring is off" in off.stderr and "Traceback" not in off.stderr


def test_the_report_and_json_say_which_figures_were_measured(tmp_path, monkeypatch):
    import torch

    import automap

    pin_machine(tmp_path / "machine.json", monkeypatch)
    plan = automap.plan(torch.nn.Linear(8, 8), max_memory={"cpu": "1GiB"}, offload_dir=tmp_path)
    flat = " ".join(plan.report().split())
    assert "measured here: cpu compute, memory; disk free space, read rate" in flat
    again = automap.Plan.from_json(plan.to_json())
    assert [d.measured for d in again.devices] == [d.measured for d in plan.devices]
    with pytest.raises(automap.AutomapError, match="'measured'"):
        automap.Plan.from_json(plan.to_json().replace('"flops_per_second",', '"speed",', 1))


def test_an_accelerator_is_measured_through_its_kind(monkeypatch):
    """The accelerator probe asks the registry for the device, its synchronisation and its torch
    module: a kind registered with CPU memory behind it (as a test's fake accelerator) runs it."""
    import torch

    from automap.kinds import DeviceKind, register_kind, unregister_kind
    from automap.machine_probes import measure_accelerator

    calls = []
    register_kind(
        DeviceKind(
            "fakegpu",
            rank=1,
            computes=True,
            is_storage=False,
            host_addressable=False,
            async_copies=False,
            flops_per_second=1e12,
            link_bytes_per_second=1e9,
            memory_bytes_per_second=1e11,
            indexed=True,
            count=lambda: 1,
            synchronize=lambda device: calls.append(device),
            torch_device=lambda name: torch.device("cpu"),
        )
    )
    try:
        figures = measure_accelerator("fakegpu:0", size=256, copy_bytes=2**20)
    finally:
        unregister_kind("fakegpu")
    assert set(figures["flops_per_second"]) == {"float32", "bfloat16", "float16"}
    assert all(rate > 0 for rate in figures["flops_per_second"].values())
    assert figures["link_bytes_per_second"] > 0 and figures["memory_bytes_per_second"] > 0
    assert calls and all(d == torch.device("cpu") for d in calls)


def test_the_cpu_probe_counts_its_flops_as_the_profiler_counts_a_models():
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from automap.machine_probes import ProbeLayer, layer_flops

    layer = ProbeLayer(64, torch.device("meta"), torch.float32, heads=4, tokens=16)
    with FlopCounterMode(display=False) as counter:
        layer(torch.empty(1, 16, 64, device="meta"))
    assert layer_flops(64, 16) == counter.get_total_flops()


def test_the_cpu_probe_knows_how_many_ops_its_layer_runs():
    """The FLOPs per op a probe layer's rate applies at are its FLOPs over these ops."""
    import torch

    from automap.machine_probes import LAYER_OPS, LAYER_SHAPE, ProbeLayer

    hidden, tokens = LAYER_SHAPE
    layer, x = (
        ProbeLayer(hidden, torch.device("cpu"), torch.float32, tokens=tokens),
        torch.ones(1, tokens, hidden),
    )
    assert _aten_ops(lambda: layer(x)) == LAYER_OPS


def test_the_op_probe_knows_how_many_ops_its_block_runs():
    import torch

    from automap.machine_probes import BLOCK_OPS
    from automap.probe_block import Block

    block, x = Block(), torch.ones(1, 1, Block.hidden)
    assert _aten_ops(lambda: block(x)) == BLOCK_OPS


def _aten_ops(call) -> int:
    """The aten ops ``call()`` dispatches, without gradients."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    with torch.no_grad(), Count():
        call()
    return Count.ops


_THRESHOLD_SCRIPT = """
import sys, torch
from automap import disk_probe, machine_probes
with torch.no_grad():
    machine_probes.measure_cpu()
disk_probe.measure_disk(sys.argv[1])
weight = torch.empty(8 * 2**20 + 4096, dtype=torch.uint8)  # a layer's weight loaded after
for line in open("/proc/self/maps"):
    if line.rstrip().endswith("[heap]"):
        low, high = (int(a, 16) for a in line.split()[0].split("-"))
        print("heap" if low <= weight.data_ptr() < high else "mapped")
        break
else:
    print("mapped")
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's dynamic mmap threshold")
def test_calibration_leaves_the_allocator_as_it_found_it(tmp_path):
    """glibc raises its mmap threshold to the size of a mapped chunk freed (up to 32 MiB): probes
    freeing 16 MiB matrices made every later weight under 16 MiB come from the heap, where a
    decode step read it 7-15 % slower. The probes' large buffers are one mapping over 32 MiB,
    so an 8 MiB weight allocated after calibration is still a mapping of its own."""
    done = subprocess.run(
        [sys.executable, "-c", _THRESHOLD_SCRIPT, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["mapped"]
