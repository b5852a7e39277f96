"""The decode prediction (planning/decode.py) on hand-made plans whose numbers are known: which
term limits a step, the step time it gives, and the hint that moves the limit."""

from __future__ import annotations

from dataclasses import replace

import pytest

from automap.devices import make_device
from automap.planning import Plan, PlanInputs, Provenance
from automap.planning.decode import predict_decode
from automap.profiling import Unit
from automap.profiling.result import Generation

GB = 10**9


def _unit(name: str, weights: int, kv_read: int = 0, flops: int = 0, kv: int = 0) -> Unit:
    return Unit(
        name,
        (f"{name}.w",),
        param_bytes=weights,
        kv_bytes=kv,
        kv_read_bytes=kv_read,
        decode_flops=flops,
        calls=1,
    )


def _plan(units, placement, devices, batch: int = 1) -> Plan:
    return Plan(
        units=tuple(units),
        devices=tuple(devices),
        placement=tuple(placement),
        provenance=Provenance("auto"),
        inputs=PlanInputs(generation=Generation(batch, 1024, 128, cache="DynamicCache")),
    )


def _gpu(name: str, capacity: int = 80 * GB):
    return make_device(
        name, capacity, flops_per_second=100e12, link_bytes_per_second=25e9, memory_bytes_per_second=2e12
    )


def test_resident_weights_bound_a_step_by_memory_bandwidth():
    plan = _plan([_unit("a", 10 * GB, kv_read=2 * GB, flops=10**9)], ["cuda:0"], [_gpu("cuda:0")])
    decode = predict_decode(plan)
    assert decode.step_seconds == pytest.approx(12 * GB / 2e12)
    assert decode.tokens_per_second == pytest.approx(1 / decode.step_seconds)
    assert decode.limit.kind == "weights" and decode.limit.amount == 10 * GB
    assert decode.describe().startswith("decode limited by 9.31 GiB of weights read from cuda:0 per step: ~")


def test_a_stream_to_a_gpu_overlaps_its_work_and_is_named_with_a_fix():
    units = [_unit("a", 10 * GB, flops=10**14), _unit("b", 17 * GB)]
    devices = [_gpu("cuda:0"), make_device("disk", 10**13, link_bytes_per_second=2e9)]
    decode = predict_decode(_plan(units, ["cuda:0", "disk"], devices))
    assert decode.step_seconds == pytest.approx(17 * GB / 2e9)  # the copy engine streams while it computes
    assert (decode.limit.kind, decode.limit.device) == ("stream", "disk")
    assert (
        "decode limited by 15.83 GiB streamed from disk per step: ~0.118 tokens/s at batch 1"
        in decode.describe()
    )
    assert "more memory on cuda:0 (max_memory) would keep every weight resident" in decode.hint


def test_on_a_cpu_compute_reads_and_stream_add_up():
    cpu = make_device("cpu", 10 * GB, flops_per_second=1e10, memory_bytes_per_second=2e10)
    disk = make_device("disk", 10**13, link_bytes_per_second=1e10)
    units = [_unit("a", GB, flops=10**10), _unit("b", 2 * GB, flops=10**10)]
    decode = predict_decode(_plan(units, ["cpu", "disk"], [cpu, disk], batch=8))
    # 2e10 FLOP / 1e10 + 1 GB / 2e10 + 2 GB / 1e10: the cores compute, read and map in turn.
    assert decode.step_seconds == pytest.approx(2.0 + 0.05 + 0.2)
    assert all(t.binds for t in decode.terms)
    assert decode.limit.kind == "compute" and decode.tokens_per_second == pytest.approx(8 / 2.25)


def test_a_cpu_step_pays_for_each_row_read_and_each_op():
    cpu = replace(
        make_device("cpu", 10 * GB, flops_per_second=1e12, memory_bytes_per_second=2e10),
        row_seconds=1e-8,
        op_seconds=2e-6,
    )
    unit = replace(_unit("a", GB), decode_weight_bytes=GB // 2, decode_weight_rows=10**6, decode_ops=500)
    decode = predict_decode(_plan([unit], ["cpu"], [cpu]))
    weights, ops = (next(t for t in decode.terms if t.kind == kind) for kind in ("weights", "ops"))
    # What a step reads of the weights (half: an embedding's one row, say), not all of them.
    assert weights.amount == GB // 2 and weights.seconds == pytest.approx(0.5 / 20 + 10**6 * 1e-8)
    assert ops.amount == 500 and ops.seconds == pytest.approx(1e-3)
    compute = next(t for t in decode.terms if t.kind == "compute")
    assert decode.step_seconds == pytest.approx(compute.seconds + weights.seconds + ops.seconds)
    assert "500 ops dispatched on cpu" in [t.describe() for t in decode.terms]


def test_compute_bound_step_and_its_hint():
    plan = _plan([_unit("a", GB, flops=10**15)], ["cuda:0"], [_gpu("cuda:0")], batch=64)
    decode = predict_decode(plan)
    assert decode.step_seconds == pytest.approx(10.0)
    assert decode.tokens_per_second == pytest.approx(6.4)
    assert decode.limit.kind == "compute" and "compute-bound on cuda:0" in decode.hint


def test_devices_take_turns_and_the_limit_sums_them():
    units = [_unit("a", 10 * GB), _unit("b", 30 * GB)]
    decode = predict_decode(_plan(units, ["cuda:0", "cuda:1"], [_gpu("cuda:0"), _gpu("cuda:1")]))
    assert decode.step_seconds == pytest.approx(40 * GB / 2e12)
    assert decode.limit.describe() == "37.25 GiB of weights read from cuda:0, cuda:1"


def test_a_larger_batch_amortises_the_weights_until_the_cache_or_compute_limits():
    plan = _plan(
        [_unit("a", 10 * GB, kv_read=GB // 2, flops=2 * 10**10, kv=GB)], ["cuda:0"], [_gpu("cuda:0")]
    )
    hint = predict_decode(plan).hint
    # Weights (10 GB) stay; the cache read grows with the batch and passes them at batch 32.
    assert "at batch 32 the limit moves to 14.90 GiB of KV cache read from cuda:0" in hint


def test_no_generation_no_prediction():
    plan = Plan(
        units=(_unit("a", GB),),
        devices=(_gpu("cuda:0"),),
        placement=("cuda:0",),
        provenance=Provenance("auto"),
    )
    assert predict_decode(plan) is None
