"""automap: place a PyTorch model across GPUs, CPU RAM and disk, and run it there.

    >>> import automap
    >>> model = automap.dispatch(model, device_map="auto")
    >>> print(automap.placement(model).report())
"""
from automap.api import dispatch, plan
from automap.devices import DeviceSpec, detect_devices
from automap.dispatch import undispatch
from automap.errors import (AutomapError, CheckpointError, DeviceError, DeviceMapError, DispatchError,
                            OffloadError, PipelineError, PlanError, ProfileError, ReportError, SizeError,
                            SpecError)
from automap.plan import Plan
from automap.profile import Profile, Unit, profile
from automap.units import format_bytes, parse_size

# Imported eagerly, after their subpackages: the function binds the package attribute, so
# `automap.load(...)` and `automap.pipeline(...)` stay functions whatever is imported later.
from automap.load import empty_model, load  # noqa: E402  (isort: keep after the core)
from automap.pipeline import pipeline  # noqa: E402
from automap.report import placement  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "AutomapError", "CheckpointError", "DeviceError", "DeviceMapError", "DeviceSpec", "DispatchError",
    "OffloadError", "PipelineError", "Plan", "PlanError", "Profile", "ProfileError", "ReportError", "SizeError",
    "SpecError", "Unit", "detect_devices", "dispatch", "empty_model", "format_bytes", "load", "parse_size",
    "pipeline", "placement", "plan", "profile", "undispatch",
]
