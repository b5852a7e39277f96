"""Running a placed model: hooks that move inputs between devices and stream offloaded
weights in just before their unit runs (the next one prefetched while it computes).

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
from automap.offload import Loader, OffloadStore
from automap.plan import Plan
from automap.profile import Unit

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Streamed:
    """An offloaded tensor: the live object, its store name, and how many units hold it in."""

    tensor: torch.Tensor
    name: str
    users: int = 0


@dataclass(eq=False)
class _Group:
    """The offloaded tensors one unit needs (its own and tied ones owned elsewhere), and the
    group expected to run after it (prefetched while this one computes)."""

    key: str
    where: str
    items: list[_Streamed]
    next: _Group | None = None
    saving: Any = None  # the saved-tensor hooks active while the unit runs with grad enabled


@dataclass
class DispatchState:
    """What :func:`undispatch` needs: the plan, hook handles, original devices, the store."""

    plan: Plan
    handles: list[RemovableHandle] = field(default_factory=list)
    original: dict[int, tuple[torch.Tensor, torch.device]] = field(default_factory=dict)
    store: OffloadStore | None = None
    streamed: dict[int, _Streamed] = field(default_factory=dict)
    host: dict[str, torch.Tensor] = field(default_factory=dict)
    groups: list[_Group] = field(default_factory=list)
    loader: Loader | None = None
    # (table, key, meta tensor) for every meta tensor replaced by a placeholder: put back on rollback.
    replaced: list[tuple[dict, str, torch.Tensor]] = field(default_factory=list)
    live: int = 0  # streamed tensors held in right now


_STATES: "weakref.WeakKeyDictionary[nn.Module, DispatchState]" = weakref.WeakKeyDictionary()


def state_of(model: nn.Module) -> DispatchState | None:
    """The dispatch state of ``model``, or None when it is not dispatched."""
    return _STATES.get(model)


# ------------------------------------------------------------------ moving values


def send(value: Any, device: torch.device) -> Any:
    """Move every tensor inside ``value`` (tuples, lists, dicts, dataclasses, ModelOutput) to
    ``device``; containers in which nothing moves come back as the same object. Other objects
    (KV caches among them) pass through untouched: their parts live with the layer that owns
    them, which is where each layer's hook sends its inputs."""
    if isinstance(value, torch.Tensor):
        return value if value.device == device else value.to(device)
    if isinstance(value, (list, tuple)):
        moved = [send(v, device) for v in value]
        if all(a is b for a, b in zip(moved, value)):
            return value
        return type(value)(*moved) if hasattr(value, "_fields") else type(value)(moved)
    if isinstance(value, dict):
        pairs = {k: send(v, device) for k, v in value.items()}
        if all(pairs[k] is v for k, v in value.items()):
            return value
        if isinstance(value, OrderedDict) and dataclasses.is_dataclass(value):  # transformers ModelOutput
            return type(value)(**pairs)
        return type(value)(pairs)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {f.name: send(getattr(value, f.name), device) for f in dataclasses.fields(value) if f.init}
        if all(changes[k] is getattr(value, k) for k in changes):
            return value
        return dataclasses.replace(value, **changes)
    return value


def _move_inputs(device: torch.device) -> Callable:
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        moved_args, moved_kwargs = send(args, device), send(kwargs, device)
        if moved_args is args and moved_kwargs is kwargs:
            return None
        return moved_args, moved_kwargs
    return hook


def _move_outputs(device: torch.device) -> Callable:
    def hook(module: nn.Module, args: tuple, output: Any) -> Any:
        return send(output, device)
    return hook


# ------------------------------------------------------------------ streaming


def _placeholder(tensor: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
    """What an offloaded tensor holds between uses: no elements, so any use outside its unit
    fails loudly with a shape error instead of computing with stale or zero weights. (``meta``
    would be clearer but ``.data`` cannot switch a CPU tensor to meta.)"""
    if device is None:
        device = tensor.device if tensor.device.type != "meta" else torch.device("cpu")
    return torch.empty(0, dtype=tensor.dtype, device=device)


def _check_trainable(module: nn.Module, group: _Group) -> None:
    if module.training and torch.is_grad_enabled() and any(i.tensor.requires_grad for i in group.items):
        raise DispatchError(
            f"unit {group.key!r} is offloaded ({group.where}) and its parameters require grad; automap does "
            "not train offloaded units (their gradients would be lost). Keep it resident (raise max_memory), "
            f"freeze it with model.get_submodule({group.key!r}).requires_grad_(False), or run it under "
            "model.eval() / torch.no_grad()"
        )


def _stream_in(state: DispatchState, group: _Group) -> Callable:
    def hook(module: nn.Module, args: tuple) -> None:
        assert state.loader is not None
        _check_trainable(module, group)
        # Weights read inside inference_mode would become inference tensors, which a normal
        # Parameter cannot hold; reading outside it keeps the parameter usable afterwards.
        with torch.inference_mode(False):
            needed = [i for i in group.items if i.users == 0]
            loaded = state.loader.take(group.key, [i.name for i in needed])
            for item in needed:
                item.tensor.data = loaded[item.name]
        for item in group.items:
            item.users += 1
        state.live += len(group.items)
        if torch.is_grad_enabled() and group.saving is None:
            group.saving = torch.autograd.graph.saved_tensors_hooks(*_save_by_name(state, group))
            group.saving.__enter__()
        ahead = group.next
        if ahead is not None and ahead is not group:
            state.loader.prefetch(ahead.key, [i.name for i in ahead.items if i.users == 0])
    return hook


@dataclass(frozen=True)
class _SavedWeight:
    """What autograd keeps of an offloaded weight a unit used: its name and the view's layout,
    not its data (which leaves when the unit ends). Backward reads it again from the store."""

    name: str
    shape: torch.Size
    stride: tuple[int, ...]


def _save_by_name(state: DispatchState, group: _Group) -> tuple[Callable, Callable]:
    loaded = {i.tensor.data_ptr(): i.name for i in group.items if i.tensor.numel()}

    def pack(tensor: torch.Tensor) -> Any:
        name = loaded.get(tensor.data_ptr()) if tensor.numel() else None
        return tensor if name is None else _SavedWeight(name, tensor.shape, tensor.stride())

    def unpack(saved: Any) -> torch.Tensor:
        if not isinstance(saved, _SavedWeight):
            return saved
        assert state.loader is not None
        source = state.loader.take(f"{saved.name}@backward", [saved.name])[saved.name]
        return source.as_strided(saved.shape, saved.stride, source.storage_offset())
    return pack, unpack


def _refuse_grad(name: str) -> Callable:
    def hook(grad: torch.Tensor) -> None:
        raise DispatchError(
            f"a gradient reached offloaded parameter {name!r}; automap does not keep gradients of offloaded "
            "weights. Freeze it (requires_grad_(False)) or keep its unit resident (raise max_memory)"
        )
    return hook


def _release(item: _Streamed) -> None:
    item.users = 0
    item.tensor.data = _placeholder(item.tensor, item.tensor.device)


def _end_saving(group: _Group) -> None:
    if group.saving is not None:
        group.saving.__exit__(None, None, None)
        group.saving = None


def _stream_out(state: DispatchState, group: _Group) -> Callable:
    def hook(module: nn.Module, args: tuple, output: Any) -> None:
        _end_saving(group)
        for item in group.items:
            item.users -= 1
            if item.users == 0:
                _release(item)
        state.live -= len(group.items)
    return hook


def _reset_stale(state: DispatchState) -> Callable:
    """A forward that raised inside a unit never ran that unit's post-hook, leaving weights
    held in; the next top-level forward releases them so memory stays within budget."""
    def hook(module: nn.Module, args: tuple) -> None:
        if state.live:
            log.debug("releasing %d streamed tensor(s) left by an interrupted forward", state.live)
            for group in reversed(state.groups):
                _end_saving(group)
            for item in state.streamed.values():
                if item.users:
                    _release(item)
            state.live = 0
    return hook


# ------------------------------------------------------------------ dispatch


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
    if model in _STATES:
        raise DispatchError(f"{type(model).__name__} is already dispatched; call automap.undispatch(model) first")
    _check_plan_matches(model, plan)
    for name in plan.used_devices:
        check_present(name)
    _check_meta(model, plan, store)
    state = DispatchState(plan=plan, store=store)
    disk_units = [u for u, d in zip(plan.units, plan.placement) if d == "disk"]
    if store is None and disk_units:
        state.store = _write_store(model, disk_units, offload_dir)
    try:
        _apply(model, plan, state, output_device, always_hook)
    except Exception as exc:
        _restore(model, state, rollback=True)
        if isinstance(exc, AutomapError):
            raise
        raise DispatchError(f"dispatching {type(model).__name__} failed ({exc}); the model was left as it was") from exc
    _STATES[model] = state
    log.info("dispatched %s: %d unit(s), %d offloaded, executing on %s", type(model).__name__,
             len(plan.units), len(state.groups), plan.execution_device)
    return model


def _named_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    tensors = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(model.named_buffers(remove_duplicate=False))
    return tensors


def _check_plan_matches(model: nn.Module, plan: Plan) -> None:
    modules = dict(model.named_modules())
    tensors = _named_tensors(model)
    for unit in plan.units:
        if unit.name not in modules:
            raise DispatchError(f"the plan names unit {unit.name!r} but the model has no such module; "
                                "was the plan made for another model?")
        bad = [t for t in unit.tensors if t not in tensors]
        if bad:
            raise DispatchError(f"the plan names tensors {bad[:3]} that the model lacks; plan this model again")


def _streamed_names(plan: Plan) -> set[str]:
    """Names of the tensors that live in the store or host RAM, not on their unit's device."""
    return {n for u, d in zip(plan.units, plan.placement) if plan.is_offloaded(d) for n in u.tensors
            if n not in u.loose}


def _check_meta(model: nn.Module, plan: Plan, store: OffloadStore | None) -> None:
    """A tensor may be on meta only when it is streamed and ``store`` holds it."""
    tensors = _named_tensors(model)
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


def _write_store(model: nn.Module, units: list[Unit], offload_dir: str | Path | None) -> OffloadStore:
    if offload_dir is None:
        names = ", ".join(u.name for u in units[:3])
        raise DispatchError(
            f"the plan offloads {len(units)} unit(s) ({names}, ...) to disk but no offload_dir was given; "
            "pass offload_dir='path/to/dir' or raise max_memory so everything fits"
        )
    tensors = _named_tensors(model)
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
    fresh: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for key, old in table.items():
                if old is None or old.device.type != "meta":
                    continue
                if id(old) not in fresh:
                    new = _placeholder(old)
                    fresh[id(old)] = nn.Parameter(new, old.requires_grad) if isinstance(old, nn.Parameter) else new
                state.replaced.append((table, key, old))
                table[key] = fresh[id(old)]


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
        group = None
        if unit.name in owned:
            items = owned[unit.name] + _aliases(modules[unit.name], state, owned[unit.name])
            group = _Group(unit.name, where, items)
            state.groups.append(group)
        if needs_hooks:
            _hook_unit(modules[unit.name], state, device, group)
    if state.groups:
        _link(state.groups)
        state.loader = Loader(state.store, state.host, execution)
        state.handles.append(model.register_forward_pre_hook(_reset_stale(state), prepend=True))
    if needs_hooks:
        _hook_loose_owners(model, plan, modules, tensors, state)
    if output_device is not None:
        state.handles.append(model.register_forward_hook(_move_outputs(torch.device(output_device))))


def _offload_tensors(state: DispatchState, unit: Unit, where: str, tensors: dict[str, torch.Tensor],
                     execution: torch.device) -> list[_Streamed]:
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
        items.append(state.streamed.setdefault(id(tensor), _Streamed(tensor, name)))
        if tensor.requires_grad:
            state.handles.append(tensor.register_hook(_refuse_grad(name)))
        tensor.data = _placeholder(tensor)
    return items


def _aliases(module: nn.Module, state: DispatchState, own: list[_Streamed]) -> list[_Streamed]:
    """Streamed tensors reachable from ``module`` that another unit owns (tied weights)."""
    mine = {id(i.tensor) for i in own}
    found = []
    for t in list(module.parameters()) + list(module.buffers()):
        if id(t) in state.streamed and id(t) not in mine:
            found.append(state.streamed[id(t)])
            mine.add(id(t))
    return found


def _link(groups: list[_Group]) -> None:
    """Each group prefetches the next in plan order; the last the first (the next forward,
    or the next token of ``generate``)."""
    for i, group in enumerate(groups):
        group.next = groups[(i + 1) % len(groups)] if len(groups) > 1 else None


def _hook_unit(module: nn.Module, state: DispatchState, device: torch.device, group: _Group | None) -> None:
    state.handles.append(module.register_forward_pre_hook(_move_inputs(device), with_kwargs=True))
    if group is not None:
        state.handles.append(module.register_forward_pre_hook(_stream_in(state, group)))
        state.handles.append(module.register_forward_hook(_stream_out(state, group)))


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


# ------------------------------------------------------------------ undo


def _read_back(state: DispatchState, item: _Streamed, device: torch.device) -> torch.Tensor:
    """A streamed tensor's weights as a tensor of its own on ``device`` (not a file view)."""
    if item.name in state.host:
        return state.host[item.name].to(device)
    assert state.store is not None
    state.store.check_unchanged([item.name])
    source = state.store.get(item.name)
    return torch.empty_like(source, device=device).copy_(source)


def _restore(model: nn.Module, state: DispatchState, *, rollback: bool = False) -> None:
    """Undo :func:`_apply`. Streamed weights are read back first, so a store that fails to
    read raises before anything changes."""
    replacements = {id(t) for t in _named_tensors(model).values()} if rollback and state.replaced else set()
    back = {key: _read_back(state, state.streamed[key], device) for key, (_, device) in state.original.items()
            if key in state.streamed and key not in replacements}
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
    for table, key, old in reversed(state.replaced if rollback else []):
        table[key] = old
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
    state = _STATES.get(model)
    if state is None:
        raise DispatchError(f"{type(model).__name__} is not dispatched by automap; nothing to undo")
    _restore(model, state)
    del _STATES[model]
    return model
