"""Micro-batch pipelining in one process: the model-parallel tutorial's ``split_size`` trick,
automated for any model a :class:`~automap.plan.Plan` splits.

A plan's *stages* are the contiguous runs of units that compute on one device. The batch is
split into ``chunks`` micro-batches; each runs the model's own ``forward`` on a thread of its
own, and a turnstile per stage lets micro-batches into that stage one at a time, in order. So
stage k works on micro-batch i while stage k+1 works on micro-batch i-1 (GPipe's fill-drain
schedule), and any model whose units a plan can place pipelines without being rewritten as an
``nn.Sequential``. Why this design, and what it costs, is in ``docs/pipeline.md``.

    >>> pipe = automap.pipeline(automap.dispatch(model, plan), chunks=4)
    >>> loss_fn(pipe(x), y).backward()  # same outputs and gradients as model(x)
"""
from __future__ import annotations

import contextlib
import logging
import math
import sys
import threading
import types
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Literal, Mapping, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from automap.devices import make_device
from automap.dispatch import send, state_of
from automap.errors import PipelineError
from automap.plan import Plan

log = logging.getLogger(__name__)

Chunks = int | Literal["auto"]

# What one micro-batch costs beyond its FLOPs, used only by chunks="auto". Round figures, as in
# automap.devices: a unit call costs Python hooks plus a few kernel launches (~10 us each), and
# handing a micro-batch to the next stage costs a thread wake-up and a copy's latency.
UNIT_OVERHEAD_SECONDS = 50e-6
HANDOFF_SECONDS = 100e-6
MAX_AUTO_CHUNKS = 64


@dataclass(frozen=True)
class Stage:
    """A contiguous run of a plan's units that compute on one device.

    Attributes:
        index: position in the pipeline (0 first).
        device: the plan's name of the device the units compute on (``"cuda:1"``).
        units: the units' module names, in execution order.
    """

    index: int
    device: str
    units: tuple[str, ...]


def plan_stages(plan: Plan) -> tuple[Stage, ...]:
    """Split ``plan``'s units into stages: maximal runs computing on one device.

    Example:
        >>> [s.device for s in plan_stages(automap.plan(model, max_memory={0: "50MB", 1: "50MB"}))]
        ['cuda:0', 'cuda:1']
    """
    runs: list[tuple[str, list[str]]] = []
    for unit, where in zip(plan.units, plan.placement):
        device = plan.compute_device(where)
        if not runs or runs[-1][0] != device:
            runs.append((device, []))
        runs[-1][1].append(unit.name)
    return tuple(Stage(i, device, tuple(names)) for i, (device, names) in enumerate(runs))


# ------------------------------------------------------------------ micro-batches


def batch_size(args: tuple, kwargs: Mapping[str, Any]) -> int:
    """The leading dimension of the first tensor among the inputs (the batch to split)."""
    leaves, _ = tree_flatten((args, dict(kwargs)))
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return int(leaf.shape[0])
    raise PipelineError("the inputs hold no tensor with a batch dimension to split into micro-batches; "
                        "pass the batch as a tensor whose first dimension is the sample index")


def split_batch(args: tuple, kwargs: Mapping[str, Any], chunks: int) -> list[tuple[tuple, dict]]:
    """Split every input tensor whose first dimension is the batch into ``chunks`` parts (sizes
    differ by at most one, as ``torch.tensor_split`` makes them); other inputs go to every part.

    Raises:
        PipelineError: ``chunks`` exceeds the batch size.
    """
    batch = batch_size(args, kwargs)
    if chunks > batch:
        raise PipelineError(f"chunks={chunks} but the batch has only {batch} sample(s); every micro-batch "
                            f"needs at least one, so use chunks <= {batch} or a larger batch")
    leaves, spec = tree_flatten((args, dict(kwargs)))
    parts = [leaf.tensor_split(chunks) if _is_batched(leaf, batch) else (leaf,) * chunks for leaf in leaves]
    return [tree_unflatten([p[i] for p in parts], spec) for i in range(chunks)]


def _is_batched(value: Any, batch: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == batch


def merge_outputs(outputs: Sequence[Any]) -> Any:
    """Concatenate the micro-batches' outputs along the batch dimension, keeping their
    structure (tuples, dicts, ``ModelOutput``); ``None`` and identical non-tensors pass.

    Raises:
        PipelineError: an output is a scalar tensor (a loss) or an object (a KV cache) that
            has no batch dimension to concatenate.
    """
    flat = [tree_flatten(out) for out in outputs]
    spec = flat[0][1]
    merged = [_merge_leaf(i, [leaves[i] for leaves, _ in flat]) for i in range(len(flat[0][0]))]
    return tree_unflatten(merged, spec)


def _merge_leaf(position: int, values: list[Any]) -> Any:
    first = values[0]
    if isinstance(first, torch.Tensor):
        if first.dim() == 0:
            raise PipelineError(
                f"output #{position} is a scalar tensor (a loss?), which has no batch dimension to join "
                "across micro-batches; return per-sample outputs and compute the loss on pipe(x)")
        return torch.cat(values)
    if all(v is first or v == first for v in values[1:]):
        return first
    raise PipelineError(
        f"output #{position} is a {type(first).__name__} that differs per micro-batch and cannot be joined; "
        "turn it off (for transformers models pass use_cache=False) or return tensors")


# ------------------------------------------------------------------ chunks="auto"


def pipeline_seconds(stage_seconds: Sequence[float], stage_units: Sequence[int], chunks: int) -> float:
    """Predicted time of one GPipe pass: the first micro-batch crosses every stage, then one
    leaves the slowest stage per period. ``stage_seconds`` is each stage's whole-batch time."""
    per = [t / chunks + n * UNIT_OVERHEAD_SECONDS + HANDOFF_SECONDS for t, n in zip(stage_seconds, stage_units)]
    return sum(per) + (chunks - 1) * max(per)


def best_chunks(stage_seconds: Sequence[float], stage_units: Sequence[int], batch: int) -> int:
    """The micro-batch count with the least :func:`pipeline_seconds` (the smallest on ties)."""
    candidates = range(1, min(batch, MAX_AUTO_CHUNKS) + 1)
    return min(candidates, key=lambda m: (pipeline_seconds(stage_seconds, stage_units, m), m))


def stage_seconds(plan: Plan, stages: Sequence[Stage], devices: Sequence[torch.device], scale: float,
                  training: bool) -> list[float]:
    """Each stage's predicted whole-batch time on the device it really runs on: its units'
    FLOPs (forward + backward when training) plus the transfer into it, times ``scale`` (the
    call's batch over the profile's)."""
    units = {u.name: u for u in plan.units}
    into = {cut.after: cut.seconds for cut in plan.cuts()}
    result = []
    for stage, device in zip(stages, devices):
        spec = plan.device(stage.device)
        speed = spec.flops_per_second if spec.kind == device.type else make_device(str(device), 0).flops_per_second
        flops = sum(units[n].train_flops if training else units[n].flops for n in stage.units)
        result.append(scale * (flops / max(speed, 1.0) + into.get(stage.units[0], 0.0)))
    return result


def _input_bytes(args: tuple, kwargs: Mapping[str, Any]) -> int:
    leaves, _ = tree_flatten((args, dict(kwargs)))
    return sum(x.numel() * x.element_size() for x in leaves if isinstance(x, torch.Tensor))


# ------------------------------------------------------------------ the schedule


class _Turnstile:
    """Lets micro-batches into one stage one at a time, in index order."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._next = 0

    def reset(self) -> None:
        with self._cond:
            self._next = 0

    def enter(self, micro: int) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._next == micro)

    def leave(self) -> None:
        with self._cond:
            self._next += 1
            self._cond.notify_all()


@dataclass
class _Ticket:
    """The micro-batch a worker thread carries and the stage it is in (-1: none yet)."""

    micro: int
    stage: int = -1


@dataclass(frozen=True)
class _Modes:
    """Thread-local settings of the caller, replayed in each worker: autograd and autocast
    modes, and the intra-op thread count (OpenMP keeps it per thread, so a worker would
    otherwise use the default, not what the caller set with ``torch.set_num_threads``)."""

    grad: bool
    inference: bool
    autocast: tuple[tuple[str, bool, torch.dtype], ...]
    threads: int

    @staticmethod
    def capture() -> _Modes:
        kinds = ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)
        casts = tuple((k, torch.is_autocast_enabled(k), torch.get_autocast_dtype(k)) for k in kinds)
        return _Modes(torch.is_grad_enabled(), torch.is_inference_mode_enabled(), casts, torch.get_num_threads())

    @contextlib.contextmanager
    def apply(self) -> Iterator[None]:
        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.inference_mode(self.inference))
            stack.enter_context(torch.set_grad_enabled(self.grad))
            for kind, enabled, dtype in self.autocast:
                stack.enter_context(torch.autocast(kind, dtype=dtype, enabled=enabled))
            yield


_PIPELINED: "weakref.WeakKeyDictionary[nn.Module, Pipeline]" = weakref.WeakKeyDictionary()


class Pipeline(nn.Module):
    """A model run as a GPipe pipeline over its plan's stages (see :func:`pipeline`).

    Calling it splits the batch into ``chunks`` micro-batches, runs them through the stages
    with overlap, and joins the outputs. ``backward`` on anything computed from the output
    flows through each micro-batch's graph; gradients add up to the whole batch's.
    """

    def __init__(self, module: nn.Module, stages: tuple[Stage, ...], devices: tuple[torch.device, ...],
                 chunks: Chunks, plan: Plan) -> None:
        super().__init__()
        self.module = module
        self.stages = stages
        self.devices = devices
        self.chunks = chunks
        self._plan = plan
        self._turnstiles = [_Turnstile() for _ in stages]
        self._local = threading.local()
        self._call_lock = threading.Lock()
        self._auto: dict[tuple[int, int, bool], int] = {}
        # One compute stream per GPU, shared by every stage on it: work queued there runs in
        # submission order, so a tensor one stage makes is ready when a later stage on the same
        # GPU reads it, and its memory is never reused across streams; between GPUs the copy
        # synchronises the two streams itself.
        self._device_streams = {d: torch.cuda.Stream(d) for d in devices if d.type == "cuda"}
        self._streams = [self._device_streams.get(d) for d in devices]
        modules = dict(module.named_modules())
        self._handles = [modules[name].register_forward_pre_hook(self._gate(stage.index), with_kwargs=True,
                                                                 prepend=True)
                         for stage in stages for name in stage.units]

    # -------------------------------------------------------------- public

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not self._handles:
            raise PipelineError("this Pipeline was closed; call automap.pipeline(model, ...) again")
        with self._call_lock:  # one pipelined pass at a time: the turnstiles are per pass
            micro = split_batch(args, kwargs, self.resolve_chunks(args, kwargs))
            outputs = self._run(micro)
        return merge_outputs(outputs)

    def resolve_chunks(self, args: tuple, kwargs: Mapping[str, Any]) -> int:
        """The micro-batch count a call with these inputs uses (``chunks`` or the auto choice)."""
        if self.chunks != "auto":
            return int(self.chunks)
        batch = batch_size(args, kwargs)
        key = (batch, _input_bytes(args, kwargs), self.module.training)
        if key not in self._auto:
            profiled = self._plan.cut_bytes[0] if self._plan.cut_bytes else 0
            scale = key[1] / profiled if profiled else 1.0
            seconds = stage_seconds(self._plan, self.stages, self.devices, scale, self.module.training)
            self._auto[key] = best_chunks(seconds, [len(s.units) for s in self.stages], batch)
            log.info("chunks='auto': %d micro-batches for batch %d (predicted stage times %s s)",
                     self._auto[key], batch, ", ".join(f"{t:.2e}" for t in seconds))
        return self._auto[key]

    def close(self) -> nn.Module:
        """Remove the pipeline's hooks and return the model, usable on its own again."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if _PIPELINED.get(self.module) is self:
            del _PIPELINED[self.module]
        return self.module

    # -------------------------------------------------------------- running

    def _run(self, micro: list[tuple[tuple, dict]]) -> list[Any]:
        for turnstile in self._turnstiles:
            turnstile.reset()
        self._sync_streams(into_stages=True)
        modes = _Modes.capture()
        outputs: list[Any] = [None] * len(micro)
        errors: list[BaseException | None] = [None] * len(micro)
        workers = [threading.Thread(target=self._work, args=(i, a, k, modes, outputs, errors),
                                    name=f"automap-microbatch-{i}", daemon=True)
                   for i, (a, k) in enumerate(micro)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        self._sync_streams(into_stages=False)
        for error in errors:
            if error is not None:
                raise error
        return outputs

    def _work(self, micro: int, args: tuple, kwargs: dict, modes: _Modes, outputs: list[Any],
              errors: list[BaseException | None]) -> None:
        ticket = _Ticket(micro)
        self._local.ticket = ticket
        try:
            with modes.apply():
                outputs[micro] = self.module(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            errors[micro] = exc
        finally:
            self._advance(ticket, len(self.stages))  # pass every stage left, so later ones go on
            self._local.ticket = None

    def _gate(self, stage: int) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
            ticket: _Ticket | None = getattr(self._local, "ticket", None)
            if ticket is None:
                return None  # a call outside the pipeline (or autograd recomputation): untouched
            if stage > ticket.stage:
                self._advance(ticket, stage)
            device = self.devices[stage]
            return send(args, device), send(kwargs, device)
        return hook

    def _advance(self, ticket: _Ticket, stage: int) -> None:
        """Move ``ticket`` forward to ``stage``, passing through any stage it skips in order."""
        while ticket.stage < stage:
            if ticket.stage >= 0:
                self._turnstiles[ticket.stage].leave()
            ticket.stage += 1
            if ticket.stage < len(self.stages):
                self._turnstiles[ticket.stage].enter(ticket.micro)
                stream = self._streams[ticket.stage]
                if stream is not None:
                    torch.cuda.set_stream(stream)

    def _sync_streams(self, into_stages: bool) -> None:
        for device, stream in self._device_streams.items():
            caller = torch.cuda.current_stream(device)
            if into_stages:
                stream.wait_stream(caller)  # the inputs were made on the caller's stream
            else:
                caller.wait_stream(stream)  # the outputs are read on the caller's stream


# ------------------------------------------------------------------ the front door


def pipeline(model: nn.Module, plan: Plan | None = None, *, chunks: Chunks = 4,
             devices: Mapping[str, str | torch.device] | None = None) -> Pipeline:
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
    if model in _PIPELINED:
        raise PipelineError(f"{type(model).__name__} is already pipelined; call .close() on its Pipeline first")
    plan = _resolve_plan(model, plan, devices)
    if plan.offloaded_units:
        raise PipelineError(
            f"the plan streams {len(plan.offloaded_units)} offloaded unit(s) (first {plan.offloaded_units[0]!r}) "
            "from CPU/disk; pipelining would stream them once per micro-batch. Plan without offload "
            "(raise max_memory) or run the dispatched model unpipelined")
    stages = plan_stages(plan)
    real = _real_devices(plan, stages, devices)
    if devices is not None:
        _place_units(model, plan, stages, real)
    _warn_batch_norm(model)
    pipe = Pipeline(model, stages, real, chunks, plan)
    _PIPELINED[model] = pipe
    log.info("pipelining %s over %d stage(s) (%s), chunks=%s", type(model).__name__, len(stages),
             " -> ".join(str(d) for d in real), chunks)
    return pipe


def _check_chunks(chunks: Chunks) -> None:
    if chunks == "auto":
        return
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise PipelineError(f"chunks must be a positive int or 'auto', got {chunks!r}; e.g. chunks=4")


def _resolve_plan(model: nn.Module, plan: Plan | None, devices: Mapping[str, Any] | None) -> Plan:
    state = state_of(model)
    if state is not None and devices is not None:
        raise PipelineError(f"{type(model).__name__} is dispatched, so its units already run where the plan "
                            "says; drop devices=..., or undispatch it first to place it with devices")
    if state is None and devices is None:
        raise PipelineError(f"{type(model).__name__} is not dispatched; call automap.dispatch(model, plan) "
                            "first, or pass devices={'cuda:0': 'cpu', 'cuda:1': 'cpu'} to run the plan's "
                            "stages on devices of your choice")
    if plan is None:
        if state is None:
            raise PipelineError("no plan given; pass the Plan from automap.plan(model, ...)")
        return state.plan
    if state is not None and (state.plan.placement != plan.placement
                              or [u.name for u in state.plan.units] != [u.name for u in plan.units]):
        raise PipelineError(f"{type(model).__name__} was dispatched with another plan; omit plan= to use that one")
    return plan


def _real_devices(plan: Plan, stages: tuple[Stage, ...],
                  devices: Mapping[str, str | torch.device] | None) -> tuple[torch.device, ...]:
    if devices is None:
        return tuple(_indexed(torch.device(s.device)) for s in stages)
    missing = sorted({s.device for s in stages} - set(devices))
    if missing:
        raise PipelineError(f"devices={dict(devices)!r} does not say where to run the plan's {missing}; "
                            f"give a real device for each of {[s.device for s in stages]}")
    return tuple(_indexed(torch.device(devices[s.device])) for s in stages)


def _indexed(device: torch.device) -> torch.device:
    """``cuda`` as ``cuda:N`` (the current one), so that stages on one GPU compare equal."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _place_units(model: nn.Module, plan: Plan, stages: tuple[Stage, ...], real: tuple[torch.device, ...]) -> None:
    tensors = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(model.named_buffers(remove_duplicate=False))
    where = {name: device for stage, device in zip(stages, real) for name in stage.units}
    for unit in plan.units:
        for name in unit.tensors:
            if name not in tensors:
                raise PipelineError(f"the plan names tensor {name!r} that {type(model).__name__} lacks; "
                                    "plan this model again")
            if tensors[name].device != where[unit.name]:
                tensors[name].data = tensors[name].data.to(where[unit.name])


def _warn_batch_norm(model: nn.Module) -> None:
    norms = [n for n, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if norms:
        log.warning("%s has %d BatchNorm layer(s) (first %r): in training each normalises one micro-batch "
                    "(statistics differ from the whole batch's, as in GPipe); in eval() outputs match exactly",
                    type(model).__name__, len(norms), norms[0])


def chunk_sizes(batch: int, chunks: int) -> list[int]:
    """Sizes of the micro-batches :func:`split_batch` makes (the tutorial's ``split_size`` is the first)."""
    return [batch // chunks + (1 if i < batch % chunks else 0) for i in range(chunks)]


def chunks_for_split_size(batch: int, split_size: int) -> int:
    """The tutorial's ``split_size`` (samples per micro-batch) as a chunk count."""
    return max(1, math.ceil(batch / split_size))


class _CallableModule(types.ModuleType):
    """``automap.pipeline`` names this module and its front door at once: once the module is
    imported the package attribute is the module, so the module calls :func:`pipeline`."""

    def __call__(self, *args: Any, **kwargs: Any) -> Pipeline:
        return pipeline(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
