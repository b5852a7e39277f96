"""The step of :func:`~automap.planning.make_plan` that places routed experts apart from their
layers, when that decodes faster than every plan that keeps layers whole.

For a plan made for a generation (``batch``/``max_length``) of a mixture-of-experts model that
does not fit the accelerators, it asks ``refine`` for each layer's routed experts as a unit of
their own (:class:`~automap.profiling.refine.Splitter` splits the layer down to them), lays the
finer profile out with the ``experts apart`` kind (:mod:`automap.planning.layout_kinds`), keeps
the layout whose offloaded experts run as the cost model picks for the decode step
(:mod:`automap.planning.experts`), records each layer's mode per phase, and keeps the plan
when its predicted decode tokens/s beats the best whole-layer plan's. ``plan.choices`` says
which won and by how much either way.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Mapping, Sequence

from automap.devices import DeviceSpec
from automap.errors import PlanError
from automap.kinds import is_host_name
from automap.planning.decode import predict_decode
from automap.planning.experts import (
    ExpertsCost,
    ExpertsLayer,
    ExpertsMode,
    ExpertsPlan,
    best_mode,
    stream_from,
)
from automap.planning.layout_plans import level_plans
from automap.planning.layout_registry import EXPERTS
from automap.planning.model import Plan
from automap.planning.strategies import Strategy
from automap.profiling import Profile
from automap.profiling.refine import Refinement
from automap.sizes import format_rate

Refine = Callable[[Profile, Sequence[str]], Refinement]

NO_GENERATION = (
    "layers kept whole: the model has routed experts, which may live apart from their layers when "
    "that decodes faster; plan for a generation (batch= and max_length=, or --max-length) to compare "
    "(docs/experts.md)"
)


def decode_rate(plan: Plan) -> float:
    """``plan``'s predicted decode tokens/s (0 when it predicts none)."""
    prediction = predict_decode(plan)
    return prediction.tokens_per_second if prediction is not None else 0.0


def with_experts_apart(
    best: Plan,
    whole: Sequence[Plan],
    profile: Profile,
    devices: tuple[DeviceSpec, ...],
    strategy: Strategy,
    reserve: Mapping[str, int],
    refine: Refine | None,
) -> Plan:
    """``best``, or the plan with routed experts apart when it decodes faster than each of
    ``whole`` (the whole-layer plans found); ``best`` as it is when the model has no routed
    experts, fits the accelerators, or was not planned for a generation."""
    generation = profile.generation
    if (
        refine is None
        or not profile.routed
        or not any(d.is_accelerator for d in devices)
        or all(best.device(d).is_accelerator for d in best.placement)
    ):
        return best
    if generation is None or not generation.cache:
        return replace(best, provenance=replace(best.provenance, choices=best.choices + (NO_GENERATION,)))
    apart = experts_plan(profile, devices, strategy, reserve, refine)
    if apart is None:
        return best
    rate = decode_rate(apart)
    baseline = max((decode_rate(p) for p in [best, *whole]), default=0.0)
    record = replace(experts_record(apart), tokens_per_second=rate, whole_layer_tokens_per_second=baseline)
    compared = (
        f"routed experts apart from their layers: predicted decode "
        f"{format_rate(rate, 'tokens')} against {format_rate(baseline, 'tokens')} for the best plan "
        "that keeps each layer whole"
    )
    if rate <= baseline:
        kept = best.choices + (f"kept layers whole; {compared}",)
        return replace(best, provenance=replace(best.provenance, choices=kept))
    choices = best.choices + (f"chosen instead: {compared}",)
    return replace(apart, experts=record, provenance=replace(apart.provenance, choices=choices))


def experts_plan(
    profile: Profile,
    devices: tuple[DeviceSpec, ...],
    strategy: Strategy,
    reserve: Mapping[str, int],
    refine: Refine,
) -> Plan | None:
    """The ``experts apart`` plan whose offloaded experts run (on the CPU, or streamed) as the
    cost model picks for most of their bytes at the decode step; None when the experts cannot
    be made units of their own or the layout fits nowhere."""
    finer = refine(profile, list(profile.routed)).profile
    if not any(u.experts for u in finer.units):
        return None
    try:
        plans = [c.plan for c in level_plans(finer, devices, strategy, reserve) if c.kind == EXPERTS]
    except PlanError:
        return None
    if not plans:
        return None
    on_cpu = [p for p in plans if is_host_name(p.execution_device)]
    streaming = [p for p in plans if not is_host_name(p.execution_device)]
    if not on_cpu or not streaming:
        return plans[0]
    votes = _decode_votes(streaming[0])
    return on_cpu[0] if votes[ExpertsMode.CPU_COMPUTES] >= votes[ExpertsMode.STREAMED] else streaming[0]


def _decode_votes(plan: Plan) -> dict[ExpertsMode, int]:
    """The bytes of the experts off the accelerators in ``plan`` by the mode the cost model
    picks for them at the decode step."""
    decode, prefill, cpu, gpu = _phases(plan)
    votes = {mode: 0 for mode in ExpertsMode}
    for unit, home in zip(plan.units, plan.placement):
        device = plan.device(home)
        if unit.experts and not device.is_accelerator:
            votes[best_mode(ExpertsCost.of(unit, prefill), decode, device, cpu, gpu)] += unit.weight_bytes
    return votes


def experts_record(plan: Plan) -> ExpertsPlan:
    """Each layer's routed experts in ``plan``: where they live and how they run at the decode
    step and at the prefill — what the runtime does with this plan, not only what the cost
    model would like. Experts on an accelerator are resident; experts an accelerator computes
    (streamed from RAM or disk) stream at every call; experts in CPU RAM that the CPU computes,
    beside a layer computing on one accelerator, stream from the cost model's crossing on
    (:func:`~automap.planning.experts.stream_from`; the runtime's per-call choice,
    :class:`~automap.runtime.experts.ExpertsByCall`); experts the CPU computes from disk stay
    there at every call."""
    decode, prefill, cpu, gpu = _phases(plan)
    around = _layer_computes(plan)
    layers = []
    for unit, home, placement in zip(plan.units, plan.placement, plan.placements):
        if not unit.experts:
            continue
        device = plan.device(home)
        if device.is_accelerator:
            layers.append(
                ExpertsLayer(unit.split_from, unit.name, home, ExpertsMode.RESIDENT, ExpertsMode.RESIDENT)
            )
            continue
        if not is_host_name(placement.compute):
            layers.append(
                ExpertsLayer(unit.split_from, unit.name, home, ExpertsMode.STREAMED, ExpertsMode.STREAMED, 1)
            )
            continue
        switches = not placement.offloaded and len(around.get(unit.split_from, set())) == 1
        crossing = stream_from(ExpertsCost.of(unit, prefill), device, cpu, gpu) if switches else 0
        modes = [
            ExpertsMode.STREAMED if crossing and tokens >= crossing else ExpertsMode.CPU_COMPUTES
            for tokens in (decode, prefill)
        ]
        layers.append(ExpertsLayer(unit.split_from, unit.name, home, *modes, crossing))
    return ExpertsPlan(tuple(layers), decode, prefill, 0.0, 0.0)


def _layer_computes(plan: Plan) -> dict[str, set[str]]:
    """For each split layer, the accelerators its pieces other than routed experts compute on."""
    found: dict[str, set[str]] = {}
    for unit, placement in zip(plan.units, plan.placements):
        if unit.split_from and not unit.experts and plan.device(placement.compute).is_accelerator:
            found.setdefault(unit.split_from, set()).add(placement.compute)
    return found


def _phases(plan: Plan) -> tuple[int, int, DeviceSpec, DeviceSpec]:
    """Tokens per call at the decode step and at the prefill of ``plan``'s generation, and the
    CPU and the accelerator the cost model weighs."""
    generation = plan.generation
    assert generation is not None
    cpu = next(d for d in plan.devices if is_host_name(d.name))
    gpu = next(d for d in plan.devices if d.is_accelerator)
    return generation.batch, generation.batch * max(generation.prompt_length, 1), cpu, gpu
