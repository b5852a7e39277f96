"""The memory model of a run (automap/planning/memory.py): what it counts, that the planner places
against it, that it refuses with the numbers, and that the report shows it."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import automap
from automap.planning import Plan
from automap.planning.memory import runtime_overhead
from automap.planning.predict import memory, summary
from conftest import tiny_gpt2, tiny_llama

MiB = 2**20
IDS = {"input_ids": torch.zeros(2, 64, dtype=torch.long)}


@pytest.fixture(scope="module")
def gpt2():
    return tiny_gpt2(layers=4)


@pytest.fixture(scope="module")
def gpt2_profile(gpt2):
    return automap.profile(gpt2, IDS)


def cpu_row(plan: Plan):
    return next(m for m in memory(plan) if m.device == "cpu")


def test_forward_peak_counts_the_logits_kept_and_training_keeps_more(gpt2_profile):
    logits = 2 * 64 * 256 * 4  # batch x tokens x vocab, float32: alive from the head to the end
    peak = gpt2_profile.forward_peak_bytes
    assert peak >= logits + max(u.output_bytes for u in gpt2_profile.units if u.name != "lm_head")
    assert peak >= max(u.peak_activation_bytes for u in gpt2_profile.units)
    # A forward with grad keeps every block's saved tensors alive until the backward.
    assert gpt2_profile.train_peak_bytes > 2 * peak
    assert gpt2_profile.run_peak_bytes == peak  # the model is in eval mode


def test_a_model_in_training_mode_is_planned_with_its_training_peak(gpt2):
    gpt2.train()
    try:
        plan = automap.plan(gpt2, max_memory={"cpu": "1GiB"}, example_inputs=IDS)
        prof = automap.profile(gpt2, IDS)
    finally:
        gpt2.eval()
    assert plan.activation_peak_bytes == prof.train_peak_bytes > prof.forward_peak_bytes
    assert cpu_row(plan).activations == prof.train_peak_bytes
    # The allocator's slack grows with what a forward frees and reuses: the inference forward's peak.
    assert cpu_row(plan).overhead == runtime_overhead("cpu", prof.train_peak_bytes, prof.forward_peak_bytes)
    # Traced as it trains: dropout's masks and the attention scores its dropout needs are kept.
    assert prof.train_peak_bytes > automap.profile(gpt2, IDS).train_peak_bytes


def test_cpu_row_is_weights_cache_activations_and_overhead(gpt2_profile):
    plan = automap.plan(gpt2_profile, max_memory={"cpu": "1GiB"})
    row = cpu_row(plan)
    assert row.weights == gpt2_profile.total_bytes
    assert row.activations == gpt2_profile.forward_peak_bytes
    assert row.overhead == runtime_overhead("cpu", row.activations) > 0
    assert row.peak_bytes == row.weights + row.activations + row.overhead
    used = next(s for s in summary(plan) if s.device.name == "cpu")
    assert used.used_bytes == row.peak_bytes  # the report's "used" is the predicted peak


@settings(max_examples=25, deadline=None)
@given(share=st.floats(0.0, 1.2))
def test_a_plan_that_fits_keeps_its_cpu_peak_within_the_budget(gpt2_profile, share):
    runtime = gpt2_profile.forward_peak_bytes + runtime_overhead("cpu", gpt2_profile.forward_peak_bytes)
    budget = runtime + int(share * gpt2_profile.total_bytes)
    plan = automap.plan(gpt2_profile, max_memory={"cpu": budget, "disk": "1GiB"})
    row = cpu_row(plan)
    assert row.fits and row.peak_bytes <= budget
    assert not [w for w in plan.warnings if "budget" in w]
    # It keeps as many weights in RAM as the room beside the run allows (each unit is small).
    largest = max(u.weight_bytes for u in gpt2_profile.units)
    assert row.weights >= min(budget - runtime, gpt2_profile.total_bytes) - largest * 2


def test_a_budget_below_one_units_activations_is_refused_with_the_numbers(gpt2_profile):
    need = gpt2_profile.forward_peak_bytes + runtime_overhead("cpu", gpt2_profile.forward_peak_bytes)
    one_unit = max(u.peak_activation_bytes for u in gpt2_profile.units)
    budget = one_unit - 1
    with pytest.raises(automap.RuntimeBudgetError) as caught:
        automap.plan(gpt2_profile, max_memory={"cpu": budget, "disk": "1GiB"})
    message = str(caught.value)
    assert isinstance(caught.value, automap.PlanError)
    for figure in (need, gpt2_profile.forward_peak_bytes, budget, one_unit):
        assert automap.format_bytes(figure) in message
    assert "max_memory['cpu']" in message


@pytest.mark.parametrize("budget", ["between", 0])
def test_a_budget_below_the_run_keeps_no_weight_in_ram_and_says_it_goes_over(gpt2_profile, budget):
    need = gpt2_profile.forward_peak_bytes + runtime_overhead("cpu", gpt2_profile.forward_peak_bytes)
    budget = need - 1 * MiB if budget == "between" else 0
    plan = automap.plan(gpt2_profile, max_memory={"cpu": budget, "disk": "1GiB"})
    row = cpu_row(plan)
    assert row.weights == 0 and row.peak_bytes == need
    if budget == 0:  # a capacity of 0 reads as unknown: accelerate's "no weights here"
        return
    assert not row.fits
    text = " ".join(plan.report().split())
    assert f"cpu holds {automap.format_bytes(need)} but its budget is {automap.format_bytes(budget)}" in text


def test_a_larger_batch_needs_more_room(gpt2):
    small = automap.profile(gpt2, {"input_ids": torch.zeros(1, 32, dtype=torch.long)})
    large = automap.profile(gpt2, {"input_ids": torch.zeros(8, 64, dtype=torch.long)})
    assert large.forward_peak_bytes > 4 * small.forward_peak_bytes


def test_the_report_shows_the_parts_of_the_peak(gpt2_profile):
    plan = automap.plan(gpt2_profile, max_memory={"cpu": "1GiB"})
    row = cpu_row(plan)
    text = " ".join(plan.report().split())  # lines wrapped at 80 columns, joined again
    parts = " + ".join(
        f"{automap.format_bytes(n)} {what}"
        for n, what in [
            (row.weights, "weights"),
            (row.activations, "activations"),
            (row.overhead, "runtime overhead"),
        ]
    )
    assert f"peak {automap.format_bytes(row.peak_bytes)} = {parts}" in text


def test_json_keeps_the_peaks_and_refuses_bad_ones(gpt2_profile):
    import json

    plan = automap.plan(gpt2_profile, max_memory={"cpu": "1GiB"})
    again = Plan.from_json(plan.to_json())
    assert again.activation_peak_bytes == plan.activation_peak_bytes > 0
    assert memory(again) == memory(plan)
    data = json.loads(plan.to_json())
    assert data["devices"][0]["overhead_bytes"] == cpu_row(plan).overhead
    for bad in (-1, "12", 1.5, True):
        data["activation_peak_bytes"] = bad
        with pytest.raises(automap.PlanError, match="activation_peak_bytes"):
            Plan.from_json(json.dumps(data))


def test_accelerators_count_their_own_activations_not_the_cpu_runtime():
    prof = automap.profile(tiny_llama(layers=2), IDS)
    plan = automap.plan(prof, max_memory={0: "64MiB", "cpu": "1GiB"})
    rows = {m.device: m for m in memory(plan)}
    assert rows["cuda:0"].activations == max(u.peak_activation_bytes for u in prof.units)
    assert rows["cpu"].activations == rows["cpu"].overhead == 0  # it computes nothing


def test_a_budget_below_the_run_is_a_runtime_budget_error_also_where_units_stay_whole(tmp_path):
    # A load with given inputs, whose decoder layers (no_split) and head outweigh the budget: the
    # planner's note on the units it kept whole must not turn the run's refusal into a plain
    # PlanError (callers catch the subclass), nor list units no split would help.
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=4000,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "llama")
    with automap.empty_model():
        skeleton = LlamaForCausalLM(config)
    one_unit = max(u.peak_activation_bytes for u in automap.profile(skeleton).units)
    with pytest.raises(automap.RuntimeBudgetError) as caught:
        automap.load(
            skeleton,
            tmp_path / "llama",
            max_memory={"cpu": one_unit - 1, "disk": "1GiB"},
            offload_dir=tmp_path / "store",
            quiet=True,
            example_inputs=(torch.ones(2, 128, dtype=torch.long),),
        )
    assert "Units that could not be split" not in str(caught.value)
