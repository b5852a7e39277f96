"""A plan's stages: the maximal runs of consecutive units that compute on one device."""

from __future__ import annotations

from dataclasses import dataclass

from automap.planning import Plan


@dataclass(frozen=True)
class Stage:
    """A contiguous run of a plan's units that compute on one device.

    Attributes:
        index: position in the pipeline (0 first).
        device: the plan's name of the device the units compute on (``"cuda:1"``).
        units: the units' module names, in execution order.
    """

    index: int
    device: str
    units: tuple[str, ...]


def plan_stages(plan: Plan) -> tuple[Stage, ...]:
    """Split ``plan``'s units into stages: maximal runs computing on one device.

    Example:
        >>> [s.device for s in plan_stages(automap.plan(model, max_memory={0: "50MB", 1: "50MB"}))]
        ['cuda:0', 'cuda:1']
    """
    runs: list[tuple[str, list[str]]] = []
    for unit, placement in zip(plan.units, plan.placements):
        device = placement.compute
        if not runs or runs[-1][0] != device:
            runs.append((device, []))
        runs[-1][1].append(unit.name)
    return tuple(Stage(i, device, tuple(names)) for i, (device, names) in enumerate(runs))
