"""The planner: which device each placement unit goes to.

Invariant: pure and deterministic, a :class:`Plan` is a function of a
:class:`~automap.profiling.Profile` and device specs; no I/O, no CUDA calls.
"""

from automap.planning.model import (
    JSON_VERSION,
    Cut,
    DeviceSummary,
    Origin,
    Plan,
    PlanInputs,
    Provenance,
    unit_label,
)
from automap.planning.plan_json import plan_from_dict
from automap.planning.layout_plans import build_plan
from automap.planning.placement import Placement, PlacementTable, Route
from automap.planning.splitting import make_plan
from automap.planning.strategies import STRATEGIES, Strategy, get_strategy, register_strategy
from automap.planning.usermap import parse_device_map, plan_from_device_map

__all__ = [
    "JSON_VERSION",
    "STRATEGIES",
    "Strategy",
    "build_plan",
    "get_strategy",
    "register_strategy",
    "Cut",
    "DeviceSummary",
    "Plan",
    "make_plan",
    "parse_device_map",
    "plan_from_device_map",
    "Origin",
    "Placement",
    "PlacementTable",
    "PlanInputs",
    "Provenance",
    "Route",
    "plan_from_dict",
    "unit_label",
]
