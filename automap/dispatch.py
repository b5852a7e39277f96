"""Running a placed model: hooks that move inputs between devices and stream offloaded
weights in just before their unit runs.

The hook lifecycle follows accelerate's (attach / pre-forward / post-forward / detach) but goes
through torch's own hook API, never patching ``module.forward``, and keeps every handle so that
:func:`undispatch` removes them all. Weights move by swapping ``tensor.data``, so every
``Parameter`` object (and every tie between them, and any optimizer holding them) survives.
"""
from __future__ import annotations

import dataclasses
import logging
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from automap.devices import check_present
from automap.errors import AutomapError, DispatchError, OffloadError
from automap.offload import OffloadStore
from automap.plan import Plan

log = logging.getLogger(__name__)


@dataclass
class _Streamed:
    """An offloaded tensor: the live object, its store name, and how many users hold it in."""

    tensor: torch.Tensor
    name: str
    users: int = 0


@dataclass
class DispatchState:
    """What :func:`undispatch` needs: the plan, hook handles, original devices, the store."""

    plan: Plan
    handles: list[RemovableHandle] = field(default_factory=list)
    original: dict[int, tuple[torch.Tensor, torch.device]] = field(default_factory=dict)
    store: OffloadStore | None = None
    streamed: dict[int, _Streamed] = field(default_factory=dict)


_STATES: "weakref.WeakKeyDictionary[nn.Module, DispatchState]" = weakref.WeakKeyDictionary()


def state_of(model: nn.Module) -> DispatchState | None:
    """The dispatch state of ``model``, or None when it is not dispatched."""
    return _STATES.get(model)


# ------------------------------------------------------------------ moving values


def send(value: Any, device: torch.device) -> Any:
    """Move every tensor inside ``value`` (tuples, lists, dicts, dataclasses, ModelOutput) to
    ``device``. Other objects (KV caches among them) pass through untouched: their parts
    already live with the layer that owns them."""
    if isinstance(value, torch.Tensor):
        return value if value.device == device else value.to(device)
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(send(v, device) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(send(v, device) for v in value)
    if isinstance(value, OrderedDict) and dataclasses.is_dataclass(value):  # transformers ModelOutput
        return type(value)(**{k: send(v, device) for k, v in value.items()})
    if isinstance(value, dict):
        return type(value)((k, send(v, device)) for k, v in value.items())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {f.name: send(getattr(value, f.name), device) for f in dataclasses.fields(value) if f.init}
        return dataclasses.replace(value, **changes)
    return value


def _move_inputs(device: torch.device) -> Callable:
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return send(args, device), send(kwargs, device)
    return hook


def _move_outputs(device: torch.device) -> Callable:
    def hook(module: nn.Module, args: tuple, output: Any) -> Any:
        return send(output, device)
    return hook


# ------------------------------------------------------------------ streaming


def _stream_in(state: DispatchState, items: list[_Streamed], device: torch.device) -> Callable:
    def hook(module: nn.Module, args: tuple) -> None:
        assert state.store is not None
        # Weights read inside inference_mode would become inference tensors, which a normal
        # Parameter cannot hold; reading outside it keeps the parameter usable afterwards.
        with torch.inference_mode(False):
            for item in items:
                if item.users == 0:
                    item.tensor.data = state.store.get(item.name).to(device, non_blocking=True)
                item.users += 1
    return hook


def _placeholder(tensor: torch.Tensor) -> torch.Tensor:
    """What an offloaded tensor holds between uses: no elements, so any use outside its unit
    fails loudly with a shape error instead of computing with stale or zero weights. (``meta``
    would be clearer but ``.data`` cannot switch a CPU tensor to meta.)"""
    device = tensor.device if tensor.device.type != "meta" else torch.device("cpu")
    return torch.empty(0, dtype=tensor.dtype, device=device)


def _off_meta(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Give every meta tensor a CPU object of its own (``.data`` cannot leave meta), replacing
    it in every module that refers to it so ties survive. Only skeletons built on meta
    reach this, so no outside reference to the old objects exists."""
    fresh: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for key, old in table.items():
                if old is None or old.device.type != "meta":
                    continue
                if id(old) not in fresh:
                    new = torch.empty(old.shape, dtype=old.dtype)
                    fresh[id(old)] = nn.Parameter(new, old.requires_grad) if isinstance(old, nn.Parameter) else new
                table[key] = fresh[id(old)]
    for name, tensor in list(tensors.items()):
        if id(tensor) in fresh:
            tensors[name] = fresh[id(tensor)]


def _stream_out(items: list[_Streamed]) -> Callable:
    def hook(module: nn.Module, args: tuple, output: Any) -> None:
        for item in items:
            item.users -= 1
            if item.users == 0:
                item.tensor.data = _placeholder(item.tensor)
    return hook


# ------------------------------------------------------------------ dispatch


def dispatch_plan(model: nn.Module, plan: Plan, *, offload_dir: str | Path | None = None,
                  output_device: str | torch.device | None = None,
                  store: OffloadStore | None = None) -> nn.Module:
    """Place ``model`` as ``plan`` says and install the hooks that run it there.

    Args:
        store: an offload store that already holds every offloaded tensor (under its name in
            the plan), e.g. built by :func:`automap.load` from checkpoint references. The
            model's offloaded tensors may then be on meta; nothing is written.

    On any failure the model is left exactly as it was and the error is an
    :class:`~automap.errors.AutomapError`.
    """
    if model in _STATES:
        raise DispatchError(f"{type(model).__name__} is already dispatched; call automap.undispatch(model) first")
    _check_plan_matches(model, plan)
    for name in plan.used_devices:
        check_present(name)
    state = DispatchState(plan=plan)
    disk_units = [u for u, d in zip(plan.units, plan.placement) if plan.is_offloaded(d)]
    if store is not None:
        state.store = store
    elif disk_units:
        state.store = _write_store(model, plan, disk_units, offload_dir)
    try:
        _apply(model, plan, state, output_device)
    except Exception as exc:
        _restore(model, state)
        if isinstance(exc, AutomapError):
            raise
        raise DispatchError(f"dispatching {type(model).__name__} failed ({exc}); the model was left as it was") from exc
    _STATES[model] = state
    return model


def _check_plan_matches(model: nn.Module, plan: Plan) -> None:
    modules = dict(model.named_modules())
    tensors = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    tensors |= {n for n, _ in model.named_buffers(remove_duplicate=False)}
    for unit in plan.units:
        if unit.name not in modules:
            raise DispatchError(f"the plan names unit {unit.name!r} but the model has no such module; "
                                "was the plan made for another model?")
        bad = [t for t in unit.tensors if t not in tensors]
        if bad:
            raise DispatchError(f"the plan names tensors {bad[:3]} that the model lacks; plan this model again")


def _write_store(model: nn.Module, plan: Plan, units: list, offload_dir: str | Path | None) -> OffloadStore:
    if offload_dir is None:
        names = ", ".join(u.name for u in units[:3])
        raise DispatchError(
            f"the plan offloads {len(units)} unit(s) ({names}, ...) to disk but no offload_dir was given; "
            "pass offload_dir='path/to/dir' or raise max_memory so everything fits"
        )
    tensors = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(model.named_buffers(remove_duplicate=False))
    chosen, files = {}, {}
    for unit in units:
        for name in unit.tensors:
            if name in unit.loose:
                continue  # loose tensors are used outside the unit's forward: kept resident
            if tensors[name].device.type == "meta":
                raise DispatchError(f"tensor {name!r} is on meta (no data); load weights with automap.load instead")
            chosen[name], files[name] = tensors[name], unit.name
    return OffloadStore.write(offload_dir, chosen, files)


def _record(state: DispatchState, tensor: torch.Tensor) -> None:
    if id(tensor) not in state.original:
        device = tensor.device if tensor.device.type != "meta" else torch.device("cpu")
        state.original[id(tensor)] = (tensor, device)


def _place(state: DispatchState, tensor: torch.Tensor, device: torch.device) -> None:
    _record(state, tensor)
    if tensor.device != device:
        tensor.data = tensor.data.to(device)


def _apply(model: nn.Module, plan: Plan, state: DispatchState, output_device: str | torch.device | None) -> None:
    modules = dict(model.named_modules())
    tensors = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(model.named_buffers(remove_duplicate=False))
    execution = torch.device(plan.execution_device)
    compute_devices = {execution if plan.is_offloaded(d) else torch.device(d) for d in plan.placement}
    needs_hooks = len(compute_devices) > 1 or bool(plan.offloaded_units) or output_device is not None
    for unit, where in zip(plan.units, plan.placement):
        offloaded = plan.is_offloaded(where)
        device = execution if offloaded else torch.device(where)
        module = modules[unit.name]
        items = []
        for name in unit.tensors:
            tensor = tensors[name]
            if offloaded and name not in unit.loose:
                _record(state, tensor)
                items.append(state.streamed.setdefault(id(tensor), _Streamed(tensor, name)))
                tensor.data = _placeholder(tensor)
            else:
                _place(state, tensor, device)
        if offloaded:
            items += _aliases(module, state, items)
        if needs_hooks:
            _hook_unit(module, state, device, items)
    if needs_hooks:
        _hook_loose_owners(model, plan, modules, tensors, state)
    if output_device is not None:
        state.handles.append(model.register_forward_hook(_move_outputs(torch.device(output_device))))


def _aliases(module: nn.Module, state: DispatchState, own: list[_Streamed]) -> list[_Streamed]:
    """Streamed tensors reachable from ``module`` that another unit owns (tied weights)."""
    mine = {id(i.tensor) for i in own}
    found = []
    for t in list(module.parameters()) + list(module.buffers()):
        if id(t) in state.streamed and id(t) not in mine:
            found.append(state.streamed[id(t)])
            mine.add(id(t))
    return found


def _hook_unit(module: nn.Module, state: DispatchState, device: torch.device, items: list[_Streamed]) -> None:
    state.handles.append(module.register_forward_pre_hook(_move_inputs(device), with_kwargs=True))
    if items:
        state.handles.append(module.register_forward_pre_hook(_stream_in(state, items, device)))
        state.handles.append(module.register_forward_hook(_stream_out(items)))


def _hook_loose_owners(model: nn.Module, plan: Plan, modules: dict[str, nn.Module],
                       tensors: dict[str, torch.Tensor], state: DispatchState) -> None:
    """A module that holds tensors itself (ViT's ``class_token``) computes with them in its own
    forward, so its inputs go to where those tensors are."""
    owners: dict[str, torch.device] = {}
    for unit in plan.units:
        for name in unit.loose:
            owners.setdefault(name.rpartition(".")[0], tensors[name].device)
    for owner, device in owners.items():
        state.handles.insert(0, modules[owner].register_forward_pre_hook(_move_inputs(device), with_kwargs=True))


def _restore(model: nn.Module, state: DispatchState) -> None:
    for handle in state.handles:
        handle.remove()
    state.handles.clear()
    for key, (tensor, device) in state.original.items():
        if key in state.streamed and state.store is not None and state.streamed[key].users == 0:
            tensor.data = state.store.get(state.streamed[key].name).to(device).clone()
        elif tensor.device != device:
            tensor.data = tensor.data.to(device)
    if state.store is not None:
        state.store.close()


def undispatch(model: nn.Module) -> nn.Module:
    """Remove every automap hook from ``model`` and bring every weight back to the device it
    was on before :func:`dispatch` (offloaded weights are read back from the store).

    Raises:
        DispatchError: ``model`` was not dispatched by automap.
    """
    state = _STATES.pop(model, None)
    if state is None:
        raise DispatchError(f"{type(model).__name__} is not dispatched by automap; nothing to undo")
    try:
        _restore(model, state)
    except OffloadError:
        _STATES[model] = state
        raise
    return model
