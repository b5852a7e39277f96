"""Running a placed model: hook objects that move inputs between devices and stream offloaded
weights in just before their unit runs (the next one prefetched while it computes).

- :mod:`~automap.runtime.place`: :func:`dispatch_plan` and :func:`undispatch`;
- :mod:`~automap.runtime.pieces`: hooks for units that compute in pieces (split units, loose
  tensors, routed experts computing apart);
- :mod:`~automap.runtime.experts`: reading routed experts' rows, and experts computed by call;
- :mod:`~automap.runtime.hooks`: the hook lifecycle (attach / pre / post / detach), moving inputs
  and outputs;
- :mod:`~automap.runtime.streaming`: the hook of an offloaded unit, and the model's check of
  the files behind its offloaded weights;
- :mod:`~automap.runtime.state`: what a dispatched model carries, and :func:`state_of`;
- :mod:`~automap.runtime.guard`: what torch's own API may do to a dispatched model
  (conversions refused at the call, plain copies and pickles, no read of a truncated file);
- :mod:`~automap.runtime.values`: moving nested inputs; :mod:`~automap.runtime.swap`: replacing
  tensor objects (off meta) with ties kept.
"""
from automap.runtime.hooks import Hook, MoveInputs, MoveOutputs
from automap.runtime.place import check_devices_present, dispatch_plan
from automap.runtime.undo import release_orphans, undispatch
from automap.runtime.state import DispatchState, Group, Streamed, check_not_dispatched, claimed, state_of
from automap.runtime.streaming import StreamWeights
from automap.runtime.values import send

__all__ = ["DispatchState", "Group", "Hook", "MoveInputs", "MoveOutputs", "StreamWeights", "Streamed",
           "check_devices_present", "check_not_dispatched", "claimed", "dispatch_plan", "release_orphans", "send", "state_of", "undispatch"]
