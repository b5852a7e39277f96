"""Profiling models as users hand them over (``automap/profiling/fallback.py``): the trace runs
in eval mode and leaves every module's mode as it was; units whose forward meta cannot run
(``.item()``, data-dependent control flow, a meta kernel narrower than the real one) are planned from
their weights and named in the report, and the plain model's outputs come back when they are
dispatched with part of their weights on disk; a dict map that places every tensor is planned
without a trace."""

from __future__ import annotations

import json
from collections import OrderedDict

import pytest
import torch
import torchvision
from torch import nn

import automap
from automap.errors import ProfileError
from automap.profiling.inputs import to_meta
from tiny_configs import beside_the_run
from conftest import tiny_gpt2, weight_bytes
from conftest import tiny_moe as moe_lm
from test_profile import reference_flops, snapshot


# ---------------------------------------------------------------------------- models


class WatchedBatchNorm(nn.BatchNorm1d):
    """A BatchNorm whose ``train()`` override records each call (the trace must not call it)."""

    def __init__(self, features: int) -> None:
        super().__init__(features)
        self.train_calls: list[bool] = []

    def train(self, mode: bool = True) -> WatchedBatchNorm:
        self.train_calls.append(mode)
        return super().train(mode)


def linear_batchnorm_linear(batchnorm: type[nn.BatchNorm1d] = nn.BatchNorm1d) -> nn.Sequential:
    """The model of issue 17, in its default train mode."""
    torch.manual_seed(0)
    return nn.Sequential(
        OrderedDict(linear1=nn.Linear(3, 4), batchnorm=batchnorm(4), linear2=nn.Linear(4, 5))
    )


class DynamicScale(nn.Module):
    """Divides its projection by the input's largest magnitude, read as a Python number (as
    dynamic quantisers compute their scale): meta tensors have no value to read."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = x.abs().max().item()
        return self.proj(x) / (1.0 + scale)


def item_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 32), DynamicScale(32), nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 8)
    )


class EarlyExit(nn.Module):
    """Runs as many blocks as ``depth`` says, read with ``.item()`` in its own forward (code
    between units): data-dependent control flow."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(8, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks[: int(depth.item())]:
            x = torch.relu(block(x))
        return x


def tiny_moe(kind: str) -> nn.Module:
    """A small mixture-of-experts causal LM from transformers (hidden 32, 4 layers, 4 experts, 2 per token)."""
    return moe_lm(kind, layers=4, hidden=32, experts=4, shared=32)


@torch.library.custom_op("automap_tests::half_only_mm", mutates_args=())
def half_only_mm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A matmul whose real kernel takes any float, and whose meta (fake) kernel, like some fused
    GPU kernels', takes bfloat16 and float16 only."""
    return x @ weight.t()


@half_only_mm.register_fake
def _(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    torch._check(
        x.dtype in (torch.bfloat16, torch.float16), lambda: f"expected bfloat16 or float16, got {x.dtype}"
    )
    return x.new_empty(*x.shape[:-1], weight.shape[0])


class HalfOnlyLayer(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width, width) / width**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + half_only_mm(x, self.weight)


def half_only_model() -> nn.Module:
    """An embedding, 4 layers whose meta kernel rejects float32, an LM head."""
    torch.manual_seed(0)
    layers = nn.Sequential(*(HalfOnlyLayer(32) for _ in range(4)))
    return nn.Sequential(OrderedDict(embed=nn.Embedding(128, 32), layers=layers, head=nn.Linear(32, 128)))


def training_flags(model: nn.Module) -> list[bool]:
    return [m.training for m in model.modules()]


def dispatch_part_on_disk(model: nn.Module, tmp_path, share: float = 0.4) -> automap.Plan:
    """Plan ``model`` with "auto" and a CPU budget of ``share`` of its weights beside the run; dispatch it."""
    budget = beside_the_run(model, int(share * weight_bytes(model)))
    plan = automap.plan(model, "auto", max_memory={"cpu": budget}, offload_dir=tmp_path)
    held = plan.placements.bytes_on
    assert held.get("disk", 0) > 0 and held.get("cpu", 0) > 0, plan.device_map
    automap.dispatch(model, plan, offload_dir=tmp_path / "offload")
    return plan


# ------------------------------------------------------------------------ train mode


def test_train_mode_batchnorm_traces_on_a_batch_of_one():
    model = linear_batchnorm_linear()
    prof = automap.profile(model)  # default input: a 1x3 vector, one value per channel
    assert [u.name for u in prof.units] == ["linear1", "batchnorm", "linear2"]
    assert [u.flops for u in prof.units] == [2 * 3 * 4, 0, 2 * 4 * 5]
    assert not prof.untraced and all(training_flags(model))


def test_trace_leaves_every_flag_as_it_was_and_calls_no_train_override():
    model = linear_batchnorm_linear(WatchedBatchNorm)
    model.linear2.eval()  # a mix: the trace must restore each module's own flag
    before = snapshot(model)
    automap.profile(model)
    assert snapshot(model)["training"] == before["training"] == [True, True, True, False]
    assert model.batchnorm.train_calls == []


def test_flags_and_forwards_are_restored_after_a_trace_that_raises():
    model = linear_batchnorm_linear()
    model.batchnorm.eval()
    before = snapshot(model)
    with pytest.raises(ProfileError, match="inside unit 'linear1'"):
        automap.profile(model, (torch.zeros(2, 7),))  # 7 features for a 3-feature layer: the user's error
    after = snapshot(model)
    assert after["training"] == before["training"] == [True, True, False, True]
    assert after["hooks"] == before["hooks"]
    assert all("forward" not in m.__dict__ for m in model.modules())  # the stand-in guards are gone


@pytest.mark.parametrize("build", ["resnet50", "gpt2"])
def test_eval_mode_trace_counts_the_train_mode_models_flops(build, request):
    # FLOPs come from matmuls, convolutions and attention: BatchNorm's batch statistics and
    # dropout's masks change none of them, so the eval-mode trace gives the train-mode counts.
    if build == "resnet50":
        model, inputs = request.getfixturevalue("resnet50").train(), (torch.zeros(2, 3, 64, 64),)
    else:
        model, inputs = tiny_gpt2(layers=2).train(), (torch.zeros(2, 16, dtype=torch.long),)
        assert model.config.resid_pdrop > 0  # dropout is live in train mode
    forward, train = reference_flops(model, to_meta(inputs))
    prof = automap.profile(model, inputs)
    assert (prof.total_flops, prof.total_train_flops) == (forward, train)
    assert all(training_flags(model))


# ------------------------------------------------------------- forwards meta cannot run


def test_a_unit_that_reads_a_number_stands_in_and_later_units_are_traced():
    prof = automap.profile(item_model())
    by_name = {u.name: u for u in prof.units}
    assert prof.untraced == ("1",)
    assert "Tensor.item()" in by_name["1"].untraced and by_name["1"].flops_estimated
    # The traced units around it count exactly; the stand-in passed the right shape on.
    assert [by_name[n].flops for n in ("0", "2", "3", "4")] == [
        2 * 16 * 32,
        2 * 32 * 32,
        2 * 32 * 32,
        2 * 32 * 8,
    ]
    assert all(not by_name[n].untraced for n in ("0", "2", "3", "4"))
    assert prof.cut_bytes(prof.index("2")) == 32 * 4  # the 1x32 activation crossing the cut
    # Its estimate: the traced units' FLOPs per weight-matrix element, times its own matrix's
    # elements; all are linear layers on one 1-row input, so the estimate is exact.
    assert by_name["1"].flops == 2 * 32 * 32
    assert by_name["1"].train_flops > by_name["1"].flops > 0


def test_a_meta_limit_between_units_keeps_what_ran_and_plans_the_rest_by_bytes():
    model = EarlyExit()
    prof = automap.profile(model, (torch.zeros(2, 8), torch.tensor(3)))
    stem, *blocks = prof.units
    assert stem.name == "stem" and stem.flops == 2 * 2 * 8 * 8 and not stem.untraced
    assert prof.total_train_flops == 0  # no backward ran: not measured, never a guess
    assert [b.name for b in blocks] == ["blocks.0", "blocks.1", "blocks.2"]
    for block in blocks:
        assert block.untraced.startswith("the traced forward stopped before it ran, after unit 'stem'")
        assert block.weight_bytes == (8 * 8 + 8) * 4 and block.flops_estimated
    assert prof.uncalled == ()  # not reached is not "never called"


class DynamicNarrow(DynamicScale):
    """A :class:`DynamicScale` that also narrows its width: its stand-in has the wrong shape."""

    def __init__(self, width: int, out: int) -> None:
        super().__init__(width)
        self.proj = nn.Linear(width, out)


def test_failures_after_a_wrong_shaped_stand_in_fall_back_too():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), DynamicNarrow(32, 8), nn.Linear(8, 8), nn.Linear(8, 4))
    prof = automap.profile(model)  # the stand-in passes 32 features to a layer that takes 8
    by_name = {u.name: u for u in prof.units}
    assert prof.untraced == ("1", "2", "3")
    assert "Tensor.item()" in by_name["1"].untraced
    assert "after the stand-in for '1'" in by_name["2"].untraced
    assert by_name["0"].flops == 2 * 16 * 32 and not by_name["0"].untraced


def test_a_stood_in_unit_is_timed_on_a_real_device():
    prof = automap.profile(item_model(), measure=True, device="cpu", repeats=1)
    assert prof.units[prof.index("1")].untraced and prof.units[prof.index("1")].seconds is not None


def test_genuine_errors_after_nothing_stood_in_still_raise():
    with pytest.raises(ProfileError, match="inside unit '0'"):
        automap.profile(item_model(), (torch.zeros(1, 5),))  # 5 features for a 16-feature layer


def test_layers_whose_meta_kernel_rejects_float32_stand_in_and_are_estimated():
    # transformers' MoE layers were the case (the grouped_mm meta kernel); they now trace
    # (profiling/metarules.py, tests/profiling/test_moe_trace.py), so a custom op plays the part.
    prof = automap.profile(half_only_model(), (torch.randint(0, 128, (2, 32)),))
    layers = [u for u in prof.units if u.name.startswith("layers.")]
    assert len(layers) == 4 and prof.untraced == tuple(u.name for u in layers)
    for layer in layers:
        assert "half_only_mm rejects float32 but runs at bfloat16" in layer.untraced
        assert layer.flops_estimated and layer.flops > 0
    head = prof.units[prof.index("head")]
    assert not head.untraced and head.flops == 2 * 64 * 32 * 128  # traced after the stand-ins


@pytest.mark.parametrize("build", ["item", "half_only"])
def test_untraced_units_plan_auto_and_dispatch_with_part_on_disk(build, tmp_path):
    model = item_model().eval() if build == "item" else half_only_model()
    inputs = torch.randn(3, 16) if build == "item" else torch.randint(0, 128, (2, 12))
    with torch.no_grad():
        expected = model(inputs)
    plan = dispatch_part_on_disk(model, tmp_path)
    with torch.no_grad():
        got = model(inputs)
    assert (got - expected).abs().max().item() <= 1e-6
    untraced = [u.name for u in plan.units if u.untraced]
    assert untraced == (["1"] if build == "item" else [f"layers.{i}" for i in range(4)])
    report = plan.report()
    names = "unit 1" if build == "item" else "units layers.0-3"
    assert f"{names} planned without a trace" in " ".join(report.split())
    assert json.loads(plan.to_json())["totals"]["untraced_units"] == untraced
    automap.undispatch(model)


# ------------------------------------------------------------ a guessed forward that fails


class HeadFirst(nn.Module):
    """``head`` is declared first, ``body`` runs first: a guess shaped for ``head`` fails."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.head = nn.Linear(64, 10)
        self.body = nn.Linear(32, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(x)))


class Masked(nn.Module):
    """A required mask argument the forward multiplies by: ``None`` for it fails after ``body``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(32, 64)
        self.mid = nn.Linear(64, 64)
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.mid(self.body(x) * mask)))


class TwoLayers(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def test_the_guess_is_shaped_for_the_first_layer_the_forward_calls():
    model = HeadFirst()
    before = snapshot(model)
    prof = automap.profile(model)
    assert prof.example == "vector 1x32 (first called linear)" and not prof.untraced
    assert [(u.name, u.flops) for u in prof.units] == [("body", 2 * 32 * 64), ("head", 2 * 64 * 10)]
    after = snapshot(model)  # the probe left no hook and no forward behind
    assert after["hooks"] == before["hooks"] and all("forward" not in m.__dict__ for m in model.modules())


def test_a_failing_guess_keeps_what_ran_and_plans_the_rest_from_weight_shapes():
    prof = automap.profile(Masked())
    assert prof.example == "vector 1x32 (first linear) + None for mask"
    body, mid, head = prof.units
    assert body.name == "body" and body.flops == 2 * 32 * 64 and not body.untraced  # measured
    assert (mid.name, head.name) == ("mid", "head")  # the rest in definition order
    for unit in (mid, head):
        assert unit.untraced.startswith(
            "the forward failed on the guessed example inputs (vector 1x32 (first "
            "linear) + None for mask) after unit 'body', in code between units: "
            "TypeError: unsupported operand"
        )
        assert (
            unit.untraced.endswith(
                "pass example_inputs=(...) to trace it (automap plan: --input-shape or --example-inputs)"
            )
            and "\n" not in unit.untraced
        )
        assert unit.flops_estimated
    # FLOPs from weight shapes, at the rate the traced body ran at (2 per element per row).
    assert (mid.flops, head.flops) == (2 * 64 * 64, 2 * 64 * 10)
    assert prof.total_train_flops == 0 and prof.uncalled == ()


def test_a_guess_failing_inside_a_unit_leaves_it_untraced_too():
    model = nn.Sequential(nn.Linear(8, 8), nn.Flatten(0), nn.Linear(8, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    prof = automap.profile(model)  # Flatten(0) makes 1x8 a vector; BatchNorm1d refuses 1-D input
    by_name = {u.name: u for u in prof.units}
    assert not by_name["0"].untraced and not by_name["2"].untraced
    assert "inside unit '3' (call 1): ValueError: expected 2D or 3D input" in by_name["3"].untraced
    assert by_name["4"].untraced == by_name["3"].untraced and by_name["4"].flops == 2 * 4 * 2


def test_inputs_the_user_gave_that_fail_still_raise_naming_the_unit():
    with pytest.raises(ProfileError, match="inside unit 'body'"):
        automap.profile(HeadFirst(), (torch.zeros(1, 64),))
    with pytest.raises(ProfileError, match="missing 1 required positional argument: 'mask'"):
        automap.plan(Masked(), max_memory={"cpu": 10**6}, example_inputs=(torch.zeros(1, 32),))


def test_a_guess_failing_before_any_unit_plans_every_unit_by_bytes_in_definition_order():
    class DictInput(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.b = nn.Linear(4, 4)
            self.a = nn.Linear(4, 4)

        def forward(self, batch: dict) -> torch.Tensor:
            return self.b(self.a(batch["x"]))

    plan = automap.plan(DictInput(), max_memory={0: 100, 1: 100, "cpu": 10**6})
    assert [u.name for u in plan.units] == ["b", "a"] and all(u.flops == 0 for u in plan.units)
    assert all(") before the first unit: " in u.untraced for u in plan.units)
    assert plan.choices[0].startswith(
        "all 2 units planned from their weights without a trace, by their bytes: "
        "the forward failed on the guessed example inputs (vector 1x4 (first linear))"
    )
    report = " ".join(plan.report().split())
    assert "balanced by bytes only (no unit traced)" in report
    assert "all 2 units planned without a trace, by their bytes (the forward failed on the guessed" in report


def test_a_container_without_forward_plans_its_children_as_units_by_bytes():
    torch.manual_seed(0)
    model = nn.ModuleDict({"encoder": TwoLayers(8), "decoder": TwoLayers(8), "proj": nn.Linear(8, 2)})
    plan = automap.plan(model, max_memory={0: 1150, "cpu": 10**6})  # room for one child, not all three
    assert [u.name for u in plan.units] == ["encoder", "decoder", "proj"]  # its children, not their leaves
    assert all(
        u.untraced == "ModuleDict has no forward of its own (a container of modules), so no forward can "
        "be traced"
        for u in plan.units
    )
    held = plan.placements.bytes_on
    assert set(plan.device_map) == {"encoder", "decoder", "proj"} and held.get("cuda:0", 0) <= 1150
    assert plan.placements.bytes_on.get("cpu", 0) >= 1120  # a whole child went to the CPU
    assert "all 3 units planned from their weights without a trace, by their bytes" in plan.choices[0]
    assert "all 3 units planned without a trace" in " ".join(plan.report().split())
    with pytest.raises(ProfileError, match='missing the required "forward" function'):
        automap.profile(model, (torch.zeros(1, 8),))  # the user's inputs: the user's error


def test_a_plan_with_a_failed_guess_dispatches_and_runs_like_the_plain_model(tmp_path):
    model = Masked().eval()
    x, mask = torch.randn(3, 32), (torch.rand(3, 64) > 0.5).float()
    with torch.no_grad():
        expected = model(x, mask)
    plan = dispatch_part_on_disk(model, tmp_path)
    assert [u.name for u in plan.units if u.untraced] == ["mid", "head"]
    with torch.no_grad():
        assert torch.equal(model(x, mask), expected)
    automap.undispatch(model)


# ------------------------------------------------------------------ dict maps, no trace


def test_a_full_dict_map_plans_without_a_trace(monkeypatch):
    model = linear_batchnorm_linear()  # train mode, no example inputs

    def no_trace(*args, **kwargs):
        raise AssertionError("a dict map that places every tensor must not be traced")

    monkeypatch.setattr("automap.profiling.build.run_trace", no_trace)
    plan = automap.plan(model, {"linear1": "disk", "batchnorm": "disk", "linear2": "disk"})
    assert plan.example == "" and plan.placement == ("disk", "disk", "disk")
    assert [(u.name, u.tensors) for u in plan.units] == [
        ("linear1", ("linear1.weight", "linear1.bias")),
        (
            "batchnorm",
            (
                "batchnorm.weight",
                "batchnorm.bias",
                "batchnorm.running_mean",
                "batchnorm.running_var",
                "batchnorm.num_batches_tracked",
            ),
        ),
        ("linear2", ("linear2.weight", "linear2.bias")),
    ]
    assert [(u.param_bytes, u.buffer_bytes) for u in plan.units] == [
        (16 * 4, 0),
        (8 * 4, 8 * 4 + 8),
        (25 * 4, 0),
    ]
    assert all(
        u.untraced.startswith("the device map places every tensor") and u.flops == 0 for u in plan.units
    )
    report = " ".join(plan.report().split())
    assert "bytes only (no trace)" in report and "all 3 units planned without a trace" in report
    assert automap.Plan.from_json(plan.to_json()).units == plan.units


def test_a_full_dict_map_is_traced_when_given_example_inputs():
    model = linear_batchnorm_linear()
    plan = automap.plan(
        model, {"linear1": "cpu", "batchnorm": "cpu", "linear2": "disk"}, example_inputs=(torch.zeros(1, 3),)
    )
    assert [u.flops for u in plan.units] == [24, 0, 40] and not any(u.untraced for u in plan.units)
    assert all(training_flags(model))


def test_a_full_dict_map_dispatches_without_a_trace(tmp_path):
    model = linear_batchnorm_linear().eval()
    x = torch.randn(6, 3)
    with torch.no_grad():
        expected = model(x)
    stats = model.batchnorm.running_mean.clone(), model.batchnorm.running_var.clone()
    automap.dispatch(model, {"linear1": "disk", "batchnorm": "disk", "linear2": "disk"}, offload_dir=tmp_path)
    with torch.no_grad():
        assert torch.equal(model(x), expected)
    automap.undispatch(model)
    assert torch.equal(model.batchnorm.running_mean, stats[0]) and torch.equal(
        model.batchnorm.running_var, stats[1]
    )


def test_a_loose_tensor_goes_to_a_unit_on_its_mapped_device_without_a_trace():
    torch.manual_seed(0)
    vit = torchvision.models.VisionTransformer(
        image_size=32, patch_size=16, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64
    )
    # class_token is held by the model itself; the map puts it with the encoder, not conv_proj.
    device_map = {"conv_proj": "cpu", "class_token": "disk", "encoder": "disk", "heads": "disk"}
    plan = automap.plan(vit, device_map)
    assert plan.units[plan_index(plan, "encoder")].loose == ("class_token",)
    assert plan.device_map == device_map | {"class_token": "disk"}


def plan_index(plan: automap.Plan, name: str) -> int:
    return [u.name for u in plan.units].index(name)
