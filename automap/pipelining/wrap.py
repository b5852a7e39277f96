"""``automap.pipeline``: a dispatched model (or one placed here from a plan) wrapped in a
:class:`~automap.pipelining.runner.Pipeline` over its plan's stages; the package face
(``automap.pipelining``) re-exports it."""

from __future__ import annotations

import logging
from typing import Any, Mapping

import torch
from torch import nn

from automap.runtime import state_of
from automap.errors import PipelineError
from automap.kinds import kind_of
from automap.pipelining.runner import PIPELINED, Chunks, Pipeline
from automap.pipelining.stages import Stage, plan_stages
from automap.planning import Plan
from automap.profiling.units import all_named_tensors

log = logging.getLogger(__name__)


def pipeline(
    model: nn.Module,
    plan: Plan | None = None,
    *,
    chunks: Chunks = 4,
    devices: Mapping[str, str | torch.device] | None = None,
) -> Pipeline:
    """Run ``model`` as a micro-batch pipeline over ``plan``'s stages (GPipe fill-drain).

    Args:
        model: a model dispatched by :func:`automap.dispatch`, or (with ``devices``) one you
            placed yourself.
        plan: the plan whose stages to pipeline; default: the plan ``model`` was dispatched with.
        chunks: micro-batches per call, or ``"auto"`` to choose the count from the plan's
            profile for each batch size (the tutorial's ``split_size`` sweep, predicted).
        devices: run the plan's devices on these real ones instead, e.g. ``{"cuda:0": "cpu",
            "cuda:1": "cpu"}`` to run a two-GPU plan on a CPU-only machine, or
            ``{"cuda:0": "cuda:0", "cuda:1": "cpu"}`` for one GPU plus the CPU. Units are moved
            there (their tensors' ``.data``, so optimizers stay valid); only for models that
            are not dispatched.

    Returns:
        A :class:`Pipeline` module: ``pipe(x)`` gives ``model(x)``'s outputs (joined along the
        batch) and, through ``backward``, its gradients. ``pipe.close()`` unhooks it.

    Raises:
        PipelineError: bad ``chunks``; no plan; the plan offloads weights; ``devices`` misses a
            plan device or is combined with a dispatched model; the model is already pipelined.

    Example:
        >>> plan = automap.plan(model, max_memory={0: "50MB", 1: "50MB"}, example_inputs=(x,))
        >>> pipe = automap.pipeline(model, plan, chunks=4, devices={"cuda:0": "cpu", "cuda:1": "cpu"})
        >>> torch.testing.assert_close(pipe(x), model(x))
    """
    _check_chunks(chunks)
    if model in PIPELINED:
        raise PipelineError(
            f"{type(model).__name__} is already pipelined; call .close() on its Pipeline first"
        )
    plan = _resolve_plan(model, plan, devices)
    if plan.offloaded_units:
        raise PipelineError(
            f"the plan streams {len(plan.offloaded_units)} offloaded unit(s) (first {plan.offloaded_units[0]!r}) "
            "from CPU/disk; pipelining would stream them once per micro-batch. Plan without offload "
            "(raise max_memory) or run the dispatched model unpipelined"
        )
    stages = plan_stages(plan)
    real = _real_devices(plan, stages, devices)
    if devices is not None:
        _place_units(model, plan, stages, real)
    _warn_batch_norm(model)
    pipe = Pipeline(model, stages, real, chunks, plan)
    PIPELINED[model] = pipe
    log.info(
        "pipelining %s over %d stage(s) (%s), chunks=%s",
        type(model).__name__,
        len(stages),
        " -> ".join(str(d) for d in real),
        chunks,
    )
    return pipe


def _check_chunks(chunks: Chunks) -> None:
    if chunks == "auto":
        return
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise PipelineError(f"chunks must be a positive int or 'auto', got {chunks!r}; e.g. chunks=4")


def _resolve_plan(model: nn.Module, plan: Plan | None, devices: Mapping[str, Any] | None) -> Plan:
    state = state_of(model)
    if state is not None and devices is not None:
        raise PipelineError(
            f"{type(model).__name__} is dispatched, so its units already run where the plan "
            "says; drop devices=..., or undispatch it first to place it with devices"
        )
    if state is None and devices is None:
        raise PipelineError(
            f"{type(model).__name__} is not dispatched; call automap.dispatch(model, plan) "
            "first, or pass devices={'cuda:0': 'cpu', 'cuda:1': 'cpu'} to run the plan's "
            "stages on devices of your choice"
        )
    if plan is None:
        if state is None:
            raise PipelineError("no plan given; pass the Plan from automap.plan(model, ...)")
        return state.plan
    if state is not None and (
        state.plan.placement != plan.placement
        or [u.name for u in state.plan.units] != [u.name for u in plan.units]
    ):
        raise PipelineError(
            f"{type(model).__name__} was dispatched with another plan; omit plan= to use that one"
        )
    return plan


def _real_devices(
    plan: Plan, stages: tuple[Stage, ...], devices: Mapping[str, str | torch.device] | None
) -> tuple[torch.device, ...]:
    if devices is None:
        return tuple(_indexed(torch.device(s.device)) for s in stages)
    missing = sorted({s.device for s in stages} - set(devices))
    if missing:
        raise PipelineError(
            f"devices={dict(devices)!r} does not say where to run the plan's {missing}; "
            f"give a real device for each of {[s.device for s in stages]}"
        )
    return tuple(_indexed(torch.device(devices[s.device])) for s in stages)


def _indexed(device: torch.device) -> torch.device:
    """``cuda`` as ``cuda:N`` (the current one), so that stages on one GPU compare equal."""
    kind = kind_of(device)
    if kind.indexed and device.index is None:
        return torch.device(device.type, kind.torch_api().current_device())
    return device


def _place_units(
    model: nn.Module, plan: Plan, stages: tuple[Stage, ...], real: tuple[torch.device, ...]
) -> None:
    tensors = dict(all_named_tensors(model, remove_duplicate=False))
    where = {name: device for stage, device in zip(stages, real) for name in stage.units}
    for unit in plan.units:
        for name in unit.tensors:
            if name not in tensors:
                raise PipelineError(
                    f"the plan names tensor {name!r} that {type(model).__name__} lacks; plan this model again"
                )
            if tensors[name].device != where[unit.name]:
                tensors[name].data = tensors[name].data.to(where[unit.name])


def _warn_batch_norm(model: nn.Module) -> None:
    norms = [n for n, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if norms:
        log.warning(
            "%s has %d BatchNorm layer(s) (first %r): in training each normalises one micro-batch "
            "(statistics differ from the whole batch's, as in GPipe); in eval() outputs match exactly",
            type(model).__name__,
            len(norms),
            norms[0],
        )
