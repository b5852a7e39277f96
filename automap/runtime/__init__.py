"""Running a placed model: hook objects with a lifecycle that move inputs between devices and
stream offloaded weights in just before their unit runs; :func:`undispatch` removes them all.
"""

from automap.runtime.hooks import Hook, MoveInputs, MoveOutputs
from automap.runtime.place import check_devices_present, dispatch_plan
from automap.runtime.undo import release_orphans, undispatch
from automap.runtime.state import DispatchState, Group, Streamed, check_not_dispatched, claimed, state_of
from automap.runtime.streaming import StreamWeights
from automap.runtime import tiers  # noqa: F401  (attaches the storage tiers' weight sources to their kinds)
from automap.runtime.values import send

__all__ = [
    "DispatchState",
    "Group",
    "Hook",
    "MoveInputs",
    "MoveOutputs",
    "StreamWeights",
    "Streamed",
    "check_devices_present",
    "check_not_dispatched",
    "claimed",
    "dispatch_plan",
    "release_orphans",
    "send",
    "state_of",
    "undispatch",
]
