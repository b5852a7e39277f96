"""Gradients of offloaded weights: refused, and refused at the start of the backward, before any
parameter's gradient changed.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import torch
from torch import nn

from automap.errors import DispatchError
from automap.runtime._compile import skip_when_compiling
from automap.runtime.hooks import Hook
from automap.runtime.state import DispatchState
from automap.runtime.values import tensors_in

# torch's own register_multi_grad_hook asks this during a backward; absent, the early refusal
# is skipped and the tensors' own hooks still refuse.
_WILL_EXECUTE: Callable[[Any], bool] | None = getattr(torch._C, "_will_engine_execute_node", None)
_TASK_ID: Callable[[], int] | None = getattr(torch._C, "_current_graph_task_id", None)


def refusal(name: str, early: bool = False) -> DispatchError:
    """The error for a gradient reaching offloaded ``name`` (``early``: refused at the start of
    backward, before any gradient was accumulated), with the fixes."""
    return DispatchError(
        f"{'backward stopped before a' if early else 'a'} gradient reached offloaded parameter {name!r}; automap "
        f"does not keep gradients of offloaded weights{', and this backward accumulated none' if early else ''}. "
        f"Freeze it (model.get_parameter({name!r}).requires_grad_(False), or requires_grad_(False) on its unit), "
        "keep its unit resident (raise max_memory), or run under torch.no_grad()"
    )


def refuse_gradients(state: DispatchState, tensor: torch.Tensor, name: str) -> None:
    """Hook offloaded ``tensor`` so that a gradient reaching it stops backward (once)."""
    if id(tensor) not in state.refusing:
        state.refusing.add(id(tensor))
        state.tensor_hooks.append(tensor.register_hook(refuse_grad(name)))


def refuse_grad(name: str) -> Callable[[torch.Tensor], None]:
    """A tensor hook that stops backward where a gradient reaches offloaded ``name``."""

    def hook(grad: torch.Tensor) -> None:
        raise refusal(name)

    return hook


class RefuseGradientsEarly(Hook):
    """On the model itself: after a forward with gradients on, while an offloaded weight
    requires grad, each output a backward can start from gets a hook that refuses that backward
    at its start when it will reach an offloaded weight (see the module's docstring).

    Args:
        state: the model's dispatch state (its streamed tensors, in plan order).
    """

    def __init__(self, state: DispatchState):
        super().__init__()
        self.state = state
        self._passed: int | None = None  # the backward last found to reach no offloaded weight

    def post(self, module: nn.Module, args: tuple, output: Any) -> None:
        if _WILL_EXECUTE is not None and torch.is_grad_enabled() and not torch.compiler.is_compiling():
            self._hook_outputs(output)
        return None

    @skip_when_compiling
    def _hook_outputs(self, output: Any) -> None:
        if not any(i.tensor.requires_grad for i in self.state.streamed.values()):
            return
        for tensor in tensors_in(output):
            # A leaf handed back as it came (an input) is the caller's own: no backward
            # through the model starts there.
            if tensor.requires_grad and tensor.grad_fn is not None:
                tensor.register_hook(self._check)

    def _check(self, grad: torch.Tensor) -> None:
        if not self.handles:  # detached by undispatch
            return
        # Each output of the forward (all hidden states, say) calls this; one look per backward.
        task = _TASK_ID() if _TASK_ID is not None else None
        if task is not None and task == self._passed:
            return
        name = next(self._reached(), None)
        if name is not None:
            raise refusal(name, early=True)
        self._passed = task

    def _reached(self) -> Iterator[str]:
        """The offloaded weights the running backward will reach, nearest the outputs first (the
        order in which it would reach them)."""
        assert _WILL_EXECUTE is not None
        for item in reversed(list(self.state.streamed.values())):
            if item.tensor.requires_grad and id(item.tensor) in self.state.refusing:
                try:
                    node = torch.autograd.graph.get_gradient_edge(item.tensor).node
                except (AttributeError, RuntimeError):
                    # Inside torch.func's transforms (grad of a functional_call) the weight has
                    # no node of its own here; its own hook still refuses a gradient reaching it.
                    continue
                try:
                    reached = _WILL_EXECUTE(node)
                except RuntimeError:  # torch.autograd.grad asked for this very weight
                    reached = True
                if reached:
                    yield item.name
