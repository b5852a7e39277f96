"""Profiling models as users hand them over: traced in eval mode (flags put back), and units whose
forward meta cannot run (a :class:`MetaLimit`) planned from their weights, as are those a forward
on guessed inputs did not reach. Any other error on the user's own inputs is a ProfileError.
"""

from __future__ import annotations

import functools
import re
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, Callable, Collection, Iterator, Mapping, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_map

from automap.interrupts import completed
from automap.profiling.metaops import tensors_in
from automap.profiling.result import Unit

# A message about meta tensors: "cannot be called on meta tensors", "the 'Meta' backend",
# "Cannot copy out of meta tensor", "not on the expected device meta" ("metadata" is not one).
# Or about tensors on two devices, which some ops say without naming them ("meshgrid expects all
# tensors to have the same device"): in a trace every given tensor is on meta, so the other one
# was made on a real device by the forward itself (an anchor grid, a coordinate table).
_ABOUT_META = re.compile(r"\bmeta\b|same device|expected device", re.IGNORECASE)
_REASON_CHARS = 200  # enough for the error's first line; the report wraps it


class MetaLimit(RuntimeError):
    """Something a forward does that meta tensors cannot: read a value, or run an op whose
    meta kernel is missing, data-dependent, or narrower than its real kernel."""


@contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """Every module of ``model`` with ``training=False`` inside the block, each flag as it was
    after it (also when the block raises). Flags are set directly: no ``train()`` override runs."""
    flags = [(m, m.training) for m in model.modules()]
    try:
        for module, _ in flags:
            module.training = False
        yield
    finally:
        for module, flag in flags:
            module.training = flag


def describe(exc: BaseException) -> str:
    """``"RuntimeError: <first line>"`` (a :class:`MetaLimit`'s message alone), short enough
    for a report line."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    if len(text) > _REASON_CHARS:
        text = text[: _REASON_CHARS - 3].rstrip() + "..."
    if isinstance(exc, MetaLimit):
        return text
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def is_meta_limit(exc: BaseException) -> bool:
    """Whether ``exc`` says what meta tensors cannot do (see the module docstring)."""
    return isinstance(exc, MetaLimit) or (
        isinstance(exc, (RuntimeError, NotImplementedError, TypeError)) and bool(_ABOUT_META.search(str(exc)))
    )


def meta_limit(func: Any, args: tuple, kwargs: dict, exc: Exception) -> MetaLimit | None:
    """The :class:`MetaLimit` an aten op's failure on meta tensors is, or None when it is an
    error the real kernel would raise too (a shape mismatch).

    Example:
        >>> meta_limit(torch.ops.my_kernels.fused_mm.default, (a, b), {}, exc)
        MetaLimit('the meta kernel of my_kernels.fused_mm rejects float32 but runs at bfloat16 ...')
    """
    if isinstance(exc, MetaLimit):
        return exc
    name = str(func).removesuffix(".default")
    if isinstance(exc, NotImplementedError) or is_meta_limit(exc):
        return MetaLimit(f"{name} cannot run on meta tensors ({describe(exc)})")
    if not isinstance(exc, RuntimeError):
        return None
    for dtype in (torch.bfloat16, torch.float16):
        if _runs_at(func, args, kwargs, dtype):
            given = sorted(
                {
                    str(t.dtype).removeprefix("torch.")
                    for t in tensors_in((args, kwargs))
                    if t.dtype in (torch.float32, torch.float64)
                }
            )
            return MetaLimit(
                f"the meta kernel of {name} rejects {'/'.join(given)} but runs at "
                f"{str(dtype).removeprefix('torch.')} ({describe(exc)})"
            )
    return None


def _runs_at(func: Any, args: tuple, kwargs: dict, dtype: torch.dtype) -> bool:
    """Whether ``func`` runs on meta with its float32/float64 tensors cast to ``dtype``."""
    wide = (torch.float32, torch.float64)
    if not any(t.dtype in wide for t in tensors_in((args, kwargs))):
        return False

    def cast(x: Any) -> Any:
        return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_meta and x.dtype in wide else x

    try:
        func(*tree_map(cast, args), **tree_map(cast, kwargs))
    except Exception:  # noqa: BLE001 - any failure means: not a dtype limit of the meta kernel
        return False
    return True


@contextmanager
def stand_ins(
    modules: Mapping[str, nn.Module], units: Sequence[str], failed: dict[str, str]
) -> Iterator[None]:
    """Guard each unit's forward while tracing: a unit that fails with a meta limit (or fails
    at all once another unit stood in) returns a stand-in, and ``failed`` gets its reason.

    The forwards are instance attributes only inside the block; afterwards every module has
    the ``forward`` it had before (also when the block raises).
    """
    saved: list[tuple[nn.Module, Any]] = []
    seen: set[int] = set()
    try:
        for name in units:
            module = modules[name]
            if id(module) in seen:
                continue
            seen.add(id(module))
            saved.append((module, module.__dict__.get("forward", _ABSENT)))
            module.forward = _guarded(module.forward, name, failed)
        yield
    finally:
        completed(lambda: _put_back(saved))  # every forward, whatever comes meanwhile


def _put_back(saved: list[tuple[nn.Module, Any]]) -> None:
    for module, before in reversed(saved):
        if before is _ABSENT:
            module.__dict__.pop("forward", None)  # an interrupt may have come before it was set
        else:
            module.forward = before


_ABSENT = object()


def _guarded(forward: Callable[..., Any], name: str, failed: dict[str, str]) -> Callable[..., Any]:
    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return forward(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - only meta limits and their consequences are kept
            if not failed and not is_meta_limit(exc):
                raise
            reason = (
                describe(exc)
                if is_meta_limit(exc)
                else f"{describe(exc)}, after the stand-in for {next(iter(failed))!r}"
            )
            failed.setdefault(name, reason)
            return stand_in(args, kwargs)

    return run


def stand_in(args: tuple, kwargs: Mapping[str, Any]) -> torch.Tensor | None:
    """What a unit that could not run returns while tracing: a copy of its first tensor
    argument (a copy, so the unit produces it and gradients still flow to earlier units)."""
    found = tensors_in((args, dict(kwargs)))
    return found[0].clone() if found else None


def untraced_reasons(
    units: Sequence[Unit], failed: Mapping[str, str], stopped: str, interrupted: Collection[str] = ()
) -> dict[str, str]:
    """Why each unit the trace did not measure was not: it stood in, or the forward ended
    (``stopped``: why, as a clause) before it ran or while it ran (``interrupted``)."""
    reasons = {}
    for unit in units:
        if unit.name in failed:
            reasons[unit.name] = f"its forward cannot run on meta: {failed[unit.name]}"
        elif stopped and (unit.calls == 0 or unit.name in interrupted):
            reasons[unit.name] = stopped
    return reasons


def fill_untraced(
    units: Sequence[Unit], reasons: Mapping[str, str], weights: Mapping[str, int]
) -> tuple[Unit, ...]:
    """``units`` with each unit named in ``reasons`` planned from its weights: FLOPs estimated
    from the shapes of its weights (see the module docstring), ``untraced`` set.

    Args:
        units: the profile's units.
        reasons: unit name -> why the trace did not measure it.
        weights: unit name -> elements of its weights that multiply every input position
            (:func:`flop_weights`).

    Example:
        >>> fill_untraced(prof.units, {"model.layers.0": "its forward cannot run on meta: ..."},
        ...               flop_weights(model, prof.units))
    """
    traced = [u for u in units if u.name not in reasons and u.calls and u.flops and weights.get(u.name)]
    rate = sum(u.flops for u in traced) / sum(weights[u.name] for u in traced) if traced else 0.0
    trained = [u for u in traced if u.train_flops]
    ratio = sum(u.train_flops for u in trained) / sum(u.flops for u in trained) if trained else 0.0
    return tuple(
        _estimated(u, reasons[u.name], rate * weights.get(u.name, 0), ratio) if u.name in reasons else u
        for u in units
    )


def _estimated(unit: Unit, reason: str, estimate: float, train_ratio: float) -> Unit:
    flops = max(unit.flops, round(estimate))
    return replace(
        unit,
        flops=flops,
        train_flops=max(unit.train_flops, round(flops * train_ratio)),
        untraced=reason,
        flops_estimated=round(estimate) > unit.flops,
    )


# Modules whose weights are looked up, not multiplied: no FLOPs per element.
_LOOKUPS = (nn.Embedding, nn.EmbeddingBag)


def flop_weights(model: nn.Module, units: Sequence[Unit]) -> dict[str, int]:
    """Per unit, the elements of its weights that a forward multiplies with every input
    position: parameters of two or more dimensions (linear, convolution and attention
    matrices, fused experts), except those of embedding tables, which are looked up. Vectors
    (biases, norms) and buffers add no FLOPs to speak of.

    Example:
        >>> flop_weights(nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 2)), prof.units)
        {'0': 0, '1': 8}
    """
    modules = dict(model.named_modules(remove_duplicate=False))
    params = dict(model.named_parameters(remove_duplicate=False))
    counts = {}
    for unit in units:
        counts[unit.name] = sum(
            params[n].numel()
            for n in unit.tensors
            if n in params
            and params[n].dim() >= 2
            and not isinstance(modules.get(n.rpartition(".")[0]), _LOOKUPS)
        )
    return counts


def untraced_units(units: Sequence[Unit], reason: str) -> tuple[Unit, ...]:
    """``units`` marked as planned without any trace, for ``reason``."""
    return tuple(replace(u, untraced=reason) for u in units)
