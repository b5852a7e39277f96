"""The one cost model: how long computing, moving and reading bytes take, from a device's speeds.

Invariant: every time automap predicts is built from these formulas, and each exists only here
(the partitioner's probe applies them to arrays).
"""

from __future__ import annotations

import math
from typing import Sequence

from automap.devices import DeviceSpec
from automap.kinds import kind_of
from automap.machine_probes import PROBE_OP_FLOPS

MIN_RATE = 1.0  # FLOP/s or bytes/s an unknown (0) rate counts as
# What an input-moving hook costs per unit call (2.9 us measured, benchmarks/notes/offload.md);
# a streamed unit pays it twice more (weights in, weights out). It makes splitting a unit into
# more units cost something in the predicted time, as it does when the model runs.
HOOK_SECONDS = 3e-6


def flop_seconds(flops: float, flops_per_second: float) -> float:
    """Seconds to compute ``flops`` at ``flops_per_second``."""
    return flops / max(flops_per_second, MIN_RATE)


def work_seconds(flops: float, ops: int, device: DeviceSpec) -> float:
    """Seconds ``device`` computes ``flops`` in ``ops`` ops: the FLOPs at its rate for ops of
    their size (:func:`compute_rate`), and each op's cost beside its work (dispatch, the code
    around it; ``DeviceSpec.op_seconds``)."""
    rate = compute_rate(device, flops / ops) if ops else device.flops_per_second
    return flop_seconds(flops, rate) + ops * device.op_seconds


def compute_rate(device: DeviceSpec, op_flops: float) -> float:
    """``device``'s FLOP/s for ops of ``op_flops`` FLOPs each: where both the probe layer's and
    the large matmul's rates were measured, between them, by where ``op_flops`` falls between
    their FLOPs per op (on a log scale; below the layer's, its rate; above the matmul's, that
    rate)."""
    small, large = device.flops_per_second, device.large_flops_per_second
    if not large or not small:
        return small
    low, high = PROBE_OP_FLOPS
    at = (math.log(max(op_flops, 1.0)) - math.log(low)) / (math.log(high) - math.log(low))
    return small * (large / small) ** min(max(at, 0.0), 1.0)


def transfer_seconds(nbytes: float, src: DeviceSpec, dst: DeviceSpec) -> float:
    """Seconds to move ``nbytes`` from ``src`` to ``dst``: the slower link bounds it."""
    return nbytes / max(min(src.link_bytes_per_second, dst.link_bytes_per_second), MIN_RATE)


def memory_bandwidth(device: DeviceSpec) -> float:
    """Bytes/s ``device`` reads its own memory at: its own figure, else its kind's default."""
    return device.memory_bytes_per_second or kind_of(device).memory_bytes_per_second or MIN_RATE


def read_seconds(nbytes: float, device: DeviceSpec) -> float:
    """Seconds for ``device`` to read ``nbytes`` of its own memory."""
    return nbytes / memory_bandwidth(device)


def stage_seconds(compute: float, streamed: float, incoming: float) -> float:
    """A stage of one forward: its compute, then its offloaded weights streamed in, then the
    activations it receives; one after another (a unit waits for its weights and inputs)."""
    return compute + streamed + incoming


def overlapped_seconds(computes: Sequence[float], reads: Sequence[float], ahead: int) -> float:
    """One unpipelined forward over units in order: unit ``i`` computes for ``computes[i]``
    seconds once its weights are in (``reads[i]`` seconds to read; 0 when they are resident). The
    runtime reads the weights of up to ``ahead`` offloaded units ahead while earlier units
    compute, one read at a time (a disk or a link is one queue): a read begins when the read
    before it has ended and the offloaded unit ``ahead`` places before it has begun computing."""
    read_end = done = 0.0
    began: list[float] = []  # when each offloaded unit so far began computing
    for compute, read in zip(computes, reads):
        start = done
        if read > 0:
            if ahead <= 0:
                gate = done  # nothing read ahead: the read waits for the compute before it
            else:
                gate = began[-ahead] if len(began) >= ahead else 0.0
            read_end = max(read_end, gate) + read
            start = max(done, read_end)
            began.append(start)
        done = start + compute
    return done


def hook_calls(calls: int, streamed: bool) -> int:
    """Hook calls a unit called ``calls`` times pays per forward (at least once; three times
    each when its weights stream in and out)."""
    return max(calls, 1) * (3 if streamed else 1)


def hooks_seconds(calls: int) -> float:
    """Seconds ``calls`` hook calls (:func:`hook_calls`, summed) add to a forward."""
    return HOOK_SECONDS * calls


def device_seconds(compute: float, reads: float, streams: float, overlaps: bool) -> float:
    """A computing device's time for work made of compute, reads of its own memory and
    streamed bytes: the largest when its kind ``overlaps`` them (copy engines, thousands of
    threads), else their sum. On a CPU the sum is what a decode step measures: its cores
    multiply a matrix-vector product's FLOPs and wait for its bytes in turn, not side by side
    (``benchmarks/notes/predict-time.md``: the sum 0.98-1.04 of the measured step, the larger
    of the two 1.10-1.15)."""
    return max(compute, reads, streams) if overlaps else compute + reads + streams
