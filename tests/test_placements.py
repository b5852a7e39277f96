"""Resolved placements (issue 24): the plan records the offload_dir it was sized for, dispatch and
load use it (or check the room of another folder first), and both raise one error when there is
no folder; JSON written before the field existed still reads."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

import automap
from automap.errors import CheckpointError, DispatchError, OffloadDirError
from conftest import store_dirs

DATA = Path(__file__).parent / "data"
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
        assert now[name] is tensor and now[name].device == device and torch.equal(now[name].detach(), values), name


# ------------------------------------------------------------------ the folder a plan was sized for


def test_the_plan_records_its_offload_dir_and_json_round_trips_it(tmp_path):
    model = mlp()
    plan = automap.plan(model, max_memory={"cpu": 1000}, offload_dir=tmp_path / "off")
    assert plan.offload_dir == os.path.abspath(tmp_path / "off")
    assert plan.offloaded_units  # the disk budget came from that folder, and units went there
    data = json.loads(plan.to_json())
    assert data["offload_dir"] == plan.offload_dir
    again = automap.Plan.from_json(plan.to_json())
    assert again.offload_dir == plan.offload_dir and again.placement == plan.placement
    assert automap.plan(model, max_memory={"cpu": 1000, "disk": "1GB"}).offload_dir is None


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
    plan = automap.plan(model, max_memory={"cpu": 1000}, offload_dir=tmp_path / "off")
    automap.dispatch(model, plan)
    try:
        assert len(store_dirs(tmp_path / "off")) == 1
        torch.testing.assert_close(model(*inputs()), expected)
    finally:
        automap.undispatch(model)


def test_dispatch_and_load_raise_one_error_for_no_offload_dir(tmp_path):
    model = mlp()
    plan = automap.plan(model, max_memory={"cpu": 1000, "disk": "1GB"})
    before = snapshot(model)
    with pytest.raises(OffloadDirError, match=r"offloads \d+ units .* to disk but no offload_dir") as dispatched:
        automap.dispatch(model, plan)
    assert isinstance(dispatched.value, DispatchError) and isinstance(dispatched.value, CheckpointError)
    assert_unchanged(model, before)
    checkpoint = tmp_path / "model.bin"
    torch.save(model.state_dict(), checkpoint)  # a pickle: offloaded tensors must be written
    with automap.empty_model():
        skeleton = mlp()
    with pytest.raises(OffloadDirError, match=r"offloads \d+ tensor\(s\) .* to disk that must be written there"):
        automap.load(skeleton, checkpoint, plan, quiet=True)


@pytest.fixture
def small_folder(tmp_path):
    """A real 256 KiB file system (tmpfs), mounted for the test and unmounted after it."""
    point = tmp_path / "small"
    point.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "none", str(point)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield point
    finally:
        subprocess.run(["umount", str(point)], check=True)


def test_another_folder_too_small_is_refused_before_anything_is_written(tmp_path, small_folder):
    model = mlp()  # 8 x 66 KiB, nearly all on disk: more than the 256 KiB there
    plan = automap.plan(model, max_memory={"cpu": 1000}, offload_dir=tmp_path / "big")
    before = snapshot(model)
    with pytest.raises(OffloadDirError, match=f"sized for offload_dir '{tmp_path / 'big'}'.*'{small_folder}'.*"
                                              "free.*plan again with offload_dir") as info:
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
    plan = automap.plan(model, max_memory={"cpu": 1000}, offload_dir=tmp_path / "a")
    automap.dispatch(model, plan, offload_dir=tmp_path / "b")
    try:
        assert len(store_dirs(tmp_path / "b")) == 1 and not store_dirs(tmp_path / "a")
        torch.testing.assert_close(model(*inputs()), expected)
    finally:
        automap.undispatch(model)
