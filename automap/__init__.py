"""automap: place a PyTorch model across GPUs, CPU RAM and disk, and run it there.

    >>> import automap
    >>> model = automap.dispatch(model, device_map="auto")
    >>> print(automap.placement(model).report())
"""
from automap.api import dispatch, load, plan
from automap.devices import DeviceSpec, detect_devices
from automap.errors import (AutomapError, CheckpointError, DeviceError, DeviceMapError, DispatchError,
                            OffloadError, PipelineError, PlanError, ProfileError, ReportError, SizeError,
                            SpecError)
from automap.planning import Plan
from automap.profiling import Profile, Unit, profile
from automap.loading import empty_model
from automap.pipelining import pipeline
from automap.report import placement
from automap.runtime import undispatch
from automap.sizes import format_bytes, parse_size

__version__ = "0.1.0"

__all__ = [
    "AutomapError", "CheckpointError", "DeviceError", "DeviceMapError", "DeviceSpec", "DispatchError",
    "OffloadError", "PipelineError", "Plan", "PlanError", "Profile", "ProfileError", "ReportError", "SizeError",
    "SpecError", "Unit", "detect_devices", "dispatch", "empty_model", "format_bytes", "load", "parse_size",
    "pipeline", "placement", "plan", "profile", "undispatch",
]
