"""Resolved placements (issue 24): the plan records the offload_dir it was sized for, dispatch and
load use it (or check the room of another folder first), and both raise one error when there is
no folder; each unit's placement (home, compute device, route) is resolved once and shown in the
JSON; JSON written before either existed still reads."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

import automap
from automap.errors import CheckpointError, DispatchError, OffloadDirError
from automap.offload import backing_file
from automap.planning.placement import Placement, Route
from conftest import store_dirs
from tiny_configs import beside_the_run

DATA = Path(__file__).parents[1] / "data"
OLD_JSON = DATA / "plan_before_offload_dir.json"  # written by main at b0b0985, before "offload_dir"


def mlp(width: int = 128, depth: int = 8) -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(depth)])


def inputs(width: int = 128) -> tuple[torch.Tensor]:
    return (torch.randn(2, width, generator=torch.Generator().manual_seed(1)),)


def snapshot(model):
    return {n: (t, t.device, t.detach().clone()) for n, t in model.state_dict(keep_vars=True).items()}


def assert_unchanged(model, before):
    assert sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()) == 0
    now = model.state_dict(keep_vars=True)
    for name, (tensor, device, values) in before.items():
        assert (
            now[name] is tensor and now[name].device == device and torch.equal(now[name].detach(), values)
        ), name


# ------------------------------------------------------------------ the folder a plan was sized for


def test_the_plan_records_its_offload_dir_and_json_round_trips_it(tmp_path):
    model = mlp()
    plan = automap.plan(model, max_memory={"cpu": 0}, offload_dir=tmp_path / "off")
    assert plan.offload_dir == os.path.abspath(tmp_path / "off")
    assert plan.offloaded_units  # the disk budget came from that folder, and units went there
    data = json.loads(plan.to_json())
    assert data["offload_dir"] == plan.offload_dir
    again = automap.Plan.from_json(plan.to_json())
    assert again.offload_dir == plan.offload_dir and again.placement == plan.placement
    assert automap.plan(model, max_memory={"cpu": 0, "disk": "1GB"}).offload_dir is None


def test_json_from_before_the_field_still_reads():
    text = OLD_JSON.read_text()
    data = json.loads(text)
    assert "offload_dir" not in data
    plan = automap.Plan.from_json(text)
    assert plan.offload_dir is None
    assert plan.placement == tuple(u["device"] for u in data["units"])
    assert set(plan.placement) == {"cuda:0", "cpu", "disk"}
    assert json.loads(plan.to_json())["offload_dir"] is None


def test_dispatch_uses_the_plans_folder_when_given_none(tmp_path):
    model = mlp()
    expected = model(*inputs())
    plan = automap.plan(model, max_memory={"cpu": 0}, offload_dir=tmp_path / "off")
    automap.dispatch(model, plan)
    try:
        assert len(store_dirs(tmp_path / "off")) == 1
        torch.testing.assert_close(model(*inputs()), expected)
    finally:
        automap.undispatch(model)


def test_dispatch_and_load_raise_one_error_for_no_offload_dir(tmp_path):
    model = mlp()
    plan = automap.plan(model, max_memory={"cpu": 0, "disk": "1GB"})
    before = snapshot(model)
    with pytest.raises(
        OffloadDirError, match=r"offloads \d+ units .* to disk but no offload_dir"
    ) as dispatched:
        automap.dispatch(model, plan)
    assert isinstance(dispatched.value, DispatchError) and isinstance(dispatched.value, CheckpointError)
    assert_unchanged(model, before)
    checkpoint = tmp_path / "model.bin"
    torch.save(model.state_dict(), checkpoint)  # a pickle: offloaded tensors must be written
    with automap.empty_model():
        skeleton = mlp()
    with pytest.raises(
        OffloadDirError, match=r"offloads \d+ tensor\(s\) .* to disk that must be written there"
    ):
        automap.load(skeleton, checkpoint, plan, quiet=True)


@pytest.fixture
def small_folder(tmp_path):
    """A real 256 KiB file system (tmpfs), mounted for the test and unmounted after it."""
    point = tmp_path / "small"
    point.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "none", str(point)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield point
    finally:
        subprocess.run(["umount", str(point)], check=True)


def test_another_folder_too_small_is_refused_before_anything_is_written(tmp_path, small_folder):
    model = mlp()  # 8 x 66 KiB, nearly all on disk: more than the 256 KiB there
    plan = automap.plan(model, max_memory={"cpu": 0}, offload_dir=tmp_path / "big")
    before = snapshot(model)
    with pytest.raises(
        OffloadDirError,
        match=f"sized for offload_dir '{tmp_path / 'big'}'.*'{small_folder}'.*"
        "free.*plan again with offload_dir",
    ) as info:
        automap.dispatch(model, plan, offload_dir=small_folder)
    assert isinstance(info.value, DispatchError)
    assert os.listdir(small_folder) == []
    assert not (tmp_path / "big").exists()
    assert_unchanged(model, before)
    checkpoint = tmp_path / "model.bin"
    torch.save(model.state_dict(), checkpoint)
    with automap.empty_model():
        skeleton = mlp()
    with pytest.raises(CheckpointError, match=f"sized for offload_dir.*'{small_folder}'"):
        automap.load(skeleton, checkpoint, plan, offload_dir=small_folder, quiet=True)
    assert os.listdir(small_folder) == []


def test_another_folder_with_room_is_used(tmp_path):
    model = mlp()
    expected = model(*inputs())
    plan = automap.plan(model, max_memory={"cpu": 0}, offload_dir=tmp_path / "a")
    automap.dispatch(model, plan, offload_dir=tmp_path / "b")
    try:
        assert len(store_dirs(tmp_path / "b")) == 1 and not store_dirs(tmp_path / "a")
        torch.testing.assert_close(model(*inputs()), expected)
    finally:
        automap.undispatch(model)


# ------------------------------------------------------------------ resolved placements


def test_placements_of_a_plan_with_gpu_cpu_and_disk_units():
    model = mlp(64, 6)
    plan = automap.plan(model, max_memory={0: 40000, "cpu": 40000, "disk": "1GB"}, example_inputs=inputs(64))
    assert set(plan.placement) == {"cuda:0", "cpu", "disk"} and plan.execution_device == "cuda:0"
    assert len(plan.placements) == len(plan.units)
    expected = {
        "cuda:0": Placement("cuda:0", "cuda", "cuda:0", Route.RESIDENT),
        "cpu": Placement("cpu", "cpu", "cuda:0", Route.STREAMED),
        "disk": Placement("disk", "disk", "cuda:0", Route.STAGED),
    }
    table = plan.placements
    assert table.rows == tuple(expected[d] for d in plan.placement) and tuple(table) == table.rows
    assert table.units == tuple(u.name for u in plan.units)
    assert dict(table.by_home) == {d.name: expected[d.name] for d in plan.devices}
    held = {
        d.name: sum(u.weight_bytes for u, h in zip(plan.units, plan.placement) if h == d.name)
        for d in plan.devices
    }
    assert table.bytes_on == held
    assert table.offloaded_bytes == table.bytes_on.get("cpu", 0) + table.bytes_on.get("disk", 0)
    assert plan.offloaded_units == tuple(u.name for u, p in zip(plan.units, plan.placements) if p.offloaded)
    assert plan.placements is table  # resolved once per plan
    units = json.loads(plan.to_json())["units"]
    assert [u["placement"] for u in units] == [p.as_dict() for p in plan.placements]
    assert units[-1]["placement"] == {
        "home": "disk",
        "tier": "disk",
        "compute_device": "cuda:0",
        "route": "staged",
    }


def test_placements_when_the_cpu_computes():
    model = mlp()
    # The CPU's budget holds the run (activations, overhead) and 200 kB of weights beside it.
    budget = {"cpu": beside_the_run(model, 200_000, example_inputs=inputs()), "disk": "1GB"}
    plan = automap.plan(model, max_memory=budget, example_inputs=inputs())
    assert set(plan.placement) == {"cpu", "disk"} and plan.execution_device == "cpu"
    routes = {p.home: (p.compute, p.route) for p in plan.placements}
    assert routes == {"cpu": ("cpu", Route.RESIDENT), "disk": ("cpu", Route.STREAMED)}  # pages read in place


def test_placements_of_json_from_before_they_were_written():
    plan = automap.Plan.from_json(OLD_JSON.read_text())
    assert {(p.home, p.route) for p in plan.placements} == {
        ("cuda:0", Route.RESIDENT),
        ("cpu", Route.STREAMED),
        ("disk", Route.STAGED),
    }
    again = automap.Plan.from_json(plan.to_json())
    assert again.placements == plan.placements


def test_load_and_dispatch_follow_the_placements(tmp_path):
    """A CPU plan with disk units, loaded from a pickle: the resident units' tensors are on the
    CPU, the disk units' tensors view the store's files, and the output is the plain model's."""
    model = mlp()
    expected = model(*inputs())
    checkpoint = tmp_path / "model.bin"
    torch.save(model.state_dict(), checkpoint)
    budget = {"cpu": beside_the_run(model, 200_000, example_inputs=inputs())}
    plan = automap.plan(model, max_memory=budget, offload_dir=tmp_path / "off", example_inputs=inputs())
    assert {p.in_store for p in plan.placements} == {True, False}, plan.device_map
    with automap.empty_model():
        skeleton = mlp()
    loaded = automap.load(skeleton, checkpoint, plan, quiet=True)  # the plan's folder: none given here
    try:
        assert len(store_dirs(tmp_path / "off")) == 1
        for unit, placement in zip(plan.units, plan.placements):
            for name in unit.tensors:
                tensor = loaded.get_parameter(name)
                assert tensor.device == torch.device(placement.compute)
                stored = backing_file(tensor) is not None
                assert stored == placement.in_store, name
        torch.testing.assert_close(loaded(*inputs()), expected)
    finally:
        automap.undispatch(loaded)


@pytest.mark.cuda
def test_dispatch_puts_each_unit_where_its_placement_says_on_a_gpu(tmp_path):
    model = mlp()
    with torch.no_grad():
        expected = model(*inputs())
    device_map = {str(i): [0, "cpu", "disk"][i % 3] for i in range(8)}
    plan = automap.plan(model, device_map, offload_dir=tmp_path)
    assert {p.route for p in plan.placements} == {Route.RESIDENT, Route.STREAMED, Route.STAGED}
    automap.dispatch(model, plan)
    try:
        for unit, placement in zip(plan.units, plan.placements):
            weight = model.get_parameter(f"{unit.name}.weight")
            if placement.route is Route.RESIDENT:
                assert weight.device == torch.device("cuda:0"), unit.name
            else:  # between forwards an offloaded weight is its host copy: pinned RAM, or the store's file
                assert (
                    weight.device.type == "cpu" and (backing_file(weight) is not None) == placement.in_store
                )
        with torch.no_grad():
            torch.testing.assert_close(model(*inputs()).cpu(), expected)
    finally:
        automap.undispatch(model)
