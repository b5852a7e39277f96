"""The floor ``benchmarks/moe.py --floors`` holds a cold MoE forward to: the best schedule of
its reads and compute on one disk. A floor above what a schedule can reach would fail automap
for nothing; one below the bounds any schedule obeys would pass it for nothing."""

import random

import pytest

from benchmarks.moe import best_schedule


def test_without_dense_parts_the_floor_is_the_routed_reads_and_the_compute_in_a_chain():
    assert best_schedule([0.0] * 3, [0.010, 0.020, 0.030], 0.004) == pytest.approx(0.060 + 3 * 0.004)


def test_dense_parts_that_the_compute_hides_cost_nothing_but_the_first():
    # Layer 0's dense part is read before anything can run; the others fit in the time the
    # compute leaves the disk (half a layer's compute before its router, half after its experts).
    found = best_schedule([0.002, 0.001, 0.001], [0.010, 0.010, 0.010], 0.004)
    assert found == pytest.approx(0.002 + 3 * (0.010 + 0.004))


def test_a_disk_busy_with_dense_parts_sets_the_floor():
    # One large layer: its dense part, then its router, its experts, its compute.
    assert best_schedule([0.100], [0.001], 0.002) == pytest.approx(0.100 + 0.001 + 0.002)


@pytest.mark.parametrize("seed", range(200))
def test_the_floor_obeys_both_bounds_and_is_reached_by_reading_dense_parts_first(seed):
    rng = random.Random(seed)
    layers = rng.randint(1, 8)
    dense = [rng.uniform(0, 0.02) for _ in range(layers)]
    routed = [rng.uniform(0, 0.02) for _ in range(layers)]
    compute = rng.uniform(0, 0.01)
    found = best_schedule(dense, routed, compute)
    # Any schedule: the chain of routers, routed reads and compute, after the first dense part;
    # and the disk, reading every byte, then the last layer's compute after its experts.
    assert found >= dense[0] + sum(routed) + layers * compute - 1e-12
    assert found >= sum(dense) + sum(routed) + compute / 2 - 1e-12
    # And one schedule reaches no less: every dense part read before the first layer runs.
    assert found <= sum(dense) + sum(routed) + layers * compute + 1e-12
