"""Replacing tensor objects in a model (``.data`` cannot move a tensor off meta), so that
every module referring to one gets the same replacement and tied weights stay tied."""

from __future__ import annotations

from typing import Any, Collection, Mapping

import torch
from torch import nn


def install(model: nn.Module, fresh: Mapping[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    """Put the new tensors in place of the old (by ``id``), in every module that refers to
    them, so that tied weights stay one object (``.data`` cannot move a tensor off meta).

    Returns:
        The inverse mapping: ``install(model, undo)`` puts the old objects back.
    """
    wrapped: dict[int, torch.Tensor] = {}
    undo: dict[int, torch.Tensor] = {}
    for module in model.modules():
        tables: tuple[dict[str, Any], ...] = (module._parameters, module._buffers)
        for table in tables:
            for key, old in table.items():
                if old is None or id(old) not in fresh:
                    continue
                if id(old) not in wrapped:
                    wrapped[id(old)] = _like(old, fresh[id(old)])
                    undo[id(wrapped[id(old)])] = old
                table[key] = wrapped[id(old)]
    return undo


def _like(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    if not isinstance(old, nn.Parameter) or isinstance(new, nn.Parameter):
        return new
    cls = type(old) if type(old) is not nn.Parameter else nn.Parameter
    return cls(new, requires_grad=old.requires_grad and new.is_floating_point())


def allocation_failed(exc: BaseException) -> bool:
    """Whether ``exc`` says an allocation failed (``MemoryError``, torch's out-of-memory
    errors of every device, the CPU allocator's "can't allocate memory")."""
    if isinstance(exc, (MemoryError, torch.OutOfMemoryError)):
        return True
    text = str(exc).lower()
    return "allocate" in text or "out of memory" in text


def moved_back(
    original: Mapping[int, tuple[torch.Tensor, torch.device]], streamed: Collection[int]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each tensor of ``original`` (by id: the tensor and its device before dispatch) that was
    moved to another device and not to a weight source (``streamed``), with a copy of it on the
    device it came from: all allocated before anything is put back."""
    return [
        (tensor, tensor.data.to(device))
        for key, (tensor, device) in original.items()
        if key not in streamed and tensor.device != device
    ]
