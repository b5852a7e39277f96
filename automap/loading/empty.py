"""Skeleton models: parameters on the meta device, buffers computed for real.

Parameters are what checkpoints hold and what makes models big, so they go to meta the moment
a module registers them, before any initialiser touches them. Buffers stay where their
module computed them: they are small, and many are not in any checkpoint (rotary
``inv_freq``, ``position_ids``), so their computed values are the only correct ones.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Callable, Iterator

from torch import nn

RegisterParameter = Callable[[nn.Module, str, "nn.Parameter | None"], None]

# nn.Module.register_parameter is patched once for all the blocks open in the process (a count,
# under a lock) and puts parameters on meta only in the threads inside a block (a thread-local
# depth), as ``with torch.device("meta")`` is per thread. Patching and restoring per block let
# two threads' blocks, ended in the other order, leave the patch installed for good: every model
# the process built afterwards had its parameters on meta, and a thread building a real model
# while another was inside a block got meta parameters too.
_LOCK = threading.Lock()
_inside = threading.local()
_open_blocks = 0
_original: RegisterParameter = nn.Module.register_parameter


def _to_meta(param: nn.Parameter) -> nn.Parameter:
    data = param.data.to("meta")
    if type(param) is nn.Parameter:
        return nn.Parameter(data, requires_grad=param.requires_grad)
    return type(param)(data, requires_grad=param.requires_grad)  # a Parameter subclass


def _register(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
    _original(self, name, param)
    if getattr(_inside, "depth", 0) and param is not None and param.device.type != "meta":
        self._parameters[name] = _to_meta(param)


def _open() -> None:
    global _open_blocks, _original
    with _LOCK:
        if nn.Module.register_parameter is not _register:  # what is there now (another library's patch too)
            _original = nn.Module.register_parameter
            nn.Module.register_parameter = _register  # type: ignore[method-assign]
        _open_blocks += 1


def _close() -> None:
    global _open_blocks
    with _LOCK:
        _open_blocks -= 1
        if (
            not _open_blocks and nn.Module.register_parameter is _register
        ):  # else patched over since: left as is
            nn.Module.register_parameter = _original  # type: ignore[method-assign]


@contextmanager
def empty_model() -> Iterator[None]:
    """Build models without allocating their parameters.

    Inside the block every parameter a module registers in this thread is put on the meta
    device (its initialiser then runs on meta, for free); buffers are computed on CPU as
    usual, and other threads build their models as they would without the block. Load the
    weights with :func:`automap.load`.

    Example:
        >>> with automap.empty_model():
        ...     model = LlamaForCausalLM(config)
        >>> model = automap.load(model, "llama/", max_memory={"cpu": "8GiB"}, offload_dir="off")
    """
    _open()
    _inside.depth = getattr(_inside, "depth", 0) + 1
    try:
        yield
    finally:
        _inside.depth -= 1
        _close()
