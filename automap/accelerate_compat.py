"""Drop-ins for accelerate's big-model functions, with automap's planner and runtime beneath.

    from automap import init_empty_weights, infer_auto_device_map, dispatch_model, load_checkpoint_and_dispatch

Each takes accelerate's argument names (accelerate 1.x) and returns what accelerate returns: a
device map (a dict in the Hugging Face form) or the model itself, dispatched, with
``model.hf_device_map`` set as accelerate sets it. What changes underneath:

- maps are balanced by FLOPs, not filled by bytes, and nothing lands on CPU or disk when the
  accelerators can hold the model;
- offloaded safetensors weights are read in place (no copy into ``offload_folder``), files are
  never modified, and offloaded units stream with prefetch;
- ``no_split_module_classes=None`` keeps the model's own ``_no_split_modules`` together
  (accelerate may then split anywhere).

Parameters that change nothing under automap are accepted and documented as no-ops
(``offload_buffers``, ``fallback_allocation``, ``skip_keys``, ``preload_module_classes``,
``force_hooks``, ``offload_state_dict``, ``strict``); those it cannot honour
(``special_dtypes``, ``state_dict``, ``offload_index``, a ``main_device`` other than the
plan's execution device, sharded-distributed loading) raise an :class:`~automap.errors.AutomapError`
naming what to do instead.
"""
from __future__ import annotations

import logging
import os
from collections import OrderedDict
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import torch
from torch import nn

from automap.api import DeviceMap, dispatch, load, plan
from automap.devices import MaxMemory
from automap.errors import CheckpointError, DispatchError, PlanError
from automap.loading import empty_model
from automap.planning import Plan
from automap.runtime import check_not_dispatched, state_of, undispatch

log = logging.getLogger(__name__)

DtypeLike = str | torch.dtype | None
ClassNames = str | Sequence[str] | None


@contextmanager
def init_empty_weights(include_buffers: bool | None = None) -> Iterator[None]:
    """accelerate's ``init_empty_weights``: :func:`automap.empty_model` (parameters on meta,
    buffers computed, as accelerate's default ``include_buffers=False``).

    Raises:
        CheckpointError: ``include_buffers=True``: buffers that no checkpoint holds (rotary
            ``inv_freq``) would have no values to load.
    """
    if include_buffers:
        raise CheckpointError("init_empty_weights(include_buffers=True) leaves buffers without values, and many are "
                              "in no checkpoint (rotary inv_freq, position_ids); automap keeps them computed: drop "
                              "include_buffers")
    with empty_model():
        yield


def infer_auto_device_map(model: nn.Module, max_memory: MaxMemory | None = None,
                          no_split_module_classes: ClassNames = None, dtype: DtypeLike = None,
                          special_dtypes: Mapping[str, DtypeLike] | None = None, verbose: bool = False,
                          clean_result: bool = True, offload_buffers: bool = False,
                          fallback_allocation: bool = False) -> OrderedDict[str, int | str]:
    """accelerate's ``infer_auto_device_map``, planned by :func:`automap.plan` (``"auto"``).

    Args:
        model: the model, real or on meta (from :func:`init_empty_weights`).
        max_memory: ``{0: "10GiB", 1: "10GiB", "cpu": "30GiB"}``; devices this machine lacks
            are fine (plan for hardware you do not have yet). Detected when None.
        no_split_module_classes: class names never split across devices; default: the model's
            ``_no_split_modules``.
        dtype: count floating-point weights at this dtype (``torch.float16`` or ``"float16"``).
        special_dtypes: not supported (raises); give those tensors their dtype on the model
            itself and leave ``dtype`` None, so each is counted at its own.
        verbose: log the plan's report (logger ``automap.accelerate_compat``, INFO).
        clean_result: group modules whose units all sit on one device (``{"": "cpu"}`` when
            everything fits in RAM), as accelerate does; units on ``"disk"`` stay apart so each
            streams on its own. False: one key per unit.
        offload_buffers, fallback_allocation: no-ops. Buffers of offloaded units are streamed
            and counted with them; the planner always falls back to packing units out of order.

    Returns:
        An ``OrderedDict`` of module name -> GPU index, ``"cpu"`` or ``"disk"``.

    Raises:
        PlanError: the model does not fit, or ``special_dtypes`` was given.

    Example:
        >>> infer_auto_device_map(model, max_memory={0: "10GiB", 1: "10GiB", "cpu": "30GiB"})
    """
    if special_dtypes:
        raise PlanError("special_dtypes is not supported: automap counts each tensor at its own dtype; set those "
                        "tensors' dtype on the model (e.g. model.get_submodule(name).to(torch.float32)) and pass "
                        "dtype=None")
    chosen = plan(model, "auto", max_memory, no_split=_class_names(no_split_module_classes), dtype=_dtype(dtype))
    if verbose:
        log.info("%s", chosen.report())
    device_map = chosen.device_map
    return OrderedDict(grouped(device_map) if clean_result else device_map)


def dispatch_model(model: nn.Module, device_map: DeviceMap, main_device: str | torch.device | None = None,
                   state_dict: Mapping[str, torch.Tensor] | None = None,
                   offload_dir: str | os.PathLike[str] | None = None, offload_index: Mapping[str, Any] | None = None,
                   offload_buffers: bool = False, skip_keys: str | Sequence[str] | None = None,
                   preload_module_classes: Sequence[str] | None = None, force_hooks: bool = False) -> nn.Module:
    """accelerate's ``dispatch_model``: :func:`automap.dispatch` with ``device_map``.

    Args:
        model: a model with real weights.
        device_map: ``{"module": 0 | "cpu" | "disk", ...}`` covering every tensor (a strategy
            name or a :class:`~automap.Plan` work too).
        main_device: where offloaded units compute; only automap's own choice (the plan's first
            accelerator, else the CPU) is accepted.
        offload_dir: where automap creates its store for the units on ``"disk"``.
        state_dict, offload_index: not supported (raise): automap streams from the model's own
            weights, or from a checkpoint in place through :func:`load_checkpoint_and_dispatch`.
        offload_buffers, skip_keys, preload_module_classes, force_hooks: no-ops. Buffers stream
            with their unit; cache objects pass between layers untouched; a unit's whole subtree
            comes in before its forward; hooks are installed wherever they do something.

    Returns:
        ``model``, dispatched, with ``model.hf_device_map`` set.

    Raises:
        DispatchError: an unsupported argument, or the model cannot be dispatched (unchanged).
    """
    _refuse(dispatch_model, state_dict=state_dict, offload_index=offload_index)
    check_not_dispatched(model)  # by automap or accelerate: before planning the hooked model
    folder = None if offload_dir is None else Path(offload_dir)
    chosen = plan(model, device_map, offload_dir=folder)
    _check_main_device(main_device, chosen)
    dispatch(model, chosen, offload_dir=folder)
    return _with_device_map(model, device_map)


def load_checkpoint_and_dispatch(model: nn.Module, checkpoint: str | os.PathLike[str],
                                 device_map: DeviceMap | None = "auto", max_memory: MaxMemory | None = None,
                                 no_split_module_classes: ClassNames = None,
                                 offload_folder: str | os.PathLike[str] | None = None, offload_buffers: bool = False,
                                 dtype: DtypeLike = None, offload_state_dict: bool | None = None,
                                 skip_keys: str | Sequence[str] | None = None,
                                 preload_module_classes: Sequence[str] | None = None, force_hooks: bool = False,
                                 strict: bool = False, full_state_dict: bool = True,
                                 broadcast_from_rank0: bool = False) -> nn.Module:
    """accelerate's ``load_checkpoint_and_dispatch``: :func:`automap.load`.

    Args:
        model: a skeleton from :func:`init_empty_weights` (or any model).
        checkpoint: a ``.safetensors``/``.bin`` file or a folder of shards (with an index or not).
        device_map: a strategy (``"auto"``, ``"balanced"``, ``"balanced_low_0"``,
            ``"sequential"``) or a dict; None loads everything into CPU RAM, undispatched, as
            accelerate does (then ``hf_device_map`` is not set).
        max_memory, no_split_module_classes, dtype: as for :func:`infer_auto_device_map`.
        offload_folder: where weights that must be written go (another dtype, a pickled
            checkpoint); safetensors weights already in the dtype are read in place.
        offload_buffers, offload_state_dict, skip_keys, preload_module_classes, force_hooks:
            no-ops (automap never holds a shard whole, and see :func:`dispatch_model`).
        strict: no-op: automap is always strict; missing, unexpected or mis-shaped keys raise
            :class:`~automap.errors.CheckpointError` (accelerate's ``strict=False`` warns).
        full_state_dict, broadcast_from_rank0: only the defaults (True, False); automap loads in
            one process.

    Returns:
        ``model``, loaded and dispatched, with ``model.hf_device_map`` set.

    Example:
        >>> model = load_checkpoint_and_dispatch(model, "sharded-gpt-j-6B", device_map="auto",
        ...                                      no_split_module_classes=["GPTJBlock"])
    """
    if not full_state_dict or broadcast_from_rank0:
        raise CheckpointError("full_state_dict=False and broadcast_from_rank0=True load sharded across processes, "
                              "which automap does not; load in one process with the defaults")
    loaded = load(model, checkpoint, {"": "cpu"} if device_map is None else device_map, max_memory,
                  offload_dir=offload_folder, dtype=_dtype(dtype), no_split=_class_names(no_split_module_classes))
    if device_map is None:
        return undispatch(loaded)  # in RAM and unhooked, as accelerate leaves it
    return _with_device_map(loaded, device_map)


def grouped(device_map: Mapping[str, int | str]) -> dict[str, int | str]:
    """Replace the keys under a module by the module's name wherever they all share one device
    that is not ``"disk"`` (accelerate's ``clean_result``): ``{"a.0": "cpu", "a.1": "cpu"}`` ->
    ``{"a": "cpu"}``. Disk keys stay apart: each is a unit streamed on its own."""
    result = dict(device_map)
    for prefix in sorted(_prefixes(result), key=lambda p: p.count(".") if p else -1):
        under = [k for k in result if _within(k, prefix)]
        values = {result[k] for k in under}
        if len(under) > 1 and len(values) == 1 and "disk" not in values:
            value = result[under[0]]
            for key in under:
                del result[key]
            result[prefix] = value
    return result


def _prefixes(device_map: Mapping[str, Any]) -> set[str]:
    """Every module path above a key: ``"a.b.c"`` gives ``""``, ``"a"`` and ``"a.b"``."""
    found: set[str] = set()
    for key in device_map:
        parts = key.split(".")
        found.update(".".join(parts[:i]) for i in range(len(parts)))
    return found


def _within(key: str, prefix: str) -> bool:
    return not prefix or key == prefix or key.startswith(prefix + ".")


def _dtype(dtype: DtypeLike) -> torch.dtype | None:
    """accelerate's dtype argument: a ``torch.dtype`` or its name (``"float16"``, ``"torch.bfloat16"``)."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    found = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(found, torch.dtype):
        raise PlanError(f"unknown dtype {dtype!r}; give a torch.dtype or its name, e.g. 'float16' or 'bfloat16'")
    return found


def _class_names(names: ClassNames) -> list[str] | None:
    return [names] if isinstance(names, str) else None if names is None else list(names)


def _refuse(function: Any, **given: Any) -> None:
    unsupported = [name for name, value in given.items() if value is not None]
    if unsupported:
        raise DispatchError(f"{function.__name__}({unsupported[0]}=...) is not supported by automap: it streams "
                            "offloaded weights from the model itself or, through load_checkpoint_and_dispatch / "
                            "automap.load, from the checkpoint in place; give the model its weights instead")


def _check_main_device(main_device: str | torch.device | None, chosen: Plan) -> None:
    if main_device is None or not chosen.offloaded_units:
        return
    wanted, used = torch.device(main_device), torch.device(chosen.execution_device)
    if (wanted.type, wanted.index or 0) != (used.type, used.index or 0):
        raise DispatchError(f"main_device={str(main_device)!r}: automap runs offloaded units on the plan's first "
                            f"accelerator, {chosen.execution_device}; drop main_device, or map the model so that "
                            f"{wanted} comes first")


def _with_device_map(model: nn.Module, asked: DeviceMap) -> nn.Module:
    """Set ``model.hf_device_map`` as accelerate does (transformers and user scripts read it):
    the map given, or the one planned, grouped as ``infer_auto_device_map`` returns it."""
    if isinstance(asked, Mapping):
        device_map = dict(asked)
    else:
        state = state_of(model)
        assert state is not None, "dispatched just now"
        device_map = grouped(state.plan.device_map)
    model.hf_device_map = device_map  # type: ignore[assignment]
    return model
