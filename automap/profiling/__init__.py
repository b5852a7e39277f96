"""The profiler: what the planner knows about a model.

A :class:`Profile` lists the model's *placement units* (modules whose weights must stay on one
device) in execution order, with their parameter and buffer bytes, forward and training FLOPs,
activation sizes, the groups of tied tensors, and the dataflow graph between units. It is
measured on the meta device, so a model of any size profiles without allocating its weights,
and the caller's model is never changed. The trace runs in eval mode whatever mode the model is
in, and a unit whose forward meta cannot run is planned from its weights instead, as are the
units a forward on guessed example inputs did not finish (``profiling/fallback.py``);
:func:`untraced_profile` skips the trace altogether.

    >>> prof = automap.profile(model)
    >>> prof.units[0].name, prof.total_flops, prof.cut_bytes(5)
"""
from automap.profiling.build import profile, untraced_profile
from automap.profiling.inputs import ExampleInputs, default_example_inputs
from automap.profiling.result import Flow, Profile, Unit
from automap.profiling.timing import calibrated_device
from automap.profiling.units import find_units, tie_groups

__all__ = [
    "ExampleInputs", "Flow", "Profile", "Unit", "calibrated_device", "default_example_inputs", "find_units",
    "profile", "tie_groups", "untraced_profile",
]
