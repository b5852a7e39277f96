"""Bringing offloaded weights to the execution device, one unit ahead of the unit running.

On CPU execution the weights are zero-copy views of the store's memory maps, so "loading" is
free once the pages are in memory; the prefetch asks the kernel, on a worker thread, to read
the next unit's pages and map them in while the current unit computes.

On a CUDA execution device the worker copies the next unit's weights from the maps into a
pinned staging buffer and issues each host-to-device copy on a side stream as soon as its
tensor is staged, so the memcpy of one tensor overlaps the DMA of the one before. The compute
stream waits on the copy's event only when the unit actually runs. Weights of units that stay
in (pinned) CPU RAM skip the staging. At most one unit is in flight ahead of the running one,
which is what the plan's reserve pays for.
"""
from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Mapping, Sequence

import torch

from automap.offload.store import OffloadStore

log = logging.getLogger(__name__)

_ALIGN = 256  # bytes; keeps every staged view aligned for any dtype and for fast DMA

Fetched = tuple[dict[str, torch.Tensor], "torch.cuda.Event | None"]


class Loader:
    """Hands out a unit's offloaded tensors on the execution device, prefetching the next.

    Args:
        store: where disk-offloaded tensors live (None when nothing is on disk).
        host: tensors kept in CPU RAM (offloaded from a GPU execution device), by name.
        device: the execution device.

    Example:
        >>> loader = Loader(store, {}, torch.device("cpu"))
        >>> loader.prefetch("layers.1", ["layers.1.weight"])   # returns at once
        >>> weights = loader.take("layers.1", ["layers.1.weight"])
    """

    def __init__(self, store: OffloadStore | None, host: Mapping[str, torch.Tensor], device: torch.device):
        self.store, self.host, self.device = store, dict(host), device
        self._cuda = device.type == "cuda"
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="automap-prefetch")
        self._pending: dict[str, Future[Fetched]] = {}
        self._lock = threading.Lock()  # the staging buffer has one user at a time
        self._staging: torch.Tensor | None = None
        self._stream = torch.cuda.Stream(device) if self._cuda else None

    # ---------------------------------------------------------------- public

    def prefetch(self, key: str, names: Sequence[str]) -> None:
        """Start bringing ``names`` (the tensors of unit ``key``) in, without waiting. A
        previous guess that was never taken is dropped, so at most one unit is in flight."""
        for other in [k for k in self._pending if k != key]:
            self._pending.pop(other).cancel()
        if names and key not in self._pending:
            self._pending[key] = self._pool.submit(self._fetch, tuple(names), True)

    def take(self, key: str, names: Sequence[str]) -> dict[str, torch.Tensor]:
        """``names`` on the execution device, ready for the current stream to use.

        Raises:
            OffloadError: a store file changed, was truncated or deleted.
        """
        stored = [n for n in names if n not in self.host] if self.store is not None else []
        if self.store is not None:
            self.store.check_unchanged(stored)
        got: dict[str, torch.Tensor] = {}
        event = None
        future = self._pending.pop(key, None)
        if future is not None and self._cuda:
            try:
                got, event = future.result()
            except Exception:  # noqa: BLE001 - the synchronous retry below raises it properly
                log.debug("prefetch of %s failed; loading it synchronously", key, exc_info=True)
        elif future is not None:
            future.cancel()  # on CPU the views are ready now; the pages come in as touched
        elif not self._cuda and self.store is not None:
            # Not prefetched (the first unit, or a guess that missed): queue the reads of the
            # whole unit now rather than page by page as the compute thread faults.
            self.store.advise(stored, populate=False)
        missing = tuple(n for n in names if n not in got)
        if missing:
            more, event2 = self._fetch(missing, False)
            got.update(more)
            event = event2 or event
        self._ready(got, event)
        return {n: got[n] for n in names}

    def close(self) -> None:
        """Stop the worker, dropping any prefetch in flight, and free the staging buffer."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._pending.clear()
        self._staging = None

    # ---------------------------------------------------------------- internals

    def _source(self, name: str) -> torch.Tensor:
        if name in self.host:
            return self.host[name]
        assert self.store is not None, f"{name} is neither in RAM nor in a store"
        return self.store.get(name)

    def _fetch(self, names: tuple[str, ...], ahead: bool) -> Fetched:
        if not self._cuda:
            if ahead and self.store is not None:
                self.store.advise([n for n in names if n not in self.host])
            return {n: self._source(n) for n in names}, None
        return self._to_cuda(names)

    def _to_cuda(self, names: tuple[str, ...]) -> Fetched:
        assert self._stream is not None
        sources = {n: self._source(n) for n in names}
        staged = sum(_aligned(t.nbytes) for t in sources.values() if not t.is_pinned())
        out: dict[str, torch.Tensor] = {}
        with self._lock, torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            offset = 0
            for name, src in sources.items():
                if not src.is_pinned():
                    src, offset = self._stage(src, offset, staged), offset + _aligned(src.nbytes)
                out[name] = torch.empty(src.shape, dtype=src.dtype, device=self.device)
                out[name].copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
            # The staging buffer is reused by the next unit: it must be drained first. This
            # thread waits, the compute stream does not.
            event.synchronize()
        return out, event

    def _stage(self, src: torch.Tensor, offset: int, total: int) -> torch.Tensor:
        if self._staging is None or self._staging.numel() < total:
            self._staging = None
            self._staging = torch.empty(total, dtype=torch.uint8, pin_memory=True)
            log.debug("pinned staging buffer of %d bytes", total)
        view = self._staging[offset:offset + src.nbytes].view(src.dtype).view(src.shape)
        view.copy_(src)
        return view

    def _ready(self, got: Mapping[str, torch.Tensor], event: torch.cuda.Event | None) -> None:
        if not self._cuda:
            return
        current = torch.cuda.current_stream(self.device)
        if event is not None:
            current.wait_event(event)
        for tensor in got.values():
            tensor.record_stream(current)  # freed only after the compute stream used it


def _aligned(nbytes: int) -> int:
    return (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
