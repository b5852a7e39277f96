"""What a dispatched model carries: its plan, hook handles, original devices, streamed tensors."""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from automap.errors import DispatchError
from automap.offload import Loader, OffloadStore
from automap.planning import Plan


@dataclass(eq=False)
class Streamed:
    """An offloaded tensor: the live object, its store name, and how many units hold it in."""

    tensor: torch.Tensor
    name: str
    users: int = 0


@dataclass(eq=False)
class Group:
    """The offloaded tensors one unit needs (its own and tied ones owned elsewhere), and the
    group expected to run after it (prefetched while this one computes)."""

    key: str
    where: str
    items: list[Streamed]
    next: Group | None = None
    saving: Any = None  # the saved-tensor hooks active while the unit runs with grad enabled


@dataclass
class DispatchState:
    """What :func:`undispatch` needs: the plan, hook handles, original devices, the store."""

    plan: Plan
    handles: list[RemovableHandle] = field(default_factory=list)
    original: dict[int, tuple[torch.Tensor, torch.device]] = field(default_factory=dict)
    store: OffloadStore | None = None
    streamed: dict[int, Streamed] = field(default_factory=dict)
    host: dict[str, torch.Tensor] = field(default_factory=dict)
    groups: list[Group] = field(default_factory=list)
    loader: Loader | None = None
    # The meta tensors replaced by placeholders, by id of the placeholder: put back on rollback.
    replaced: dict[int, torch.Tensor] = field(default_factory=dict)
    live: int = 0  # streamed tensors held in right now


STATES: "weakref.WeakKeyDictionary[nn.Module, DispatchState]" = weakref.WeakKeyDictionary()


def state_of(model: nn.Module) -> DispatchState | None:
    """The dispatch state of ``model``, or None when it is not dispatched."""
    return STATES.get(model)


def check_not_dispatched(model: nn.Module) -> None:
    """Raise :class:`DispatchError` when ``model`` is dispatched already (before planning it
    again, which would fail on the hooked model with a less useful message)."""
    if model in STATES:
        raise DispatchError(f"{type(model).__name__} is already dispatched; call automap.undispatch(model) first")
