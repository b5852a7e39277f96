"""Reading a unit's file ranges ahead with several large requests in flight (merged contiguous
ranges, one thread per chunk, through the page cache: no anonymous memory, no copy).
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Iterable, NamedTuple

from automap.offload.pages import PAGE, madvise
from automap.page_cache import MADV_POPULATE_READ, send_to_page_cache

log = logging.getLogger(__name__)

WORKERS = 4  # requests in flight: where this machine's disk (and most NVMe) reaches its best rate
# Each request a long transfer: the kernel's readahead streams within one ``sendfile``, and every
# seam between requests costs. On the development machine, 464 MB of offloaded layers read cold
# in 0.14 s with 64 MB requests, 0.15 with 32 MB and 0.17 with 16 MB, against 0.15 s for the
# best of one reader and four in flight with ``preadv`` (benchmarks/notes/offload.md). A layer
# of 200 MB or more is still spread over the workers.
CHUNK_BYTES = 64 << 20


def coalesce(spans: Iterable[tuple[int, int]], gap: int = PAGE) -> list[tuple[int, int]]:
    """``(start, length)`` spans merged where they touch, overlap or lie within ``gap`` bytes
    of each other (reading a few bytes between two tensors is cheaper than a second request)."""
    merged: list[tuple[int, int]] = []
    for start, length in sorted(s for s in spans if s[1] > 0):
        if merged and start <= merged[-1][0] + merged[-1][1] + gap:
            first, size = merged[-1]
            merged[-1] = (first, max(size, start + length - first))
        else:
            merged.append((start, length))
    return merged


def chunked(spans: Iterable[tuple[int, int]], chunk_bytes: int) -> list[tuple[int, int]]:
    """The spans cut into pieces of at most ``chunk_bytes`` (page-aligned cuts)."""
    size = max(PAGE, chunk_bytes // PAGE * PAGE)
    return [
        (offset, min(size, start + length - offset))
        for start, length in spans
        for offset in range(start, start + length, size)
    ]


class Chunk(NamedTuple):
    """One request: ``length`` bytes at ``offset`` in the file open as ``fd``, mapped at ``address``."""

    fd: int
    offset: int
    address: int
    length: int


class ReadAhead:
    """Maps file ranges in with up to ``workers`` large requests in flight.

    Args:
        workers: threads issuing requests (each blocks in the kernel, without the GIL).
        chunk_bytes: the size of each request.

    ``peak_in_flight`` and ``requests`` count what it did, for tests and benchmarks.

    Example:
        >>> ReadAhead().read(mapped.spans(["model.layers.3.mlp.up_proj.weight"]), mapped.fd, mapped.address)
    """

    def __init__(self, workers: int = WORKERS, chunk_bytes: int = CHUNK_BYTES):
        self.workers, self.chunk_bytes = workers, chunk_bytes
        self._pool: ThreadPoolExecutor | None = None
        self._count = threading.Lock()
        self.in_flight = self.peak_in_flight = self.requests = 0
        _READERS.add(self)

    def forget_threads(self) -> None:
        """In a forked child: the parent's threads do not exist here, and its lock may have been
        held by one of them at the fork; start afresh (the first read makes a new pool)."""
        self._pool, self._count, self.in_flight = None, threading.Lock(), 0

    def read(self, spans: Iterable[tuple[int, int]], fd: int, base: int) -> None:
        """Read the page-aligned ``(address, length)`` spans of the file ``fd``, mapped at
        ``base``, into memory and map them in; returns when every page is there (or the kernel
        refused: a hint, never an error)."""
        chunks = [
            Chunk(fd, start - base, start, length)
            for start, length in chunked(coalesce(spans), self.chunk_bytes)
        ]
        if len(chunks) <= 1 or self.workers <= 1:
            for chunk in chunks:
                self._one(chunk)
            return
        wait([self._executor().submit(self._one, chunk) for chunk in chunks])

    def _executor(self) -> ThreadPoolExecutor:
        with self._count:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="automap-read")
            return self._pool

    def _one(self, chunk: Chunk) -> None:
        with self._count:
            self.in_flight += 1
            self.requests += 1
            self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        try:
            self.read_chunk(chunk)
        finally:
            with self._count:
                self.in_flight -= 1

    def read_chunk(self, chunk: Chunk) -> None:
        """One request: the kernel reads the chunk into the page cache (``sendfile`` to
        ``/dev/null``: its own large reads, no copy to this process), then its pages are mapped
        in. Where ``sendfile`` cannot read the file, readahead is queued instead."""
        if not send_to_page_cache(chunk.fd, chunk.offset, chunk.length):
            madvise(chunk.address, chunk.length, mmap.MADV_WILLNEED)
        madvise(
            chunk.address, chunk.length, MADV_POPULATE_READ
        )  # kernels before 5.14 lack it: the pages are read

    def close(self) -> None:
        """Stop the threads (a later :meth:`read` starts them again)."""
        with self._count:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)


_READERS: "weakref.WeakSet[ReadAhead]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for reader in list(_READERS):
        reader.forget_threads()


os.register_at_fork(after_in_child=_after_fork_in_child)

SHARED = ReadAhead()  # one pool for every source: the disk's queue, not the number of models, sets the depth
# Routed experts are read on the critical path, once the router has chosen them: a few ranges of
# a few MB each, where the time is the requests' latency. Smaller requests, more of them in
# flight (measured on the development machine, 19 MB in four ranges, cold: 0.85 GB/s with four
# 16 MB requests at most, 1.2 GB/s with sixteen of 1 MB).
ROUTED = ReadAhead(workers=16, chunk_bytes=1 << 20)
