"""The predicted time of a forward whose weights are partly read from disk: reads run ahead of
the compute (automap/planning/cost.py ``overlapped_seconds``), as the runtime's prefetch does."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import automap
from automap.planning.cost import overlapped_seconds
from automap.planning.predict import forward_seconds, memory, summary
from conftest import tiny_llama

seconds = st.floats(min_value=0.0, max_value=1.0, allow_nan=False)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(seconds, seconds), min_size=1, max_size=20), st.integers(min_value=0, max_value=4))
def test_reads_ahead_hide_behind_compute_but_never_vanish(units, ahead):
    computes, reads = [c for c, _ in units], [r for _, r in units]
    total = overlapped_seconds(computes, reads, ahead)
    slack = 1e-9 * len(units)
    assert total <= sum(computes) + sum(reads) + slack  # never worse than one after the other
    assert total >= max(sum(computes), sum(reads)) - slack  # the compute and the disk each take their time
    assert total + slack >= overlapped_seconds(
        computes, reads, ahead + 1
    )  # reading further ahead never slows
    if ahead == 0:
        assert math.isclose(total, sum(computes) + sum(reads), abs_tol=slack)


def test_equal_units_cost_the_first_read_then_the_slower_of_read_and_compute():
    computes, reads = [8.0] * 6, [9.0] * 6
    assert overlapped_seconds(computes, reads, 2) == 9.0 * 6 + 8.0
    assert overlapped_seconds(reads, computes, 2) == 8.0 + 9.0 * 6
    assert overlapped_seconds(computes, [0.0] * 6, 2) == 48.0


def _all_in_ram_and_half_on_disk() -> tuple[automap.Plan, automap.Plan]:
    """An 8-layer Llama planned with room for everything, then with half its weights on disk."""
    model = tiny_llama(layers=8)
    ids = {"input_ids": torch.zeros(1, 64, dtype=torch.long)}
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    probe = automap.plan(model, max_memory={"cpu": "1GiB"}, example_inputs=ids)
    cpu = next(m for m in memory(probe) if m.device == "cpu")
    plan = automap.plan(
        model, max_memory={"cpu": weights // 2 + cpu.peak_bytes - cpu.weights}, example_inputs=ids
    )
    return probe, plan


def test_a_forward_with_half_its_weights_on_disk_is_predicted_below_its_stages_summed():
    probe, plan = _all_in_ram_and_half_on_disk()
    assert "disk" in plan.placement and "cpu" in plan.placement
    stages = sum(s.stage_seconds for s in summary(plan))
    assert forward_seconds(plan) < stages
    # Resident alone, the same model costs its compute: reading ahead cannot make it cheaper.
    assert forward_seconds(plan) >= forward_seconds(probe)


def test_the_cpu_is_predicted_to_read_ahead_as_far_as_its_transfers_do():
    from automap.kinds import kind_of
    from automap.offload.direct import DirectTransfer
    from automap.offload.transfer import PageTransfer

    assert kind_of("cpu").read_ahead == PageTransfer.lookahead == DirectTransfer.lookahead


def test_where_torchs_threads_fill_the_cores_an_offloaded_read_takes_its_cpu_time_from_the_compute():
    """With a core to spare the read-ahead hides a read behind the compute; with none, the
    read's CPU time (the kernel's page-cache work, measured by calibration per byte) is taken
    from the compute of the unit it reads."""
    from dataclasses import replace

    probe, plan = _all_in_ram_and_half_on_disk()
    cost = 1e-9  # CPU seconds a byte read costs
    devices = tuple(
        replace(d, spare_cores=s, read_cpu_seconds_per_byte=cost if d.kind == "disk" else 0.0)
        for d in plan.devices
        for s in [0 if d.kind == "cpu" else 1]
    )
    busy, free = (
        replace(plan, devices=devices),
        replace(plan, devices=tuple(replace(d, spare_cores=1) for d in devices)),
    )
    offloaded = sum(u.weight_bytes for u, where in zip(plan.units, plan.placement) if where == "disk")
    assert offloaded > 0
    assert forward_seconds(free) == forward_seconds(plan)
    # The reads' CPU time lengthens the compute (which may then hide reads it did not before).
    assert forward_seconds(busy) > forward_seconds(free) and forward_seconds(busy) >= offloaded * cost
    again = automap.Plan.from_json(busy.to_json())
    assert [(d.spare_cores, d.read_cpu_seconds_per_byte) for d in again.devices] == [
        (d.spare_cores, d.read_cpu_seconds_per_byte) for d in devices
    ]


@settings(max_examples=60, deadline=None)
@given(
    small=st.floats(1e9, 1e12),
    factor=st.floats(0.25, 4.0),
    first=st.floats(1.0, 1e12),
    second=st.floats(1.0, 1e12),
)
def test_a_units_rate_lies_between_the_probe_layers_and_grows_with_its_ops_size(small, factor, first, second):
    """Ops smaller than the small layer's run at its rate, larger than the large one's at that
    rate, between them monotonically between the two; one rate measured: that rate."""
    from dataclasses import replace

    from automap.devices import make_device
    from automap.machine_probes import PROBE_OP_FLOPS
    from automap.planning.cost import compute_rate

    cpu = replace(make_device("cpu", 2**30), flops_per_second=small, large_flops_per_second=small * factor)
    low, high = PROBE_OP_FLOPS
    assert math.isclose(compute_rate(cpu, low), small) and math.isclose(compute_rate(cpu, low / 10), small)
    assert math.isclose(compute_rate(cpu, high), small * factor)
    assert math.isclose(compute_rate(cpu, high * 10), small * factor)
    lesser, greater = sorted((first, second))
    rates = [compute_rate(cpu, lesser), compute_rate(cpu, greater)]
    assert (
        min(small, small * factor) * (1 - 1e-9)
        <= min(rates)
        <= max(rates)
        <= max(small, small * factor) * (1 + 1e-9)
    )
    assert (rates[0] <= rates[1] * (1 + 1e-9)) if factor >= 1 else (rates[0] * (1 + 1e-9) >= rates[1])
    assert compute_rate(replace(cpu, large_flops_per_second=0.0), high) == small


def test_a_speed_given_by_hand_runs_every_op_at_that_speed():
    """``speeds={"cpu": ...}`` stands for both probe layers' rates: none is left measured."""
    from dataclasses import replace

    from automap.devices import _override, make_device

    cpu = replace(
        make_device("cpu", 2**30),
        flops_per_second=1e11,
        large_flops_per_second=2e11,
        measured=("flops_per_second", "large_flops_per_second"),
    )
    given = _override(cpu, "flops_per_second", {"cpu": 5e10})
    assert (given.flops_per_second, given.large_flops_per_second, given.measured) == (5e10, 0.0, ())
