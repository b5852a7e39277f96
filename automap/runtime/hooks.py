"""Hook objects: what automap attaches to a module, with a lifecycle — :meth:`Hook.attach`,
:meth:`Hook.pre` before the module's forward, :meth:`Hook.post` after it (also when the forward
raised), :meth:`Hook.detach`. Like accelerate's ``ModelHook``, but through torch's own hook API
(``register_forward_pre_hook(..., with_kwargs=True)``, ``register_forward_hook(...,
always_call=True)``): ``module.forward`` is never patched, and the handles are kept so that
:func:`automap.undispatch` removes every one."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from automap.runtime.values import send


class Hook:
    """Base class: subclasses override :meth:`pre` and/or :meth:`post`."""

    def __init__(self) -> None:
        self.handles: list[RemovableHandle] = []

    def attach(self, module: nn.Module) -> Hook:
        """Register this hook's methods on ``module``; returns ``self``."""
        if type(self).pre is not Hook.pre:
            self.handles.append(module.register_forward_pre_hook(self.pre, with_kwargs=True))
        if type(self).post is not Hook.post:
            self.handles.append(module.register_forward_hook(self.post, always_call=True))
        return self

    def pre(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """Before ``module`` runs; may return replacement ``(args, kwargs)``."""
        return None

    def post(self, module: nn.Module, args: tuple, output: Any) -> Any:
        """After ``module`` ran, or raised; may return a replacement output."""
        return None

    def detach(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


def _on(values: tuple, device: torch.device) -> bool:
    """True when every value is a tensor already on ``device`` (the common case, checked
    without rebuilding anything: it runs before every unit)."""
    for value in values:
        if not isinstance(value, torch.Tensor) or value.device != device:
            return False
    return True


class MoveInputs(Hook):
    """Sends a module's inputs (nested in any container) to the device it computes on."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device

    def pre(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if _on(args, self.device) and (not kwargs or _on(tuple(kwargs.values()), self.device)):
            return None
        moved_args, moved_kwargs = send(args, self.device), send(kwargs, self.device)
        if moved_args is args and moved_kwargs is kwargs:
            return None
        return moved_args, moved_kwargs


class MoveOutputs(Hook):
    """Sends the model's outputs to ``device`` (``dispatch(..., output_device=...)``)."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device

    def post(self, module: nn.Module, args: tuple, output: Any) -> Any:
        return send(output, self.device)
