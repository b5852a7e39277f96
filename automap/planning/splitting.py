"""The planner's front door (:func:`make_plan`): lay the model out, split the units that do not fit
where they must go, round after round, and keep the plan with the smallest predicted forward.

Invariant: one splitting rule for every device set (a unit larger than every computing device's
room, or put on disk whole while CPU RAM could hold a part, is split first); if some option keeps
everything on the accelerators, only those count.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Mapping, Sequence

from automap.devices import DeviceSpec
from automap.errors import MapFormatError, PlanError, RuntimeBudgetError
from automap.kinds import is_host_name, kind_of
from automap.planning.layout_plans import Candidate, level_plans
from automap.planning.experts_choice import with_experts_apart
from automap.planning.layout_registry import CPU_COMPUTES, EXPERTS, PACKED, RESIDENT, STREAMED, room, tiers
from automap.planning.model import Plan
from automap.planning.predict import forward_seconds
from automap.planning.strategies import get_strategy
from automap.planning.usermap import expressible, map_execution_device
from automap.profiling import Profile
from automap.profiling.refine import Refinement
from automap.sizes import format_bytes, format_seconds

Refine = Callable[[Profile, Sequence[str]], Refinement]

# Rounds of splitting at most (each traces the model once more): a unit's depth in the module
# tree bounds what splitting can reach, and four or five levels cover the models we know.
MAX_ROUNDS = 8
# A streamed unit should stage in at most this share of the execution device's room; larger
# ones are split so that the device keeps the rest for resident units.
STAGING_SHARE = 0.25
_LISTED = 4  # names listed in a choice before "and N more"


@dataclass(frozen=True)
class _Level:
    """The options at one level of splitting, and the splits that led there."""

    profile: Profile
    candidates: tuple[Candidate, ...]
    splits: tuple[str, ...]


def make_plan(
    profile: Profile,
    devices: tuple[DeviceSpec, ...],
    strategy: str = "auto",
    *,
    reserve: Mapping[str, int] | None = None,
    refine: Refine | None = None,
    accept: Callable[[Plan], bool] | None = None,
) -> Plan:
    """Place ``profile``'s units on ``devices`` with a named strategy.

    Args:
        profile: the model's units in execution order.
        devices: where units may go (hypothetical devices are fine), fastest tier first.
        strategy: a registered strategy's name (:mod:`automap.planning.strategies`):
            ``"auto"`` / ``"balanced"``, ``"balanced_low_0"`` or ``"sequential"``.
        reserve: bytes to keep free per device name (KV cache, optimizer state).
        refine: splits units into their children (:class:`~automap.profiling.refine.Splitter`);
            without it the units stay as profiled.
        accept: only plans it returns True for may be chosen (the accelerate drop-in keeps
            those whose device map alone says where each unit computes).

    Returns:
        A deterministic :class:`Plan`; ``plan.choices`` says what was split and chosen.

    Raises:
        PlanError: unknown strategy, no devices, a unit that fits nowhere and cannot be split
            (the message names its class when ``no_split`` keeps it whole), or a model that
            does not fit even on disk (the message gives the numbers per tier).
        MapFormatError: ``accept`` refused every plan that fits.

    Example:
        >>> make_plan(prof, (make_device("cuda:0", 2**30), make_device("cuda:1", 2**30)))
    """
    chosen = get_strategy(strategy)
    if not devices:
        raise PlanError("no devices to place on; give max_memory={'cpu': '8GiB'} or similar")
    devices = tuple(sorted(devices, key=DeviceSpec.sort_key))
    reserve = dict(reserve or {})
    levels: list[_Level] = []
    refused: dict[str, str] = {}
    current, error = profile, None
    splits: tuple[str, ...] = ()
    for _ in range(MAX_ROUNDS + 1):
        try:
            candidates = tuple(c for c in level_plans(current, devices, chosen, reserve) if c.kind != EXPERTS)
        except PlanError as exc:
            candidates, error = (), exc
        levels.append(_Level(current, candidates, splits))
        # Pieces of a unit share a device, so once everything fits on the accelerators (as is,
        # or packed out of order) splitting finer cannot do better.
        if refine is None or any(_all_computing(c.plan, devices) for c in candidates):
            break
        wanted = {
            n: why
            for n, why in split_targets(current, devices, reserve, candidates).items()
            if n not in refused
        }
        if not wanted:
            break
        refinement = refine(current, list(wanted))
        refused.update(refinement.refused)
        if not refinement.pieces:
            break
        splits += _split_notes(refinement.pieces, wanted)
        current = refinement.profile
    best = _best(levels, refused, error)
    if accept is None:  # a plan with experts apart is for automap's own runtime, never a map alone
        whole = [c.plan for level in levels for c in level.candidates]
        return _map_note(with_experts_apart(best, whole, profile, devices, chosen, reserve, refine))
    if accept(best):
        return _map_note(best)
    return _best_accepted(levels, refused, error, accept, best)


def _map_note(plan: Plan) -> Plan:
    """``plan`` with a warning when its ``device_map`` alone would be read as another placement
    (the CPU computing while GPUs hold units has its own note, from the layout)."""
    if expressible(plan) or is_host_name(plan.execution_device):
        return plan
    reading = map_execution_device(plan)
    read_as = "computing them on the CPU" if is_host_name(reading) else f"streaming them into {reading}"
    note = (
        f"offloaded units stream into {plan.execution_device}, but accelerate and from_pretrained would read "
        f"this plan's device_map as {read_as}; pass this Plan itself to automap.dispatch or "
        "automap.load, or plan with map_only=True for a map that says everything"
    )
    return replace(plan, provenance=replace(plan.provenance, warnings=plan.warnings + (note,)))


def _best_accepted(
    levels: list[_Level],
    refused: Mapping[str, str],
    error: PlanError | None,
    accept: Callable[[Plan], bool],
    best: Plan,
) -> Plan:
    """The best plan ``accept`` takes, when it is as good a kind as ``best`` (all on the
    accelerators; the accelerators computing every unit; the CPU computing some).

    Raises:
        MapFormatError: every plan of ``best``'s kind was refused; ``fallback`` is the best one
            taken, of a worse kind (None when none was).
    """
    kept = [
        replace(level, candidates=tuple(c for c in level.candidates if accept(c.plan))) for level in levels
    ]
    fallback = _best(kept, refused, error) if any(level.candidates for level in kept) else None
    if fallback is not None and _kind_rank(fallback) <= _kind_rank(best):
        return fallback
    raise MapFormatError(
        "no plan that fits can be said by a device map alone as well as one that cannot: "
        "those stream offloaded units into a GPU other than the lowest-numbered one holding "
        "units (or into one holding none), or let the CPU compute while GPUs hold units; raise "
        "the GPU budgets, allow 'cpu' in max_memory, or pass the Plan itself (not its "
        "device_map) to automap.dispatch/automap.load",
        fallback=fallback,
    )


def _kind_rank(plan: Plan) -> int:
    """0: every unit on an accelerator; 1: accelerators compute every unit; 2: the CPU computes some."""
    if _all_on_accelerators(plan):
        return 0
    return 1 if all(plan.device(p.compute).is_accelerator for p in plan.placements) else 2


def split_targets(
    profile: Profile,
    devices: Sequence[DeviceSpec],
    reserve: Mapping[str, int],
    candidates: Sequence[Candidate],
) -> dict[str, str]:
    """The units that do not fit where they must go, and why (see the module docstring)."""
    computing, _ = tiers(devices)
    if not computing:
        return {}
    largest = max(room(d, reserve) for d in computing)
    what = "any GPU's room" if computing[0].is_accelerator else "the CPU's RAM budget"
    wanted = {}
    for unit in profile.units:
        need = unit.weight_bytes + unit.peak_activation_bytes
        if need > largest:
            wanted[unit.name] = f"larger than {what} ({format_bytes(need)} > {format_bytes(largest)})"
    wanted.update(
        (n, why)
        for n, why in _spilled_whole(profile, devices, reserve, candidates).items()
        if n not in wanted
    )
    gpus = [d for d in computing if d.is_accelerator]
    if not gpus:
        return wanted
    plan = next((c.plan for c in candidates if c.kind == STREAMED), None)
    executor = (
        plan.device(plan.execution_device) if plan is not None else max(gpus, key=lambda d: room(d, reserve))
    )
    limit = STAGING_SHARE * room(executor, reserve)
    # The units streamed, or else those the CPU computes (streamed if an accelerator executed).
    off_gpu = plan or next((c.plan for c in candidates if c.kind == CPU_COMPUTES), None)
    for i, unit in enumerate(profile.units):
        on_gpu = off_gpu is not None and off_gpu.device(off_gpu.placement[i]).is_accelerator
        if unit.name not in wanted and unit.weight_bytes > limit and not on_gpu:
            wanted[unit.name] = (
                f"streamed to {executor.name}, it would take more than a quarter of its room "
                f"({format_bytes(unit.weight_bytes)} of {format_bytes(room(executor, reserve))})"
            )
    return wanted


def _spilled_whole(
    profile: Profile,
    devices: Sequence[DeviceSpec],
    reserve: Mapping[str, int],
    candidates: Sequence[Candidate],
) -> dict[str, str]:
    """Units a candidate puts on a storage-only tier (disk) whole though CPU RAM could hold a
    part of them: one larger than RAM's room, and the first one on disk where the RAM that
    candidate leaves free is at least a sixteenth of it (a piece of it may fill that room).
    Split, their pieces fill RAM before anything goes to disk."""
    hosts = [d for d in devices if kind_of(d).is_host]
    if not hosts or not any(kind_of(d).stores_only for d in devices):
        return {}
    ram = max(room(d, reserve) for d in hosts)
    wanted = {}
    for candidate in candidates:
        plan = candidate.plan
        free = max(room(d, reserve) - plan.placements.bytes_on.get(d.name, 0) for d in hosts)
        first = True
        for i, unit in enumerate(profile.units):
            if not kind_of(plan.device(plan.placement[i])).stores_only or unit.name in wanted:
                continue
            if unit.weight_bytes > ram:
                wanted[unit.name] = (
                    f"larger than the CPU's RAM budget, it would go to disk whole "
                    f"({format_bytes(unit.weight_bytes)} > {format_bytes(ram)})"
                )
            elif first and free * 16 >= unit.weight_bytes:
                wanted[unit.name] = (
                    f"it would go to disk whole while {format_bytes(free)} of CPU RAM stays free "
                    f"({format_bytes(unit.weight_bytes)})"
                )
            first = False
    return wanted


def _best(levels: Sequence[_Level], refused: Mapping[str, str], error: PlanError | None) -> Plan:
    """The fastest candidate of all levels in the first tier that has any, with its choices:
    everything on the accelerators; else the accelerators compute every unit (the rest
    streamed to one of them); else the CPU computes what no accelerator can run."""
    pool = [(level, i, c) for i, level in enumerate(levels) for c in level.candidates]
    if not pool:
        assert error is not None
        raise _explained(
            error, refused, {u.name: u.weight_bytes for level in levels for u in level.profile.units}
        )
    tiers = (
        [p for p in pool if p[2].kind in (RESIDENT, PACKED) and _all_on_accelerators(p[2].plan)],
        [p for p in pool if p[2].kind != CPU_COMPUTES],
        pool,
    )
    rank, tier = next((r, t) for r, t in enumerate(tiers) if t)
    level, index, best = min(tier, key=lambda p: (forward_seconds(p[2].plan), p[1]))
    notes = [n for n in (level.profile.untraced_summary,) if n] + list(level.splits)
    kept = [f"{name} ({why})" for name, why in refused.items()]
    if kept:
        more = f", and {len(kept) - _LISTED} more" if len(kept) > _LISTED else ""
        notes.append(f"kept whole: {'; '.join(kept[:_LISTED])}{more}")
    if len(pool) > 1 or best.kind == CPU_COMPUTES:
        others = sorted((p for p in pool if p[2] is not best), key=lambda p: forward_seconds(p[2].plan))
        listed = ", ".join(f"{_describe(c, i)} ({_ms(c.plan)})" for _, i, c in others[:_LISTED]) or "none"
        notes.append(
            f"chosen: {_describe(best, index)}, predicted forward {_ms(best.plan)} ({_TIER_REASONS[rank]}); "
            f"alternatives: {listed}"
            + (f", and {len(others) - _LISTED} more" if len(others) > _LISTED else "")
        )
    _, faster_index, faster = min(pool, key=lambda p: (forward_seconds(p[2].plan), p[1]))
    if forward_seconds(faster.plan) < forward_seconds(best.plan):
        quick = forward_seconds(faster.plan)
        ratio = forward_seconds(best.plan) / quick if quick > 0 else 0.0
        notes.append(
            f"chosen over a faster alternative ({_describe(faster, faster_index)}, {_ms(faster.plan)}: "
            f"predicted {ratio:.2f}x as fast as the chosen {_ms(best.plan)}), not taken "
            f"because {_OVER_FASTER[rank]}; the rules, in order: everything resident on the accelerators, "
            "then the accelerators computing every unit, then the fastest"
        )
    return replace(best.plan, provenance=replace(best.plan.provenance, choices=tuple(notes)))


# Why the chosen plan beat a faster one in a later tier (see _best); the last tier is all plans,
# so its choice is always the fastest.
_OVER_FASTER = (
    "it keeps every unit resident on the accelerators and the faster one does not",
    "the accelerators compute every unit in it, while in the faster one the CPU computes some",
)
# Why the chosen plan's tier won (see _best).
_TIER_REASONS = (
    "everything fits on the accelerators: the fastest such plan",
    "the fastest plan in which the accelerators compute every unit",
    "no accelerator can stream every unit the accelerators cannot hold, so the CPU computes those: "
    "the fastest such plan",
)


def _split_notes(pieces: Mapping[str, Sequence[str]], reasons: Mapping[str, str]) -> tuple[str, ...]:
    """One line per kind of split: ``"layer4.0 split into 7 pieces: larger than ..."``, or for
    units split alike ``"a, b and 10 more split into 4 pieces each: ..."`` (the first's numbers)."""
    alike: dict[tuple[int, str], list[str]] = {}
    for name, parts in pieces.items():
        alike.setdefault((len(parts), reasons[name].partition(" (")[0]), []).append(name)
    notes = []
    for (count, _), names in alike.items():
        shown = ", ".join(names[:2]) + (
            f" and {len(names) - 2} more" if len(names) > 3 else "".join(f", {n}" for n in names[2:])
        )
        each = " each" if len(names) > 1 else ""
        notes.append(f"{shown} split into {count} pieces{each}: {reasons[names[0]]}")
    return tuple(notes)


def _all_on_accelerators(plan: Plan) -> bool:
    return all(plan.device(d).is_accelerator for d in plan.placement)


def _all_computing(plan: Plan, devices: Sequence[DeviceSpec]) -> bool:
    """Every unit on a computing device (the accelerators; CPU RAM when the CPU computes alone)."""
    computing = {d.name for d in tiers(devices)[0]}
    return all(d in computing for d in plan.placement)


def _describe(candidate: Candidate, level: int) -> str:
    plan = candidate.plan
    off = sum(plan.placements.bytes_on[d.name] for d in plan.devices if not d.is_accelerator)
    what = {
        RESIDENT: "all on the accelerators"
        if any(d.is_accelerator for d in plan.devices)
        else "all in CPU RAM",
        PACKED: "units packed out of order on the accelerators",
        STREAMED: f"{format_bytes(off)} streamed to {plan.execution_device}",
        CPU_COMPUTES: (
            f"the CPU computes {format_bytes(off)} the accelerators cannot hold"
            if is_host_name(plan.executor)
            else "all on the CPU"
        ),
    }[candidate.kind]
    return what + (f" after {level} round{'' if level == 1 else 's'} of splitting" if level else "")


def _ms(plan: Plan) -> str:
    return format_seconds(forward_seconds(plan))


def _explained(error: PlanError, refused: Mapping[str, str], sizes: Mapping[str, int]) -> PlanError:
    """``error`` with the units that stayed whole (why, and their size) when that kept it from fitting."""
    if not refused or isinstance(error, RuntimeBudgetError):
        return error  # the run itself does not fit: no split of a unit would help
    whole = "; ".join(
        f"{name!r} ({why}, {format_bytes(sizes[name])})" if name in sizes else f"{name!r} ({why})"
        for name, why in list(refused.items())[:_LISTED]
    )
    return type(error)(f"{error}. Units that could not be split: {whole}")
