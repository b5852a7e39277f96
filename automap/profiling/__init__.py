"""The profiler: a model's placement units in execution order, with bytes, FLOPs, activations,
tied tensors and the dataflow graph, measured on the meta device (no weights allocated, the
caller's model never changed).
"""

from automap.profiling.build import profile, untraced_profile
from automap.profiling.inputs import ExampleInputs, default_example_inputs
from automap.profiling.result import Flow, Profile, Unit
from automap.profiling.timing import calibrated_device
from automap.profiling.units import find_units, tie_groups

__all__ = [
    "ExampleInputs",
    "Flow",
    "Profile",
    "Unit",
    "calibrated_device",
    "default_example_inputs",
    "find_units",
    "profile",
    "tie_groups",
    "untraced_profile",
]
