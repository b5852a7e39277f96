"""Building a :class:`~automap.profiling.result.Profile`: the units found, the trace run (or
skipped, or stopped short), the figures assembled per unit, measured timings added. The package
face (``automap.profiling``) re-exports :func:`profile` and :func:`untraced_profile`."""

from __future__ import annotations

import logging
import warnings
from dataclasses import replace
from typing import Any, Iterable, Mapping, Sequence

import torch
from torch import nn

from automap.errors import ProfileError
from automap.progress import step
from automap.profiling.experts import with_routed
from automap.profiling.fallback import (
    eval_mode,
    fill_untraced,
    flop_weights,
    untraced_reasons,
    untraced_units,
)
from automap.profiling.inputs import ExampleInputs, default_example_inputs, split_inputs, to_meta
from automap.profiling.graph import build_graph
from automap.profiling.result import Profile, Unit
from automap.profiling.timing import measure_units
from automap.profiling.result import TraceResult
from automap.profiling.traced_run import run_trace
from automap.profiling.units import (
    all_named_tensors,
    assign_tensors,
    check_units,
    find_units,
    has_forward,
    stray_reads,
    tensor_bytes,
    tie_groups,
    unit_aliases,
)


log = logging.getLogger(__name__)


def profile(
    model: nn.Module,
    example_inputs: ExampleInputs | None = None,
    *,
    no_split: Iterable[str | type] | None = None,
    dtype: torch.dtype | None = None,
    units: Sequence[str] | None = None,
    seq_len: int = 128,
    batch: int = 1,
    backward: bool = True,
    measure: bool = False,
    device: str | torch.device | None = None,
    repeats: int = 5,
    guessed: str = "",
) -> Profile:
    """Profile ``model`` on the meta device.

    Args:
        model: any ``nn.Module``, with real weights or on meta. It is not changed.
        example_inputs: positional args (tuple) or keyword args (dict) for ``forward``; tensors
            may be on any device. Derived for common families when None (see
            :func:`default_example_inputs`); ``Profile.example`` says which were used.
        no_split: module classes (or class names) never to split; default: the model's
            ``_no_split_modules`` when it has them.
        dtype: count floating-point weights and activations at this dtype (the dtype the
            model will run in).
        units: explicit unit names (module names), overriding ``no_split`` (the keys of a
            user device map).
        seq_len, batch: size of derived example inputs.
        backward: also trace a backward pass on meta for ``Unit.train_flops``.
        measure: also time each unit on ``device`` (median of ``repeats``), one unit at a time.
        device: where to time units (``"cuda:0"``, ``"cpu"``); required with ``measure``.
        repeats: timed runs per unit.
        guessed: how ``example_inputs`` were derived when automap derived them (the description
            :func:`default_example_inputs` returns); "" when they are the user's. Derived
            inputs are a guess, so a forward failing on them falls back (see below).

    Returns:
        A :class:`Profile` with units in execution order.

    The forward is traced in eval mode (the model's own flags are put back). A unit whose
    forward cannot run on meta (``.item()``, data-dependent shapes, a meta kernel's dtype check)
    is planned from its weights, with ``Unit.untraced`` saying why (``profiling/fallback.py``).
    Without the user's example inputs, planning never depends on guessing them right: when the
    forward fails on the derived ones, or the model has no ``forward`` of its own (a
    ``ModuleDict``), the units traced before the failure keep their figures and the rest are
    planned from their weights, in definition order; ``Unit.untraced`` says why.

    Raises:
        ProfileError: ``no_split`` names a class the model lacks, ``units`` names a module it
            lacks, ``measure`` comes without a ``device``, or the forward failed on the user's
            example inputs for a reason other than meta tensors' limits (the message names the
            unit; the model's own error is its ``__cause__``).

    Example:
        >>> prof = automap.profile(torchvision.models.resnet50())
        >>> prof.units[0].name, prof.example
        ('conv1', 'image 1x3x224x224 (first conv)')
    """
    if measure and device is None:
        raise ProfileError("measure=True needs a device to time on; pass device='cuda:0' or device='cpu'")
    unit_names = find_units(model, no_split) if units is None else check_units(model, units)
    how = guessed or "given"
    if example_inputs is None and not has_forward(model):
        log.warning(
            "%s has no forward of its own: planning its %d units from their weights",
            type(model).__name__,
            len(unit_names),
        )
        return _without_trace(
            model,
            unit_names,
            dtype,
            f"{type(model).__name__} has no forward of its own (a "
            "container of modules), so no forward can be traced",
        )
    if example_inputs is None:
        example_inputs, how = default_example_inputs(model, seq_len, batch)
        guessed = how
    if example_inputs is None:
        warnings.warn(
            f"no example inputs for {type(model).__name__}: profiling bytes only, so plans balance "
            "memory, not compute; pass example_inputs=(...) for FLOP-aware plans",
            stacklevel=2,
        )
        return _without_trace(model, unit_names, dtype, "no example inputs were given or derivable")
    try:
        with step(f"automap: tracing {type(model).__name__}"):
            trace = _trace(model, example_inputs, unit_names, dtype, backward, measure, bool(guessed))
    except ProfileError as exc:
        if how == "given":
            raise
        raise ProfileError(
            f"{exc}. automap guessed these inputs ({how}); pass the model's own as "
            "example_inputs=(...) (automap plan: --input-shape or --example-inputs)"
        ) from exc
    log.info(
        "profiled %s on %s: %d units, %.3g forward FLOPs",
        type(model).__name__,
        how,
        len(unit_names),
        trace.total_flops,
    )
    prof = _assemble(model, unit_names, trace, dtype, how)
    if measure:
        prof = _with_timing(model, prof, trace, device, dtype, repeats)
    return prof


def untraced_profile(
    model: nn.Module,
    reason: str,
    *,
    units: Sequence[str] | None = None,
    no_split: Iterable[str | type] | None = None,
    dtype: torch.dtype | None = None,
    loose_homes: Mapping[str, str] | None = None,
) -> Profile:
    """What is known about ``model`` without running it: units (in definition order), the
    tensors each owns, their bytes, tie groups. FLOPs, activations and cuts are unknown (0), so
    plans balance by bytes; every unit's ``untraced`` is ``reason``.

    Args:
        model: any ``nn.Module``, real or on meta; its forward never runs.
        reason: why no trace ran, for the report.
        units, no_split, dtype: as for :func:`profile`.
        loose_homes: tensor name -> unit for tensors held outside every unit (what a trace
            learns from their first use); default: the first unit inside their holder.

    Raises:
        ProfileError: ``no_split`` names a class the model lacks, or ``units`` a module it lacks.

    Example:
        >>> untraced_profile(model, "the device map places every tensor", units=["0", "1"]).example
        ''
    """
    unit_names = find_units(model, no_split) if units is None else check_units(model, units)
    return _without_trace(model, unit_names, dtype, reason, loose_homes or {})


def _without_trace(
    model: nn.Module,
    unit_names: Sequence[str],
    dtype: torch.dtype | None,
    reason: str,
    loose_homes: Mapping[str, str] | None = None,
) -> Profile:
    prof = _assemble(model, unit_names, TraceResult(first_use=dict(loose_homes or {})), dtype, "")
    return replace(prof, units=untraced_units(prof.units, reason))


def _trace(
    model: nn.Module,
    example_inputs: ExampleInputs,
    unit_names: Sequence[str],
    dtype: torch.dtype | None,
    backward: bool,
    measure: bool,
    guessed: bool,
) -> TraceResult:
    # Meta copies made under a caller's inference_mode could not take part in a backward.
    with torch.inference_mode(False):
        args, kwargs = split_inputs(to_meta(example_inputs, dtype))
        state = {name: _meta_tensor(t, dtype) for name, t in all_named_tensors(model)}

        def run() -> TraceResult:
            return run_trace(
                model,
                state,
                args,
                kwargs,
                unit_names,
                backward=backward,
                record_inputs=measure,
                guessed=guessed,
            )

        if backward and model.training and not guessed:
            # The training forward the model will run: what dropout and BatchNorm's batch
            # statistics keep for the backward counts. Where it cannot run on these inputs (a
            # batch of 1 for BatchNorm), the eval forward below is traced instead.
            try:
                trace = run()
            except ProfileError:
                trace = None
            if trace is not None and not trace.stopped and not trace.failed:
                return trace
        with eval_mode(model):
            return run()


def _meta_tensor(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    meta = to_meta(t, dtype)
    # Every floating parameter takes part in the backward, as in full training.
    if isinstance(t, nn.Parameter) and meta.is_floating_point():
        meta.requires_grad_(True)
    return meta


def _assemble(
    model: nn.Module, unit_names: Sequence[str], trace: TraceResult, dtype: torch.dtype | None, how: str
) -> Profile:
    owned = assign_tensors(model, unit_names, trace.order, trace.first_use)
    unreached = [n for n in unit_names if n not in trace.calls]
    ordered = list(trace.order) + unreached
    # Units a stopped forward never reached are untraced, not uncalled.
    uncalled = unreached if trace.order and not trace.stopped else []
    tensors = dict(all_named_tensors(model, remove_duplicate=False))
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    aliases = unit_aliases(model, unit_names)
    units = tuple(_unit(name, owned[name], tensors, params, aliases[name], trace, dtype) for name in ordered)
    reasons = untraced_reasons(units, trace.failed, _stopped(trace, how), trace.interrupted)
    if reasons:
        units = fill_untraced(units, reasons, flop_weights(model, units))
        first, why = next(iter(reasons.items()))
        log.warning(
            "%d unit(s) of %s are planned from their weights, without a trace, first %r: %s",
            len(reasons),
            type(model).__name__,
            first,
            why,
        )
    # A unit whose tensors all belong to units that ran (T5's tied `shared` embedding) misses nothing.
    uncalled = [u.name for u in units if u.name in uncalled and (u.tensors or u.loose)]
    if uncalled:
        log.warning(
            "%d unit(s) of %s never ran in the traced forward: %s",
            len(uncalled),
            type(model).__name__,
            ", ".join(uncalled[:5]),
        )
    units, routed = with_routed(model, units)
    repeated = [n for n, c in trace.calls.items() if c > 1]
    if repeated:
        log.info("unit(s) called more than once: %s", ", ".join(repeated[:5]))
    return Profile(
        model_name=type(model).__name__,
        units=units,
        tie_groups=tuple(tie_groups(model)),
        graph=build_graph(units, trace.flows),
        example=how,
        uncalled=tuple(uncalled),
        flows=tuple(trace.flows),
        dtype=str(dtype).removeprefix("torch.") if dtype is not None else "",
        strays=tuple(
            stray_reads(model, unit_names, trace.readers, (n for _, loose in owned.values() for n in loose))
        ),
        routed=routed,
        **_peaks(trace, model.training),
    )


def _peaks(trace: TraceResult, training: bool) -> dict[str, Any]:
    """The profile's activation peaks: unknown (0) when the forward stopped before its end."""
    if trace.stopped:
        return {"training": training}
    return {
        "forward_peak_bytes": trace.forward_peak,
        "train_peak_bytes": trace.train_peak,
        "training": training,
    }


def _stopped(trace: TraceResult, how: str) -> str:
    """Why the units a forward that ended early did not run, as one clause ("" if it ran through)."""
    if not trace.stopped:
        return ""
    if trace.guess_failed:
        return (
            f"the forward failed on the guessed example inputs ({how}) {trace.stopped}; pass "
            "example_inputs=(...) to trace it (automap plan: --input-shape or --example-inputs)"
        )
    return f"the traced forward stopped before it ran, {trace.stopped}"


def _unit(
    name: str,
    owned: tuple[list[str], list[str]],
    tensors: Mapping[str, torch.Tensor],
    params: set[str],
    aliases: tuple[str, ...],
    trace: TraceResult,
    dtype: torch.dtype | None,
) -> Unit:
    names, loose = owned
    by_dtype: dict[str, int] = {}
    for n in names:
        key = str(tensors[n].dtype).removeprefix("torch.")
        by_dtype[key] = by_dtype.get(key, 0) + tensor_bytes(tensors[n], None)
    return Unit(
        name=name,
        tensors=tuple(names),
        loose=tuple(loose),
        param_bytes=sum(tensor_bytes(tensors[n], dtype) for n in names if n in params),
        buffer_bytes=sum(tensor_bytes(tensors[n], dtype) for n in names if n not in params),
        flops=trace.flops.get(name, 0),
        ops=trace.ops.get(name, 0),
        train_flops=trace.train_flops.get(name, 0),
        output_bytes=trace.output_bytes.get(name, 0),
        peak_activation_bytes=trace.peak_bytes.get(name, 0),
        calls=trace.calls.get(name, 0),
        aliases=aliases,
        dtype_bytes=by_dtype,
        input_bytes=trace.input_bytes.get(name, 0),
    )


def _with_timing(
    model: nn.Module,
    prof: Profile,
    trace: TraceResult,
    device: str | torch.device | None,
    dtype: torch.dtype | None,
    repeats: int,
) -> Profile:
    with eval_mode(model):  # as traced: BatchNorm of a batch of 1, no dropout
        seconds = measure_units(model, trace.unit_inputs, device, dtype=dtype, repeats=repeats)
    units = tuple(replace(u, seconds=seconds.get(u.name)) for u in prof.units)
    return replace(prof, units=units, measured_device=str(torch.device(device)) if device is not None else "")
