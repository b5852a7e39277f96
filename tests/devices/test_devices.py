"""Devices: max_memory parsing, hypothetical devices, speed/link overrides, calibration, reserves."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from automap.devices import (
    DEFAULT_FLOPS,
    calibrate,
    canonical_name,
    detect_devices,
    make_device,
    parse_max_memory,
    parse_reserve,
)
from automap.errors import DeviceError


def test_hypothetical_devices_come_sorted_with_disk():
    devices = detect_devices({"cpu": "1GB", 1: "2GiB", "cuda:0": 10**9}, offload_dir="/tmp")
    assert [d.name for d in devices] == ["cuda:0", "cuda:1", "cpu", "disk"]
    assert devices[1].capacity_bytes == 2 * 2**30
    assert devices[0].flops_per_second == DEFAULT_FLOPS["cuda"]


def test_speed_and_link_overrides_by_name_or_kind():
    devices = detect_devices(
        {0: "1GB", 1: "1GB", "cpu": "1GB"}, speeds={"cuda": 3e14, "cuda:1": 1e14}, links={"cuda": 3e11}
    )
    by_name = {d.name: d for d in devices}
    assert by_name["cuda:0"].flops_per_second == 3e14
    assert by_name["cuda:1"].flops_per_second == 1e14
    assert by_name["cuda:0"].link_bytes_per_second == 3e11
    assert by_name["cpu"].link_bytes_per_second == make_device("cpu", 1).link_bytes_per_second


def test_negative_speed_is_refused():
    with pytest.raises(DeviceError, match=r"speeds\['cuda'\]=-1 is negative"):
        detect_devices({0: "1GB"}, speeds={"cuda": -1})


def test_calibration_replaces_speed_from_a_measurement():
    devices = (make_device("cuda:0", 10), make_device("cpu", 10))
    cal = calibrate(devices, flops=10**12, seconds={"cpu": 2.0})
    assert cal[1].flops_per_second == 5e11 and cal[0] == devices[0]
    with pytest.raises(DeviceError, match="not among the devices"):
        calibrate(devices, 10**12, {"cuda:3": 1.0})
    with pytest.raises(DeviceError, match="> 0 seconds"):
        calibrate(devices, 10**12, {"cpu": 0.0})


def test_reserve_size_applies_to_each_computing_device():
    gpus = (make_device("cuda:0", 10), make_device("cuda:1", 10), make_device("cpu", 10))
    assert parse_reserve("1KiB", gpus) == {"cuda:0": 1024, "cuda:1": 1024}
    assert parse_reserve(5, (make_device("cpu", 10),)) == {"cpu": 5}
    assert parse_reserve({0: "2KB"}, gpus) == {"cuda:0": 2000}
    assert parse_reserve(None, gpus) == {}


def test_detection_does_not_initialise_cuda():
    detect_devices()
    assert not torch.cuda.is_initialized()


def test_device_names_are_canonical():
    assert (
        canonical_name(3) == "cuda:3"
        and canonical_name("CUDA") == "cuda:0"
        and canonical_name("mps:0") == "mps"
    )
    with pytest.raises(DeviceError, match="unknown device 'tpu'"):
        canonical_name("tpu")
    assert parse_max_memory({"0": "1KB"}) == {"cuda:0": 1000}


def test_empty_max_memory_detects_this_machine_like_none():
    detected = {d.name for d in detect_devices(None)}
    assert {d.name for d in detect_devices({})} == detected and "cpu" in detected


def test_devices_parse_without_importing_torch():
    code = (
        "import sys; from automap.devices import parse_max_memory_text; "
        "parse_max_memory_text('0=1GB,cpu=2GB'); assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
