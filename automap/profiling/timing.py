"""Measured timing: each unit run alone on a real device, and the FLOP/s it achieved.

One unit at a time is copied to the device (weights random when the model is on meta),
called with tensors of the shapes the traced forward gave it, and timed: the median of
``repeats`` runs after one warm-up. The caller's model is never touched.
"""

from __future__ import annotations

import copy
import logging
import statistics
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Mapping

import torch
from torch import nn
from torch.utils._pytree import tree_map

from automap.devices import DeviceSpec
from automap.errors import ProfileError
from automap.kinds import kind_of
from automap.profiling.metaops import InputTensorSpec
from automap.profiling.units import leave_out_observers

if TYPE_CHECKING:
    from automap.profiling.result import Profile

log = logging.getLogger(__name__)


def measure_units(
    model: nn.Module,
    unit_inputs: Mapping[str, Any],
    device: str | torch.device | None,
    *,
    dtype: torch.dtype | None = None,
    repeats: int = 5,
) -> dict[str, float]:
    """Median forward seconds of each unit, run alone on ``device``.

    Args:
        model: the model (real or on meta); only copies of single units are moved.
        unit_inputs: unit name -> ``(args, kwargs)`` with :class:`~automap.profiling.metaops.InputTensorSpec`
            leaves, as recorded by the traced forward.
        device: where to run.
        dtype: run floating-point weights and inputs at this dtype.
        repeats: timed runs per unit (after one warm-up).

    Returns:
        Seconds per unit; units that fail to run alone are logged and left out.

    Raises:
        ProfileError: no device was given, or ``repeats`` < 1.
    """
    if device is None:
        raise ProfileError("measure=True needs a device to time on; pass device='cuda:0' or device='cpu'")
    if repeats < 1:
        raise ProfileError(f"repeats={repeats}: timing needs at least 1 run per unit")
    target = torch.device(device)
    modules = dict(model.named_modules(remove_duplicate=False))
    seconds: dict[str, float] = {}
    for name, specs in unit_inputs.items():
        try:
            seconds[name] = _time_unit(modules[name], specs, target, dtype, repeats)
        except Exception as exc:  # noqa: BLE001 - one unit that cannot run alone is not fatal
            log.warning(
                "could not time unit %r alone on %s (%s: %s); its FLOPs stand in for it",
                name,
                target,
                type(exc).__name__,
                exc,
            )
    return seconds


def _time_unit(
    module: nn.Module, specs: Any, device: torch.device, dtype: torch.dtype | None, repeats: int
) -> float:
    unit = _materialise(module, device, dtype)
    args, kwargs = tree_map(lambda s: _tensor_for(s, device, dtype), specs)
    runs = []
    with torch.no_grad():
        for i in range(repeats + 1):
            _sync(device)
            start = time.perf_counter()
            unit(*args, **kwargs)
            _sync(device)
            if i:  # the first run warms up caches and kernels
                runs.append(time.perf_counter() - start)
    return statistics.median(runs)


def _materialise(module: nn.Module, device: torch.device, dtype: torch.dtype | None) -> nn.Module:
    """A copy of ``module`` on ``device``; random weights where the original is on meta."""
    on_meta = any(t.is_meta for t in list(module.parameters()) + list(module.buffers()))
    if on_meta:
        unit = copy.deepcopy(module).to_empty(device=device)
        with torch.no_grad():
            for t in list(unit.parameters()) + list(unit.buffers()):
                if t.is_floating_point():
                    t.normal_(0.0, 0.02)
                else:
                    t.zero_()
    else:
        unit = copy.deepcopy(module).to(device)
    for part in unit.modules():  # the copy shares the user's hooks (functions are not copied)
        leave_out_observers(part)
    return unit.to(dtype) if dtype is not None else unit


def _tensor_for(spec: Any, device: torch.device, dtype: torch.dtype | None) -> Any:
    if not isinstance(spec, InputTensorSpec):
        return spec
    if spec.dtype.is_floating_point:
        return torch.randn(spec.shape, dtype=dtype or spec.dtype, device=device)
    if spec.dtype == torch.bool:
        return torch.ones(spec.shape, dtype=torch.bool, device=device)
    return torch.zeros(spec.shape, dtype=spec.dtype, device=device)  # valid ids and positions


def _sync(device: torch.device) -> None:
    """Wait for the work queued on ``device``, as its kind does (nothing to wait for on the CPU)."""
    synchronize = kind_of(device).factory("synchronize")
    if synchronize is not None:
        synchronize(device)


def calibrated_device(spec: DeviceSpec, prof: Profile) -> DeviceSpec:
    """``spec`` with ``flops_per_second`` set to what ``prof``'s measured units achieved.

    Args:
        spec: the device the profile was measured on.
        prof: a profile made with ``measure=True``.

    Returns:
        A copy of ``spec`` whose speed the planner can trust for this model.

    Raises:
        ProfileError: the profile has no measured units with FLOPs.

    Example:
        >>> prof = automap.profile(model, measure=True, device="cuda:0")
        >>> gpu = calibrated_device(gpu, prof)
    """
    rate = prof.achieved_flops_per_second
    if rate is None:
        raise ProfileError(
            f"profile of {prof.model_name} has no measured units with FLOPs; "
            "profile it with measure=True, device=... and example inputs"
        )
    return replace(spec, flops_per_second=rate)
