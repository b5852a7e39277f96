"""automap: place a PyTorch model across GPUs, CPU RAM and disk, and run it there.

    >>> import automap
    >>> model = automap.dispatch(model, device_map="auto")
    >>> print(automap.placement(model).report())

accelerate's big-model functions have drop-ins here (``infer_auto_device_map``,
``dispatch_model``, ``load_checkpoint_and_dispatch``, ``init_empty_weights``): see
:mod:`automap.accelerate_compat`.
"""
from automap.accelerate_compat import (dispatch_model, infer_auto_device_map, init_empty_weights,
                                       load_checkpoint_and_dispatch)
from automap.api import dispatch, load, plan
from automap.devices import DeviceSpec, detect_devices
from automap.errors import (AutomapError, CheckpointError, DependencyError, DeviceError, DeviceMapError,
                            DispatchError, OffloadError, PipelineError, PlanError, ProfileError, ReportError,
                            SizeError, SpecError)
from automap.planning import Plan
from automap.profiling import Profile, Unit, profile
from automap.loading import empty_model
from automap.pipelining import pipeline
from automap.report import placement
from automap.runtime import undispatch
from automap.sizes import format_bytes, parse_size

__version__ = "0.1.0"

__all__ = [
    "AutomapError", "CheckpointError", "DependencyError", "DeviceError", "DeviceMapError", "DeviceSpec",
    "DispatchError", "OffloadError", "PipelineError", "Plan", "PlanError", "Profile", "ProfileError", "ReportError",
    "SizeError", "SpecError", "Unit", "detect_devices", "dispatch", "dispatch_model", "empty_model", "format_bytes",
    "infer_auto_device_map", "init_empty_weights", "load", "load_checkpoint_and_dispatch", "parse_size", "pipeline",
    "placement", "plan", "profile", "undispatch",
]
