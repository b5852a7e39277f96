"""Placing a model as a plan says and hooking it (undone by :mod:`automap.runtime.undo`, also on a
failed dispatch)."""

from __future__ import annotations

import itertools
import logging
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from automap.devices import canonical_name, check_present
from automap.kinds import kind_of, torch_device
from automap.errors import AutomapError, DeviceError, DispatchError
from automap.interrupts import deferred
from automap.progress import step
from automap.offload import OffloadStore, SourceSet, TensorSpec, Transfer, WeightSource, make_transfer
from automap.offload.folder import no_offload_dir, store_folder, stored_bytes
from automap.offload.store import collecting
from automap.planning import Plan, unit_label
from automap.planning.memory import streaming_buffers
from automap.planning.placement import Placement
from automap.profiling import Unit
from automap.profiling.units import all_named_tensors
from automap.runtime.hooks import MoveInputs, MoveOutputs
from automap.runtime.pieces import (
    called,
    hook_loose_owners,
    hook_split_units,
    is_experts,
    never_called,
    split_devices,
)
from automap.runtime.experts import hook_experts, hook_experts_by_call
from automap.runtime.guard import Guard
from automap.runtime.state import DispatchState, Group, Streamed, claimed, forget, remember
from automap.runtime.gradients import RefuseGradientsEarly, refuse_gradients
from automap.runtime.streaming import CheckFiles, StreamWeights
from automap.runtime.swap import install
from automap.runtime.undo import release_orphans, restore

log = logging.getLogger(__name__)

# Builds the transfer from a weight source to the execution device, given by its name in the plan,
# and how many buffers of the largest offloaded unit fit beside the plan's peak (None: unknown).
TransferFactory = Callable[[WeightSource, str, "int | None"], Transfer]


def dispatch_plan(
    model: nn.Module,
    plan: Plan,
    *,
    offload_dir: str | Path | None = None,
    output_device: str | torch.device | None = None,
    source: WeightSource | None = None,
    always_hook: bool = False,
    transfer: TransferFactory = make_transfer,
) -> nn.Module:
    """Place ``model`` as ``plan`` says and install the hooks that run it there.

    Args:
        offload_dir: where to create the store for the weights of units placed on ``"disk"``
            (a directory of automap's own inside it; nothing else there is touched); None: the
            folder the plan was sized for (``plan.offload_dir``). Another folder than the
            plan's must have room for its disk units.
        output_device: move the model's outputs here (default: where they were produced).
        source: a weight source that already holds offloaded tensors (under their names in
            the plan), e.g. built by :func:`automap.load` from checkpoint references. Those
            tensors may then be on meta in the model; nothing is written for them. The model
            owns the source from here on: :func:`undispatch` closes it.
        always_hook: install input-moving hooks even when everything is on one device (for
            measuring hook overhead).
        transfer: builds the transfer to the execution device, given the source and the
            device's name in the plan (default: as the device's kind says: pages on CPU,
            staged copies on a GPU).

    Raises:
        DispatchError, DeviceError, OffloadError: the model is left exactly as it was, and
            nothing this call wrote is left on disk. :class:`~automap.errors.OffloadDirError`
            (a DispatchError) when disk units have no folder, or one without room for them.
            DispatchError too when another thread is dispatching ``model`` meanwhile.
    """
    release_orphans(model)
    with claimed(model):
        return _dispatch(model, plan, offload_dir, output_device, source, always_hook, transfer)


def _dispatch(
    model: nn.Module,
    plan: Plan,
    offload_dir: str | Path | None,
    output_device: str | torch.device | None,
    source: WeightSource | None,
    always_hook: bool,
    transfer: TransferFactory,
) -> nn.Module:
    offload_dir = store_folder(plan, offload_dir, stored_bytes(plan) if source is None else 0)
    tensors = named_tensors(model)
    check_plan_matches(model, tensors, plan)
    check_devices_present(plan)
    if output_device is not None:
        output_device = _output_device(output_device)
    check_meta(tensors, plan, source)
    state = DispatchState(plan=plan)
    try:
        state.source = build_source(
            state, tensors, plan, source, offload_dir
        )  # reads and writes: interruptible
        with deferred():  # hooks attached and listed, tensors swapped and recorded: all or nothing
            apply(model, plan, state, output_device, always_hook, transfer)
            remember(model, state)
    except BaseException as exc:
        with deferred():
            forget(state)
            restore(model, state, rollback=True)
        if isinstance(exc, AutomapError) or not isinstance(exc, Exception):
            raise
        raise DispatchError(
            f"dispatching {type(model).__name__} failed ({exc}); the model was left as it was"
        ) from exc
    log.info(
        "dispatched %s: %d unit(s), %d streaming, executing on %s",
        type(model).__name__,
        len(plan.units),
        len(state.groups),
        plan.execution_device,
    )
    return model


def check_devices_present(plan: Plan) -> None:
    """Raise :class:`DeviceError` unless this machine has every device ``plan`` places weights
    on or computes on (a plan read from JSON may name a GPU it lacks as the execution device)."""
    for name in sorted({*plan.used_devices, plan.execution_device}):
        check_present(name)


def _output_device(asked: str | int | torch.device) -> torch.device:
    """``output_device`` as a device of this machine.

    Raises:
        DeviceError: it names no kind of device, or one this machine does not have.
    """
    name = canonical_name(asked)
    if kind_of(name).stores_only:
        raise DeviceError("output_device='disk': outputs go to a device that computes; give 'cpu' or a GPU")
    try:
        check_present(name)
    except DeviceError as exc:
        raise DeviceError(
            f"output_device={asked!r}: {name} is not on this machine; give 'cpu' or a GPU it has"
        ) from exc
    return torch.device(name)


def named_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    return dict(all_named_tensors(model, remove_duplicate=False))


def check_plan_matches(model: nn.Module, tensors: dict[str, torch.Tensor], plan: Plan) -> None:
    modules = dict(model.named_modules())
    for unit, placement in zip(plan.units, plan.placements):
        if unit.name not in modules:
            raise DispatchError(
                f"the plan names unit {unit.name!r} but the model has no such module; "
                "was the plan made for another model?"
            )
        module = modules[unit.name]
        if placement.offloaded and never_called(module):
            children = [f"{unit.name}.{c}" for c, _ in list(module.named_children())[:2]]
            raise DispatchError(
                f"unit {unit.name!r} is a {type(module).__name__}, which is never called, so its "
                f"weights cannot be streamed in when it runs; map its children ({children}, ...) "
                "to 'disk' instead"
            )
        bad = [t for t in unit.tensors if t not in tensors]
        if bad:
            raise DispatchError(
                f"the plan names tensors {bad[:3]} that the model lacks; plan this model again"
            )
    missing = next((name for name in split_devices(plan, modules) if name not in modules), None)
    if missing is not None:
        raise DispatchError(
            f"the plan splits unit {missing!r} but the model has no such module; "
            "was the plan made for another model?"
        )


def streamed_names(plan: Plan, tensors: dict[str, torch.Tensor]) -> dict[str, tuple[Unit, Placement]]:
    """Each offloaded tensor once (tied ones under their first name): name -> (unit, its
    resolved placement)."""
    found: dict[str, tuple[Unit, Placement]] = {}
    seen: set[int] = set()
    for unit, placement in zip(plan.units, plan.placements):
        if not placement.offloaded:
            continue
        for name in unit.tensors:
            if name not in unit.loose and id(tensors[name]) not in seen:
                seen.add(id(tensors[name]))
                found[name] = (unit, placement)
    return found


def check_meta(tensors: dict[str, torch.Tensor], plan: Plan, source: WeightSource | None) -> None:
    """A tensor may be on meta only when it is streamed and ``source`` holds it."""
    streamed = {id(tensors[n]): n for n in streamed_names(plan, tensors)}
    held = set(source.names()) if source is not None else set()
    for name, tensor in tensors.items():
        if tensor.device.type != "meta":
            continue
        if id(tensor) not in streamed:
            raise DispatchError(
                f"tensor {name!r} is on meta (no data) but the plan keeps it resident; "
                "load its weights first (automap.load does) or plan it onto 'disk'"
            )
        if streamed[id(tensor)] not in held:
            raise DispatchError(
                f"tensor {name!r} is on meta and offloaded, but the weight source has no "
                f"entry {streamed[id(tensor)]!r}; load it with automap.load, or give the model "
                "real weights"
            )


def build_source(
    state: DispatchState,
    tensors: dict[str, torch.Tensor],
    plan: Plan,
    given: WeightSource | None,
    offload_dir: str | Path | None,
) -> WeightSource | None:
    """One source for every offloaded tensor: ``given`` for what it holds, and for the rest
    the source each storage tier's kind builds (a new store for "disk", host RAM, pinned for
    a GPU, for "cpu"), slowest tier first."""
    held = set(given.names()) if given is not None else set()
    if given is not None:
        state.owned.append(given)
    tiers: dict[Placement, dict[str, str]] = {}
    for name, (unit, placement) in streamed_names(plan, tensors).items():
        if name not in held:
            tiers.setdefault(placement, {})[name] = unit.name
    for placement in sorted(tiers, key=lambda p: plan.device(p.home).sort_key(), reverse=True):
        make = kind_of(placement.tier).factory("source")
        if make is None:
            raise DispatchError(
                f"the plan streams units from {placement.home!r}, a kind of device that holds no "
                "offloaded weights; plan the model again with automap.plan"
            )
        with collecting(state.owned):  # a store is in state.owned as soon as it exists (rollback removes it)
            source = make(tensors, tiers[placement], offload_dir, placement.compute)
        if not any(source is owned for owned in state.owned):
            state.owned.append(source)
    if not state.owned:
        return None
    return state.owned[0] if len(state.owned) == 1 else SourceSet(state.owned)


def write_store(
    tensors: dict[str, torch.Tensor], groups: dict[str, str], offload_dir: str | Path | None
) -> OffloadStore:
    if offload_dir is None:
        units = [unit_label(u) for u in dict.fromkeys(groups.values())]
        listed = ", ".join(units[:3]) + (f" and {len(units) - 3} more" if len(units) > 3 else "")
        raise no_offload_dir(f"{len(units)} unit{'' if len(units) == 1 else 's'} ({listed})")
    specs = {n: TensorSpec(g, tensors[n].dtype, tuple(tensors[n].shape)) for n, g in groups.items()}
    with step("automap: writing the offload store"):
        return OffloadStore.write(offload_dir, specs, lambda name: tensors[name].data)


def record(state: DispatchState, tensor: torch.Tensor) -> None:
    if id(tensor) not in state.original:
        device = tensor.device if tensor.device.type != "meta" else torch.device("cpu")
        state.original[id(tensor)] = (tensor, device)


def place(state: DispatchState, tensor: torch.Tensor, device: torch.device) -> None:
    record(state, tensor)
    if tensor.device != device:
        tensor.data = tensor.data.to(device)


def off_meta(model: nn.Module, plan: Plan, state: DispatchState) -> None:
    """Give every meta tensor (all of them streamed, see :func:`check_meta`) its home in the
    source, as a new object: ``.data`` cannot move a tensor off meta. Every module that refers
    to one gets the same replacement, so ties survive; the old objects are kept for rollback."""
    tensors = named_tensors(model)
    names = {id(tensors[n]): n for n in streamed_names(plan, tensors)}
    meta = {id(t) for t in tensors.values() if t.is_meta}
    if meta:
        assert state.source is not None, "check_meta: meta tensors are streamed from the source"
        state.replaced = install(model, {key: state.source.get(names[key]) for key in meta})


def apply(
    model: nn.Module,
    plan: Plan,
    state: DispatchState,
    output_device: str | torch.device | None,
    always_hook: bool,
    transfer: TransferFactory,
) -> None:
    off_meta(model, plan, state)
    modules = dict(model.named_modules())
    tensors = named_tensors(model)
    compute_devices = {p.compute for p in plan.placements}
    needs_hooks = (
        always_hook or len(compute_devices) > 1 or bool(plan.offloaded_units) or output_device is not None
    )
    by_call = hook_experts_by_call(plan, modules, state) if needs_hooks else set()
    place_units(plan, state, modules, tensors, needs_hooks, by_call)
    name = type(model).__name__
    if state.groups:
        assert state.source is not None
        link(state.groups)
        state.transfer = transfer(state.source, plan.execution_device, streaming_buffers(plan))
        files = (
            CheckFiles(state.gate, name)
            if state.transfer.swaps
            else CheckFiles(state.gate, name, state.groups, state.transfer)
        )
        for group in state.groups:
            state.hooks.append(
                StreamWeights(group, state, None if state.transfer.swaps else files).attach(
                    modules[group.key]
                )
            )
        hook_experts(state, modules)
        state.hooks.append(files.attach(model))
        state.hooks.append(RefuseGradientsEarly(state).attach(model))
    elif needs_hooks:
        state.hooks.append(CheckFiles(state.gate, name).attach(model))
    if needs_hooks:
        hook_loose_owners(plan, modules, tensors, state)
        hook_split_units(plan, modules, state)
    if output_device is not None:
        state.hooks.append(MoveOutputs(torch.device(output_device)).attach(model))
    state.guard = Guard(model, state).install()


def place_units(
    plan: Plan,
    state: DispatchState,
    modules: dict[str, nn.Module],
    tensors: dict[str, torch.Tensor],
    needs_hooks: bool,
    own_inputs: set[str] = frozenset(),
) -> None:
    """Point offloaded tensors at their homes, move resident ones to their devices, and make a
    streaming group per unit that has offloaded tensors (its own or tied ones). Units in
    ``own_inputs`` have a hook that moves their inputs already (:class:`ExpertsByCall`)."""
    streamed = streamed_names(plan, tensors)
    owned = {u.name: [] for u, p in zip(plan.units, plan.placements) if p.offloaded}
    fed = fed_in_place(plan, modules)
    for name, (unit, _) in streamed.items():
        owned[unit.name].append(offload(state, name, tensors[name], modules))
    for unit, placement in zip(plan.units, plan.placements):
        device = torch_device(placement.compute)
        for name in unit.tensors:
            if id(tensors[name]) not in state.streamed:
                place(state, tensors[name], device)
        # A unit also streams in tied tensors that an offloaded unit owns (even when it is
        # resident itself), so a tie split between RAM and disk stays one parameter.
        own = owned.get(unit.name, [])
        items = own + aliases(modules[unit.name], unit.name, inner_units(plan, unit.name), state, own)
        if items:
            state.groups.append(Group(unit.name, placement.home, items))
        if needs_hooks and unit.name not in own_inputs and not (unit.name in fed and not items):
            state.hooks.extend(MoveInputs(device).attach(m) for m in called(modules[unit.name]))


def fed_in_place(plan: Plan, modules: dict[str, nn.Module]) -> set[str]:
    """Units whose one input is the output of the unit before them in an ``nn.Sequential``
    (through children between them that hold no tensors: an activation, a dropout) computing on
    the same device, both resident and whole (no piece of a split unit, no routed experts), and
    not called a second time by other code (as a trace counts it; a plan without one trusts the
    ``Sequential`` to be the caller): what they are given is where they compute already, so no
    hook runs between them. Elsewhere a unit's inputs may come from any unit (each layer of a
    decoder reads the rotary embedding's cos/sin beside the previous layer's output), and its
    hook stays."""
    rows = {u.name: (u, p) for u, p in zip(plan.units, plan.placements)}
    whole = {
        name: p.compute
        for name, (u, p) in rows.items()
        if not p.offloaded and not u.split_from and u.calls <= 1 and not is_experts(u, modules.get(name))
    }
    found = set()
    for name, module in modules.items():
        if type(module).forward is not nn.Sequential.forward:
            continue
        before = None  # where the last unit of the run so far computes
        for key, inner in module.named_children():
            child = f"{name}.{key}" if name else key
            if child in rows:
                if before is not None and whole.get(child) == before:
                    found.add(child)
                before = whole.get(child)
            elif not passes_through(inner) or any(u.startswith(f"{child}.") for u in rows):
                before = None
    return found


def passes_through(module: nn.Module) -> bool:
    """Whether ``module`` holds no tensors: it computes where its inputs are."""
    return next(itertools.chain(module.parameters(), module.buffers()), None) is None


def offload(state: DispatchState, name: str, tensor: torch.Tensor, modules: dict[str, nn.Module]) -> Streamed:
    """Point ``tensor`` at its home in the source (its RAM copy is released) and refuse
    gradients that would reach it."""
    assert state.source is not None
    record(state, tensor)
    home = state.source.get(name)
    is_buffer = not isinstance(tensor, nn.Parameter)
    if tensor.data_ptr() != home.data_ptr() or tensor.device != home.device:
        tensor.data = home
    owner, _, key = name.rpartition(".")
    table = modules[owner]._buffers if is_buffer else modules[owner]._parameters
    item = state.streamed.setdefault(
        id(tensor), Streamed(tensor, name, home, is_buffer, version=tensor._version, slot=(table, key))
    )
    if tensor.requires_grad:
        refuse_gradients(state, tensor, name)
    return item


def aliases(
    module: nn.Module, name: str, inner: list[str], state: DispatchState, own: list[Streamed]
) -> list[Streamed]:
    """Streamed tensors reachable from unit ``name``'s ``module`` that another unit owns (tied
    weights); not those of the ``inner`` units (modules inside it that are units of their own,
    as the model's children are inside a unit mapped as ``""``), which bring in their own."""
    mine = {id(i.tensor) for i in own}
    found = []
    named = [
        *module.named_parameters(prefix=name, remove_duplicate=False),
        *module.named_buffers(prefix=name, remove_duplicate=False),
    ]
    for key, t in named:
        if any(key.startswith(f"{n}.") for n in inner):
            continue
        if id(t) in state.streamed and id(t) not in mine:
            found.append(state.streamed[id(t)])
            mine.add(id(t))
    return found


def inner_units(plan: Plan, name: str) -> list[str]:
    """The plan's units inside unit ``name`` (all others when it is the model, ``""``)."""
    return [u.name for u in plan.units if u.name != name and (not name or u.name.startswith(f"{name}."))]


def link(groups: list[Group]) -> None:
    """Each group prefetches the next in plan order; the last the first (the next forward,
    or the next token of ``generate``)."""
    for i, group in enumerate(groups):
        group.next = groups[(i + 1) % len(groups)] if len(groups) > 1 else None
