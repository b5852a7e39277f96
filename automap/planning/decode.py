"""Predicted generation speed: the prefill, and decode tokens per second with what limits it
(per computing device: compute, reads of weights and cache, streamed weights; overlapped on an
accelerator, added on the CPU).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterable

from automap.devices import DeviceSpec
from automap.kinds import kind_of
from automap.planning.cost import device_seconds, flop_seconds, read_seconds
from automap.planning.experts import touched_bytes
from automap.planning.model import Plan
from automap.planning.predict import forward_seconds, link_seconds, summary
from automap.sizes import format_bytes, format_flops, format_rate

# Batches tried when looking for the one that amortises a stream or a weight read.
_MAX_BATCH = 4096
_WHAT = {
    "compute": "of compute on",
    "weights": "of weights read from",
    "cache": "of KV cache read from",
    "stream": "streamed from",
    "ops": "dispatched on",
}


@dataclass(frozen=True)
class Term:
    """One part of a decode step's cost.

    Attributes:
        kind: ``"compute"`` (FLOPs), ``"weights"`` or ``"cache"`` (bytes read from the device's
            memory), ``"stream"`` (offloaded weights moved from a tier to the execution device)
            or ``"ops"`` (ops dispatched, each costing time beside its work).
        device: the computing device, or for a stream the tier it comes from.
        amount: FLOPs, bytes or ops per step.
        seconds: predicted seconds per step.
        binds: whether it adds to its computing device's time (on a CPU every part does; on
            an accelerator only the largest of compute, reads and streams).
    """

    kind: str
    device: str
    amount: float
    seconds: float
    binds: bool = True

    def describe(self) -> str:
        """``'16.11 GiB streamed from disk'``, ``'1.25 TFLOP of compute on cuda:0'``."""
        if self.kind == "ops":
            return f"{self.amount:,.0f} ops {_WHAT[self.kind]} {self.device}"
        amount = format_flops(self.amount) if self.kind == "compute" else format_bytes(self.amount)
        return f"{amount} {_WHAT[self.kind]} {self.device}"


@dataclass(frozen=True)
class DeviceStep:
    """One computing device's share of a decode step: its compute, its memory reads, the
    weights streamed to it and its ops' dispatch; ``overlapped`` when the first three run side
    by side (an accelerator), not one after another (a CPU). Ops add on every device."""

    device: str
    compute: Term
    reads: tuple[Term, ...]
    streams: tuple[Term, ...]
    overlapped: bool
    ops: Term | None = None

    @property
    def seconds(self) -> float:
        compute, reads, streams = _parts(self.compute, self.reads, self.streams)
        return device_seconds(compute, reads, streams, self.overlapped) + (
            self.ops.seconds if self.ops else 0.0
        )

    @property
    def terms(self) -> tuple[Term, ...]:
        return (self.compute, *self.reads, *self.streams, *((self.ops,) if self.ops else ()))


def _parts(compute: Term, reads: Iterable[Term], streams: Iterable[Term]) -> tuple[float, float, float]:
    return compute.seconds, sum(t.seconds for t in reads), sum(t.seconds for t in streams)


@dataclass(frozen=True)
class DecodePrediction:
    """Predicted speed of ``generate`` for the plan's generation (batch x max_length).

    Attributes:
        batch, prompt_length, max_length: the generation planned.
        prefill_seconds: the prompt's forward (all sequences).
        steps: what one decode step (one token for every sequence, averaged over the decode)
            spends its time on, per computing device, in execution order.
        hint: what would move the limit.
    """

    batch: int
    prompt_length: int
    max_length: int
    prefill_seconds: float
    steps: tuple[DeviceStep, ...]
    hint: str

    @property
    def step_seconds(self) -> float:
        """One decode step: the computing devices take their turns."""
        return step_seconds(self.steps)

    @property
    def terms(self) -> tuple[Term, ...]:
        return tuple(t for s in self.steps for t in s.terms)

    @property
    def tokens_per_second(self) -> float:
        """New tokens per second over the whole batch."""
        return self.batch / self.step_seconds if self.step_seconds > 0 else float("inf")

    @property
    def limit(self) -> Term | None:
        """What costs a step the most, summed over devices (see :func:`_limit`)."""
        return _limit(self.steps)

    def describe(self) -> str:
        """``'decode limited by 16.11 GiB streamed from disk per step: ~0.1 tokens/s at batch 1'``."""
        speed = f"~{format_rate(self.tokens_per_second, 'tokens')} at batch {self.batch}"
        limit = self.limit
        return f"decode limited by {limit.describe()} per step: {speed}" if limit else f"decode {speed}"


def step_seconds(steps: Iterable[DeviceStep]) -> float:
    """Seconds of one decode step made of ``steps``: the computing devices take their turns."""
    return sum(s.seconds for s in steps)


def _limit(steps: Iterable[DeviceStep]) -> Term | None:
    """The costliest kind of binding term, summed over the devices that take their turns
    (streams apart per tier): ``'128.52 GiB of weights read from cuda:0, cuda:1'``."""
    groups: dict[tuple[str, str], list[Term]] = {}
    for t in (t for s in steps for t in s.terms if t.binds):
        groups.setdefault((t.kind, t.device if t.kind == "stream" else ""), []).append(t)
    if not groups:
        return None
    terms = max(groups.values(), key=lambda ts: sum(t.seconds for t in ts))
    return Term(
        terms[0].kind,
        ", ".join(dict.fromkeys(t.device for t in terms)),
        sum(t.amount for t in terms),
        sum(t.seconds for t in terms),
    )


def predict_decode(plan: Plan) -> DecodePrediction | None:
    """The decode prediction of ``plan`` (see the module docstring), or None when it was not
    planned for a generation (``automap.plan(..., batch=, max_length=)``) or its model keeps
    no cache (then ``generate`` recomputes every token each step, which this does not model).

    Example:
        >>> print(predict_decode(automap.plan(model, max_memory=..., batch=1, max_length=2048)).describe())
        decode limited by 16.11 GiB streamed from disk per step: ~0.1 tokens/s at batch 1
    """
    generation = plan.generation
    if generation is None or not generation.cache:
        return None
    steps = decode_steps(plan, 1.0)
    return DecodePrediction(
        generation.batch,
        generation.prompt_length,
        generation.max_length,
        forward_seconds(plan),
        steps,
        _hint(plan, steps),
    )


def decode_steps(plan: Plan, scale: float) -> tuple[DeviceStep, ...]:
    """The terms of one decode step, with FLOPs and cache reads ``scale`` times the planned
    batch's (weights and streams stay: a batch shares them; of routed experts, a larger batch
    touches more)."""
    flops: dict[str, float] = {}
    reads: dict[tuple[str, str], float] = {}
    rows: dict[str, float] = {}
    ops: dict[str, float] = {}
    streams: dict[str, dict[str, float]] = {}
    tokens = plan.generation.batch * scale if plan.generation is not None else scale
    for unit, where in zip(plan.units, plan.placement):
        compute = plan.placements.by_home[where].compute
        flops[compute] = flops.get(compute, 0.0) + unit.decode_flops * scale
        ops[compute] = ops.get(compute, 0.0) + unit.decode_ops
        reads[(compute, "cache")] = reads.get((compute, "cache"), 0.0) + unit.kv_read_bytes * scale
        nbytes = touched_bytes(unit, tokens)  # routed experts: only those the step's tokens use
        if plan.placements.by_home[where].offloaded:  # moved whole, whatever the step reads of it
            tier = streams.setdefault(compute, {})
            tier[where] = tier.get(where, 0.0) + nbytes
        else:
            read = nbytes if unit.experts or unit.decode_weight_bytes is None else unit.decode_weight_bytes
            reads[(compute, "weights")] = reads.get((compute, "weights"), 0.0) + read
            if unit.decode_weight_bytes:  # rows in proportion to the bytes (routed experts: those used)
                rows[compute] = (
                    rows.get(compute, 0.0) + unit.decode_weight_rows * read / unit.decode_weight_bytes
                )
    return tuple(
        _device_step(
            plan,
            plan.device(name),
            flops.get(name, 0.0),
            {k: reads.get((name, k), 0.0) for k in ("weights", "cache")},
            streams.get(name, {}),
            (rows.get(name, 0.0), ops.get(name, 0.0)),
        )
        for name in dict.fromkeys(plan.placements.by_home[d].compute for d in plan.placement)
    )


def _device_step(
    plan: Plan,
    device: DeviceSpec,
    flops: float,
    reads: dict[str, float],
    streams: dict[str, float],
    rows_and_ops: tuple[float, float],
) -> DeviceStep:
    """One device's step: ``reads`` (bytes by kind), ``streams`` (bytes by tier) and the rows
    of the weights read and the ops run, each row and op costing the device's own time."""
    rows, ops = rows_and_ops
    read = [
        Term(
            kind,
            device.name,
            nbytes,
            read_seconds(nbytes, device) + (rows * device.row_seconds if kind == "weights" else 0.0),
        )
        for kind, nbytes in reads.items()
        if nbytes
    ]
    dispatch = Term("ops", device.name, ops, ops * device.op_seconds) if ops and device.op_seconds else None
    stream = [
        Term("stream", tier, nbytes, link_seconds(plan, int(nbytes), tier, device.name))
        for tier, nbytes in streams.items()
        if nbytes
    ]
    compute = Term("compute", device.name, flops, flop_seconds(flops, device.flops_per_second))
    overlapped = kind_of(device).overlaps
    if not overlapped:  # every part adds to the step
        return DeviceStep(device.name, compute, tuple(read), tuple(stream), overlapped, dispatch)
    c, r, s = _parts(compute, read, stream)
    top = max(c, r, s)  # the part that sets the device's time; the others hide behind it
    return DeviceStep(
        device.name,
        replace(compute, binds=c == top),
        tuple(replace(t, binds=r == top and c < top) for t in read),
        tuple(replace(t, binds=s == top and c < top and r < top) for t in stream),
        overlapped,
        dispatch,
    )


def _hint(plan: Plan, steps: tuple[DeviceStep, ...]) -> str:
    limit = _limit(steps)
    if limit is None or limit.seconds == 0:
        return ""
    if limit.kind == "compute":
        return (
            f"compute-bound on {limit.device}: a larger batch no longer raises tokens/s; a faster device "
            f"(speeds=...) or more devices sharing the layers would"
        )
    if limit.kind == "cache":
        return (
            "the KV cache read grows with batch and length: a shorter max_length, fewer sequences per "
            "step, or the layers spread over more devices (read in parallel) raise tokens/s per sequence"
        )
    hint = _batch_hint(plan, limit)
    if limit.kind == "stream":
        offloaded = plan.placements.offloaded_bytes
        resident = (
            f"{format_bytes(offloaded)} more memory on {plan.execution_device} (max_memory) would keep "
            "every weight resident"
        )
        hint = f"{resident}; or {hint}" if hint else resident
    return hint or f"{limit.describe()} limits every batch that fits"


def _batch_hint(plan: Plan, limit: Term) -> str:
    """The smallest batch (doubling) at which ``limit`` stops limiting, else the largest whose
    cache still fits beside the weights, with its speed; "" when no larger batch fits."""
    generation = plan.generation
    assert generation is not None
    kv = sum(u.kv_bytes for u in plan.units)
    free = sum(
        r.device.capacity_bytes - r.used_bytes
        for r in summary(plan)
        if r.device.name in {plan.placements.by_home[d].compute for d in plan.placement}
    )
    shared = "stream" if limit.kind == "stream" else "weight reads"
    batch, fits = generation.batch, generation.batch
    while batch < _MAX_BATCH:
        batch *= 2
        if kv * (batch / generation.batch - 1) > free:
            break
        fits = batch
        steps = decode_steps(plan, batch / generation.batch)
        top = _limit(steps)
        if top is not None and (top.kind, top.device) != (limit.kind, limit.device):
            return (
                f"decode more sequences at once, which share the {shared}: at batch {batch} the limit moves "
                f"to {top.describe()} (~{format_rate(batch / step_seconds(steps), 'tokens')}; its KV "
                f"cache needs {format_bytes(kv * batch // generation.batch)})"
            )
    if fits == generation.batch:
        return ""
    steps = decode_steps(plan, fits / generation.batch)
    return (
        f"decode more sequences at once, which share the {shared}: batch {fits} still fits "
        f"(~{format_rate(fits / step_seconds(steps), 'tokens')})"
    )
