"""Drop-ins for accelerate's big-model functions (``infer_auto_device_map``, ``dispatch_model``,
``load_checkpoint_and_dispatch``, ``init_empty_weights``), planned and run by automap.

Each takes accelerate's argument names and returns what accelerate returns; an argument automap
cannot honour raises an :class:`~automap.errors.AutomapError` naming what to do instead
(``docs/accelerate-compat.md`` lists every difference).
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from contextlib import contextmanager
from typing import Any, Iterator, Mapping, Sequence

import torch
from torch import nn

from automap.api import DeviceMap, as_dtype, check_argument_types, load, plan
from automap.devices import MaxMemory, canonical_name, detect_devices, make_device
from automap.errors import CheckpointError, DispatchError, MapFormatError, PlanError
from automap.kinds import kind_of
from automap.loading import empty_model
from automap.planning import Plan
from automap.runtime import check_not_dispatched, dispatch_plan, release_orphans, state_of, undispatch
from automap.userfiles import as_path

log = logging.getLogger(__name__)

DtypeLike = str | torch.dtype | None
ClassNames = str | Sequence[str] | None


@contextmanager
def init_empty_weights(include_buffers: bool | None = None) -> Iterator[None]:
    """accelerate's ``init_empty_weights``: :func:`automap.empty_model` (parameters on meta,
    buffers computed, as accelerate's default ``include_buffers=False``).

    With ``include_buffers=True`` every tensor created inside the block goes to meta, buffers
    included, as accelerate does (through ``torch.device("meta")``, nothing patched): their
    values must then come from the checkpoint; :func:`load_checkpoint_and_dispatch` says
    which buffers it lacks.
    """
    if include_buffers:
        with torch.device("meta"):
            yield
        return
    with empty_model():
        yield


def infer_auto_device_map(
    model: nn.Module,
    max_memory: MaxMemory | None = None,
    no_split_module_classes: ClassNames = None,
    dtype: DtypeLike = None,
    special_dtypes: Mapping[str, DtypeLike] | None = None,
    verbose: bool = False,
    clean_result: bool = True,
    offload_buffers: bool = False,
    fallback_allocation: bool = False,
) -> OrderedDict[str, int | str]:
    """accelerate's ``infer_auto_device_map``, planned by :func:`automap.plan` (``"auto"``).

    Args:
        model: the model, real or on meta (from :func:`init_empty_weights`).
        max_memory: ``{0: "10GiB", 1: "10GiB", "cpu": "30GiB"}``; devices this machine lacks
            are fine (plan for hardware you do not have yet). Detected when None.
        no_split_module_classes: class names never split across devices; default: the model's
            ``_no_split_modules``. Names of classes the model lacks are ignored, as accelerate
            ignores them (generic scripts list the blocks of several families).
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
        An ``OrderedDict`` of module name -> GPU index, ``"cpu"`` or ``"disk"``, in execution
        order. It means the same placement to this module's :func:`dispatch_model`, to
        accelerate's and to ``from_pretrained(device_map=...)``: units on ``"cpu"``/``"disk"``
        compute on the first GPU the map names, or on the CPU when it names none. Plans that
        format cannot say (the CPU computing while GPUs hold layers, streaming into a GPU that
        holds none) are not returned; the best plan it can say is.

    Raises:
        PlanError: the model does not fit, or ``special_dtypes`` was given.

    Example:
        >>> infer_auto_device_map(model, max_memory={0: "10GiB", 1: "10GiB", "cpu": "30GiB"})
    """
    if special_dtypes:
        raise PlanError(
            "special_dtypes is not supported: automap counts each tensor at its own dtype; set those "
            "tensors' dtype on the model (e.g. model.get_submodule(name).to(torch.float32)) and pass "
            "dtype=None"
        )
    check_argument_types(
        model, offload_dir=None, no_split=no_split_module_classes, example_inputs=None, max_memory=max_memory
    )
    chosen = _map_only_plan(model, max_memory, _class_names(model, no_split_module_classes), as_dtype(dtype))
    if verbose:
        log.info("%s", chosen.report())
    device_map = chosen.device_map
    return OrderedDict(grouped(device_map) if clean_result else device_map)


def dispatch_model(
    model: nn.Module,
    device_map: DeviceMap,
    main_device: str | torch.device | None = None,
    state_dict: Mapping[str, torch.Tensor] | None = None,
    offload_dir: str | os.PathLike[str] | None = None,
    offload_index: Mapping[str, Any] | None = None,
    offload_buffers: bool = False,
    skip_keys: str | Sequence[str] | None = None,
    preload_module_classes: Sequence[str] | None = None,
    force_hooks: bool = False,
) -> nn.Module:
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
        offload_buffers, skip_keys, preload_module_classes: no-ops. Buffers stream with their
            unit; cache objects pass between layers untouched; a unit's whole subtree comes in
            before its forward.
        force_hooks: as accelerate: with everything on one device, inputs are still moved to
            it (hooks are otherwise installed only where they do something).

    Returns:
        ``model``, dispatched, with ``model.hf_device_map`` set. A model automap dispatched
        already is undispatched first and dispatched again with the new map, as accelerate
        re-dispatches.

    Raises:
        DispatchError: an unsupported argument, or the model cannot be dispatched (unchanged).
    """
    _refuse(dispatch_model, state_dict=state_dict, offload_index=offload_index)
    _redispatchable(model)
    folder = None if offload_dir is None else as_path(offload_dir, "offload_dir", DispatchError)
    chosen = plan(model, device_map, offload_dir=folder)
    _check_main_device(main_device, chosen)
    dispatch_plan(model, chosen, offload_dir=folder, always_hook=force_hooks)
    return _with_device_map(model, device_map)


def load_checkpoint_and_dispatch(
    model: nn.Module,
    checkpoint: str | os.PathLike[str],
    device_map: DeviceMap | None = None,
    max_memory: MaxMemory | None = None,
    no_split_module_classes: ClassNames = None,
    offload_folder: str | os.PathLike[str] | None = None,
    offload_buffers: bool = False,
    dtype: DtypeLike = None,
    offload_state_dict: bool | None = None,
    skip_keys: str | Sequence[str] | None = None,
    preload_module_classes: Sequence[str] | None = None,
    force_hooks: bool = False,
    strict: bool = False,
    full_state_dict: bool = True,
    broadcast_from_rank0: bool = False,
) -> nn.Module:
    """accelerate's ``load_checkpoint_and_dispatch``: :func:`automap.load`.

    Args:
        model: a skeleton from :func:`init_empty_weights` (or any model).
        checkpoint: a ``.safetensors``/``.bin`` file or a folder of shards (with an index or not).
        device_map: a strategy (``"auto"``, ``"balanced"``, ``"balanced_low_0"``,
            ``"sequential"``) or a dict; None (the default, as in accelerate) loads everything
            into CPU RAM, undispatched (then ``hf_device_map`` is not set).
        max_memory, no_split_module_classes, dtype: as for :func:`infer_auto_device_map`.
        offload_folder: where weights that must be written go (another dtype, a pickled
            checkpoint); safetensors weights already in the dtype are read in place.
        offload_buffers, offload_state_dict, skip_keys, preload_module_classes, force_hooks:
            no-ops (automap never holds a shard whole, and see :func:`dispatch_model`).
        strict: False (accelerate's default): checkpoint keys the model lacks are skipped and
            tensors the checkpoint lacks keep the model's values, with a warning naming them
            (a tensor left on meta still raises). True: either raises
            :class:`~automap.errors.CheckpointError`. Mis-shaped tensors always raise.
        full_state_dict, broadcast_from_rank0: only the defaults (True, False); automap loads in
            one process.

    Returns:
        ``model``, loaded and dispatched, with ``model.hf_device_map`` set. A model automap
        dispatched already is undispatched first, as accelerate loads into a dispatched model.

    Example:
        >>> model = load_checkpoint_and_dispatch(model, "sharded-gpt-j-6B", device_map="auto",
        ...                                      no_split_module_classes=["GPTJBlock"])
    """
    if not full_state_dict or broadcast_from_rank0:
        raise CheckpointError(
            "full_state_dict=False and broadcast_from_rank0=True load sharded across processes, "
            "which automap does not; load in one process with the defaults"
        )
    _redispatchable(model)
    loaded = load(
        model,
        checkpoint,
        {"": "cpu"} if device_map is None else device_map,
        max_memory,
        offload_dir=offload_folder,
        dtype=as_dtype(dtype),
        strict=strict,
        no_split=_class_names(model, no_split_module_classes),
    )
    if device_map is None:
        return undispatch(loaded)  # in RAM and unhooked, as accelerate leaves it
    return _with_device_map(loaded, device_map)


def grouped(device_map: Mapping[str, int | str]) -> dict[str, int | str]:
    """Replace the keys under a module by the module's name wherever they all share one device
    that is not ``"disk"`` (accelerate's ``clean_result``): ``{"a.0": "cpu", "a.1": "cpu"}`` ->
    ``{"a": "cpu"}``. Disk keys stay apart: each is a unit streamed on its own. The order is
    kept (a group takes its first key's place): the first GPU a map names is where accelerate
    computes its offloaded units."""
    order = {key: i for i, key in enumerate(device_map)}
    result = {key: (order[key], value) for key, value in device_map.items()}
    for prefix in sorted(_prefixes(result), key=lambda p: p.count(".") if p else -1):
        under = [k for k in result if _within(k, prefix)]
        values = {result[k][1] for k in under}
        if (
            len(under) > 1
            and len(values) == 1
            and not kind_of(canonical_name(next(iter(values)))).stores_only
        ):
            first = min(result[k] for k in under)
            for key in under:
                del result[key]
            result[prefix] = first
    return {key: value for key, (_, value) in sorted(result.items(), key=lambda kv: kv[1][0])}


def _prefixes(device_map: Mapping[str, Any]) -> set[str]:
    """Every module path above a key: ``"a.b.c"`` gives ``""``, ``"a"`` and ``"a.b"``."""
    found: set[str] = set()
    for key in device_map:
        parts = key.split(".")
        found.update(".".join(parts[:i]) for i in range(len(parts)))
    return found


def _within(key: str, prefix: str) -> bool:
    return not prefix or key == prefix or key.startswith(prefix + ".")


def _class_names(model: nn.Module, names: ClassNames) -> list[str] | None:
    """accelerate's ``no_split_module_classes`` without the classes ``model`` lacks, which
    accelerate ignores (automap's own ``no_split`` refuses them, as likely typos)."""
    if names is None:
        return None
    wanted = [names] if isinstance(names, str) else [n if isinstance(n, str) else n.__name__ for n in names]
    present = {type(m).__name__ for m in model.modules()}
    absent = [n for n in wanted if n not in present]
    if absent:
        log.debug(
            "no_split_module_classes: %s has no module of class %s; ignored", type(model).__name__, absent
        )
    return [n for n in wanted if n in present]


def _map_only_plan(
    model: nn.Module, max_memory: MaxMemory | None, no_split: list[str] | None, dtype: torch.dtype | None
) -> Plan:
    """The plan whose device map alone says it (see :func:`automap.planning.usermap.expressible`).
    When every plan as good as the planner's best is one the format cannot say, the
    lowest-numbered GPU is left out and the rest planned again, while something else can still
    compute: a GPU that could only take the streamed units (it holds none) is one the format
    cannot name. Failing that, the best plan it can say for the budgets given (all on the CPU,
    say)."""
    budgets: dict[int | str, int | str] = (
        dict(max_memory) if max_memory is not None else {d.name: d.capacity_bytes for d in detect_devices()}
    )
    if not any(kind_of(make_device(key, 0)).is_host for key in budgets):
        # accelerate computes on the CPU what no GPU can run even when max_memory gives the CPU
        # no budget: RAM then holds nothing and every such unit streams from disk.
        budgets["cpu"] = 0
    fallback = None
    while True:
        try:
            return plan(model, "auto", budgets, no_split=no_split, dtype=dtype, map_only=True)
        except MapFormatError as exc:
            fallback = fallback or exc.fallback
            kinds = sorted((make_device(key, 0) for key in budgets), key=lambda d: d.sort_key())
            computing = [d for d in kinds if kind_of(d).computes]
            if len(computing) < 2 or not computing[0].is_accelerator:
                if isinstance(fallback, Plan):
                    return fallback
                raise
            first = next(key for key in budgets if make_device(key, 0).name == computing[0].name)
            log.debug("no plan using %s that a device map can say; planning without it", computing[0].name)
            del budgets[first]


def _redispatchable(model: nn.Module) -> None:
    """A model automap dispatched is undispatched (accelerate dispatches a dispatched model
    again); one accelerate dispatched is refused with the fix."""
    if state_of(model) is not None and state_of(model).model is model:
        undispatch(model)
    release_orphans(model)
    check_not_dispatched(model)


def _refuse(function: Any, **given: Any) -> None:
    unsupported = [name for name, value in given.items() if value is not None]
    if unsupported:
        raise DispatchError(
            f"{function.__name__}({unsupported[0]}=...) is not supported by automap: it streams "
            "offloaded weights from the model itself or, through load_checkpoint_and_dispatch / "
            "automap.load, from the checkpoint in place; give the model its weights instead"
        )


def _check_main_device(main_device: str | torch.device | None, chosen: Plan) -> None:
    """``main_device`` (accelerate's: where offloaded units compute) agrees with the plan's."""
    if main_device is None:
        return
    wanted = torch.device(canonical_name(main_device))  # a name no device has: DeviceError
    streamed_to = next((p.compute for p in chosen.placements if p.offloaded), None)
    if streamed_to is None:
        return
    used = torch.device(streamed_to)
    if (wanted.type, wanted.index or 0) != (used.type, used.index or 0):
        raise DispatchError(
            f"main_device={str(main_device)!r}: automap runs offloaded units on the plan's first "
            f"accelerator, {chosen.execution_device}; drop main_device, or map the model so that "
            f"{wanted} comes first"
        )


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
