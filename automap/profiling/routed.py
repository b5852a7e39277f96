"""Finding a model's routed experts (stacked in 3-D tensors, or listed in a ModuleList beside a
router), the weights a forward reads only for the experts its router picked, and guessing the
next layer's routing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import nn


@dataclass(frozen=True)
class Experts:
    """Weights read per call, for the experts routed to.

    Attributes:
        module: the stacked module's name, or one listed expert's.
        tensors: the full names of its parameters and buffers.
        count: experts stacked along the first dimension of each tensor; 0 for a listed
            expert (read whole, when the block calls it).
    """

    module: str
    tensors: tuple[str, ...]
    count: int

    @property
    def stacked(self) -> bool:
        return self.count > 0


def find_experts(root: nn.Module, prefix: str = "") -> list[Experts]:
    """The routed experts inside ``root`` (whose name in the model is ``prefix``), stacked
    modules and listed experts, in module order.

    Example:
        >>> [e.module for e in find_experts(mixtral.model.layers[0], "model.layers.0")]
        ['model.layers.0.mlp.experts']
    """
    found: list[Experts] = []
    for name, module in root.named_modules(prefix=prefix):
        count = stacked_count(module)
        if count:
            found.append(Experts(name, _own_tensors(module, name), count))
        elif isinstance(module, nn.ModuleList) and _listed(module, name, root, prefix):
            found.extend(
                Experts(f"{name}.{i}", _all_tensors(child, f"{name}.{i}"), 0)
                for i, child in enumerate(module)
            )
    return found


def stacked_count(module: nn.Module) -> int:
    """The experts stacked in ``module``'s own tensors, or 0 when it is not such a module: it
    says ``num_experts``, each of its own parameters has them along its first dimension, and
    one has three dimensions or more (a router's weight has two)."""
    count = getattr(module, "num_experts", None)
    own = list(module.parameters(recurse=False))
    if not isinstance(count, int) or count < 2 or not own:
        return 0
    if all(p.dim() >= 2 and p.shape[0] == count for p in own) and any(p.dim() >= 3 for p in own):
        return count
    return 0


def _listed(experts: nn.ModuleList, name: str, root: nn.Module, prefix: str) -> bool:
    """Whether ``experts`` (``name``) is a list of experts: two or more modules of one class
    with the same tensors, beside a router in the block that holds the list."""
    children = list(experts)
    if len(children) < 2 or len({type(c) for c in children}) > 1:
        return False
    shapes = [[tuple(p.shape) for p in c.parameters()] for c in children]
    if not shapes[0] or any(s != shapes[0] for s in shapes):
        return False
    block = _parent(root, prefix, name)
    inside = {id(p) for p in experts.parameters()}
    return any(
        p.dim() == 2 and p.shape[0] == len(children) for p in block.parameters() if id(p) not in inside
    )


def _parent(root: nn.Module, prefix: str, name: str) -> nn.Module:
    relative = name[len(prefix) + 1 :] if prefix else name
    owner = relative.rpartition(".")[0]
    return root.get_submodule(owner) if owner else root


def _own_tensors(module: nn.Module, name: str) -> tuple[str, ...]:
    return tuple(f"{name}.{key}" for key, _ in _named(module, recurse=False))


def _all_tensors(module: nn.Module, name: str) -> tuple[str, ...]:
    return tuple(f"{name}.{key}" for key, _ in _named(module, recurse=True))


def _named(module: nn.Module, recurse: bool) -> Iterator[tuple[str, torch.Tensor]]:
    yield from module.named_parameters(recurse=recurse)
    yield from module.named_buffers(recurse=recurse)


def routing_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The routing a call of a stacked module carries: its first integer tensor argument (the
    experts of each token, ``top_k`` along the last dimension), or None."""
    for value in (*args, *kwargs.values()):
        if (
            isinstance(value, torch.Tensor)
            and not value.is_floating_point()
            and not value.is_complex()
            and value.dtype is not torch.bool
        ):
            return value
    return None


def routed_rows(args: tuple[Any, ...], kwargs: dict[str, Any], count: int) -> list[int] | None:
    """The experts a call of a stacked module routes to: the distinct values below ``count``
    of its routing (:func:`routing_of`; values past it mark tokens sent to no expert here);
    None when the call carries none (then every expert is read)."""
    routing = routing_of(args, kwargs)
    if routing is None:
        return None
    return [i for i in torch.unique(routing.detach()).tolist() if 0 <= i < count]


def router_of(block: nn.Module, experts: nn.Module, count: int) -> torch.Tensor | None:
    """The router's weight of the stacked ``experts`` in ``block`` (the module holding them):
    a weight outside them with one row per expert, or None."""
    inside = {id(p) for p in experts.parameters()}
    for weight in block.parameters():
        if id(weight) not in inside and weight.dim() == 2 and weight.shape[0] == count:
            return weight
    return None


def guess_rows(hidden: torch.Tensor, router: torch.Tensor, top_k: int) -> list[int]:
    """The experts ``router`` (a weight with a row per expert) would pick, ``top_k`` per token,
    for the tokens of ``hidden``: from one layer's input, a guess of the next layer's routing
    (the residual stream changes little from one layer to the next; biases, normalisation and
    scoring functions are left out, which rarely changes the top ones)."""
    tokens = hidden.detach().reshape(-1, hidden.shape[-1])
    weight = router.detach().to(device=tokens.device, dtype=tokens.dtype)
    return torch.unique((tokens @ weight.T).topk(min(top_k, weight.shape[0]), dim=-1).indices).tolist()
