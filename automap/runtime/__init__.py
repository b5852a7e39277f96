"""Running a placed model: hooks that move inputs between devices and stream offloaded
weights in just before their unit runs (the next one prefetched while it computes).

The hook lifecycle follows accelerate's (attach / pre-forward / post-forward / detach) but goes
through torch's own hook API, never patching ``module.forward``, and keeps every handle so that
:func:`undispatch` removes them all. Weights move by swapping ``tensor.data``, so every
``Parameter`` object (and every tie between them, and any optimizer holding them) survives.

The package: :mod:`~automap.runtime.place` (dispatch_plan, undispatch),
:mod:`~automap.runtime.streaming` (offloaded units' hooks), :mod:`~automap.runtime.values`
(moving nested inputs), :mod:`~automap.runtime.swap` (replacing tensor objects, e.g. off
meta), :mod:`~automap.runtime.state`.
"""
from automap.runtime.place import dispatch_plan, undispatch
from automap.runtime.state import DispatchState, check_not_dispatched, state_of
from automap.runtime.values import send

__all__ = ["DispatchState", "check_not_dispatched", "dispatch_plan", "send", "state_of", "undispatch"]
