"""The traced run (:func:`run_trace`): one forward (and backward) of a model on the meta device
under a :class:`~automap.profiling.tracer.Tracer`, with each unit hooked, units whose forward meta
cannot run standing in (``fallback.py``), eager experts run as grouped ones (``experts.py``), and
attention counted as torch's CPU kernel choice runs it (fused, or the math path's scores)."""

from __future__ import annotations

import gc
import logging
from contextlib import ExitStack, contextmanager
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
from torch import nn, overrides
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode
from torch.utils import _python_dispatch

from automap.errors import ProfileError
from automap.interrupts import completed, deferred
from automap.profiling.experts import traceable_experts
from automap.profiling.fallback import describe, is_meta_limit, stand_ins
from automap.profiling.metaops import tensors_in, unpack_saved
from automap.profiling.result import TraceResult
from automap.profiling.tracer import Tracer
from automap.profiling.units import call_with, has_user_hooks

log = logging.getLogger(__name__)


_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_MATH = 0  # torch's SDPBackend.MATH: the score matrix is built, and kept for a backward


class FusedAttention(TorchFunctionMode):
    """Counts ``scaled_dot_product_attention`` as the CPU runs it: where torch picks a fused
    kernel for these inputs, its output stays and the score matrix the meta (math) path builds is
    never alive at once; where it picks the math path (attention dropout in training), every
    intermediate counts, and those autograd saves stay until the backward. CUDA fuses in more
    cases (dropout included): on a GPU this can over-count a training forward."""

    def __init__(self, tracer: Tracer) -> None:
        super().__init__()
        self.tracer = tracer

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is not F.scaled_dot_product_attention:
            return func(*args, **(kwargs or {}))
        given = {**dict(zip(_SDPA_ARGS, args)), **(kwargs or {})}
        if not self._fused_on_cpu(given):
            return func(*args, **(kwargs or {}))
        self.tracer.fused += 1
        try:
            out = func(*args, **(kwargs or {}))
        finally:
            self.tracer.fused -= 1
        self.tracer.fused_output(out)
        inputs = [given.get(n) for n in _SDPA_ARGS[:3]]
        if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs):
            # The fused kernel saves its inputs, its output and one float per query row
            # (logsumexp) for the backward, in place of the score matrix.
            for t in [*inputs, out]:
                if isinstance(t, torch.Tensor):
                    self.tracer.pack_saved(t)
            self.tracer.keep(out.shape[:-1].numel() * 4)
        return out

    def _fused_on_cpu(self, given: dict[str, Any]) -> bool:
        """Whether torch's CPU kernel choice for these (meta) arguments, by name, is a fused
        kernel: asked with CPU tensors of the same shapes, strides and dtypes (allocated, never
        written)."""

        def on_cpu(t: Any) -> Any:
            if not isinstance(t, torch.Tensor):
                return t
            host = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
            return host.requires_grad_(t.requires_grad) if host.is_floating_point() else host

        try:
            with self.tracer.probing():
                q, k, v, mask = (on_cpu(given.get(n)) for n in _SDPA_ARGS[:4])
                choice = torch._fused_sdp_choice(
                    q,
                    k,
                    v,
                    mask,
                    float(given.get("dropout_p", 0.0)),
                    bool(given.get("is_causal", False)),
                    scale=given.get("scale"),
                    enable_gqa=bool(given.get("enable_gqa", False)),
                )
        except (RuntimeError, TypeError, ValueError):  # arguments torch would refuse: the call says so itself
            return True
        return choice != _MATH


def run_trace(
    model: nn.Module,
    state: Mapping[str, torch.Tensor],
    args: tuple,
    kwargs: dict,
    units: Sequence[str],
    *,
    backward: bool,
    record_inputs: bool,
    keep_output: bool = False,
    guessed: bool = False,
) -> TraceResult:
    """Run ``model`` with ``state`` (meta tensors) on meta inputs and measure every unit.

    Args:
        model: the model; its own tensors are not used (``functional_call`` swaps in ``state``).
        state: meta tensors for every parameter and buffer name.
        args, kwargs: meta example inputs.
        units: unit names to hook.
        backward: also run a backward pass for ``train_flops``.
        record_inputs: keep the shapes each unit was called with (for timing).
        keep_output: return the forward's output too (``TraceResult.output``): the storages it
            keeps alive, such as a generation cache, are then still in ``TraceResult.producers``.
        guessed: the inputs were derived by automap, not given: a forward failing on them ends
            the trace there (``guess_failed``) instead of raising.

    Returns:
        A :class:`TraceResult`.

    A unit whose forward meta cannot run stands in (``profiling/fallback.py``) and is listed in
    ``failed``; a meta limit between units, or any error on ``guessed`` inputs, ends the forward
    early, said in ``stopped``.

    Hooks the user registered on the model's modules are left out (``units.computes_the_model``:
    a feature collector must not see meta tensors); a forward that stops or fails without them
    runs again with them, as they are then part of its computation (a hook reshaping an input).

    Raises:
        ProfileError: the forward failed otherwise; the message says in which unit.
    """
    options = dict(backward=backward, record_inputs=record_inputs, keep_output=keep_output, guessed=guessed)
    try:
        result = _run_once(model, state, args, kwargs, units, user_hooks=False, **options)
    except ProfileError:
        if not has_user_hooks(model):
            raise
        return _run_once(model, state, args, kwargs, units, user_hooks=True, **options)
    if result.stopped and has_user_hooks(model):
        again = _run_once(model, state, args, kwargs, units, user_hooks=True, **options)
        if not again.stopped:
            log.info(
                "the forward of %s needs the hooks registered on it: traced with them", type(model).__name__
            )
            return again
    return result


def _run_once(
    model: nn.Module,
    state: Mapping[str, torch.Tensor],
    args: tuple,
    kwargs: dict,
    units: Sequence[str],
    *,
    backward: bool,
    record_inputs: bool,
    keep_output: bool,
    guessed: bool,
    user_hooks: bool,
) -> TraceResult:
    tracer = Tracer(state, record_inputs, backward)
    tracer.add_inputs((args, kwargs))
    handles: list[Any] = []
    try:
        output, forward_flops = _traced(
            model,
            state,
            args,
            kwargs,
            units,
            tracer,
            handles,
            backward=backward,
            guessed=guessed,
            user_hooks=user_hooks,
        )
    finally:
        interrupt: BaseException | None = None
        while handles:  # again when an interrupt came at the very call, before it held the handlers
            try:
                _remove(handles)
            except Exception:
                raise
            except (
                BaseException
            ) as exc:  # KeyboardInterrupt, SystemExit from a handler: raised once they are gone
                interrupt = interrupt or exc
        if interrupt is not None:
            raise interrupt
    result = tracer.finish(forward_flops)
    if keep_output:
        result.output, result.producers = output, tracer.producers()
    return result


def _traced(
    model: nn.Module,
    state: Mapping[str, torch.Tensor],
    args: tuple,
    kwargs: dict,
    units: Sequence[str],
    tracer: Tracer,
    handles: list[Any],
    *,
    backward: bool,
    guessed: bool,
    user_hooks: bool,
) -> tuple[Any, int]:
    """The traced forward (and backward): the tracer's hooks on ``units``, listed in ``handles``
    for the caller to remove, and torch's modes around it; its output and forward FLOPs."""
    modules = dict(model.named_modules(remove_duplicate=False))
    attention = FusedAttention(tracer)
    with ExitStack() as stack:
        stack.callback(_leave_modes, tracer, attention)
        if gc.isenabled():
            # Tens of thousands of meta tensors and autograd nodes make each cyclic collection
            # slow; reference counting alone frees them (and tells the live bytes).
            gc.disable()
            stack.callback(gc.enable)
        with deferred():  # each hook registered and listed for removal together
            for name in units:
                handles.append(
                    modules[name].register_forward_pre_hook(tracer.pre_hook(name), with_kwargs=True)
                )
                handles.append(modules[name].register_forward_hook(tracer.post_hook(name), with_kwargs=True))
        stack.enter_context(torch.inference_mode(False))
        stack.enter_context(torch.enable_grad() if backward else torch.no_grad())
        if backward:
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(tracer.pack_saved, unpack_saved))
        stack.enter_context(traceable_experts(model))  # eager experts cannot run on meta (experts.py)
        stack.enter_context(stand_ins(modules, units, tracer.result.failed))
        stack.enter_context(_entered(tracer, _python_dispatch._get_current_dispatch_mode_stack))
        stack.enter_context(_entered(attention, overrides._get_current_function_mode_stack))
        tracer.begin(None)
        output = forward_of(model, state, args, kwargs, tracer, guessed, user_hooks)
        tracer.add_outputs(output)
        forward_flops = tracer.total_flops
        if backward and not tracer.result.stopped:
            backward_of(output, tracer)
    return output, forward_flops


def _remove(handles: list[Any]) -> None:
    """Remove the trace's hooks, all of them, whatever comes (then forget them)."""
    completed(lambda: [handle.remove() for handle in handles])
    handles.clear()


@contextmanager
def _entered(mode: Any, modes: Callable[[], list[Any]]) -> Iterator[None]:
    """Inside ``mode``; on the way out it is popped only if still on top of its stack (``modes``):
    an interrupt inside torch's own temporary pop of it (while it handles a call) leaves it off
    already, and popping again would raise from an empty stack instead of the interrupt."""
    mode.__enter__()
    try:
        yield
    finally:
        if modes()[-1:] == [mode]:
            mode.__exit__(None, None, None)


def _leave_modes(tracer: Tracer, attention: FusedAttention) -> None:
    """Take the trace's modes off torch's global stacks if they are still there: a mode's own
    ``__exit__`` interrupted (Ctrl-C) before it popped itself would leave every later torch
    call of the process traced."""
    while _python_dispatch._get_current_dispatch_mode_stack()[-1:] == [tracer]:
        _python_dispatch._pop_mode()
    while overrides._get_current_function_mode_stack()[-1:] == [attention]:
        overrides._pop_mode()


def forward_of(
    model: nn.Module,
    state: Mapping[str, torch.Tensor],
    args: tuple,
    kwargs: dict,
    tracer: Tracer,
    guessed: bool,
    user_hooks: bool = False,
) -> Any:
    try:
        return call_with(model, state, args, kwargs, user_hooks=user_hooks)
    except Exception as exc:  # noqa: BLE001 - re-raised with the unit where it happened
        result = tracer.result
        failed = result.failed
        if is_meta_limit(exc) or failed or guessed:
            after = (
                f", after the stand-in for {next(iter(failed))!r}"
                if failed and not is_meta_limit(exc)
                else ""
            )
            result.stopped = f"{tracer.where()}: {describe(exc)}{after}"
            result.guess_failed = guessed and not is_meta_limit(exc) and not failed
            result.interrupted = tuple(call.name for call in tracer.active)
            log.info("the traced forward of %s stopped %s", type(model).__name__, result.stopped)
            return None
        raise ProfileError(
            f"the forward of {type(model).__name__} failed on the example inputs {tracer.where()}: "
            f"{type(exc).__name__}: {exc}. Check the example inputs (shapes, dtypes, argument names) "
            "against the model's forward"
        ) from exc


def backward_of(output: Any, tracer: Tracer) -> None:
    roots = [t for t in tensors_in(output) if t.requires_grad and t.is_floating_point()]
    if not roots:
        log.warning("no output requires grad: train_flops are forward FLOPs only")
        return
    tracer.in_backward = True
    try:
        torch.autograd.backward(roots, [torch.ones_like(t) for t in roots])
    except Exception as exc:  # noqa: BLE001 - training FLOPs are optional; forward ones stand
        log.warning(
            "backward on meta failed (%s: %s); train_flops cover what ran before it", type(exc).__name__, exc
        )
    finally:
        tracer.in_backward = False
