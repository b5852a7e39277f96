"""The balancer: which device each placement unit goes to.

Pure and deterministic: a :class:`Plan` is a function of a :class:`~automap.profiling.Profile`
and a tuple of :class:`~automap.devices.DeviceSpec`; no I/O, no CUDA calls.

- :mod:`automap.planning.model`: :class:`Plan`, its summaries, cuts, predictions and JSON;
- :mod:`automap.planning.plan_json`: a plan read back from its JSON, every field checked;
- :mod:`automap.planning.placement`: :class:`Placement`, each unit's resolved home, compute
  device and route;
- :mod:`automap.planning.partition`: the contiguous min-bottleneck split on plain arrays;
- :mod:`automap.planning.strategies`: the named strategies, one registration each;
- :mod:`automap.planning.items`: units merged into items (ties) and groups (split pieces);
- :mod:`automap.planning.layout_registry`: the layout-kind registry and the context every kind reads;
- :mod:`automap.planning.layout_kinds`: the registered kinds (resident, packed, streamed, CPU
  computes), with :mod:`automap.planning.offloading` for what streams from where;
- :mod:`automap.planning.layout_plans`: the options for one profile, with generation-cache room,
  built as plans;
- :mod:`automap.planning.splitting`: :func:`make_plan`: options at each level of splitting,
  the fastest kept;
- :mod:`automap.planning.packing`: the out-of-order fallback before offloading;
- :mod:`automap.planning.usermap`: user device maps, validated;
- :mod:`automap.planning.decode`: a generation's predicted prefill and decode tokens/s;
- :mod:`automap.planning.experts`: routed experts apart from their layers, the one cost model
  of how they run (on the CPU, or streamed) and the plan's per-layer record of it, with
  :mod:`automap.planning.experts_choice`, the step of :func:`make_plan` that offers it.
"""
from automap.planning.model import (JSON_VERSION, Cut, DeviceSummary, Origin, Plan, PlanInputs, Provenance,
                                    unit_label)
from automap.planning.plan_json import plan_from_dict
from automap.planning.layout_plans import build_plan
from automap.planning.placement import Placement, PlacementTable, Route
from automap.planning.splitting import make_plan
from automap.planning.strategies import STRATEGIES, Strategy, get_strategy, register_strategy
from automap.planning.usermap import parse_device_map, plan_from_device_map

__all__ = ["JSON_VERSION", "STRATEGIES", "Strategy", "build_plan", "get_strategy", "register_strategy", "Cut", "DeviceSummary", "Plan", "make_plan", "parse_device_map", "plan_from_device_map",
           "Origin", "Placement", "PlacementTable", "PlanInputs", "Provenance", "Route", "plan_from_dict",
           "unit_label"]
