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
@pytest.mark.parametrize(
    "argument",
    [
        "no_split",
        "batch",
        "max_length",
        "example_inputs",
        "bandwidths",
        "speeds",
        "links",
        "offload_dir",
        "dtype",
    ],
)
def test_plan_and_dispatch_refuse_an_argument_of_the_wrong_kind_by_name(
    argument, value, tmp_path, monkeypatch
):
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
    with pytest.raises(
        automap.errors.PlanError, match="'0.weight' is a lazy module's uninitialized tensor.*run one forward"
    ):
        automap.dispatch(model, device_map=device_map, max_memory={"cpu": 0}, offload_dir=tmp_path / "off")
    assert not (tmp_path / "off").exists()
    x = torch.randn(3, 5)
    expected = model(x)  # the fix: one forward gives the lazy module its shapes
    automap.dispatch(model, device_map=device_map, max_memory={"cpu": 0}, offload_dir=tmp_path / "off")
    assert torch.equal(model(x), expected)


@pytest.mark.parametrize("how", ["script", "trace"])
@pytest.mark.parametrize("device_map", ["auto", {"0": "disk", "1": "cpu", "2": "cpu"}])
def test_a_torchscript_submodule_is_refused_naming_it(how, device_map, tmp_path):
    import torch

    model = _model()
    model[1] = (
        torch.jit.script(model[1]) if how == "script" else torch.jit.trace(model[1], torch.zeros(1, 16))
    )
    x = torch.randn(2, 8)
    expected = model(x)
    with pytest.raises(automap.PlanError, match="'1' is a TorchScript module .* dispatch the eager model"):
        automap.dispatch(model, device_map=device_map, offload_dir=tmp_path)
    assert automap.runtime.state_of(model) is None and torch.equal(model(x), expected)


@pytest.mark.parametrize("folder", ["", "off\0load"], ids=["empty", "nul"])
def test_an_offload_dir_that_is_no_path_is_refused(folder, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for call in (
        lambda: automap.plan(_model(), offload_dir=folder),
        lambda: automap.dispatch(
            _model(), device_map={"0": "disk", "1": "cpu", "2": "cpu"}, offload_dir=folder
        ),
    ):
        with pytest.raises(automap.PlanError, match="offload_dir=.* is no path"):
            call()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("device", ["cuda:7", 3, "gpu", "disk"])
def test_an_output_device_this_machine_lacks_is_refused_at_dispatch(device):
    import torch

    if torch.cuda.device_count() > 3 and device in ("cuda:7", 3):
        pytest.skip("this machine has that GPU")
    model = _model()
    with pytest.raises(automap.DeviceError, match="output_device|unknown device"):
        automap.dispatch(model, device_map={"": "cpu"}, output_device=device)
    assert automap.runtime.state_of(model) is None


@pytest.mark.parametrize("call", ["no_split", "max_memory", "main_device", "main_device, nothing offloaded"])
def test_the_accelerate_drop_ins_refuse_arguments_of_the_wrong_kind(call, tmp_path):
    from automap import accelerate_compat as compat

    calls = {
        "no_split": lambda: compat.infer_auto_device_map(
            _model(), max_memory={"cpu": "1GB"}, no_split_module_classes=5
        ),
        "max_memory": lambda: compat.infer_auto_device_map(_model(), max_memory="1GB"),
        "main_device": lambda: compat.dispatch_model(
            _model(),
            device_map={"0": "cpu", "1": "disk", "2": "cpu"},
            main_device="gpu",
            offload_dir=tmp_path,
        ),
        "main_device, nothing offloaded": lambda: compat.dispatch_model(
            _model(), device_map={"": "cpu"}, main_device="gpu"
        ),
    }
    with pytest.raises(AutomapError, match="no_split_module_classes|no_split|max_memory|gpu"):
        calls[call]()


def test_cli_example_inputs_that_return_no_inputs_are_one_line_errors(capsys):
    from automap.cli import main

    assert main(["plan", "torchvision:resnet18", "--example-inputs", "os:getcwd"]) == 2
    assert "returned a str; it must return the forward's inputs" in capsys.readouterr().err
