"""Cheap meta execution: memoised op results, and the small tensor helpers the tracer uses.

Meta kernels of many ops are Python references that cost far more than the tracer's own
bookkeeping. The 80 identical layers of a 70B model repeat the same calls, so a pure op's
output shapes and FLOPs are memoised by the shapes, strides and dtypes of its arguments:
on meta nothing else can change them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from automap.profiling.metarules import run_op


@dataclass(frozen=True)
class InputTensorSpec:
    """Shape and dtype of a tensor a unit received (to rebuild it for timing)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    stride: tuple[int, ...] | None = None


def tensors_in(tree: Any) -> list[torch.Tensor]:
    """Tensors among a pytree's leaves."""
    leaves, _ = tree_flatten(tree)
    return [x for x in leaves if isinstance(x, torch.Tensor)]


def op_tensors(args: tuple, kwargs: dict) -> Iterator[torch.Tensor]:
    """Tensors among an aten op's arguments: flat, or in one list level (``cat``)."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from (v for v in value if isinstance(v, torch.Tensor))


def storage_of(t: torch.Tensor) -> torch.UntypedStorage | None:
    """The tensor's storage (the same Python object for every view of it), or None."""
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # sparse, nested and other storage-less tensors
        return None


def unique_bytes(tree: Any) -> int:
    """Bytes of the distinct tensors in a pytree."""
    seen: dict[int, int] = {}
    for t in tensors_in(tree):
        seen[id(t)] = t.numel() * t.element_size()
    return sum(seen.values())


class MemoTable:
    """Results of pure meta ops by argument shapes: ``run`` executes an op or rebuilds it."""

    def __init__(self) -> None:
        self.results: dict[tuple, tuple[Any, int]] = {}
        self._is_pure: dict[Any, bool] = {}

    def run(
        self, func: Any, formula: Callable[..., int] | None, args: tuple, kwargs: dict
    ) -> tuple[Any, int]:
        """``func(*args, **kwargs)`` and its FLOPs by ``formula`` (0 without one)."""
        key = _memo_key(func, args, kwargs) if self._pure(func) else None
        hit = self.results.get(key) if key is not None else None
        if hit is not None:
            return _rebuild(hit[0]), hit[1]
        out = run_op(func, args, kwargs)
        flops = formula(*args, **kwargs, out_val=out) if formula is not None else 0
        if key is not None and _aliases_input(out, args, kwargs):
            self._is_pure[func] = False  # an alias its schema does not declare (_unsafe_view)
        elif key is not None:
            spec = _out_spec(out)
            if spec is not None:
                self.results[key] = (spec, flops)
        return out, flops

    def _pure(self, func: Any) -> bool:
        """No views, no mutation, no aliasing: a fresh tensor of the same shape is the same result."""
        pure = self._is_pure.get(func)
        if pure is None:
            schema = func._schema
            pure = self._is_pure[func] = not func.is_view and all(
                a.alias_info is None for a in (*schema.arguments, *schema.returns)
            )
        return pure


def _aliases_input(out: Any, args: tuple, kwargs: dict) -> bool:
    inputs = {id(st) for st in map(storage_of, op_tensors(args, kwargs)) if st is not None}
    return any(id(storage_of(t)) in inputs for t in op_tensors((out,), {}))


def _memo_key(func: Any, args: tuple, kwargs: dict) -> tuple | None:
    """A hashable key of everything a meta op's result depends on, or None if unsure."""
    parts: list[Any] = [func, torch.get_default_dtype()]  # factory ops without a dtype use it
    try:
        for value in (*args, *sorted(kwargs.items())):
            parts.append(_arg_key(value))
        key = tuple(parts)
        hash(key)
    except (TypeError, _Uncacheable):
        return None
    return key


class _Uncacheable(Exception):
    pass


def _arg_key(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        if (
            type(value) not in (torch.Tensor, nn.Parameter)
            or value.layout != torch.strided
            or not value.is_meta
        ):
            raise _Uncacheable
        return ("T", tuple(value.shape), value.stride(), value.dtype)
    if isinstance(value, (list, tuple)):
        return tuple(_arg_key(v) for v in value)
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        raise _Uncacheable
    return type(value), value  # 1, 1.0 and True are equal keys but promote to different dtypes


def _out_spec(out: Any) -> Any:
    """Shapes of a pure op's result, or None when it is not plain tensors and numbers."""
    if isinstance(out, torch.Tensor):
        strided = out.layout == torch.strided
        return InputTensorSpec(tuple(out.shape), out.dtype, out.stride()) if strided else None
    if isinstance(out, (tuple, list)):
        specs = [_out_spec(o) for o in out]
        return None if any(s is None and o is not None for s, o in zip(specs, out)) else type(out)(specs)
    return out if out is None or isinstance(out, (int, float, bool)) else None


def _rebuild(spec: Any) -> Any:
    if isinstance(spec, InputTensorSpec):
        assert spec.stride is not None  # memoised results always record strides
        return torch.empty_strided(spec.shape, spec.stride, dtype=spec.dtype, device="meta")
    if isinstance(spec, (tuple, list)):
        return type(spec)(_rebuild(s) for s in spec)
    return spec


_PLAIN = (type(None), bool, int, float, str, torch.dtype, torch.device, torch.memory_format)


def arg_specs(tree: Any) -> Any:
    """Shapes of a unit's arguments. Objects other than plain values (a transformers cache)
    belong to the traced run and become None: a unit timed alone starts without them."""

    def spec(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return InputTensorSpec(tuple(x.shape), x.dtype)
        return x if isinstance(x, _PLAIN) else None

    return tree_map(spec, tree)


def pack_saved(t: torch.Tensor) -> tuple:
    """Saved-for-backward tensor as its shape only: meta values are empty, and autograd then
    keeps nothing alive that an inference forward would have freed."""
    return tuple(t.shape), t.stride(), t.dtype


def unpack_saved(packed: tuple) -> torch.Tensor:
    """A fresh meta tensor of the saved shape, for the backward."""
    shape, stride, dtype = packed
    return torch.empty_strided(shape, stride, dtype=dtype, device="meta")


@functools.cache
def decomposes(func: Any) -> bool:
    """Whether the op ``func`` has a CompositeImplicitAutograd kernel (it decomposes into
    others, which the tracer then sees one by one)."""
    return func is not torch.ops.prim.device.default and torch._C._dispatch_has_kernel_for_dispatch_key(
        func.name(), torch._C.DispatchKey.CompositeImplicitAutograd
    )
