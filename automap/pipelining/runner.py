"""The schedule: one thread per micro-batch, a turnstile per stage (GPipe fill-drain)."""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Literal, Mapping

import torch
from torch import nn

from automap.runtime import send
from automap.errors import PipelineError
from automap.kinds import kind_of
from automap.pipelining.cost import best_chunks, stage_costs
from automap.pipelining.microbatch import batch_size, input_bytes, merge_outputs, split_batch
from automap.pipelining.stages import Stage
from automap.planning import Plan
from automap.sizes import format_seconds

log = logging.getLogger(__name__)

Chunks = int | Literal["auto"]


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
        return _Modes(
            torch.is_grad_enabled(), torch.is_inference_mode_enabled(), casts, torch.get_num_threads()
        )

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


PIPELINED: "weakref.WeakKeyDictionary[nn.Module, Pipeline]" = weakref.WeakKeyDictionary()


class Pipeline(nn.Module):
    """A model run as a GPipe pipeline over its plan's stages (see :func:`pipeline`).

    Calling it splits the batch into ``chunks`` micro-batches, runs them through the stages
    with overlap, and joins the outputs. ``backward`` on anything computed from the output
    flows through each micro-batch's graph; gradients add up to the whole batch's.
    """

    def __init__(
        self,
        module: nn.Module,
        stages: tuple[Stage, ...],
        devices: tuple[torch.device, ...],
        chunks: Chunks,
        plan: Plan,
    ) -> None:
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
        self._apis = {d: kind_of(d).torch_api() for d in devices if kind_of(d).compute_streams}
        self._device_streams = {d: api.Stream(d) for d, api in self._apis.items()}
        self._streams = [self._device_streams.get(d) for d in devices]
        modules = dict(module.named_modules())
        self._handles = [
            modules[name].register_forward_pre_hook(self._gate(stage.index), with_kwargs=True, prepend=True)
            for stage in stages
            for name in stage.units
        ]

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
        key = (batch, input_bytes(args, kwargs), self.module.training)
        if key not in self._auto:
            profiled = self._plan.cut_bytes[0] if self._plan.cut_bytes else 0
            scale = key[1] / profiled if profiled else 1.0
            costs = stage_costs(
                self._plan, self.stages, self.devices, self.module, scale, self.module.training
            )
            self._auto[key] = best_chunks(costs, batch)
            log.info(
                "chunks='auto': %d micro-batches for batch %d (stages: %s)",
                self._auto[key],
                batch,
                ", ".join(
                    f"{format_seconds(c.seconds)} + {format_seconds(c.fixed_seconds)}/micro-batch on {c.device}"
                    for c in costs
                ),
            )
        return self._auto[key]

    def close(self) -> nn.Module:
        """Remove the pipeline's hooks and return the model, usable on its own again."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if PIPELINED.get(self.module) is self:
            del PIPELINED[self.module]
        return self.module

    # -------------------------------------------------------------- running

    def _run(self, micro: list[tuple[tuple, dict]]) -> list[Any]:
        for turnstile in self._turnstiles:
            turnstile.reset()
        self._sync_streams(into_stages=True)
        modes = _Modes.capture()
        outputs: list[Any] = [None] * len(micro)
        errors: list[BaseException | None] = [None] * len(micro)
        workers = [
            threading.Thread(
                target=self._work,
                args=(i, a, k, modes, outputs, errors),
                name=f"automap-microbatch-{i}",
                daemon=True,
            )
            for i, (a, k) in enumerate(micro)
        ]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        self._sync_streams(into_stages=False)
        for error in errors:
            if error is not None:
                raise error
        return outputs

    def _work(
        self,
        micro: int,
        args: tuple,
        kwargs: dict,
        modes: _Modes,
        outputs: list[Any],
        errors: list[BaseException | None],
    ) -> None:
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
                    self._apis[self.devices[ticket.stage]].set_stream(stream)

    def _sync_streams(self, into_stages: bool) -> None:
        for device, stream in self._device_streams.items():
            caller = self._apis[device].current_stream(device)
            if into_stages:
                stream.wait_stream(caller)  # the inputs were made on the caller's stream
            else:
                caller.wait_stream(stream)  # the outputs are read on the caller's stream
