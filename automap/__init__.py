"""automap: place a PyTorch model across GPUs, CPU RAM and disk, and run it there.

    >>> import automap
    >>> model = automap.dispatch(model, device_map="auto")
    >>> print(automap.plan(model).report())
"""
from automap.api import dispatch, plan
from automap.devices import DeviceSpec, detect_devices
from automap.dispatch import undispatch
from automap.errors import (AutomapError, CheckpointError, DeviceError, DeviceMapError, DispatchError,
                            OffloadError, PipelineError, PlanError, ProfileError, SizeError)
from automap.plan import Plan
from automap.profile import Profile, Unit, profile
from automap.units import format_bytes, parse_size

__version__ = "0.1.0"

# Names that live in heavier modules are imported on first use.
_LAZY = {"load": "automap.load", "empty_model": "automap.load", "placement": "automap.report",
         "pipeline": "automap.pipeline"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'automap' has no attribute {name!r}")

__all__ = [
    "AutomapError", "CheckpointError", "DeviceError", "DeviceMapError", "DeviceSpec", "DispatchError",
    "OffloadError", "PipelineError", "Plan", "PlanError", "Profile", "ProfileError", "SizeError", "Unit",
    "detect_devices", "dispatch", "format_bytes", "parse_size", "plan", "profile", "undispatch",
]
