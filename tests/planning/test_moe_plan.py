"""Routed experts placed apart from their layers (``automap/planning/experts.py``,
``experts_choice.py``): on one 24 GiB GPU and 64 GiB of CPU RAM, a Mixtral-8x7B-shaped and a
Qwen3-30B-A3B-shaped model (bfloat16, on meta) keep every layer's attention, norms and router on
the GPU and their routed experts beside them or in CPU RAM (disk when RAM is short); the CPU
computes the experts at a decode step of batch 1 and they stream at the prompt's prefill, as
the cost model predicts, and the plan's predicted decode rate beats every whole-layer plan's."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

import automap
from automap.planning.experts import ExpertsCost, ExpertsMode, best_mode, mode_seconds, touched_fraction
from conftest import tiny_moe

BUDGET = {0: "24GiB", "cpu": "64GiB", "disk": "500GiB"}
# A desktop with DDR5 (80 GB/s) beside a PCIe 4 GPU (25 GB/s, the default link): the CPU reads
# the two experts of a token faster than the link could carry them.
DDR5 = {"cpu": 80e9}
DATA = Path(__file__).parents[1] / "data"


def mixtral(layers: int = 32):
    """Mixtral-8x7B's shape: hidden 4096, 14336 per expert, 8 experts, 2 per token."""
    import transformers

    config = transformers.MixtralConfig(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=layers,
        num_local_experts=8,
        num_experts_per_tok=2,
        vocab_size=32000,
        num_attention_heads=32,
        num_key_value_heads=8,
    )
    with torch.device("meta"):
        return transformers.MixtralForCausalLM(config).to(torch.bfloat16).eval()


def qwen3_moe(layers: int = 48):
    """Qwen3-30B-A3B's shape: hidden 2048, 128 experts of 768, 8 per token."""
    import transformers

    config = transformers.Qwen3MoeConfig(
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=layers,
        num_experts=128,
        num_experts_per_tok=8,
        vocab_size=151936,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        mlp_only_layers=[],
        decoder_sparse_step=1,
    )
    with torch.device("meta"):
        return transformers.Qwen3MoeForCausalLM(config).to(torch.bfloat16).eval()


def planned(model, budget=BUDGET, bandwidths=DDR5, batch=1):
    prompt = (torch.zeros(batch, 128, dtype=torch.long, device="meta"),)
    return automap.plan(
        model, max_memory=budget, example_inputs=prompt, batch=batch, max_length=4096, bandwidths=bandwidths
    )


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe"])
def moe_plan(request):
    return {"mixtral": mixtral, "qwen3_moe": qwen3_moe}[request.param](), planned(globals()[request.param]())


def test_every_layers_non_expert_part_is_on_the_gpu_and_its_experts_beside_it_or_in_ram(moe_plan):
    model, plan = moe_plan
    layers = {name for name, _ in model.model.layers.named_children()}
    assert plan.experts is not None and len(plan.experts.layers) == len(layers)
    where = dict(zip((u.name for u in plan.units), plan.placement))
    for unit in plan.units:
        if unit.name.startswith("model.layers.") and not unit.experts:
            assert where[unit.name] == "cuda:0", unit.name
    homes = [layer.home for layer in plan.experts.layers]
    assert set(homes) <= {"cuda:0", "cpu", "disk"} and homes.count("cpu") >= len(homes) // 2, homes
    assert plan.device_map["model.layers.20.mlp.experts"] == "cpu"
    assert plan.device_map["model.layers.20.self_attn"] == 0


def test_the_cpu_computes_the_experts_at_batch_1_and_they_stream_at_the_prefill(moe_plan):
    _, plan = moe_plan
    in_ram = [layer for layer in plan.experts.layers if layer.home == "cpu"]
    assert in_ram and all(layer.decode is ExpertsMode.CPU_COMPUTES for layer in in_ram)
    assert all(layer.prefill is ExpertsMode.STREAMED for layer in in_ram)  # 128 tokens
    assert plan.execution_device == "cpu"  # the device map's "cpu" experts compute there at decode
    assert all(1 < layer.stream_from <= 128 for layer in in_ram)


def test_the_modes_follow_the_one_cost_model_at_every_batch(moe_plan):
    _, plan = moe_plan
    layer = next(layer for layer in plan.experts.layers if layer.home == "cpu")
    unit = plan.units[[u.name for u in plan.units].index(layer.unit)]
    cpu, gpu = plan.device("cpu"), plan.device("cuda:0")
    cost = ExpertsCost.of(unit, plan.experts.prefill_tokens)
    for tokens in (1, layer.stream_from - 1, layer.stream_from, 64 * 128):
        seconds = mode_seconds(cost, tokens, cpu, cpu, gpu)
        assert best_mode(cost, tokens, cpu, cpu, gpu) is min(seconds, key=seconds.get)
    assert best_mode(cost, layer.stream_from - 1, cpu, cpu, gpu) is ExpertsMode.CPU_COMPUTES
    assert best_mode(cost, 64 * 128, cpu, cpu, gpu) is ExpertsMode.STREAMED  # a large prefill batch
    assert touched_fraction(unit, 1) == unit.experts_per_token / unit.experts
    assert touched_fraction(unit, 64 * 128) == pytest.approx(1.0)


def test_its_predicted_decode_rate_beats_the_best_whole_layer_plan(moe_plan):
    _, plan = moe_plan
    record = plan.experts
    assert record.tokens_per_second > record.whole_layer_tokens_per_second > 0
    from automap.planning.decode import predict_decode

    assert predict_decode(plan).tokens_per_second == pytest.approx(record.tokens_per_second)
    assert any(c.startswith("chosen instead: routed experts apart") for c in plan.choices)


@pytest.mark.parametrize("cpu", ["64GiB", "30GiB"])
def test_each_layers_modes_are_what_the_runtime_does_with_its_experts(cpu):
    """With 64 GiB the CPU computes the experts off the GPU (those in RAM stream from the
    crossing on, those on disk never); with 30 GiB the plan streams every one to the GPU. The
    record says so per layer, whatever the cost model would have liked for each alone."""
    plan = planned(mixtral(), budget={0: "24GiB", "cpu": cpu, "disk": "500GiB"})
    placements = {u.name: p for u, p in zip(plan.units, plan.placements)}
    seen = set()
    for layer in plan.experts.layers:
        placement = placements[layer.unit]
        if layer.home == "cuda:0":
            expected = (ExpertsMode.RESIDENT, ExpertsMode.RESIDENT, 0)
        elif placement.compute == "cuda:0":
            expected = (ExpertsMode.STREAMED, ExpertsMode.STREAMED, 1)
        elif placement.offloaded:
            expected = (ExpertsMode.CPU_COMPUTES, ExpertsMode.CPU_COMPUTES, 0)
        else:
            assert 1 < layer.stream_from <= 128, layer
            expected = (ExpertsMode.CPU_COMPUTES, ExpertsMode.STREAMED, layer.stream_from)
        assert (layer.decode, layer.prefill, layer.stream_from) == expected, layer
        seen.add((layer.home, placement.compute))
    assert ("cpu", "cuda:0" if cpu == "30GiB" else "cpu") in seen, seen
    assert cpu == "30GiB" or ("disk", "cpu") in seen, seen


def test_the_report_shows_each_layer_and_the_json_carries_it_back(moe_plan):
    _, plan = moe_plan
    text = plan.report()
    assert "routed experts apart from their layers" in text and "for the best whole-layer plan" in text
    assert sum(1 for line in text.splitlines() if "cpu computes" in line and "streamed" in line) >= 10
    data = json.loads(plan.to_json())
    assert data["experts"]["layers"][-1]["unit"] == plan.experts.layers[-1].unit
    again = automap.Plan.from_json(plan.to_json())
    assert again.experts == plan.experts and again.device_map == plan.device_map


def test_slow_cpu_memory_streams_the_experts_even_at_batch_1():
    """The default CPU memory (20 GB/s) reads slower than the link carries (25 GB/s): the cost
    model then streams the two experts of a token instead."""
    plan = planned(mixtral(8), budget={0: "6GiB", "cpu": "16GiB", "disk": "100GiB"}, bandwidths=None)
    assert plan.experts is not None
    in_ram = [layer for layer in plan.experts.layers if layer.home == "cpu"]
    assert in_ram and all(layer.decode is ExpertsMode.STREAMED for layer in in_ram)
    assert plan.execution_device == "cuda:0"
    assert plan.experts.tokens_per_second > plan.experts.whole_layer_tokens_per_second


def test_layers_stay_whole_without_a_generation_or_when_the_gpu_holds_everything():
    model = mixtral(2)
    prompt = (torch.zeros(1, 16, dtype=torch.long, device="meta"),)
    whole = automap.plan(model, max_memory={0: "3GiB", "cpu": "64GiB"}, example_inputs=prompt)
    assert whole.experts is None and any("plan for a generation" in c for c in whole.choices)
    roomy = automap.plan(
        model, max_memory={0: "80GiB", "cpu": "64GiB"}, example_inputs=prompt, batch=1, max_length=64
    )
    assert roomy.experts is None and not [u for u in roomy.units if u.experts]


def test_plan_json_from_before_reads_without_experts():
    plan = automap.Plan.from_json((DATA / "plan_before_offload_dir.json").read_text())
    assert plan.experts is None


def _same_logits_dispatched(model, ids, device_map) -> None:
    """``model`` dispatched by ``device_map`` (or plan) gives the plain model's logits on ``ids``."""
    with torch.no_grad():
        expected = model(*ids).logits
    automap.dispatch(model, device_map)
    try:
        with torch.no_grad():
            got = model(*ids).logits
    finally:
        automap.undispatch(model)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_a_plan_with_the_experts_as_units_dispatches_on_the_cpu_with_the_plain_outputs(kind):
    model = tiny_moe(kind, layers=2, hidden=64, experts=8, shared=48)
    ids = (torch.randint(0, 128, (2, 16)),)
    _same_logits_dispatched(
        model, ids, {"": "cpu", **{f"model.layers.{i}.mlp.experts": "cpu" for i in range(2)}}
    )


def test_the_cli_shows_the_experts_plan_against_the_whole_layer_plan(tmp_path, capsys):
    from automap.cli import main

    out_json = tmp_path / "plan.json"
    code = main(
        [
            "plan",
            "hf:mixtral",
            "--max-memory",
            "0=24GiB,cpu=64GiB,disk=500GiB",
            "--dtype",
            "bfloat16",
            "--max-length",
            "4096",
            "--json",
            str(out_json),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    text = " ".join(out.split())
    assert "routed experts apart from their layers: predicted decode" in text
    assert "for the best whole-layer plan" in text
    rows = [line.split() for line in out.splitlines() if re.match(r"  model\.layers\.\d+ ", line)]
    assert len(rows) == 32 and all(row[1] in ("cuda:0", "cpu", "disk") for row in rows), rows
    record = json.loads(out_json.read_text())["experts"]
    assert record["tokens_per_second"] > record["whole_layer_tokens_per_second"] > 0
    assert len(record["layers"]) == 32


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_a_plan_of_the_profile_with_experts_as_units_dispatches_on_the_cpu(kind):
    from automap.profiling.refine import Splitter

    model = tiny_moe(kind, layers=2, hidden=64, experts=8, shared=48)
    ids = (torch.randint(0, 128, (2, 16)),)
    prof = automap.profile(model, ids)
    finer = Splitter(model, example_inputs=ids)(prof, list(prof.routed)).profile
    experts = [u for u in finer.units if u.experts]
    assert [u.name for u in experts] == list(prof.routed) and all(u.split_from for u in experts)
    plan = automap.plan(finer, max_memory={"cpu": "1GiB"})
    assert plan.device_map["model.layers.1.mlp.experts"] == "cpu"
    _same_logits_dispatched(model, ids, plan)


def test_experts_the_cpu_computes_get_the_per_call_choice_at_the_planned_token_count(moe_plan):
    from automap.runtime.experts import ExpertsByCall, hook_experts_by_call
    from automap.runtime.state import DispatchState

    model, plan = moe_plan
    in_ram = {layer.unit: layer.stream_from for layer in plan.experts.layers if layer.home == "cpu"}
    state = DispatchState(plan=plan)
    hooked = hook_experts_by_call(plan, dict(model.named_modules()), state)
    try:
        assert hooked == set(in_ram) and hooked
        assert {h.stream_from for h in state.hooks} == set(in_ram.values())
        assert all(
            isinstance(h, ExpertsByCall) and h.accelerator == torch.device("cuda:0") for h in state.hooks
        )
    finally:
        for hook in state.hooks:
            hook.detach()


def test_experts_are_read_whole_ahead_when_most_of_what_is_not_kept_is_routed_to():
    from automap.planning.experts import RANGED_SHARE, reads_whole

    assert not reads_whole(2, 8)  # batch 1 of top-2-of-8: rows
    assert reads_whole(6, 8)  # batch 4: about 70 % of the layer routed to: whole
    assert not reads_whole(1, 6)  # two of eight kept in memory, one of the rest routed to: rows
    assert not reads_whole(0, 0) and not reads_whole(3, 0)  # nothing left to read
    for whole in range(1, 40):
        flips = [routed for routed in range(whole + 1) if reads_whole(routed, whole)]
        assert flips == list(range(flips[0], whole + 1)) if flips else True  # more routed: never back to rows
        assert all(routed >= whole * RANGED_SHARE for routed in flips)
