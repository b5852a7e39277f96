"""Foundation end to end: real models dispatched with part of their weights on disk give the
plain model's outputs; undispatch restores it; bad input fails cleanly."""

from __future__ import annotations

import os

import pytest
import torch

import automap
from automap.errors import DeviceError, DeviceMapError, OffloadError, PlanError
from conftest import (
    assert_offloaded_in_files,
    ids_and_logits,
    logits_of,
    store_dirs,
    tiny_llama,
    weight_bytes,
)
from tiny_configs import part_on_disk


def _snapshot(model):
    return {n: (t, t.device, t.detach().clone()) for n, t in model.state_dict(keep_vars=True).items()}


def _hooks(model):
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())


def _assert_unchanged(model, snapshot):
    assert _hooks(model) == 0
    now = model.state_dict(keep_vars=True)
    for name, (tensor, device, values) in snapshot.items():
        assert now[name] is tensor, name
        assert now[name].device == device, name
        assert torch.equal(now[name].detach(), values), name


def test_resnet50_with_part_on_disk_matches_plain(resnet50, tmp_path):
    x = torch.randn(2, 3, 96, 96)
    with torch.no_grad():
        expected = resnet50(x)
    snapshot = _snapshot(resnet50)
    budget = int(weight_bytes(resnet50) * 0.5)
    plan = automap.plan(resnet50, max_memory={"cpu": budget}, example_inputs=(x,))
    assert 0 < len(plan.offloaded_units) < len(plan.units)
    automap.dispatch(resnet50, plan, offload_dir=tmp_path)
    assert_offloaded_in_files(resnet50, under=tmp_path)  # offloaded weights left RAM: views of store files
    with torch.no_grad():
        got = resnet50(x)
    assert (got - expected).abs().max().item() <= 1e-6
    automap.undispatch(resnet50)
    _assert_unchanged(resnet50, snapshot)
    with torch.no_grad():
        assert torch.equal(resnet50(x), expected)


def test_llama_with_part_on_disk_matches_plain(tmp_path):
    model = tiny_llama(layers=4)
    ids, expected = ids_and_logits(model, (2, 12))
    snapshot = _snapshot(model)
    automap.dispatch(model, max_memory=part_on_disk(model), offload_dir=tmp_path / "off")
    (store,) = store_dirs(tmp_path / "off")
    assert os.path.exists(store / "automap-store.json")
    assert_offloaded_in_files(model, under=store)
    got = logits_of(model, ids)
    assert (got - expected).abs().max().item() <= 1e-6
    automap.undispatch(model)
    _assert_unchanged(model, snapshot)


def test_everything_on_one_device_installs_no_hooks(resnet50):
    automap.dispatch(resnet50, "auto")
    assert _hooks(resnet50) == 0
    automap.undispatch(resnet50)


def test_plan_json_round_trip(resnet50):
    plan = automap.plan(resnet50, max_memory={0: "60MB", 1: "60MB", "cpu": "1GB"})
    again = automap.Plan.from_json(plan.to_json())
    assert again == plan
    assert again.device_map == plan.device_map
    assert '"device_map"' in plan.to_json()


def test_unknown_strategy_is_refused(resnet50):
    with pytest.raises(
        PlanError, match="device_map='fastest' is neither a strategy .*sequential.* nor a device"
    ):
        automap.plan(resnet50, "fastest")


def test_negative_budget_is_refused(resnet50):
    with pytest.raises(automap.SizeError, match="negative"):
        automap.plan(resnet50, max_memory={"cpu": "-1GB"})


def test_device_map_naming_a_missing_module_is_refused(resnet50):
    with pytest.raises(DeviceMapError, match="'layer9'.*not a module"):
        automap.dispatch(resnet50, {"layer9": "cpu", "": "cpu"})
    assert _hooks(resnet50) == 0


def test_device_map_leaving_tensors_without_a_device_is_refused(resnet50):
    with pytest.raises(DeviceMapError, match=r"leaves \d+ tensor\(s\) without a device.*conv1.weight"):
        automap.dispatch(resnet50, {"layer1": "cpu"})


def test_user_device_map_is_honoured(tmp_path):
    model = tiny_llama(layers=2)
    ids, expected = ids_and_logits(model)
    device_map = {
        "model.embed_tokens": "cpu",
        "model.rotary_emb": "cpu",
        "model.layers.0": "disk",
        "model.layers.1": "cpu",
        "model.norm": "disk",
        "lm_head": "cpu",
    }
    automap.dispatch(model, device_map, offload_dir=tmp_path)
    offloaded = assert_offloaded_in_files(model, under=tmp_path)
    assert (
        "model.layers.0.mlp.up_proj.weight" in offloaded
        and "model.layers.1.mlp.up_proj.weight" not in offloaded
    )
    assert torch.equal(logits_of(model, ids), expected)
    automap.undispatch(model)


def test_failed_dispatch_leaves_the_model_untouched_missing_gpu(resnet50):
    snapshot = _snapshot(resnet50)
    with pytest.raises(DeviceError, match="cuda:7"):
        automap.dispatch(resnet50, {"": 7})
    _assert_unchanged(resnet50, snapshot)


def test_failed_dispatch_leaves_the_model_untouched_unwritable_dir(resnet50, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    snapshot = _snapshot(resnet50)
    with pytest.raises(OffloadError, match="not writable"):
        automap.dispatch(resnet50, max_memory={"cpu": "30MB"}, offload_dir=blocker / "sub")
    _assert_unchanged(resnet50, snapshot)


def test_disk_offload_without_offload_dir_says_how(resnet50):
    with pytest.raises(automap.DispatchError, match="offload_dir"):
        automap.dispatch(resnet50, max_memory={"cpu": "30MB"})
    assert _hooks(resnet50) == 0


def test_double_dispatch_is_refused(resnet50, tmp_path):
    automap.dispatch(resnet50, max_memory={"cpu": "60MB"}, offload_dir=tmp_path)
    with pytest.raises(automap.DispatchError, match="already dispatched"):
        automap.dispatch(resnet50, max_memory={"cpu": "60MB"}, offload_dir=tmp_path)
    automap.undispatch(resnet50)


def test_planning_a_dispatched_model_points_to_placement(resnet50, tmp_path):
    automap.dispatch(resnet50, max_memory={"cpu": "60MB"}, offload_dir=tmp_path)
    with pytest.raises(PlanError, match=r"automap.placement\(model\).*undispatch"):
        automap.plan(resnet50)
    assert automap.placement(resnet50).offloaded_units
    automap.undispatch(resnet50)
    assert automap.plan(resnet50).units
