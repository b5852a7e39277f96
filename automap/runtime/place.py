"""Placing a model as a plan says, hooking it, and undoing both (also on a failed dispatch)."""
from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from automap.devices import check_present
from automap.runtime.state import STATES, DispatchState, Group, Streamed, check_not_dispatched
from automap.runtime.streaming import placeholder, refuse_grad, reset_stale, stream_in, stream_out
from automap.runtime.swap import install
from automap.runtime.values import move_inputs, move_outputs
from automap.errors import AutomapError, DispatchError
from automap.offload import Loader, OffloadStore
from automap.planning import Plan
from automap.profiling import Unit
from automap.profiling.units import all_named_tensors

log = logging.getLogger(__name__)


def dispatch_plan(model: nn.Module, plan: Plan, *, offload_dir: str | Path | None = None,
                  output_device: str | torch.device | None = None,
                  store: OffloadStore | None = None, always_hook: bool = False) -> nn.Module:
    """Place ``model`` as ``plan`` says and install the hooks that run it there.

    Args:
        offload_dir: where to write the weights of units placed on ``"disk"``.
        output_device: move the model's outputs here (default: where they were produced).
        store: an offload store that already holds every offloaded tensor (under its name in
            the plan), e.g. built by :func:`automap.load` from checkpoint references. The
            model's offloaded tensors may then be on meta; nothing is written or allocated.
        always_hook: install input-moving hooks even when everything is on one device (for
            measuring hook overhead).

    Raises:
        DispatchError, DeviceError, OffloadError: the model is left exactly as it was.
    """
    check_not_dispatched(model)
    tensors = _named_tensors(model)
    _check_plan_matches(model, tensors, plan)
    for name in plan.used_devices:
        check_present(name)
    _check_meta(tensors, plan, store)
    state = DispatchState(plan=plan, store=store)
    disk_units = [u for u, d in zip(plan.units, plan.placement) if d == "disk"]
    if store is None and disk_units:
        state.store = _write_store(tensors, disk_units, offload_dir)
    try:
        _apply(model, plan, state, output_device, always_hook)
    except Exception as exc:
        _restore(model, state, rollback=True)
        if isinstance(exc, AutomapError):
            raise
        raise DispatchError(f"dispatching {type(model).__name__} failed ({exc}); the model was left as it was") from exc
    STATES[model] = state
    log.info("dispatched %s: %d unit(s), %d offloaded, executing on %s", type(model).__name__,
             len(plan.units), len(state.groups), plan.execution_device)
    return model


def _named_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    return dict(all_named_tensors(model, remove_duplicate=False))


def _check_plan_matches(model: nn.Module, tensors: dict[str, torch.Tensor], plan: Plan) -> None:
    modules = dict(model.named_modules())
    for unit in plan.units:
        if unit.name not in modules:
            raise DispatchError(f"the plan names unit {unit.name!r} but the model has no such module; "
                                "was the plan made for another model?")
        module = modules[unit.name]
        if plan.is_offloaded(plan.device_of(unit.name)) and isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            children = [f"{unit.name}.{c}" for c, _ in list(module.named_children())[:2]]
            raise DispatchError(f"unit {unit.name!r} is a {type(module).__name__}, which is never called, so its "
                                f"weights cannot be streamed in when it runs; map its children ({children}, ...) "
                                "to 'disk' instead")
        bad = [t for t in unit.tensors if t not in tensors]
        if bad:
            raise DispatchError(f"the plan names tensors {bad[:3]} that the model lacks; plan this model again")


def _streamed_names(plan: Plan) -> set[str]:
    """Names of the tensors that live in the store or host RAM, not on their unit's device."""
    return {n for u, d in zip(plan.units, plan.placement) if plan.is_offloaded(d) for n in u.tensors
            if n not in u.loose}


def _check_meta(tensors: dict[str, torch.Tensor], plan: Plan, store: OffloadStore | None) -> None:
    """A tensor may be on meta only when it is streamed and ``store`` holds it."""
    streamed = {id(tensors[n]): n for n in _streamed_names(plan)}
    entries = store.entries if store is not None else {}
    for name, tensor in tensors.items():
        if tensor.device.type != "meta":
            continue
        if id(tensor) not in streamed:
            raise DispatchError(f"tensor {name!r} is on meta (no data) but the plan keeps it resident; "
                                "load its weights first (automap.load does) or plan it onto 'disk'")
        if streamed[id(tensor)] not in entries:
            raise DispatchError(f"tensor {name!r} is on meta and offloaded, but the offload store has no "
                                f"entry {streamed[id(tensor)]!r}; load it with automap.load, or give the model "
                                "real weights")


def _write_store(tensors: dict[str, torch.Tensor], units: list[Unit], offload_dir: str | Path | None) -> OffloadStore:
    if offload_dir is None:
        names = ", ".join(u.name for u in units[:3])
        raise DispatchError(
            f"the plan offloads {len(units)} unit(s) ({names}, ...) to disk but no offload_dir was given; "
            "pass offload_dir='path/to/dir' or raise max_memory so everything fits"
        )
    chosen, files = {}, {}
    for unit in units:
        for name in unit.tensors:
            if name in unit.loose:
                continue  # loose tensors are used outside the unit's forward: kept resident
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


def _off_meta(model: nn.Module, state: DispatchState) -> None:
    """Give every meta tensor (all of them streamed, see :func:`_check_meta`) a 0-element CPU
    object of its own, since ``.data`` cannot move a tensor off meta. Every module that refers
    to one gets the same replacement, so ties survive; the old objects are kept for rollback."""
    fresh = {id(t): placeholder(t) for _, t in all_named_tensors(model) if t.device.type == "meta"}
    state.replaced = install(model, fresh)


def _apply(model: nn.Module, plan: Plan, state: DispatchState, output_device: str | torch.device | None,
           always_hook: bool) -> None:
    _off_meta(model, state)
    modules = dict(model.named_modules())
    tensors = _named_tensors(model)
    execution = torch.device(plan.execution_device)
    compute_devices = {plan.compute_device(d) for d in plan.placement}
    needs_hooks = always_hook or len(compute_devices) > 1 or bool(plan.offloaded_units) or output_device is not None
    owned = {u.name: _offload_tensors(state, u, where, tensors, execution)
             for u, where in zip(plan.units, plan.placement) if plan.is_offloaded(where)}
    for unit, where in zip(plan.units, plan.placement):
        device = torch.device(plan.compute_device(where))
        for name in unit.tensors:
            if unit.name not in owned or name in unit.loose:
                _place(state, tensors[name], device)
        # A unit also streams in tied tensors that an offloaded unit owns (even when it is
        # resident itself), so a tie split between RAM and disk stays one parameter.
        own = owned.get(unit.name, [])
        items = own + _aliases(modules[unit.name], state, own)
        group = Group(unit.name, where, items) if items else None
        if group is not None:
            state.groups.append(group)
        if needs_hooks:
            _hook_unit(modules[unit.name], state, device, group)
    if state.groups:
        _link(state.groups)
        state.loader = Loader(state.store, state.host, execution)
        state.handles.append(model.register_forward_pre_hook(reset_stale(state), prepend=True))
    if needs_hooks:
        _hook_loose_owners(model, plan, modules, tensors, state)
    if output_device is not None:
        state.handles.append(model.register_forward_hook(move_outputs(torch.device(output_device))))


def _offload_tensors(state: DispatchState, unit: Unit, where: str, tensors: dict[str, torch.Tensor],
                     execution: torch.device) -> list[Streamed]:
    """Move the unit's tensors out to where they live between uses (host RAM, pinned when a
    GPU executes, or the store) and leave placeholders behind."""
    items = []
    for name in unit.tensors:
        tensor = tensors[name]
        if name in unit.loose or id(tensor) in state.streamed:
            continue
        _record(state, tensor)
        if where != "disk" and tensor.numel() > 0:
            state.host[name] = tensor.data.pin_memory() if execution.type == "cuda" else tensor.data
        elif state.store is None or name not in state.store.entries:
            raise DispatchError(f"unit {unit.name!r} is placed on disk but the offload store has no tensor "
                                f"{name!r}; pass a store that holds it, or an offload_dir to write one")
        items.append(state.streamed.setdefault(id(tensor), Streamed(tensor, name)))
        if tensor.requires_grad:
            state.handles.append(tensor.register_hook(refuse_grad(name)))
        tensor.data = placeholder(tensor)
    return items


def _aliases(module: nn.Module, state: DispatchState, own: list[Streamed]) -> list[Streamed]:
    """Streamed tensors reachable from ``module`` that another unit owns (tied weights)."""
    mine = {id(i.tensor) for i in own}
    found = []
    for t in list(module.parameters()) + list(module.buffers()):
        if id(t) in state.streamed and id(t) not in mine:
            found.append(state.streamed[id(t)])
            mine.add(id(t))
    return found


def _link(groups: list[Group]) -> None:
    """Each group prefetches the next in plan order; the last the first (the next forward,
    or the next token of ``generate``)."""
    for i, group in enumerate(groups):
        group.next = groups[(i + 1) % len(groups)] if len(groups) > 1 else None


def _hook_unit(module: nn.Module, state: DispatchState, device: torch.device, group: Group | None) -> None:
    state.handles.append(module.register_forward_pre_hook(move_inputs(device), with_kwargs=True))
    if group is not None:
        state.handles.append(module.register_forward_pre_hook(stream_in(state, group)))
        state.handles.append(module.register_forward_hook(stream_out(state, group)))


def _hook_loose_owners(model: nn.Module, plan: Plan, modules: dict[str, nn.Module],
                       tensors: dict[str, torch.Tensor], state: DispatchState) -> None:
    """A module that holds tensors itself (ViT's ``class_token``) computes with them in its own
    forward, so its inputs go to where those tensors are."""
    owners: dict[str, torch.device] = {}
    for unit in plan.units:
        for name in unit.loose:
            owners.setdefault(name.rpartition(".")[0], tensors[name].device)
    for owner, device in owners.items():
        state.handles.insert(0, modules[owner].register_forward_pre_hook(move_inputs(device), with_kwargs=True))


# ------------------------------------------------------------------ undo


def _read_back(state: DispatchState, item: Streamed, device: torch.device) -> torch.Tensor:
    """A streamed tensor's weights as a tensor of its own on ``device`` (not a file view).
    The caller checks the store's files first (:meth:`OffloadStore.check_unchanged`)."""
    if item.name in state.host:
        return state.host[item.name].to(device)
    assert state.store is not None
    source = state.store.get(item.name)
    return torch.empty_like(source, device=device).copy_(source)


def _restore(model: nn.Module, state: DispatchState, *, rollback: bool = False) -> None:
    """Undo :func:`_apply`. Streamed weights are read back first, so a store that fails to
    read raises before anything changes."""
    replacements = {id(t) for _, t in all_named_tensors(model)} if rollback and state.replaced else set()
    wanted = {key: device for key, (_, device) in state.original.items()
              if key in state.streamed and key not in replacements}
    if state.store is not None:  # one stat per file, not one per tensor
        state.store.check_unchanged([n for n in (state.streamed[k].name for k in wanted) if n not in state.host])
    back = {key: _read_back(state, state.streamed[key], device) for key, device in wanted.items()}
    for handle in state.handles:
        handle.remove()
    state.handles.clear()
    if state.loader is not None:
        state.loader.close()
    for key, (tensor, device) in state.original.items():
        if key in back:
            tensor.data = back[key]
        elif key not in state.streamed and tensor.device != device:
            tensor.data = tensor.data.to(device)
    if rollback:
        install(model, state.replaced)
    if state.store is not None:
        state.store.close()


def undispatch(model: nn.Module) -> nn.Module:
    """Remove every automap hook from ``model`` and bring every weight back to the device it
    was on before :func:`dispatch` (offloaded weights are read back from the store into RAM;
    tensors that were on meta come back on CPU).

    Raises:
        DispatchError: ``model`` was not dispatched by automap.
        OffloadError: the store cannot be read back; the model stays dispatched.

    Example:
        >>> automap.undispatch(automap.dispatch(model, max_memory={"cpu": "1GB"}, offload_dir="off"))
    """
    state = STATES.get(model)
    if state is None:
        raise DispatchError(f"{type(model).__name__} is not dispatched by automap; nothing to undo")
    _restore(model, state)
    del STATES[model]
    return model
