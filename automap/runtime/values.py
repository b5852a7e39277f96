"""Moving the values that flow between units (tensors nested in containers) to a device, and
finding the tensors in them."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import Any, Iterator

import torch


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


def tensors_in(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside ``value``, in the containers :func:`send` walks (other objects,
    KV caches among them, are not looked into)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from tensors_in(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from tensors_in(v)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            yield from tensors_in(getattr(value, f.name))
