"""Transfers: bringing a unit's offloaded weights to the execution device, the next unit's
prefetched while the current one computes.

:class:`PageTransfer` (the CPU executes: nothing is copied) and :class:`StagedTransfer` (an
accelerator executes: pinned staging, copies on a side stream, every ordering step through
:class:`DeviceOps`). This module attaches the built-in accelerators' ops to their kinds.
"""

from __future__ import annotations

import abc
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Protocol, Sequence

import torch

from automap.kinds import attach, kind_of, torch_device
from automap.offload.format import dense_order
from automap.offload.source import RowSource, WeightSource

log = logging.getLogger(__name__)

ALIGN = 256  # bytes; keeps every staged view aligned for any dtype and for fast DMA


def aligned(nbytes: int) -> int:
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


class Transfer(abc.ABC):
    """Hands out a unit's offloaded tensors on the execution device, prefetching the next.

    ``swaps`` says whether :meth:`take` returns new tensors (copies on an accelerator) that the
    runtime must put in place for the unit and take back after, or the source's own tensors
    (which the model's parameters hold anyway).
    """

    swaps: bool = False
    # Units read ahead of the running one. One where each costs a staging buffer the plan
    # reserved; page transfers read into the page cache (file-backed memory the kernel may
    # drop), where a second keeps the disk busy while the first is being computed.
    lookahead: int = 1

    def __init__(self, source: WeightSource):
        self.source = source
        # A worker per unit in flight: the reads of the next unit start while those of the one
        # before still end, so the disk's queue does not drain at each unit's last requests.
        self._pool = ThreadPoolExecutor(max_workers=self.lookahead, thread_name_prefix="automap-prefetch")
        self._pending: dict[str, Future[Any]] = {}
        self._state = threading.Lock()  # guards _pending: forwards may run on several threads
        self._closed = False

    def prefetch(self, key: str, names: Sequence[str]) -> None:
        """Start bringing ``names`` (the tensors of unit ``key``) in, without waiting. A
        previous guess that was never taken is dropped, so at most one unit is in flight
        (until :meth:`prefetch_after` adds the ones after it)."""
        with self._state:
            if self._closed:
                return  # a forward racing undispatch: a prefetch is a hint, and there is no worker now
            for other in [k for k in self._pending if k != key]:
                self._pending.pop(other).cancel()
            self._submit(key, names)

    def prefetch_after(self, units: Sequence[tuple[str, Sequence[str]]]) -> None:
        """Also start bringing in the units ``(key, names)`` expected after those in flight,
        in that order, while fewer than :attr:`lookahead` units are in flight; drops nothing."""
        with self._state:
            if self._closed:
                return
            for key, names in units:
                if key not in self._pending and len(self._pending) >= self.lookahead:
                    break
                self._submit(key, names)

    def _submit(self, key: str, names: Sequence[str]) -> None:
        if names and (key not in self._pending or self._stale(self._pending[key])):
            self._pending[key] = self._pool.submit(self._ahead, tuple(names))

    def _stale(self, future: Future[Any]) -> bool:
        """Whether a prefetch done but not yet taken must run again when asked for once more."""
        return False

    def drain(self) -> None:
        """Wait until every prefetch in flight has finished (tests and benchmarks)."""
        with self._state:
            pending = list(self._pending.values())
        wait(pending)

    def discard(self, key: str) -> None:
        """Drop what was read ahead for unit ``key`` (its tensors were written since): the
        next :meth:`take` of it reads them again."""
        future = self._claim(key)
        if future is not None:
            future.cancel()

    def _claim(self, key: str) -> Future[Any] | None:
        with self._state:
            return self._pending.pop(key, None)

    @abc.abstractmethod
    def _ahead(self, names: tuple[str, ...]) -> Any:
        """The prefetch, on the worker thread."""

    @abc.abstractmethod
    def take(self, key: str, names: Sequence[str]) -> dict[str, torch.Tensor]:
        """``names`` on the execution device, ready for the current stream to use.

        Raises:
            OffloadError: a file behind them changed, was truncated or deleted.
        """

    def take_rows(
        self, key: str, names: Sequence[str], rows: Sequence[int] | None
    ) -> dict[str, torch.Tensor]:
        """``names`` on the execution device, read now (the routing that decides what a unit
        of experts needs is known only as it runs): of each, only ``rows`` along its first
        dimension when given (the routed experts of tensors that stack every expert; the
        other rows hold what they hold, the caller reads only these), else the whole tensor.
        By default the whole tensors (:meth:`take`).

        Raises:
            OffloadError: a file behind them changed, was truncated or deleted.
        """
        return self.take(key, names)

    def _read_rows(self, names: Sequence[str], rows: Sequence[int] | None) -> None:
        """Check the files behind ``names``, then have the source read ``rows`` of each (all:
        None) in now, without reading around them (:func:`read_rows`)."""
        self.source.check_unchanged(names)
        read_rows(self.source, names, rows)

    @property
    def pinned_bytes(self) -> int:
        """Page-locked host memory this transfer holds (its staging buffer)."""
        return 0

    def forget_threads(self) -> None:
        """In a forked child: the parent's worker does not exist here, its pool believes it
        does (a prefetch queued there would never run, and the forward waiting for it would
        hang), and a lock may have been held by one of the parent's threads at the fork. Start
        afresh without prefetching: :meth:`take` reads what it needs as it did without one."""
        self._state = threading.Lock()
        self._pending = {}
        self._closed = True
        self._pool = ThreadPoolExecutor(max_workers=self.lookahead, thread_name_prefix="automap-prefetch")

    def close(self) -> None:
        """Stop the worker, dropping any prefetch in flight; a later :meth:`prefetch` does
        nothing (:meth:`take` still works, without one)."""
        with self._state:
            self._closed = True
        self._pool.shutdown(wait=True, cancel_futures=True)
        with self._state:
            self._pending.clear()


class PageTransfer(Transfer):
    """CPU execution: the source's tensors are used where they are; prefetching reads pages.

    Example:
        >>> transfer = PageTransfer(store)
        >>> transfer.prefetch("layers.1", ["layers.1.weight"])   # returns at once
        >>> weights = transfer.take("layers.1", ["layers.1.weight"])
    """

    swaps = False
    lookahead = 2

    def _ahead(self, names: tuple[str, ...]) -> None:
        self.source.prefetch(names)

    def _stale(self, future: Future[Any]) -> bool:
        # Pages read ahead may have been dropped since (memory pressure, the previous forward's
        # guess for this one made before an eviction): read again, which costs one mincore
        # per file when they are still there.
        return future.done()

    def take(self, key: str, names: Sequence[str]) -> dict[str, torch.Tensor]:
        self.source.check_unchanged(names)
        future = self._claim(key)
        if future is None:
            # Not prefetched (the first unit, or a guess that missed): queue the reads of the
            # whole unit now rather than page by page as the compute thread faults.
            self.source.prefetch(names, populate=False)
        else:
            # The prefetch in flight maps every page in: a page the compute thread faulted on
            # meanwhile would be read with the kernel's read-around (up to read_ahead_kb around
            # it), which reaches into the rows of experts no token goes to.
            wait([future])
        return {n: self.source.get(n) for n in names}

    def take_rows(
        self, key: str, names: Sequence[str], rows: Sequence[int] | None
    ) -> dict[str, torch.Tensor]:
        self._read_rows(names, rows)
        return {n: self.source.get(n) for n in names}


def read_rows(source: WeightSource, names: Sequence[str], rows: Sequence[int] | None) -> None:
    """Have ``source`` read ``rows`` of ``names`` (all of them: None) in now, several requests
    in flight and nothing around them; a source that reads only whole tensors reads those."""
    if isinstance(source, RowSource):
        source.prefetch_rows(names, rows)
    else:
        source.prefetch(names)


class DeviceOps(Protocol):
    """The primitives :class:`StagedTransfer` orders its copies with (see :class:`CudaOps`)."""

    def side_stream(self) -> Any: ...
    def current_stream(self) -> Any: ...
    def on_stream(self, stream: Any) -> AbstractContextManager[Any]: ...
    def empty(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor: ...
    def pinned(self, nbytes: int) -> torch.Tensor: ...
    def is_pinned(self, tensor: torch.Tensor) -> bool: ...
    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None: ...
    def record(self, stream: Any) -> Any: ...
    def wait(self, stream: Any, event: Any) -> None: ...
    def synchronize(self, event: Any) -> None: ...
    def keep_alive(self, tensor: torch.Tensor, stream: Any) -> None: ...


class CudaOps:
    """:class:`DeviceOps` on a CUDA device: a side stream, events, non-blocking copies."""

    def __init__(self, device: torch.device):
        self.device = device

    def side_stream(self) -> torch.cuda.Stream:
        return torch.cuda.Stream(self.device)

    def current_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def on_stream(self, stream: torch.cuda.Stream) -> AbstractContextManager[Any]:
        return torch.cuda.stream(stream)

    def empty(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=self.device)

    def pinned(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned()

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)

    def record(self, stream: torch.cuda.Stream) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def wait(self, stream: torch.cuda.Stream, event: torch.cuda.Event) -> None:
        stream.wait_event(event)

    def synchronize(self, event: torch.cuda.Event) -> None:
        event.synchronize()

    def keep_alive(self, tensor: torch.Tensor, stream: torch.cuda.Stream) -> None:
        tensor.record_stream(stream)


class StagedTransfer(Transfer):
    """Accelerator execution: pinned staging, copies on a side stream, the compute stream waits.

    Args:
        source: where the offloaded weights live.
        ops: the stream/event/copy primitives of the execution device.
    """

    swaps = True

    def __init__(self, source: WeightSource, ops: DeviceOps):
        super().__init__(source)
        self.ops = ops
        self._staging_lock = threading.Lock()  # the staging buffer has one user at a time
        self._staging: torch.Tensor | None = None
        self._stream = ops.side_stream()

    @property
    def pinned_bytes(self) -> int:
        return self._staging.numel() if self._staging is not None else 0

    def _ahead(self, names: tuple[str, ...]) -> tuple[dict[str, torch.Tensor], Any]:
        return self._copy(names)

    def take(self, key: str, names: Sequence[str]) -> dict[str, torch.Tensor]:
        self.source.check_unchanged(names)
        got: dict[str, torch.Tensor] = {}
        events = []
        future = self._claim(key)
        if future is not None:
            try:
                got, event = future.result()
                events.append(event)
            except Exception:  # noqa: BLE001 - the synchronous copy below raises it properly
                log.debug("prefetch of %s failed; copying it now", key, exc_info=True)
                got = {}
        missing = tuple(n for n in names if n not in got)
        if missing:
            more, event = self._copy(missing)
            got.update(more)
            events.append(event)
        current = self.ops.current_stream()
        for event in events:
            self.ops.wait(current, event)
        for tensor in got.values():
            self.ops.keep_alive(tensor, current)  # its memory is reused only after compute used it
        return {n: got[n] for n in names}

    def take_rows(
        self, key: str, names: Sequence[str], rows: Sequence[int] | None
    ) -> dict[str, torch.Tensor]:
        self._read_rows(names, rows)
        got, event = self._copy(tuple(names), rows)
        current = self.ops.current_stream()
        self.ops.wait(current, event)
        for tensor in got.values():
            self.ops.keep_alive(tensor, current)
        return got

    def _copy(
        self, names: tuple[str, ...], rows: Sequence[int] | None = None
    ) -> tuple[dict[str, torch.Tensor], Any]:
        """Copy ``names`` (only ``rows`` of each along its first dimension, when given) into new
        tensors on the device, through the staging buffer where the source is not pinned."""
        sources = {n: self.source.get(n) for n in names}
        parts = {n: [t] if rows is None else [t[r] for r in rows] for n, t in sources.items()}
        staged = sum(aligned(p.nbytes) for ps in parts.values() for p in ps if not self.ops.is_pinned(p))
        out: dict[str, torch.Tensor] = {}
        with self._staging_lock, self.ops.on_stream(self._stream):
            offset = 0
            for name, src in sources.items():
                out[name] = self._like(src)
                targets = [out[name]] if rows is None else [out[name][r] for r in rows]
                for part, target in zip(parts[name], targets):
                    if not self.ops.is_pinned(part):
                        part, offset = self._stage(part, offset, staged), offset + aligned(part.nbytes)
                    self.ops.copy(target, part)
            event = self.ops.record(self._stream)
            if staged:
                # The staging buffer is reused by the next unit: it must be drained first. This
                # thread waits, the compute stream does not. Copies from pinned sources staged
                # nothing: the compute stream's wait on the event orders them, the host need not.
                self.ops.synchronize(event)
        return out, event

    def _like(self, src: torch.Tensor) -> torch.Tensor:
        """A tensor of the device shaped as ``src``, with its strides where it lays out densely
        in another order (a channels-last weight): the unit then runs the plain model's kernels."""
        if dense_order(src) is None:
            return self.ops.empty(src.shape, src.dtype)
        return self.ops.empty(torch.Size([src.numel()]), src.dtype).as_strided(src.shape, src.stride())

    def _stage(self, src: torch.Tensor, offset: int, total: int) -> torch.Tensor:
        if self._staging is None or self._staging.numel() < total:
            self._staging = None
            self._staging = self.ops.pinned(total)
            log.debug("pinned staging buffer of %d bytes", total)
        view = self._staging[offset : offset + src.nbytes].view(src.dtype).view(src.shape)
        view.copy_(src)
        return view


class HostCopyOps:
    """:class:`DeviceOps` that run the staged path on the CPU: every copy is a real copy into
    a tensor of its own, finished when issued. It lets the runtime's accelerator path (weights
    swapped in for a unit, written back, re-read for backward) run and be tested on a machine
    without a GPU; it is not faster than :class:`PageTransfer`."""

    def side_stream(self) -> None:
        return None

    def current_stream(self) -> None:
        return None

    def on_stream(self, stream: Any) -> AbstractContextManager[Any]:
        return nullcontext()

    def empty(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)

    def pinned(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return False

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def record(self, stream: Any) -> None:
        return None

    def wait(self, stream: Any, event: Any) -> None:
        return None

    def synchronize(self, event: Any) -> None:
        return None

    def keep_alive(self, tensor: torch.Tensor, stream: Any) -> None:
        return None


class DeviceCopyOps(HostCopyOps):
    """:class:`DeviceOps` for an accelerator without side streams here (``xpu``, ``mps``):
    each weight is copied into memory of the device, finished when issued. No overlap, but
    the weights land where the unit computes, as :class:`~automap.runtime.hooks.MoveInputs`
    sends its inputs."""

    def __init__(self, device: torch.device):
        self.device = device

    def empty(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=self.device)


def make_transfer(source: WeightSource, device: torch.device | str, buffers: int | None = None) -> Transfer:
    """The transfer for an execution device (a ``torch.device`` or a plan's device name), as
    its kind says: staged copies through the kind's :class:`DeviceOps` for an accelerator; on
    a kind computing on host memory, the transfer its kind names (the CPU's:
    :func:`~automap.offload.direct.host_transfer`, pages or reads past the page cache, the
    latter only where ``buffers`` of the largest offloaded unit fit the budget), else pages.

    Raises:
        DeviceError: ``device`` is of no registered kind.
        OffloadError: ``AUTOMAP_COLD_READS`` holds no setting.
    """
    kind = kind_of(device)
    ops, host = kind.factory("ops"), kind.factory("transfer")
    if ops is not None:
        return StagedTransfer(source, ops(torch_device(str(device))))
    return host(source, buffers) if host is not None else PageTransfer(source)


# The built-in accelerators' staged copies, attached to their kinds here (the registry in
# automap.kinds names no module above it).
attach("cuda", ops=CudaOps)
attach("xpu", ops=DeviceCopyOps)
attach("mps", ops=DeviceCopyOps)
