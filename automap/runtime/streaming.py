"""The hooks of an offloaded unit: bring its weights in before it runs (prefetching the next
unit's), release them after, and let backward read them again by name instead of keeping them."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from automap.runtime.state import DispatchState, Group, Streamed
from automap.errors import DispatchError

log = logging.getLogger(__name__)


def placeholder(tensor: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
    """What an offloaded tensor holds between uses: no elements, so any use outside its unit
    fails loudly with a shape error instead of computing with stale or zero weights. (``meta``
    would be clearer but ``.data`` cannot switch a CPU tensor to meta.)"""
    if device is None:
        device = tensor.device if tensor.device.type != "meta" else torch.device("cpu")
    return torch.empty(0, dtype=tensor.dtype, device=device)


def _check_trainable(module: nn.Module, group: Group) -> None:
    if module.training and torch.is_grad_enabled() and any(i.tensor.requires_grad for i in group.items):
        raise DispatchError(
            f"unit {group.key!r} is offloaded ({group.where}) and its parameters require grad; automap does "
            "not train offloaded units (their gradients would be lost). Keep it resident (raise max_memory), "
            f"freeze it with model.get_submodule({group.key!r}).requires_grad_(False), or run it under "
            "model.eval() / torch.no_grad()"
        )


def stream_in(state: DispatchState, group: Group) -> Callable:
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


def _save_by_name(state: DispatchState, group: Group) -> tuple[Callable, Callable]:
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


def refuse_grad(name: str) -> Callable:
    def hook(grad: torch.Tensor) -> None:
        raise DispatchError(
            f"a gradient reached offloaded parameter {name!r}; automap does not keep gradients of offloaded "
            "weights. Freeze it (requires_grad_(False)) or keep its unit resident (raise max_memory)"
        )
    return hook


def _release(item: Streamed) -> None:
    item.users = 0
    item.tensor.data = placeholder(item.tensor, item.tensor.device)


def _end_saving(group: Group) -> None:
    if group.saving is not None:
        group.saving.__exit__(None, None, None)
        group.saving = None


def stream_out(state: DispatchState, group: Group) -> Callable:
    def hook(module: nn.Module, args: tuple, output: Any) -> None:
        _end_saving(group)
        for item in group.items:
            item.users -= 1
            if item.users == 0:
                _release(item)
        state.live -= len(group.items)
    return hook


def reset_stale(state: DispatchState) -> Callable:
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
