"""Split until it fits: units split into their children when they do not fit where they must
go (checked against a fresh trace), the plan kept by predicted time with its reasons, never
all-CPU by accident, budgets that bound what they say, and split units that run."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import automap
from automap.devices import make_device
from automap.errors import PlanError
from automap.planning import Plan, build_plan, make_plan
from automap.planning.predict import forward_seconds, hook_seconds, summary
from automap.profiling.refine import Splitter
from conftest import ids_and_logits, logits_of, tiny_llama, weight_bytes

MB = 10**6


@pytest.fixture(scope="module")
def resnet50_meta():
    import torchvision

    with torch.device("meta"):
        return torchvision.models.resnet50().eval()


def hypothetical(total: int, count: int, ratio: float) -> dict:
    """As benchmarks/plan_quality.py: GPUs holding ``ratio`` of the model in total, CPU RAM
    4x the model (or 0.3x when the GPUs are short) and disk behind."""
    budget = {i: int(total * ratio / count) for i in range(count)}
    return {**budget, "cpu": 4 * total if ratio >= 1 else int(0.3 * total), "disk": 100 * total}


def gpu_flops_share(plan: Plan) -> float:
    """Share of the forward FLOPs computed on accelerators, resident there or streamed to one."""
    on = sum(
        u.flops
        for u, d in zip(plan.units, plan.placement)
        if plan.device(plan.placements.by_home[d].compute).is_accelerator
    )
    return on / sum(u.flops for u in plan.units)


def fits(plan: Plan) -> bool:
    return all(row.used_bytes <= row.device.capacity_bytes for row in summary(plan))


def pieces_on_one_device(plan: Plan) -> bool:
    where: dict[str, set[str]] = {}
    for unit, device in zip(plan.units, plan.placement):
        if unit.split_from:
            where.setdefault(unit.split_from, set()).add(plan.placements.by_home[device].compute)
    return all(len(devices) == 1 for devices in where.values())


# ---------------------------------------------------------------------------------- splitter


def test_a_block_splits_into_its_children_and_a_leaf_stays_whole(resnet50_meta):
    prof = automap.profile(resnet50_meta)
    split = Splitter(resnet50_meta)(prof, ["layer4.0", "fc"])
    assert split.pieces == {
        "layer4.0": tuple(
            f"layer4.0.{c}" for c in ("conv1", "bn1", "conv2", "bn2", "conv3", "bn3", "downsample")
        )
    }
    assert split.refused == {"fc": "leaf Linear"}
    units = {u.name: u for u in split.profile.units}
    assert "layer4.0" not in units and units["layer4.0.conv2"].split_from == "layer4.0"
    assert (
        sum(units[p].weight_bytes for p in split.pieces["layer4.0"])
        == prof.units[prof.index("layer4.0")].weight_bytes
    )
    again = Splitter(resnet50_meta)(split.profile, ["layer4.0.downsample"])
    assert again.pieces == {"layer4.0.downsample": ("layer4.0.downsample.0", "layer4.0.downsample.1")}
    assert {u.split_from for u in again.profile.units if u.name.startswith("layer4.0.")} == {"layer4.0"}, (
        "a piece of a piece keeps the outermost unit: its forward code runs between them all"
    )


def test_no_split_classes_stay_whole(resnet50_meta):
    prof = automap.profile(resnet50_meta, no_split=["Bottleneck"])
    split = Splitter(resnet50_meta, no_split=["Bottleneck"])(prof, ["layer4.0"])
    assert split.pieces == {} and split.refused == {"layer4.0": "its class Bottleneck is in no_split"}
    assert split.profile is prof


def test_a_module_that_reads_its_childrens_weights_stays_whole():
    import torchvision

    model = torchvision.models.vit_b_16(image_size=64).eval()
    splitter = Splitter(model)
    block = "encoder.layers.encoder_layer_0"
    first = splitter(automap.profile(model), [block])
    assert first.pieces[block] == tuple(f"{block}.{c}" for c in ("ln_1", "self_attention", "ln_2", "mlp"))
    second = splitter(first.profile, [f"{block}.self_attention", f"{block}.mlp"])
    # nn.MultiheadAttention computes with out_proj.weight in its own code: out_proj is no unit.
    assert second.refused == {
        f"{block}.self_attention": f"its forward never calls '{block}.self_attention.out_proj'"
    }
    assert second.pieces == {f"{block}.mlp": (f"{block}.mlp.0", f"{block}.mlp.3")}
    assert not second.profile.strays and not second.profile.uncalled


def test_the_profile_names_weights_read_outside_their_unit():
    import torchvision

    model = torchvision.models.vit_b_16(image_size=64).eval()
    attention = "encoder.layers.encoder_layer_0.self_attention"
    units = [u.name for u in automap.profile(model).units if u.name != "encoder.layers.encoder_layer_0"]
    prof = automap.profile(model, units=units + [f"{attention}.out_proj"])
    assert prof.strays == (f"{attention}.out_proj.weight", f"{attention}.out_proj.bias")
    assert automap.profile(model).strays == ()


# ------------------------------------------------------------------------- planner on meta


@pytest.mark.parametrize("count, ratio", [(8, 1.3), (4, 0.6)])
def test_resnet50_computes_most_flops_on_gpus_by_splitting(resnet50_meta, count, ratio):
    total = weight_bytes(resnet50_meta)
    plan = automap.plan(resnet50_meta, max_memory=hypothetical(total, count, ratio))
    assert gpu_flops_share(plan) >= 0.9
    assert fits(plan) and pieces_on_one_device(plan)
    assert any(u.split_from == "layer4.0" for u in plan.units)
    streamed = max(u.weight_bytes for u, p in zip(plan.units, plan.placements) if p.offloaded)
    assert dict(plan.reserves)[plan.execution_device] >= streamed, (
        "the executor keeps room for the largest piece"
    )
    assert any(c.startswith("layer4.0 split into 7 pieces: larger than any GPU's room") for c in plan.choices)
    assert any(c.startswith("chosen: ") and "alternatives: " in c for c in plan.choices)
    assert "choices:" in plan.report() and "layer4.0 split into 7 pieces" in plan.report()
    unsplit = make_plan(automap.profile(resnet50_meta), plan.devices)
    assert gpu_flops_share(unsplit) < 0.9, "without splitting the GPUs cannot run layer4"


def test_splitting_is_deterministic(resnet50_meta):
    budget = hypothetical(weight_bytes(resnet50_meta), 8, 1.3)
    first, second = (automap.plan(resnet50_meta, max_memory=budget) for _ in range(2))
    assert first == second and first.to_json() == second.to_json()


def test_no_split_that_forbids_the_only_way_to_fit_names_the_class_and_size(resnet50_meta):
    # GPUs and disk only: no CPU budget to compute layer4.0 (23 MiB), which no 16 MB GPU holds.
    budget = {
        0: 16 * MB,
        1: 16 * MB,
        2: 16 * MB,
        3: 16 * MB,
        4: 16 * MB,
        5: 16 * MB,
        6: 16 * MB,
        "disk": "10GB",
    }
    plan = automap.plan(resnet50_meta, max_memory=budget)
    assert gpu_flops_share(plan) == 1.0, "split, layer4 streams piece by piece"
    with pytest.raises(
        PlanError,
        match=r"Units that could not be split: 'layer4.0' \(its class Bottleneck is in "
        r"no_split, 23.08 MiB\)",
    ):
        automap.plan(resnet50_meta, max_memory=budget, no_split=["Bottleneck"])


def test_a_unit_larger_than_every_gpu_is_computed_by_the_cpu_not_the_whole_model():
    """Llama's 262 MB embedding and LM head (leaves) fit no 240 MB GPU: the CPU computes them,
    and the GPUs keep decoder layers (196 MB each); nothing sends the whole model to the CPU."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=8,
        num_attention_heads=32,
        vocab_size=32000,
        tie_word_embeddings=False,
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    plan = automap.plan(model, max_memory={0: 240 * MB, 1: 240 * MB, "cpu": 250 * MB, "disk": "10GB"})
    assert plan.execution_device == "cpu" and plan.executor == "cpu"
    assert plan.device_of("model.embed_tokens") in ("cpu", "disk")
    assert {plan.device_of("model.layers.0"), plan.device_of("model.layers.1")} == {"cuda:0", "cuda:1"}
    assert fits(plan)
    assert any("the CPU computes the units placed on 'cpu'" in w for w in plan.warnings)
    assert any("no accelerator can stream" in c for c in plan.choices)
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.execution_device == "cpu" and json.loads(plan.to_json())["choices"]


def test_predicted_time_counts_hooks(resnet50_meta):
    prof = automap.profile(resnet50_meta)
    alone = make_plan(prof, (make_device("cuda:0", 10**10),))
    assert hook_seconds(alone) == 0.0
    split = make_plan(prof, (make_device("cuda:0", 10**10), make_device("cuda:1", 10**10)))
    assert hook_seconds(split) == pytest.approx(3e-6 * len(prof.units))
    stages = sum(r.stage_seconds for r in summary(split))
    assert forward_seconds(split) == pytest.approx(stages + hook_seconds(split))


# ------------------------------------------------------------------------------- budgets


def test_cpu_execution_charges_nothing_for_disk_units(resnet50_meta):
    total = weight_bytes(resnet50_meta)
    # (10 % of the weights, 9.8 MiB, cannot hold the 10 MiB of one unit's activations: refused.)
    for share in (0.3, 0.0):
        plan = automap.plan(resnet50_meta, max_memory={"cpu": int(share * total), "disk": "10GB"})
        assert plan.reserves == (), "mmap'd disk units need no staging room in RAM"
        held = plan.placements.bytes_on
        assert held.get("cpu", 0) <= share * total and held.get("disk", 0) >= (1 - share) * total


def test_gpu_execution_counts_pinned_staging_in_the_cpu_budget(resnet50_meta):
    total = weight_bytes(resnet50_meta)
    plan = automap.plan(resnet50_meta, max_memory=hypothetical(total, 4, 0.6))
    largest_on_disk = max(u.weight_bytes for u, d in zip(plan.units, plan.placement) if d == "disk")
    assert dict(plan.reserves)["cpu"] == largest_on_disk
    row = next(r for r in summary(plan) if r.device.name == "cpu")
    assert row.weight_bytes + row.reserve_bytes <= row.device.capacity_bytes


def test_a_zero_cpu_budget_runs(tmp_path):
    model = tiny_llama(layers=2)
    ids, expected = ids_and_logits(model)
    plan = automap.plan(model, max_memory={"cpu": 0}, offload_dir=tmp_path)
    held = plan.placements.bytes_on
    assert held.get("cpu", 0) == 0 and held.get("disk", 0) == sum(u.weight_bytes for u in plan.units)
    automap.dispatch(model, plan, offload_dir=tmp_path)
    assert torch.equal(logits_of(model, ids), expected)
    automap.undispatch(model)


# ------------------------------------------------------------------------ split units run


def _split_to_leaves(model, inputs, no_split=None):
    """The model's units split as far as the splitter goes: every split the planner can ask for."""
    splitter = Splitter(model, example_inputs=inputs, no_split=no_split)
    prof = automap.profile(model, inputs, no_split=no_split)
    while True:
        split = splitter(prof, [u.name for u in prof.units])
        if not split.pieces:
            return prof
        prof = split.profile


def _vision(name: str, **options):
    import torchvision

    torch.manual_seed(0)
    return torchvision.models.get_model(name, **options).eval(), (torch.randn(1, 3, 64, 64),)


@pytest.mark.parametrize(
    "name",
    [
        "resnet50",
        "densenet121",
        "convnext_tiny",
        "swin_t",
        "efficientnet_b0",
        "mobilenet_v3_small",
        "googlenet",
        "vit_b_16",
        "llama",
    ],
)
def test_split_units_run_as_units(name, tmp_path):
    """What the planner splits for a GPU, run on CPU and disk piece by piece: the split
    modules' own code (residual adds, concatenations) between pieces gives the same outputs."""
    if name == "llama":
        model, inputs, no_split = tiny_llama(layers=2), ({"input_ids": torch.randint(0, 256, (1, 8))}), []
    else:
        model, inputs = _vision(name, **({"image_size": 64} if name.startswith("vit") else {}))
        no_split = None
    call = (lambda m: m(*inputs)) if isinstance(inputs, tuple) else (lambda m: m(**inputs).logits)
    with torch.no_grad():
        expected = call(model)
    split = _split_to_leaves(model, inputs, no_split)
    assert sum(1 for u in split.units if u.split_from) > len(split.units) / 2
    device_map = {}
    for i, unit in enumerate(split.units):
        device_map.update({name: ("disk" if i % 2 else "cpu") for name in (unit.name, *unit.loose)})
    automap.dispatch(model, device_map, offload_dir=tmp_path / "off", example_inputs=inputs)
    try:
        with torch.no_grad():
            got = call(model)
    finally:
        automap.undispatch(model)
        shutil.rmtree(tmp_path / "off", ignore_errors=True)
    assert torch.equal(got, expected)


def _layer4_split_over_two_gpus():
    """resnet18 with ``layer4.0`` split and its ``conv2`` alone on GPU 1 (as a piece tied to
    units elsewhere computes with them), and the plan."""
    import torchvision

    model = torchvision.models.resnet18().eval()
    prof = Splitter(model)(automap.profile(model), ["layer4.0"]).profile
    devices = (make_device("cuda:0", 10**10), make_device("cuda:1", 10**10))
    placement = ["cuda:1" if u.name == "layer4.0.conv2" else "cuda:0" for u in prof.units]
    return model, build_plan(prof, devices, placement, "manual", {})


def test_a_piece_computing_apart_from_its_split_unit_sends_its_outputs_back():
    """The split unit's own code (the residual add) runs where most of its pieces compute; the
    piece on the other GPU sends its outputs back there."""
    from automap.runtime.pieces import hook_split_units, split_devices
    from automap.runtime.state import DispatchState

    model, plan = _layer4_split_over_two_gpus()
    modules = dict(model.named_modules())
    assert split_devices(plan, modules) == {"layer4.0": "cuda:0"}
    state = DispatchState(plan)
    hook_split_units(plan, modules, state)
    try:
        assert sorted((type(h).__name__, str(h.device)) for h in state.hooks) == [
            ("MoveInputs", "cuda:0"),
            ("MoveOutputs", "cuda:0"),
        ]
        hooked = {n for n, m in modules.items() if m._forward_pre_hooks or m._forward_hooks}
        assert hooked == {"layer4.0", "layer4.0.conv2"}
        assert modules["layer4.0.conv2"]._forward_hooks  # its outputs go back to cuda:0
    finally:
        for hook in state.hooks:
            hook.detach()


@pytest.mark.multi_gpu
def test_a_piece_computing_apart_from_its_split_unit_gives_the_same_outputs():
    model, plan = _layer4_split_over_two_gpus()
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        expected = model(x)
    automap.dispatch(model, plan)
    try:
        with torch.no_grad():
            got = model(x).cpu()
    finally:
        automap.undispatch(model)
    torch.testing.assert_close(got, expected)


# --------------------------------------------------------------------------- on a real GPU


def _resnet50_and_input():
    import torchvision

    torch.manual_seed(0)
    return torchvision.models.resnet50().eval(), torch.randn(1, 3, 64, 64)


@pytest.mark.cuda
def test_split_units_stream_piece_by_piece_to_a_gpu(tmp_path):
    import copy

    model, x = _resnet50_and_input()
    with torch.no_grad():
        expected = copy.deepcopy(model).cuda()(x.cuda())
    plan = automap.plan(model, max_memory={0: "20MB", "cpu": "1GB"}, example_inputs=(x,))
    assert plan.execution_device == "cuda:0" and any(u.split_from == "layer4.0" for u in plan.units)
    assert gpu_flops_share(plan) == 1.0
    automap.dispatch(model, plan, offload_dir=tmp_path)
    with torch.no_grad():
        got = model(x)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-3)
    automap.undispatch(model)


@pytest.mark.cuda
def test_the_cpu_computes_what_no_gpu_can_hold_beside_gpu_units(tmp_path, exact_cuda_math):
    model, x = _resnet50_and_input()
    with torch.no_grad():
        expected = model(x)
    # 8 MB: layer4's 3x3 convolutions (9.4 MB each, leaves) fit no GPU room, nor stream to one.
    plan = automap.plan(model, max_memory={0: "8MB", "cpu": "1GB"}, example_inputs=(x,))
    assert plan.executor == "cpu" and "cuda:0" in plan.used_devices
    automap.dispatch(model, plan, offload_dir=tmp_path)
    with torch.no_grad():
        got = model(x)
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-4, atol=1e-3)
    automap.undispatch(model)
