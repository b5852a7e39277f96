"""Skeleton models: parameters on the meta device, buffers computed for real.

Parameters are what checkpoints hold and what makes models big, so they go to meta the moment
a module registers them, before any initialiser touches them. Buffers stay where their
module computed them: they are small, and many are not in any checkpoint (rotary
``inv_freq``, ``position_ids``), so their computed values are the only correct ones.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from torch import nn


def _to_meta(param: nn.Parameter) -> nn.Parameter:
    data = param.data.to("meta")
    if type(param) is nn.Parameter:
        return nn.Parameter(data, requires_grad=param.requires_grad)
    return type(param)(data, requires_grad=param.requires_grad)  # a Parameter subclass


@contextmanager
def empty_model() -> Iterator[None]:
    """Build models without allocating their parameters.

    Inside the block every parameter a module registers is put on the meta device (its
    initialiser then runs on meta, for free); buffers are computed on CPU as usual. Load the
    weights with :func:`automap.load`.

    Example:
        >>> with automap.empty_model():
        ...     model = LlamaForCausalLM(config)
        >>> model = automap.load(model, "llama/", max_memory={"cpu": "8GiB"}, offload_dir="off")
    """
    register = nn.Module.register_parameter

    def register_on_meta(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(self, name, param)
        if param is not None and param.device.type != "meta":
            self._parameters[name] = _to_meta(param)

    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]
