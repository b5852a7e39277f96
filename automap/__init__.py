"""automap: place a PyTorch model across GPUs, CPU RAM and disk, and run it there.

    >>> import automap
    >>> model = automap.dispatch(model, device_map="auto")
    >>> print(automap.placement(model).report())

accelerate's big-model functions have drop-ins here (``infer_auto_device_map``,
``dispatch_model``, ``load_checkpoint_and_dispatch``, ``init_empty_weights``): see
:mod:`automap.accelerate_compat`.

The public names are imported when first used (PEP 562), so ``import automap`` and the
``automap`` command's ``--help`` answer before torch is imported; ``automap.plan`` and its
siblings then import what they need (never ``torch._dynamo``, matplotlib or transformers, which
wait for the call that uses them).
"""
from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> the module that defines it
_HOMES = {
    "dispatch_model": "automap.accelerate_compat", "infer_auto_device_map": "automap.accelerate_compat",
    "init_empty_weights": "automap.accelerate_compat", "load_checkpoint_and_dispatch": "automap.accelerate_compat",
    "dispatch": "automap.api", "load": "automap.api", "plan": "automap.api",
    "DeviceSpec": "automap.devices", "detect_devices": "automap.devices",
    "Plan": "automap.planning", "Profile": "automap.profiling", "Unit": "automap.profiling",
    "profile": "automap.profiling", "empty_model": "automap.loading", "pipeline": "automap.pipelining",
    "placement": "automap.report", "undispatch": "automap.runtime",
    "format_bytes": "automap.sizes", "parse_size": "automap.sizes",
    **{name: "automap.errors" for name in (
        "AutomapError", "CheckpointError", "ConversionError", "DependencyError", "DeviceError", "DeviceMapError",
        "DispatchError", "FormatError", "MapFormatError", "OffloadDirError", "OffloadError", "PipelineError",
        "PlanError", "ProfileError", "ReportError", "RuntimeBudgetError", "SizeError", "SpecError")},
}

__all__ = sorted(_HOMES)


_LIGHT = {"automap.errors", "automap.sizes"}  # torch-free: imported alone


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        if importlib.util.find_spec(f"automap.{name}") is not None:  # a submodule: automap.progress
            return importlib.import_module(f"automap.{name}")
        raise AttributeError(f"module 'automap' has no attribute {name!r}")
    # The first torch-backed name imports the whole surface, as an eager __init__ would: a
    # plan's report() and to_json() need automap.report's renderers registered.
    for module in [home] if home in _LIGHT else sorted(set(_HOMES.values())):
        importlib.import_module(module)
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOMES))


if TYPE_CHECKING:  # what type checkers and editors see: the same names, imported eagerly
    from automap.accelerate_compat import (dispatch_model, infer_auto_device_map, init_empty_weights,
                                           load_checkpoint_and_dispatch)
    from automap.api import dispatch, load, plan
    from automap.devices import DeviceSpec, detect_devices
    from automap.errors import (AutomapError, CheckpointError, ConversionError, DependencyError, DeviceError,
                                DeviceMapError, DispatchError, FormatError, MapFormatError, OffloadDirError,
                                OffloadError, PipelineError, PlanError, ProfileError, ReportError, RuntimeBudgetError,
                                SizeError, SpecError)
    from automap.loading import empty_model
    from automap.pipelining import pipeline
    from automap.planning import Plan
    from automap.profiling import Profile, Unit, profile
    from automap.report import placement
    from automap.runtime import undispatch
    from automap.sizes import format_bytes, parse_size
