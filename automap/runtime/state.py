"""What a dispatched model carries: its plan, hook objects, original devices, streamed tensors
and their weight source, found through :func:`state_of`."""
from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field

import torch
from torch import nn

from automap.errors import DispatchError
from automap.offload import SourceStats, Transfer, WeightSource
from automap.planning import Plan
from automap.runtime.hooks import Hook


@dataclass(eq=False)
class Streamed:
    """An offloaded tensor: the live object in the model, its name in the source, what it
    holds between uses (``home``: the source's real CPU tensor), whether it is a buffer, and
    — on an accelerator, where a copy stands in for it while a unit runs — how many units
    hold it in and its version counter when it went in (to write back what they changed)."""

    tensor: torch.Tensor
    name: str
    home: torch.Tensor
    is_buffer: bool
    users: int = 0
    version: int = 0


@dataclass(eq=False)
class Group:
    """The offloaded tensors one unit needs (its own and tied ones owned elsewhere), and the
    group expected to run after it (prefetched while this one computes)."""

    key: str
    where: str
    items: list[Streamed]
    next: Group | None = None

    @property
    def names(self) -> list[str]:
        return [i.name for i in self.items]


@dataclass
class DispatchState:
    """Everything :func:`automap.undispatch` needs, and what :func:`automap.placement` reads.

    Attributes:
        plan: the plan the model was dispatched with.
        hooks: hook objects attached to the model's modules (detached by undispatch).
        tensor_hooks: handles of hooks on tensors (refusing gradients of offloaded weights).
        original: id of each tensor dispatch moved -> (the tensor, the device it was on).
        source: where offloaded tensors live between uses (None: nothing is offloaded).
        owned: the sources this dispatch created or was handed (closed by undispatch).
        transfer: brings offloaded weights to the execution device.
        streamed: id of each offloaded tensor -> its :class:`Streamed` record.
        groups: one per unit that streams weights, in plan order.
        replaced: meta tensors replaced by real ones, by id of the replacement (rollback).
        lock: held while a unit runs with weights swapped in (accelerator execution), so that
            forwards from several threads take turns through streamed units.
    """

    plan: Plan
    hooks: list[Hook] = field(default_factory=list)
    tensor_hooks: list[torch.utils.hooks.RemovableHandle] = field(default_factory=list)
    original: dict[int, tuple[torch.Tensor, torch.device]] = field(default_factory=dict)
    source: WeightSource | None = None
    owned: list[WeightSource] = field(default_factory=list)
    transfer: Transfer | None = None
    streamed: dict[int, Streamed] = field(default_factory=dict)
    groups: list[Group] = field(default_factory=list)
    replaced: dict[int, torch.Tensor] = field(default_factory=dict)
    lock: threading.RLock = field(default_factory=threading.RLock)

    def streamed_ids(self) -> set[int]:
        """ids of the model's tensors that live in the weight source."""
        return set(self.streamed)

    def stats(self) -> SourceStats:
        """Bytes behind the offloaded tensors (files, RAM, pinned, written copy-on-write),
        including the transfer's pinned staging buffer."""
        found = self.source.stats() if self.source is not None else SourceStats()
        pinned = self.transfer.pinned_bytes if self.transfer is not None else 0
        return found + SourceStats(pinned_bytes=pinned)


_STATES: weakref.WeakKeyDictionary[nn.Module, DispatchState] = weakref.WeakKeyDictionary()


def state_of(model: nn.Module) -> DispatchState | None:
    """The dispatch state of ``model``, or None when it is not dispatched."""
    return _STATES.get(model)


def remember(model: nn.Module, state: DispatchState) -> None:
    """Record that ``model`` is dispatched with ``state``."""
    _STATES[model] = state


def forget(model: nn.Module) -> None:
    """Drop ``model``'s dispatch state (after :func:`automap.undispatch` undid it)."""
    _STATES.pop(model, None)


def check_not_dispatched(model: nn.Module) -> None:
    """Raise :class:`DispatchError` when ``model`` is dispatched already, by automap or by
    accelerate (before planning it again, which would fail on the hooked model with a less
    useful message)."""
    if model in _STATES:
        raise DispatchError(f"{type(model).__name__} is already dispatched; call automap.undispatch(model) first")
    check_no_accelerate_hooks(model)


def check_no_accelerate_hooks(model: nn.Module) -> None:
    """Refuse a model that accelerate dispatched (``dispatch_model``, ``cpu_offload``,
    ``from_pretrained(device_map=...)``): its hooks replace the modules' forwards and move
    weights behind automap's back. automap does not remove them itself: only the caller knows
    whether the weights they would leave on meta matter."""
    hooked = [name or "(the model)" for name, module in model.named_modules() if hasattr(module, "_hf_hook")]
    if hooked:
        raise DispatchError(
            f"{type(model).__name__} is dispatched by accelerate: {len(hooked)} module(s) carry its hooks (first "
            f"{hooked[:3]}). Remove them before automap places it: from accelerate.hooks import "
            "remove_hook_from_module; remove_hook_from_module(model, recurse=True) — weights accelerate offloaded "
            "come back only if the model had them before its dispatch; otherwise load it with automap.load, or "
            "from_pretrained without device_map")
