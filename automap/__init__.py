"""automap: place a PyTorch model across GPUs, CPU RAM and disk, and run it there.

The public names are imported on first use (PEP 562), so ``import automap`` and ``automap --help``
answer before torch is imported; accelerate's big-model functions have drop-ins in
:mod:`automap.accelerate_compat`.
"""

from __future__ import annotations

import importlib as _importlib
import importlib.util as _importlib_util
import typing as _typing


# public name -> the module that defines it
_HOMES = {
    "dispatch_model": "automap.accelerate_compat",
    "infer_auto_device_map": "automap.accelerate_compat",
    "init_empty_weights": "automap.accelerate_compat",
    "load_checkpoint_and_dispatch": "automap.accelerate_compat",
    "dispatch": "automap.api",
    "load": "automap.api",
    "plan": "automap.api",
    "DeviceSpec": "automap.devices",
    "detect_devices": "automap.devices",
    "Plan": "automap.planning",
    "Profile": "automap.profiling",
    "Unit": "automap.profiling",
    "profile": "automap.profiling",
    "empty_model": "automap.loading",
    "pipeline": "automap.pipelining",
    "placement": "automap.report",
    "undispatch": "automap.runtime",
    "clean": "automap.offload",
    "format_bytes": "automap.sizes",
    "parse_size": "automap.sizes",
    **{
        name: "automap.errors"
        for name in (
            "ArgumentError",
            "AutomapError",
            "CheckpointError",
            "ConversionError",
            "DependencyError",
            "DeviceError",
            "DeviceMapError",
            "DispatchError",
            "FormatError",
            "MapFormatError",
            "OffloadDirError",
            "OffloadError",
            "PipelineError",
            "PlanError",
            "ProfileError",
            "ReportError",
            "RuntimeBudgetError",
            "SizeError",
            "SpecError",
        )
    },
}

__all__ = sorted(_HOMES)


_LIGHT = {"automap.errors", "automap.sizes"}  # torch-free: imported alone


def __getattr__(name: str) -> _typing.Any:
    if name == "__version__":  # read from the installed metadata on first use, not at import
        from automap.version import installed_version

        globals()[name] = installed_version()
        return globals()[name]
    home = _HOMES.get(name)
    if home is None:
        if _importlib_util.find_spec(f"automap.{name}") is not None:  # a submodule: automap.progress
            return _importlib.import_module(f"automap.{name}")
        raise AttributeError(f"module 'automap' has no attribute {name!r}")
    # The first torch-backed name imports the whole surface, as an eager __init__ would: a
    # plan's report() and to_json() need automap.report's renderers registered.
    for module in [home] if home in _LIGHT else sorted(set(_HOMES.values())):
        _importlib.import_module(module)
    value = getattr(_importlib.import_module(home), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    """The public API only (``dir(automap)``, tab completion): the names of :data:`__all__` and
    ``__version__``; submodules (``automap.report``, ``automap.progress``) are reached by name."""
    return sorted({*__all__, "__version__"})


if _typing.TYPE_CHECKING:  # what type checkers and editors see: the same names, imported eagerly
    from automap.accelerate_compat import (
        dispatch_model,
        infer_auto_device_map,
        init_empty_weights,
        load_checkpoint_and_dispatch,
    )
    from automap.api import dispatch, load, plan
    from automap.devices import DeviceSpec, detect_devices
    from automap.errors import (
        AutomapError,
        CheckpointError,
        ConversionError,
        DependencyError,
        DeviceError,
        DeviceMapError,
        DispatchError,
        FormatError,
        MapFormatError,
        OffloadDirError,
        OffloadError,
        PipelineError,
        PlanError,
        ProfileError,
        ReportError,
        RuntimeBudgetError,
        SizeError,
        SpecError,
    )
    from automap.loading import empty_model
    from automap.offload import clean
    from automap.pipelining import pipeline
    from automap.planning import Plan
    from automap.profiling import Profile, Unit, profile
    from automap.report import placement
    from automap.runtime import undispatch
    from automap.sizes import format_bytes, parse_size
