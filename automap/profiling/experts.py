"""Tracing transformers' mixture-of-experts layers on meta: eager experts (data-dependent shapes)
are traced as ``grouped_mm`` with the eager loop's FLOPs, and get their own implementation back
afterwards, error or not.
"""

from __future__ import annotations

import logging
from contextlib import ExitStack, contextmanager
from dataclasses import replace
from typing import Any, Iterator

from torch import nn

from automap.profiling.routed import stacked_count

from automap.profiling.result import Unit

log = logging.getLogger(__name__)

TRACEABLE = "grouped_mm"  # the implementation run while tracing in place of "eager"


@contextmanager
def traceable_experts(model: nn.Module) -> Iterator[None]:
    """Inside the block, every transformers model within ``model`` whose experts run ``eager``
    runs them as ``grouped_mm``; afterwards each has the implementations it had.

    Example:
        >>> with traceable_experts(model):   # a Mixtral built with experts_implementation="eager"
        ...     run_trace(model, ...)
    """
    with ExitStack() as stack:
        for module in model.modules():
            stack.enter_context(_switched(module))
        yield


@contextmanager
def _switched(module: nn.Module) -> Iterator[None]:
    before = _implementations(module)
    if not before or "eager" not in before.values():
        yield
        return
    try:
        module.set_experts_implementation({k: TRACEABLE if v == "eager" else v for k, v in before.items()})
    except (ValueError, KeyError, ImportError, RuntimeError) as exc:  # transformers refused: eager stands in
        log.debug(
            "%s keeps its eager experts while tracing (%s)", type(module).__name__, exc
        )  # dense models too
        yield
        return
    log.info(
        "tracing %s with its experts as %s (eager ones cannot run on meta)", type(module).__name__, TRACEABLE
    )
    try:
        yield
    finally:
        module.set_experts_implementation(before)


def _implementations(module: nn.Module) -> dict[str, Any] | None:
    """The model's experts implementations by sub-config ("" for its own), or None when it is
    not a transformers model that can say."""
    get = getattr(module, "get_experts_implementation", None)
    if get is None or not callable(getattr(module, "set_experts_implementation", None)):
        return None
    try:
        found = get()
    except AttributeError:  # a config without the attribute: not a model with experts
        return None
    return found if isinstance(found, dict) else None


# ------------------------------------------------------------------ routed experts as units


def routed_experts(model: nn.Module) -> dict[str, tuple[int, int]]:
    """The routed-experts modules of ``model``, in definition order: name -> (experts, experts
    per token). One is a child named ``experts`` of a mixture-of-experts block whose router
    says its ``top_k``: transformers' fused experts (``num_experts`` of them, weights in 3-D
    parameters) or a ``ModuleList`` of expert modules. A shared expert, which every token
    uses, is not one.

    Example:
        >>> routed_experts(mixtral)["model.layers.0.mlp.experts"]
        (8, 2)
    """
    found: dict[str, tuple[int, int]] = {}
    for name, block in model.named_modules():
        experts = getattr(block, "experts", None)
        count = _expert_count(experts)
        top_k = _top_k(block)
        if count and top_k and top_k < count:
            found[f"{name}.experts" if name else "experts"] = (count, top_k)
    return found


def with_routed(model: nn.Module, units: tuple[Unit, ...]) -> tuple[tuple[Unit, ...], tuple[str, ...]]:
    """``units`` with the routed-experts ones marked (``Unit.experts``,
    ``experts_per_token``), and the names of every routed-experts module of ``model``."""
    routed = routed_experts(model)
    marked = tuple(
        replace(u, experts=routed[u.name][0], experts_per_token=routed[u.name][1]) if u.name in routed else u
        for u in units
    )
    return marked, tuple(routed)


def _expert_count(experts: Any) -> int:
    """Experts in a list of them, or stacked in one module (the rule of
    :func:`automap.profiling.routed.stacked_count`, which the runtime streams by)."""
    if isinstance(experts, nn.ModuleList):
        return len(experts)
    return stacked_count(experts) if isinstance(experts, nn.Module) else 0


def _top_k(block: nn.Module) -> int:
    """The experts per token ``block``'s router picks (its own ``top_k``, its router's, or its
    config's ``num_experts_per_tok``); 0 when it says none."""
    for holder in (block, getattr(block, "gate", None), getattr(block, "router", None)):
        top_k = getattr(holder, "top_k", None)
        if isinstance(top_k, int) and top_k > 0:
            return top_k
    top_k = getattr(getattr(block, "config", None), "num_experts_per_tok", None)
    return top_k if isinstance(top_k, int) else 0
