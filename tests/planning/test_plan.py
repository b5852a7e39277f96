"""The balancer on hypothetical devices: optimality against brute force, the fits-on-GPUs
promise on real architectures (built on meta), capacities, tie groups, determinism, user maps
and errors."""

from __future__ import annotations

import dataclasses

import itertools
import json

import networkx as nx
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import automap
from automap.devices import make_device
from automap.errors import DeviceMapError, PlanError
from automap.planning import Plan, make_plan
from automap.planning.partition import Chain, Slot, fill, memory_reach, min_bottleneck
from automap.planning.layout_plans import all_cut_bytes, build_plan
from automap.planning.predict import bottleneck_seconds, compute_seconds, cuts, summary
from automap.profiling import Profile, Unit
from conftest import tiny_gpt2, tiny_llama, weight_bytes
from tiny_configs import beside_the_run, part_on_disk

MB = 10**6


# ----------------------------------------------------------------------------- builders


def chain_profile(flops, weights, activations=None, cuts=None, ties=()) -> Profile:
    """A synthetic profile: units u0..u{n-1} in a chain; ``cuts[i]`` bytes flow into unit i."""
    n = len(flops)
    activations = activations or [0] * n
    cuts = cuts or [0] * n
    units = tuple(
        Unit(
            name=f"u{i}",
            tensors=(f"u{i}.weight",),
            param_bytes=weights[i],
            flops=flops[i],
            train_flops=3 * flops[i],
            output_bytes=cuts[i + 1] if i + 1 < n else 0,
            peak_activation_bytes=activations[i],
            calls=1,
        )
        for i in range(n)
    )
    graph = nx.DiGraph()
    graph.add_nodes_from(["<input>", *(u.name for u in units)])
    for i in range(n):
        graph.add_edge("<input>" if i == 0 else f"u{i - 1}", f"u{i}", bytes=cuts[i])
    return Profile("Chain", units, tie_groups=tuple(ties), graph=graph, example="synthetic")


def gpus(capacities, speeds=None, links=None):
    speeds = speeds or [None] * len(capacities)
    links = links or [None] * len(capacities)
    return tuple(
        make_device(f"cuda:{i}", c, flops_per_second=s, link_bytes_per_second=b)
        for i, (c, s, b) in enumerate(zip(capacities, speeds, links))
    )


def fits(plan: Plan) -> bool:
    return all(row.used_bytes <= row.device.capacity_bytes for row in summary(plan))


def brute_force(profile: Profile, devices) -> float | None:
    """The smallest bottleneck over every contiguous split (device order fixed, devices may
    stay empty), judged by Plan itself; None when no split fits."""
    n, k = len(profile.units), len(devices)
    best = None
    for bounds in itertools.combinations_with_replacement(range(n + 1), k - 1):
        edges = (0, *bounds, n)
        placement = [devices[j].name for j in range(k) for _ in range(edges[j], edges[j + 1])]
        plan = build_plan(profile, devices, placement, "brute", {})
        if fits(plan) and (best is None or bottleneck_seconds(plan) < best):
            best = bottleneck_seconds(plan)
    return best


def spilled(plan: Plan) -> int:
    return plan.placements.bytes_on.get("cpu", 0) + plan.placements.bytes_on.get("disk", 0)


def hypothetical(profile: Profile, count: int, total_ratio: float) -> tuple:
    share = int(profile.total_bytes * total_ratio / count)
    return gpus([share] * count) + (
        make_device("cpu", 10 * profile.total_bytes),
        make_device("disk", 100 * profile.total_bytes),
    )


# ------------------------------------------------------------------- optimality (property)


@st.composite
def instances(draw):
    n = draw(st.integers(1, 7))
    k = draw(st.integers(1, 3))
    flops = draw(st.lists(st.integers(1, 10**12), min_size=n, max_size=n))
    weights = draw(st.lists(st.integers(0, 100 * MB), min_size=n, max_size=n))
    activations = draw(st.lists(st.integers(0, 20 * MB), min_size=n, max_size=n))
    cuts = draw(st.lists(st.integers(0, 10**9), min_size=n, max_size=n))
    capacities = draw(st.lists(st.integers(0, 400 * MB), min_size=k, max_size=k))
    speeds = draw(st.lists(st.sampled_from([1e12, 5e12, 2e13, 1e14]), min_size=k, max_size=k))
    links = draw(st.lists(st.sampled_from([1e9, 1e10, 5e10, 3e11]), min_size=k, max_size=k))
    return chain_profile(flops, weights, activations, cuts), gpus(capacities, speeds, links)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instances())
def test_balanced_bottleneck_equals_brute_force_optimum(instance):
    profile, devices = instance
    optimum = brute_force(profile, devices)
    if optimum is None:
        try:
            plan = make_plan(profile, devices, "balanced")
        except PlanError:
            return
        assert fits(plan) and any("out of order" in w for w in plan.warnings)
        return
    plan = make_plan(profile, devices, "balanced")
    assert fits(plan)
    assert bottleneck_seconds(plan) == pytest.approx(optimum, rel=1e-9, abs=1e-15)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.integers(0, 50), min_size=0, max_size=12),
    st.lists(st.integers(0, 30), min_size=12, max_size=12),
    st.integers(0, 120),
)
def test_memory_reach_is_the_longest_fitting_range(weights, activations, room):
    chain = Chain([1.0] * len(weights), weights, activations[: len(weights)], [0.0] * len(weights))
    reach = memory_reach(chain, room)
    for start in range(len(weights) + 1):
        need = [
            sum(weights[start:e]) + max(activations[start:e], default=0)
            for e in range(start, len(weights) + 1)
        ]
        assert reach[start] == start + max(i for i, x in enumerate(need) if x <= room or i == 0)
        assert fill(chain, [room], start)[1] == reach[start]


def test_partition_prefers_a_small_cut():
    # Splitting after item 0 or 1 moves 1 GB; after item 2 almost nothing: the optimum pays compute
    # imbalance to avoid the big transfer.
    chain = Chain([1e12, 1e12, 1e12, 1e12], [0] * 4, [0] * 4, [0, 1e9, 1e9, 1e3])
    slots = [Slot(10**9, 1e14, 1e10), Slot(10**9, 1e14, 1e10)]
    assert min_bottleneck(chain, slots) == [(0, 3), (3, 4)]


def test_a_chain_one_slot_runs_alone_goes_to_the_first_slot():
    # A big cut after every item: splitting never pays, so one slot runs everything, and the
    # first one that can (GPU 0, where inputs live) rather than the last.
    chain = Chain([1e6] * 3, [0] * 3, [0] * 3, [0, 1e12, 1e12])
    slots = [Slot(10**9, 1e14, 1e10)] * 3
    assert min_bottleneck(chain, slots) == [(0, 3), None, None]
    # When the first slot cannot hold it, the next one that can takes it.
    small = [Slot(10, 1e14, 1e10), Slot(10**9, 1e14, 1e10), Slot(10**9, 1e14, 1e10)]
    assert min_bottleneck(Chain([1e6] * 3, [100] * 3, [0] * 3, [0, 1e12, 1e12]), small) == [
        None,
        (0, 3),
        None,
    ]


def test_a_small_model_on_two_gpus_runs_on_gpu_0():
    model = tiny_llama(layers=4)
    plan = automap.plan(
        model,
        max_memory={0: "1GiB", 1: "1GiB"},
        example_inputs={"input_ids": torch.zeros(1, 8, dtype=torch.long)},
    )
    assert set(plan.device_map.values()) == {0}


# --------------------------------------------------------------- the promise on real models


@pytest.fixture(scope="module")
def resnet50_profile():
    import torchvision

    with torch.device("meta"):
        model = torchvision.models.resnet50()
    return automap.profile(model)


@pytest.fixture(scope="module")
def llama_2g_profile():
    """2.2 GB Llama-style model (float32) with an untied 262 MB lm_head."""
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
    return automap.profile(model)


@pytest.mark.parametrize("count, ratio", [(4, 1.3), (2, 1.5)])
def test_resnet50_that_fits_on_gpus_spills_nothing(resnet50_profile, count, ratio):
    devices = hypothetical(resnet50_profile, count, ratio)
    plan = make_plan(resnet50_profile, devices, "auto")
    assert spilled(plan) == 0
    assert plan.offloaded_units == ()
    assert fits(plan)
    assert set(plan.device_map.values()) <= set(range(count))


def test_resnet50_on_two_gpus_is_the_optimum(resnet50_profile):
    devices = hypothetical(resnet50_profile, 2, 1.5)[:2]
    plan = make_plan(resnet50_profile, devices, "balanced")
    assert bottleneck_seconds(plan) == pytest.approx(brute_force(resnet50_profile, devices), rel=1e-9)


def test_llama_with_untied_lm_head_keeps_it_on_a_gpu(llama_2g_profile):
    prof = llama_2g_profile
    assert 2.1e9 < prof.total_bytes < 2.3e9
    assert prof.units[prof.index("lm_head")].weight_bytes == 262_144_000
    plan = make_plan(prof, hypothetical(prof, 2, 1.15), "auto")
    assert spilled(plan) == 0
    assert plan.device_of("lm_head") in ("cuda:0", "cuda:1")
    assert fits(plan)
    assert bottleneck_seconds(plan) == pytest.approx(brute_force(prof, plan.devices[:2]), rel=1e-9)


def test_too_small_gpus_keep_a_contiguous_run_then_cpu_then_disk(llama_2g_profile):
    prof = llama_2g_profile
    total, n = prof.total_bytes, len(prof.units)
    devices = gpus([total // 3, total // 3]) + (make_device("cpu", total // 4), make_device("disk", total))
    plan = make_plan(prof, devices, "auto")
    assert fits(plan)
    on_gpu = [i for i, d in enumerate(plan.placement) if d.startswith("cuda")]
    run = [i for i in on_gpu if i < next((j for j in range(on_gpu[0], n) if j not in on_gpu), n)]
    assert run == list(range(on_gpu[0], run[-1] + 1)) and on_gpu[0] <= 4
    # After the run, a GPU with room left keeps an offloaded unit or two (the final norm) resident.
    extras = [i for i in on_gpu if i not in run]
    assert sum(prof.units[i].weight_bytes for i in extras) < 0.01 * total
    stored = {plan.placement[i] for i in range(n) if i not in on_gpu}
    assert stored == {"cpu", "disk"}
    cpu = next(r for r in summary(plan) if r.device.name == "cpu")
    free = cpu.device.capacity_bytes - cpu.used_bytes
    assert all(u.weight_bytes > free for u, d in zip(plan.units, plan.placement) if d == "disk"), (
        "CPU RAM takes every offloaded unit that fits before disk"
    )
    assert plan.placements.bytes_on.get("disk", 0) > 0 and plan.placements.bytes_on.get("cpu", 0) > 0
    assert sum(plan.placements.bytes_on[f"cuda:{i}"] for i in range(2)) > 0.45 * total
    largest = max(u.weight_bytes for u, p in zip(plan.units, plan.placements) if p.offloaded)
    assert dict(plan.reserves)[plan.execution_device] == largest
    assert any("offloaded" in w for w in plan.warnings)


def test_nothing_is_offloaded_reserve_when_all_fits(resnet50_profile):
    plan = make_plan(resnet50_profile, hypothetical(resnet50_profile, 2, 1.5), "auto")
    assert plan.reserves == ()


def test_sequential_fills_gpu0_first(resnet50_profile):
    devices = hypothetical(resnet50_profile, 2, 1.5)
    plan = make_plan(resnet50_profile, devices, "sequential")
    rows = {r.device.name: r for r in summary(plan)}
    assert spilled(plan) == 0
    nxt = plan.units[len(rows["cuda:0"].units)]
    assert rows["cuda:0"].used_bytes + nxt.weight_bytes > devices[0].capacity_bytes


def test_sequential_spill_fills_gpus_in_order_then_cpu(llama_2g_profile):
    prof = llama_2g_profile
    total = prof.total_bytes
    plan = make_plan(prof, gpus([total // 3, total // 3]) + (make_device("cpu", total),), "sequential")
    assert fits(plan) and spilled(plan) > 0
    on_gpu = [d for d in plan.placement if d.startswith("cuda")]
    assert on_gpu == sorted(on_gpu), "GPU 0's units come before GPU 1's"


def test_plan_front_door_takes_reserve_and_speeds(llama_2g_profile):
    share = int(llama_2g_profile.total_bytes * 0.7)
    plain = automap.plan(llama_2g_profile, max_memory={0: share, 1: share, "cpu": "10GB"})
    kept = automap.plan(
        llama_2g_profile,
        max_memory={0: share, 1: share, "cpu": "10GB"},
        reserve=share // 2,
        speeds={"cuda:1": 50e12},
    )
    assert spilled(plain) == 0 and spilled(kept) > 0
    assert [r.reserve_bytes >= share // 2 for r in summary(kept)[:2]] == [True, True]
    assert kept.device("cuda:1").flops_per_second == 50e12


def test_balanced_low_0_keeps_gpu0_light(llama_2g_profile):
    devices = gpus([10**10] * 4)
    low = make_plan(llama_2g_profile, devices, "balanced_low_0")
    shares = [r.flops_share for r in summary(low)]
    assert shares[0] < min(shares[1:])
    assert shares[0] < summary(make_plan(llama_2g_profile, devices, "balanced"))[0].flops_share


def test_reserve_keeps_room_on_every_gpu(llama_2g_profile):
    prof = llama_2g_profile
    share = int(prof.total_bytes * 1.5 / 2)
    devices = gpus([share, share])
    plain = make_plan(prof, devices)
    assert spilled(plain) == 0
    kept = make_plan(
        prof, devices + (make_device("cpu", 10**10),), reserve={"cuda:0": share // 2, "cuda:1": share // 2}
    )
    assert spilled(kept) > 0 and fits(kept)
    assert all(r.reserve_bytes >= share // 2 for r in summary(kept)[:2])


def test_activations_for_the_planned_batch_are_reserved():
    model = tiny_llama(layers=4)
    budget = {0: weight_bytes(model), 1: weight_bytes(model), "cpu": "1GB"}
    small = automap.plan(model, max_memory=budget, batch=1)
    big = automap.plan(model, max_memory=budget, batch=64)
    assert spilled(small) == 0 and spilled(big) > 0
    assert max(u.peak_activation_bytes for u in big.units) > 50 * max(
        u.peak_activation_bytes for u in small.units
    )
    assert fits(big) and fits(small)


# ---------------------------------------------------------------- ties, determinism, JSON


def test_tied_embeddings_share_a_device():
    model = tiny_gpt2(layers=6)
    prof = automap.profile(model)
    assert prof.tie_groups
    for count in (2, 3, 4):
        plan = make_plan(prof, gpus([int(prof.total_bytes * 0.8)] * count) + (make_device("cpu", 10**9),))
        assert plan.device_of("lm_head") == plan.device_of("transformer.wte")
        assert fits(plan)


@settings(max_examples=40, deadline=None)
@given(instances(), st.data())
def test_synthetic_tie_groups_are_colocated(instance, data):
    profile, devices = instance
    n = len(profile.units)
    a, b = sorted(data.draw(st.lists(st.integers(0, n - 1), min_size=2, max_size=2)))
    tied = Profile(
        profile.model_name,
        profile.units,
        tie_groups=((f"u{a}.weight", f"u{b}.weight"),),
        graph=profile.graph,
        example="synthetic",
    )
    try:
        plan = make_plan(tied, devices + (make_device("cpu", 10**10),))
    except PlanError:
        return
    assert plan.device_of(f"u{a}") == plan.device_of(f"u{b}")
    assert fits(plan)


def test_identical_inputs_give_identical_plans(resnet50_profile, llama_2g_profile):
    for prof, devices in (
        (resnet50_profile, hypothetical(resnet50_profile, 4, 1.3)),
        (llama_2g_profile, hypothetical(llama_2g_profile, 8, 0.5)),
    ):
        plans = [make_plan(prof, devices) for _ in range(3)]
        rebuilt = dataclasses.replace(
            prof,
            units=tuple(Unit(**vars(u)) for u in prof.units),
            graph=nx.DiGraph(list(reversed(list(prof.graph.edges(data=True))))),
        )
        plans.append(make_plan(rebuilt, devices))
        assert all(p == plans[0] and p.to_json() == plans[0].to_json() for p in plans)


def test_a_fresh_profile_gives_the_same_plan(resnet50_profile):
    import torchvision

    devices = hypothetical(resnet50_profile, 4, 1.3)
    with torch.device("meta"):
        fresh = automap.profile(torchvision.models.resnet50())
    assert make_plan(fresh, devices).to_json() == make_plan(resnet50_profile, devices).to_json()


def test_json_round_trip_keeps_device_map_and_reserves(llama_2g_profile):
    total = llama_2g_profile.total_bytes
    devices = gpus([total // 3, total // 3]) + (make_device("cpu", total), make_device("disk", total))
    plan = make_plan(llama_2g_profile, devices, reserve={"cuda:1": 10 * MB})
    data = json.loads(plan.to_json())
    assert data["device_map"] == {k: v for k, v in plan.device_map.items()}
    assert [d["name"] for d in data["devices"]] == ["cuda:0", "cuda:1", "cpu", "disk"]
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.reserves == plan.reserves
    assert bottleneck_seconds(again) == bottleneck_seconds(plan)


def test_device_map_covers_every_tensor_including_loose_ones():
    import torchvision

    with torch.device("meta"):
        model = torchvision.models.vit_b_16()
    plan = automap.plan(model, max_memory={0: "200MB", 1: "200MB", "cpu": "1GB"})
    names = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers()]
    assert "class_token" in names

    def lookup(name):
        while name not in plan.device_map:
            assert name, "tensor without a device"
            name = name.rpartition(".")[0]
        return plan.device_map[name]

    assert {lookup(n) for n in names} == {0, 1}


def test_cut_bytes_in_one_pass_match_the_profile():
    prof = automap.profile(tiny_gpt2(layers=3))
    assert all_cut_bytes(prof) == tuple(prof.cut_bytes(i) for i in range(len(prof.units)))


# ------------------------------------------------------------------------------- errors


def test_model_that_fits_nowhere_says_how_much_is_missing(llama_2g_profile):
    devices = gpus([300 * MB, 300 * MB]) + (make_device("cpu", 500 * MB), make_device("disk", 800 * MB))
    with pytest.raises(
        PlanError,
        match=r"does not fit even with offloading.*2.0\d GiB of weights.*"
        r"cuda:0 286.10 MiB.*disk 762.94 MiB.*short.*raise max_memory",
    ):
        make_plan(llama_2g_profile, devices)


def test_unit_larger_than_every_device_is_named(llama_2g_profile):
    # No disk: the CPU would have to hold the embedding in RAM to compute it.
    devices = gpus([200 * MB, 200 * MB]) + (make_device("cpu", 250 * MB),)
    with pytest.raises(
        PlanError,
        match=r"unit 'model.embed_tokens' needs 250.00 MiB but the largest device .* cpu, has 238.42 MiB",
    ):
        make_plan(llama_2g_profile, devices)


def test_disk_alone_cannot_run_a_model(resnet50_profile):
    with pytest.raises(PlanError, match="nothing can run the model.*'disk'.*add CPU memory"):
        make_plan(resnet50_profile, (make_device("disk", 10**10),))


def test_unknown_strategy_and_no_devices(resnet50_profile):
    with pytest.raises(PlanError, match="unknown strategy 'fast'"):
        make_plan(resnet50_profile, hypothetical(resnet50_profile, 2, 2), "fast")
    with pytest.raises(PlanError, match="no devices"):
        make_plan(resnet50_profile, ())


# ---------------------------------------------------------------------------- user maps


def test_user_map_becomes_a_plan_and_reports_split_ties():
    model = tiny_gpt2(layers=2)
    device_map = {
        "transformer.wte": 0,
        "transformer.wpe": 0,
        "transformer.drop": 0,
        "transformer.h.0": 0,
        "transformer.h.1": 1,
        "transformer.ln_f": 1,
        "lm_head": 1,
    }
    plan = automap.plan(model, device_map, max_memory={0: "1GB", 1: "1GB"})
    assert plan.origin == "user"
    assert plan.device_of("transformer.h.1") == "cuda:1"
    assert any("tied weights split" in w and "lm_head" in w for w in plan.warnings)


def test_user_map_with_a_bad_device_is_refused(resnet50):
    with pytest.raises(DeviceMapError, match=r"device_map\['fc'\] = 'tpu' is not a device"):
        automap.plan(resnet50, {"": "cpu", "fc": "tpu"})


def test_plan_device_map_works_with_accelerate_and_transformers(tmp_path):
    from accelerate import dispatch_model
    from transformers import LlamaForCausalLM

    model = tiny_llama(layers=4)
    model.save_pretrained(tmp_path / "ckpt")
    ids = torch.randint(0, 256, (1, 10))
    with torch.no_grad():
        expected = model(ids).logits
    plan = automap.plan(model, max_memory={**part_on_disk(model), "disk": "1GB"})
    assert "disk" in plan.device_map.values() and "cpu" in plan.device_map.values()
    loaded = LlamaForCausalLM.from_pretrained(
        tmp_path / "ckpt", device_map=plan.device_map, offload_folder=str(tmp_path / "hf-off")
    )
    with torch.no_grad():
        assert torch.allclose(loaded(ids).logits, expected, atol=1e-5)
    dispatched = dispatch_model(
        tiny_llama(layers=4), device_map=plan.device_map, offload_dir=str(tmp_path / "acc")
    )
    with torch.no_grad():
        assert torch.allclose(dispatched(ids).logits, expected, atol=1e-5)


def test_a_new_strategy_is_one_registration(resnet50_profile):
    """Strategies are looked up by name: registering a split function makes it a device_map."""
    from automap.planning import STRATEGIES, register_strategy

    @register_strategy("last_gpu_only", "everything on the last computing device")
    def last_gpu_only(chain, slots, anchor_first):
        return [None] * (len(slots) - 1) + [(0, len(chain))]

    try:
        devices = (make_device("cuda:0", 10**10), make_device("cuda:1", 10**10))
        plan = make_plan(resnet50_profile, devices, "last_gpu_only")
        assert set(plan.placement) == {"cuda:1"} and plan.strategy == "last_gpu_only"
        assert (
            automap.plan(resnet50_profile, "last_gpu_only", {0: "10GB", 1: "10GB"}).placement
            == plan.placement
        )
    finally:
        del STRATEGIES["last_gpu_only"]
    with pytest.raises(PlanError, match="unknown strategy 'last_gpu_only'"):
        make_plan(resnet50_profile, devices, "last_gpu_only")


# ------------------------------------------------------- plans a user would not question


def test_balanced_low_0_streams_to_another_gpu_than_gpu_0(llama_2g_profile):
    """GPU 0 keeps no streaming slot when another GPU can execute: it stays light for
    generate(), and the streaming GPU, not GPU 0, is the busiest."""
    prof = llama_2g_profile
    devices = gpus([int(prof.total_bytes * 0.2)] * 4) + (make_device("cpu", 10 * prof.total_bytes),)
    plan = make_plan(prof, devices, "balanced_low_0")
    assert plan.offloaded_units and fits(plan)
    assert plan.execution_device != "cuda:0"
    assert "cuda:0" not in dict(plan.reserves), "no room kept on GPU 0 for streamed weights"
    seconds = compute_seconds(plan)
    assert seconds["cuda:0"] < seconds[plan.execution_device]
    assert max(seconds, key=seconds.get) != "cuda:0"
    auto = make_plan(prof, devices, "auto")
    assert auto.execution_device == "cuda:0", "balanced streams to GPU 0 as before"


def _headroom(plan: Plan) -> dict[str, int]:
    return {
        r.device.name: r.device.capacity_bytes - r.used_bytes
        for r in summary(plan)
        if r.device.is_accelerator
    }


def test_idle_gpu_room_takes_streamed_units_before_the_cpu_streams_them(resnet50_profile):
    """ResNet-50 on 8 GPUs of 16.6 MB and 410 MB of CPU RAM: layer4's blocks are larger than
    any GPU, so their pieces compute together on the execution GPU; every unit that streams
    from the CPU has no GPU with room to keep it (a piece: on the GPU that computes its
    block; any other unit: on any GPU)."""
    import torchvision

    with torch.device("meta"):
        model = torchvision.models.resnet50()
    total = weight_bytes(model)
    budget = {**{i: int(total * 1.3 / 8) for i in range(8)}, "cpu": 4 * total}
    plan = automap.plan(model, max_memory=budget)
    assert fits(plan) and plan.offloaded_units
    room = _headroom(plan)
    for unit, where in zip(plan.units, plan.placement):
        if not plan.placements.by_home[where].offloaded:
            continue
        could = [plan.execution_device] if unit.split_from else list(room)
        need = unit.weight_bytes + unit.peak_activation_bytes
        assert all(room[d] < need for d in could), (
            f"{unit.name} ({unit.weight_bytes} B) streams though {[d for d in could if room[d] >= need]} have room"
        )
    resident = {d for d in plan.placement if plan.device(d).is_accelerator}
    assert len(resident) >= 5


def test_no_gpu_holds_a_lone_small_unit_that_only_adds_cuts():
    """A Mixtral whose layers, embedding and LM head are each larger than the one 10 MB GPU:
    only the final norm would fit there, and sending the activations to the GPU and back for
    it costs more than it saves, so the CPU computes everything."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=8,
        vocab_size=32000,
    )
    with torch.device("meta"):
        model = MixtralForCausalLM(config)
    plan = automap.plan(model, max_memory={0: 10 * MB, "cpu": 2 * weight_bytes(model)})
    assert plan.device_of("model.norm") == "cpu"
    assert cuts(plan) == ()
    assert not [d for d in plan.placement if d == "cuda:0"]


def test_room_enough_in_total_but_not_where_a_unit_runs_is_said_so():
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 256), torch.nn.Linear(256, 256), torch.nn.Linear(256, 256)
    )
    with pytest.raises(
        PlanError,
        match=r"is enough, but its largest piece \(259.00 KiB .* a device that computes to "
        r"run, and the most one has is 195.31 KiB",
    ):
        automap.plan(model, max_memory={"cpu": beside_the_run(model, 200_000), "disk": "700KB"})
