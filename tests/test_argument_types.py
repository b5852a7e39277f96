"""Arguments of the wrong kind get an AutomapError that names the argument, before anything
reads them (a bare TypeError or AttributeError from deep inside before): every public entry
point, with each argument given a value of each wrong kind."""
from __future__ import annotations

import inspect

import pytest
from torch import nn

import automap
from automap.errors import AutomapError

WRONG = [0, -1, 1.5, "x", object(), float("nan"), True, 10**30, (1,), [object()]]


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()


def _takes(function, argument: str) -> bool:
    return argument in inspect.signature(function).parameters


@pytest.mark.parametrize("value", WRONG, ids=repr)
@pytest.mark.parametrize("argument", ["no_split", "batch", "max_length", "example_inputs", "bandwidths",
                                      "speeds", "links", "offload_dir", "dtype"])
def test_plan_and_dispatch_refuse_an_argument_of_the_wrong_kind_by_name(argument, value, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # offload_dir="x" is a relative folder: it goes here, not into the checkout
    calls = [lambda: automap.plan(_model(), **{argument: value})]
    if _takes(automap.dispatch, argument):
        folder = {} if argument == "offload_dir" else {"offload_dir": tmp_path}
        calls.append(lambda: automap.dispatch(_model(), {"": "disk"}, **{argument: value}, **folder))
    for call in calls:
        try:
            call()  # a value that still means something (a tuple as example inputs) may plan
        except AutomapError as exc:
            said = str(exc)
            assert argument in said or argument.replace("_", " ") in said, said


@pytest.mark.parametrize("value", WRONG + [None], ids=repr)
def test_what_takes_a_model_refuses_anything_else_by_name(value, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(AutomapError, match="not dispatched|nn.Module"):
        automap.undispatch(value)
    with pytest.raises(AutomapError, match="nn.Module"):
        automap.placement(value)
    with pytest.raises(AutomapError, match="nn.Module|Profile"):
        automap.plan(value)
    with pytest.raises(AutomapError):
        automap.load(value, offload_dir=tmp_path)
    if not isinstance(value, str):  # a str is a path: one that holds no checkpoint says so
        with pytest.raises(AutomapError, match="path"):
            automap.load(_model(), value, offload_dir=tmp_path)


@pytest.mark.parametrize("device_map", ["auto", {"0": "disk", "1": "cpu"}])
def test_a_lazy_module_not_yet_run_is_refused_with_the_fix(device_map, tmp_path):
    import torch

    model = nn.Sequential(nn.LazyLinear(8), nn.Linear(8, 2))
    with pytest.raises(automap.errors.PlanError, match="'0.weight' is a lazy module's uninitialized tensor.*run one forward"):
        automap.dispatch(model, device_map=device_map, max_memory={"cpu": 0}, offload_dir=tmp_path / "off")
    assert not (tmp_path / "off").exists()
    x = torch.randn(3, 5)
    expected = model(x)  # the fix: one forward gives the lazy module its shapes
    automap.dispatch(model, device_map=device_map, max_memory={"cpu": 0}, offload_dir=tmp_path / "off")
    assert torch.equal(model(x), expected)
