"""The names a device map may give a module. A module registered under two names
(``self.b = self.a``, ``nn.Sequential(layer, act, layer)``, ALBERT-style sharing): planning leaves
the user's weights alone, dispatch gives the plain outputs, and a map may name it by either name.
A module a map places tensor by tensor (``{"fc.weight": "disk", "fc.bias": "disk"}``) is a unit."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import automap
from automap.errors import DeviceMapError
from automap.runtime import state_of


class TwoNames(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.mid = nn.Linear(16, 16)
        self.b = self.a  # the same module, a second name

    def forward(self, x):
        return self.b(torch.relu(self.mid(self.a(x))))


def repeated() -> nn.Module:
    layer = nn.Linear(16, 16)
    return nn.Sequential(layer, nn.ReLU(), layer, nn.Linear(16, 4))


BUILDERS = {"attribute": TwoNames, "sequential": repeated}


def _built(kind: str) -> nn.Module:
    torch.manual_seed(0)
    return BUILDERS[kind]().eval()


@pytest.mark.parametrize("kind", sorted(BUILDERS))
def test_planning_leaves_the_weights_of_a_module_with_two_names_in_place(kind):
    model = _built(kind)
    before = {n: t.clone() for n, t in model.state_dict().items()}
    automap.plan(model, max_memory={"cpu": 0})
    after = model.state_dict()
    assert all(t.device.type == "cpu" and torch.equal(t, before[n]) for n, t in after.items())


@pytest.mark.parametrize("kind", sorted(BUILDERS))
@pytest.mark.parametrize("budget", [0, 3000])
def test_a_module_with_two_names_dispatched_gives_the_plain_outputs(kind, budget, tmp_path):
    model = _built(kind)
    x = torch.randn(3, 16)
    with torch.no_grad():
        expected = model(x)
    state = {n: t.clone() for n, t in model.state_dict().items()}
    automap.dispatch(model, device_map="auto", max_memory={"cpu": budget}, offload_dir=tmp_path)
    with torch.no_grad():
        assert torch.equal(model(x), expected)
    automap.undispatch(model)
    assert all(torch.equal(t, state[n]) for n, t in model.state_dict().items())


@pytest.mark.parametrize(
    "device_map",
    [{"b": "disk", "mid": "cpu"}, {"a": "disk", "b": "disk", "mid": "cpu"}, {"b": "cpu", "mid": "disk"}],
)
def test_a_map_may_name_a_module_by_its_second_name(device_map, tmp_path):
    placed = _dispatched_exactly(_built("attribute"), device_map, tmp_path)
    assert placed["a"] == device_map["b"] and placed["mid"] == device_map["mid"]


def _dispatched_exactly(model: nn.Module, device_map: dict[str, str], folder) -> dict[str, str]:
    """Dispatch ``model`` with ``device_map``, check it gives the plain outputs, and return
    where automap placed it (``placement(model).device_map``)."""
    x = torch.randn(3, 16)
    with torch.no_grad():
        expected = model(x)
    automap.dispatch(model, device_map=device_map, offload_dir=folder)
    with torch.no_grad():
        assert torch.equal(model(x), expected)
    return dict(automap.placement(model).device_map)


def test_a_plans_own_map_of_a_module_with_two_names_dispatches(tmp_path):
    model = _built("attribute")
    x = torch.randn(3, 16)
    with torch.no_grad():
        expected = model(x)
    plan = automap.plan(model, max_memory={"cpu": 0})
    automap.dispatch(model, device_map=dict(plan.device_map), offload_dir=tmp_path)
    with torch.no_grad():
        assert torch.equal(model(x), expected)


def test_a_map_putting_one_module_on_two_devices_by_its_two_names_is_refused(tmp_path):
    model = _built("attribute")
    with pytest.raises(DeviceMapError, match="other name 'b'"):
        automap.dispatch(model, device_map={"a": "disk", "b": "cpu", "mid": "cpu"}, offload_dir=tmp_path)
    assert model.a.weight.device.type == "cpu" and state_of(model) is None


class OwnAndChild(nn.Module):
    """A module with a tensor of its own beside a child (a scale, a class token)."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(16))
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        return self.lin(x) * self.scale


@pytest.mark.parametrize("no_split", [None, []])
def test_a_map_splitting_a_modules_own_tensor_from_its_child_names_both_and_the_module(no_split, tmp_path):
    model = nn.Sequential(OwnAndChild(), nn.Linear(16, 4))
    with pytest.raises(DeviceMapError) as raised:
        automap.dispatch(
            model,
            device_map={"0.scale": "disk", "0.lin": "cpu", "1": "cpu"},
            offload_dir=tmp_path,
            **({} if no_split is None else {"no_split": no_split}),
        )
    message = str(raised.value)
    assert "'0.scale' on 'disk'" in message and "'0.lin.weight' on 'cpu'" in message
    assert "map '0', which holds them, to one device" in message and "no_split" not in message
    automap.dispatch(model, device_map={"0": "disk", "1": "cpu"}, offload_dir=tmp_path)  # the fix it names


@pytest.mark.parametrize(
    "device_map",
    [
        {"0.weight": "disk", "0.bias": "disk", "2": "cpu"},
        {"0.weight": "cpu", "0.bias": "cpu", "2.weight": "disk", "2.bias": "disk"},
    ],
)
def test_a_module_placed_tensor_by_tensor_is_a_unit(device_map, tmp_path):
    torch.manual_seed(0)
    placed = _dispatched_exactly(
        nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)).eval(), device_map, tmp_path
    )
    assert {k: placed[k] for k in ("0", "2")} == {
        m: device_map.get(m, device_map.get(f"{m}.weight")) for m in ("0", "2")
    }


def test_a_module_whose_tensors_a_map_puts_on_two_devices_is_refused_by_name(tmp_path):
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    with pytest.raises(
        DeviceMapError, match="'0.bias' on 'cpu', '0.weight' on 'disk'.*map '0', which holds them"
    ):
        automap.dispatch(
            model, device_map={"0.weight": "disk", "0.bias": "cpu", "2": "cpu"}, offload_dir=tmp_path
        )
