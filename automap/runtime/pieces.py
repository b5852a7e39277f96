"""Hooks for a model whose units compute in pieces: a split unit's own code runs where its
pieces compute, a module holding loose tensors computes where they are, and a unit that
computes apart from the code around it (routed experts, a piece tied to units elsewhere) sends
its outputs back there."""

from __future__ import annotations

import torch
from torch import nn

from automap.kinds import torch_device
from automap.planning import Plan
from automap.profiling import Unit
from automap.profiling.routed import stacked_count
from automap.runtime.hooks import MoveInputs, MoveOutputs
from automap.runtime.state import DispatchState


def never_called(module: nn.Module) -> bool:
    """A container is never called unless its class has a forward (torchvision's _DenseBlock)."""
    return isinstance(module, (nn.ModuleList, nn.ModuleDict)) and type(module).forward is nn.Module.forward


def called(module: nn.Module) -> list[nn.Module]:
    """The modules that run when ``module``'s code runs: itself, or for a container that is never
    called (a list of experts the block around it calls one by one) the modules it holds, found
    the same way."""
    if not never_called(module):
        return [module]
    return [m for child in module.children() for m in called(child)]


def hook_loose_owners(
    plan: Plan, modules: dict[str, nn.Module], tensors: dict[str, torch.Tensor], state: DispatchState
) -> None:
    """A module that holds tensors itself (ViT's ``class_token``) computes with them in its own
    forward, so its inputs go to where those tensors are."""
    owners: dict[str, torch.device] = {}
    for unit in plan.units:
        for name in unit.loose:
            owners.setdefault(name.rpartition(".")[0], tensors[name].device)
    for owner, device in owners.items():
        state.hooks.append(MoveInputs(device).attach(modules[owner]))


def split_devices(plan: Plan, modules: dict[str, nn.Module]) -> dict[str, str]:
    """For each unit the planner split (``Unit.split_from``), the device its own code runs on:
    where most of its pieces compute, routed experts left out (the first such device in plan
    order on a tie). The planner keeps the pieces on one device but for a piece tied to units
    outside its split unit, which computes with them (:mod:`automap.planning.items`);
    :func:`hook_split_units` sends that piece's outputs back."""
    found: dict[str, list[str]] = {}
    for unit, placement in zip(plan.units, plan.placements):
        if unit.split_from and not is_experts(unit, modules.get(unit.name)):
            found.setdefault(unit.split_from, []).append(placement.compute)
    return {name: max(dict.fromkeys(computes), key=computes.count) for name, computes in found.items()}


def is_experts(unit: Unit, module: nn.Module | None) -> bool:
    """Whether ``unit`` (``module``) holds a layer's routed experts, stacked or listed (the
    profile marked it; a plan from before that, stacked ones only): a piece that may compute
    apart from the rest of its layer (the experts in CPU RAM computed by the CPU, the attention
    on a GPU)."""
    return bool(unit.experts) or (module is not None and stacked_count(module) > 0)


def hook_split_units(plan: Plan, modules: dict[str, nn.Module], state: DispatchState) -> None:
    """A split unit's own forward code (a residual add) runs between its pieces, on what it
    was given: its inputs go where its pieces compute (:func:`split_devices`). A piece that
    computes elsewhere (routed experts, a piece tied to units outside it) sends its outputs
    back there, as does a unit of routed experts computing apart from the unit around it."""
    devices = {name: torch_device(device) for name, device in split_devices(plan, modules).items()}
    for name, device in devices.items():
        state.hooks.append(MoveInputs(device).attach(modules[name]))
    computes = {u.name: torch_device(p.compute) for u, p in zip(plan.units, plan.placements)}
    for unit, placement in zip(plan.units, plan.placements):
        if unit.split_from:
            around = devices.get(unit.split_from)
        elif is_experts(unit, modules[unit.name]):
            around = enclosing(unit.name, computes)
        else:
            continue
        if around is not None and around != torch_device(placement.compute):
            state.hooks.extend(MoveOutputs(around).attach(m) for m in called(modules[unit.name]))


def enclosing(name: str, computes: dict[str, torch.device]) -> torch.device | None:
    """Where the nearest unit whose module contains module ``name`` computes (None: none does)."""
    while name:
        name = name.rpartition(".")[0]
        if name in computes:
            return computes[name]
    return None
