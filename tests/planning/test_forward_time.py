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


def test_a_forward_with_half_its_weights_on_disk_is_predicted_below_its_stages_summed():
    model = tiny_llama(layers=8)
    ids = {"input_ids": torch.zeros(1, 64, dtype=torch.long)}
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    probe = automap.plan(model, max_memory={"cpu": "1GiB"}, example_inputs=ids)
    cpu = next(m for m in memory(probe) if m.device == "cpu")
    plan = automap.plan(
        model, max_memory={"cpu": weights // 2 + cpu.peak_bytes - cpu.weights}, example_inputs=ids
    )
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
