"""Meta rules for ops whose meta kernel is narrower than their real kernels, and FLOP formulas
for ops ``FlopCounterMode`` lacks: grouped matrix multiplication (exact routed work).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

_GROUPED_MM = torch.ops.aten._grouped_mm


def grouped_mm_shape(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor | None) -> tuple[int, ...]:
    """The output shape of ``_grouped_mm(mat_a, mat_b, offs)``.

    The four layouts: 2-D x 3-D (rows split into groups, one weight per group), 3-D x 2-D
    (columns of ``mat_b`` split), 2-D x 2-D (the contraction split: one output per group) and
    3-D x 3-D (a batched matmul, no ``offs``).

    Raises:
        RuntimeError: the contraction or group dimensions do not match, as the real kernels say.

    Example:
        >>> grouped_mm_shape(torch.empty(12, 16), torch.empty(4, 16, 24), torch.empty(4))
        (12, 24)
    """
    if mat_a.dim() not in (2, 3) or mat_b.dim() not in (2, 3):
        raise RuntimeError(f"grouped_mm takes 2-D or 3-D matrices, got {mat_a.dim()}-D and {mat_b.dim()}-D")
    if mat_a.shape[-1] != mat_b.shape[-2]:
        raise RuntimeError(
            f"grouped_mm: contraction dimensions differ ({tuple(mat_a.shape)} x {tuple(mat_b.shape)})"
        )
    groups = offs.shape[0] if offs is not None else None
    if mat_a.dim() == 3 and mat_b.dim() == 3:
        if mat_a.shape[0] != mat_b.shape[0]:
            raise RuntimeError(f"grouped_mm: batch sizes differ ({mat_a.shape[0]} and {mat_b.shape[0]})")
        return mat_a.shape[0], mat_a.shape[1], mat_b.shape[2]
    if groups is None:
        raise RuntimeError("grouped_mm needs offs when a matrix is 2-D")
    stacked = mat_b if mat_b.dim() == 3 else mat_a if mat_a.dim() == 3 else None
    if stacked is not None and stacked.shape[0] != groups:
        raise RuntimeError(f"grouped_mm: {groups} offsets for {stacked.shape[0]} matrices")
    if mat_b.dim() == 3:
        return mat_a.shape[0], mat_b.shape[2]
    if mat_a.dim() == 3:
        return mat_a.shape[1], mat_b.shape[1]
    return groups, mat_a.shape[0], mat_b.shape[1]


def grouped_mm_flops(
    mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor | None = None, *_: Any, **__: Any
) -> int:
    """FLOPs of ``_grouped_mm``: 2 per multiply-add, summed over the groups (see the module
    docstring: exact without the values of ``offs``)."""
    if mat_a.dim() == 3 and mat_b.dim() == 2:
        # Each of the G matrices of mat_a meets its own columns of mat_b: m * k * (all columns).
        return 2 * mat_a.shape[1] * mat_b.numel()
    # 2-D x 3-D: every row meets one k x n matrix; 2-D x 2-D: the groups split k; 3-D x 3-D: bmm.
    return 2 * mat_a.numel() * mat_b.shape[-1]


def run_op(func: Any, args: tuple, kwargs: dict) -> Any:
    """``func(*args, **kwargs)`` on meta tensors; where its meta kernel refuses what a real kernel
    runs and a rule here knows the result's shape, a meta tensor of that shape instead."""
    try:
        return func(*args, **kwargs)
    except RuntimeError:
        rule = _RULES.get(func._overloadpacket)
        if rule is None or not all(a.is_meta for a in args if isinstance(a, torch.Tensor)):
            raise
        return rule(*args, **kwargs)


def _grouped_mm_meta(
    mat_a: torch.Tensor,
    mat_b: torch.Tensor,
    offs: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The output of ``_grouped_mm`` from the shapes alone, in the dtype the real kernel returns."""
    shape = grouped_mm_shape(mat_a, mat_b, offs)
    if bias is not None:
        raise RuntimeError("grouped_mm does not take a bias")
    return torch.empty(shape, dtype=out_dtype or mat_a.dtype, device="meta")


_RULES: dict[Any, Callable[..., torch.Tensor]] = {_GROUPED_MM: _grouped_mm_meta}

FLOP_FORMULAS: dict[Any, Callable[..., int]] = {_GROUPED_MM: grouped_mm_flops}


def flop_formulas() -> dict[Any, Callable[..., int]]:
    """``FlopCounterMode``'s formulas by op overload packet, with the ones above added."""
    from torch.utils.flop_counter import flop_registry  # imports triton: not at `import automap`

    return {**flop_registry, **FLOP_FORMULAS}
