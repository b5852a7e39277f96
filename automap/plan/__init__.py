"""The balancer: which device each placement unit goes to.

Pure and deterministic: a :class:`Plan` is a function of a :class:`~automap.profile.Profile`
and a tuple of :class:`~automap.devices.DeviceSpec`; no I/O, no CUDA calls.

- :mod:`automap.plan.model`: :class:`Plan`, its summaries, cuts, predictions and JSON;
- :mod:`automap.plan.partition`: the contiguous min-bottleneck split on plain arrays;
- :mod:`automap.plan.strategies`: tiers, tie groups, reserves and the named strategies;
- :mod:`automap.plan.packing`: the out-of-order fallback before offloading;
- :mod:`automap.plan.usermap`: user device maps, validated.
"""
from automap.plan.model import JSON_VERSION, Cut, DeviceSummary, Plan, plan_from_dict, plan_to_dict
from automap.plan.strategies import STRATEGIES, make_plan
from automap.plan.usermap import plan_from_device_map

__all__ = ["JSON_VERSION", "STRATEGIES", "Cut", "DeviceSummary", "Plan", "make_plan", "plan_from_device_map",
           "plan_from_dict", "plan_to_dict"]
