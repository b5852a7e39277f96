"""A safetensors file mapped copy-on-write: one real CPU tensor per entry, zero-copy.

Invariants: a write into a tensor never reaches the file; the open file (not its name) is what is
mapped and checked, so a truncated file is refused by name before a read could raise SIGBUS; and
the file is held with a read lease where the kernel grants one, so that another process writing
or truncating it first waits while the tensors' bytes are copied out of it (:mod:`.lease`).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import threading
import warnings
import weakref
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator, Protocol

import torch

from automap.errors import OffloadError
from automap.offload import lease
from automap.offload.format import Header, TensorInfo, header_of, permutations_of
from automap.offload.opening import Identity, Signature, open_for_map, reopen, signature
from automap.offload.pages import (
    MADV_POPULATE_WRITE,
    PAGE,
    madvise,
    page_range,
    private_pages,
    resident_spans,
)
from automap.page_cache import MADV_POPULATE_READ

log = logging.getLogger(__name__)


class SpanReader(Protocol):
    """What reads page-aligned ``(address, length)`` spans of the file ``fd`` mapped at ``base``
    in (:class:`~automap.offload.readahead.ReadAhead`)."""

    def read(self, spans: Iterable[tuple[int, int]], fd: int, base: int) -> None: ...


class MappedFile:
    """One safetensors file, validated and mapped copy-on-write, with a tensor per key.

    Args:
        path: the file (made absolute here: a later ``os.chdir`` changes nothing); opened
            here, following links, unless ``fd`` is given.
        keys: the keys to make tensors for (default: all of them).
        fd: the file, already open (see :func:`open_for_map`); owned by this object from here.
        identity: the ``(st_dev, st_ino)`` the file must have (the file automap wrote or read).

    Raises:
        FormatError: the file is missing, truncated or not valid safetensors.
        OffloadError: a key is not in the file, or it is not the file of ``identity``.

    Example:
        >>> mapped = MappedFile(Path("model.safetensors"), ["lm_head.weight"])
        >>> mapped.tensor("lm_head.weight").shape
    """

    def __init__(
        self,
        path: Path,
        keys: Iterable[str] | None = None,
        *,
        fd: int | None = None,
        identity: Identity | None = None,
    ):
        self.path = Path(os.path.abspath(path))
        self._hold_file(fd, identity)
        try:
            self.header: Header = header_of(self.fd, self.path)
            wanted = list(self.header.tensors) if keys is None else list(dict.fromkeys(keys))
            missing = [k for k in wanted if k not in self.header.tensors]
            if missing:
                raise OffloadError(
                    f"{path} has no tensor {missing[0]!r}"
                    + (f" (nor {len(missing) - 1} more)" if len(missing) > 1 else "")
                    + "; it is not the file automap read before, or it was changed"
                )
            # Routed experts' rows are read through a descriptor of their own without the kernel's
            # readahead, which would add up to read_ahead_kb (8 MiB on many volumes) after each row:
            # the rows of experts no token went to. Whole tensors keep it: on this machine's disk a
            # cold layer read with it ran in 235 ms, without it in 440-600 ms (benchmarks/moe.py).
            # It is a second open file of the same inode (not of the name), checked to be one.
            self.rows_fd, own = reopen(self.fd)
            self._rows_finalizer = weakref.finalize(self, os.close, self.rows_fd)
            if own:  # a dup shares the readahead state: then rows keep the kernel's readahead
                os.posix_fadvise(self.rows_fd, 0, 0, os.POSIX_FADV_RANDOM)
            self.signature: Signature = signature(self.fd)
            size = self.signature[2]
            self._map = mmap.mmap(self.fd, 0, access=mmap.ACCESS_COPY) if size else None
        except BaseException:
            self.close()
            raise
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self._map)) if self._map is not None else 0
        self.permutations = permutations_of(self.header)  # tensors stored in their memory order
        self._tensors = {key: self._tensor(self.header.tensors[key]) for key in wanted}
        self._mapped_in: set[str] = set()  # keys advised before (their pages may since have been reclaimed)
        self._exact: dict[str, int] = {}  # keys whose pages fault in without read-around: readers of each
        self._exact_lock = threading.Lock()
        self._held: dict[tuple[str, int], tuple[int, int]] = {}  # (key, row) -> its pages held in memory
        self._held_lock = threading.Lock()  # held and released by the experts' worker, read by others
        self._lease_lock = (
            threading.RLock()
        )  # detaching (the lease thread) and attaching again, one at a time
        self.detached: int | None = None  # since a writer came: the bytes the user had written in memory
        self.unleased = lease.take(self) if self._map is not None else None  # why no lease (None: held)
        if self.unleased:
            log.info("%s: %s; it is checked before each read only", self.path, self.unleased)

    def _hold_file(self, fd: int | None, identity: Identity | None) -> None:
        """The file opened once (or handed over open, as ``fd``, which this object then owns);
        its header, its map and every later check go through this descriptor, never through the
        name again: what the name holds later (a link, another file) is never read."""
        self.fd = open_for_map(self.path) if fd is None else fd
        self._finalizer = weakref.finalize(self, os.close, self.fd)
        if identity is not None and self.identity != identity:
            self.close()
            raise OffloadError(
                f"{self.path} is not the file automap wrote or read there (another file was put in "
                "its place); it is not read. Restore it, or dispatch (or load) again"
            )

    def _tensor(self, info: TensorInfo) -> torch.Tensor:
        dtype = info.torch_dtype
        if info.nbytes == 0 or self._map is None:
            return torch.empty(info.shape, dtype=dtype)
        with warnings.catch_warnings():
            warnings.simplefilter(
                "ignore", UserWarning
            )  # "the given buffer is not writable": it is (private)
            flat = torch.frombuffer(
                self._map, dtype=dtype, count=info.nbytes // dtype.itemsize, offset=info.begin
            )
        order = self.permutations.get(info.key)
        return flat.view(info.shape) if order is None else flat.view(info.shape).permute(order)

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(self._tensors)

    @property
    def identity(self) -> Identity:
        """``(st_dev, st_ino)`` of the file held open: which file this is, whatever its name says."""
        info = os.fstat(self.fd)
        return info.st_dev, info.st_ino

    def close(self) -> None:
        """Close the descriptors, which ends the lease (the map stays while tensors view it)."""
        lease.drop(self)
        self._finalizer()
        rows = getattr(self, "_rows_finalizer", None)
        if rows is not None:
            rows()

    def tensor(self, key: str) -> torch.Tensor:
        """The tensor ``key``: a CPU view of the map (writes stay in this process's memory)."""
        return self._tensors[key]

    def info(self, key: str) -> TensorInfo:
        return self.header.tensors[key]

    def changed(self) -> Signature | None:
        """The mapped file's new signature if it was truncated or rewritten in place since it
        was mapped, else None (one ``fstat``). Deleting, renaming or replacing the file under
        its name changes nothing here: the map still holds the bytes read."""
        now = signature(self.fd)
        return None if now == self.signature else now

    def detach(self) -> None:
        """A writer came (the lease is breaking): the bytes of every tensor are copied into this
        process's memory, in place, so that nothing the writer does reaches them (their size in
        RAM). The checks then see the file's change as before; :meth:`attach` maps it again."""
        with self._lease_lock:
            if self.detached is not None or self._map is None:
                return
            written = self.written_bytes() or 0
            copied = lease.detach(self.spans(self._tensors))
            self.detached = written
        log.warning(
            "%s is being written by another process while tensors are read from it; automap copied "
            "their %.1f MiB into memory (reads of the file would crash once it is cut short), and refuses "
            "the file until it reads as before",
            self.path,
            copied / 2**20,
        )

    def attach(self) -> str | None:
        """After :meth:`detach`, map the file again (the lease taken again): None when done (or
        never detached), else why it cannot be (it is open for writing now; the user wrote to
        tensors in memory, which mapping the file again would drop)."""
        with self._lease_lock:
            if self.detached is None:
                return None
            if self.detached:
                return f"{self.detached} bytes of its tensors were written in memory and would be lost"
            why = lease.take(self)
            if why or lease.breaking(self.fd) or self.lost():
                return why or "another process is writing it"
            lease.attach(self.spans(self._tensors), self.fd, self.address)
            self.detached = None
            return None

    def lost(self, keys: Iterable[str] | None = None, size: int | None = None) -> list[str]:
        """The ``keys`` (default: all mapped) whose bytes lie past the file's end now (the
        file was truncated in place): reading them would raise SIGBUS, and their values are
        gone. ``size``: the file's size, if just taken."""
        size = signature(self.fd)[2] if size is None else size
        return [
            k
            for k in (self._tensors if keys is None else keys)
            if self.header.tensors[k].nbytes and self.header.tensors[k].end > size
        ]

    def spans(self, keys: Iterable[str]) -> list[tuple[int, int]]:
        """The page-aligned ``(address, length)`` span of each of ``keys`` in this process (none when empty)."""
        if self._map is None:
            return []
        found = []
        for key in keys:
            info = self.header.tensors[key]
            if info.nbytes:
                start = self.address + info.begin
                found.append((start - start % PAGE, info.nbytes + start % PAGE))
        return found

    def row_spans(self, key: str, rows: Iterable[int]) -> list[tuple[int, int]]:
        """The page-aligned ``(address, length)`` span of each of ``rows`` of ``key`` along its
        first dimension (one expert of a tensor that stacks them), in this process."""
        info = self.header.tensors[key]
        if self._map is None or not info.nbytes or not info.shape:
            return []
        order = self.permutations.get(key)
        if order is not None and order[0] != 0:  # stored in another order: its rows are not ranges
            return self.spans([key])
        row = info.nbytes // info.shape[0]
        found = []
        for index in rows:
            start = self.address + info.begin + index * row
            found.append((start - start % PAGE, row + start % PAGE))
        return found

    @contextmanager
    def faulting_exactly(self, keys: Iterable[str]) -> Iterator[None]:
        """While inside, a page fault in ``keys`` reads just its page, not the kernel's
        read-around (up to ``read_ahead_kb`` on each side): ``MADV_RANDOM`` on their part of the
        map, ``MADV_NORMAL`` again when the last reader of a key leaves. For tensors read part
        by part (routed experts' rows): a page reclaimed under memory pressure between its read
        and its mapping is read again alone, not with the rows of experts beside it. Outside,
        faults keep the read-around, which is what reads a cold tensor fast when something
        touches all of it (``undispatch``, ``torch.save``)."""
        keys = list(dict.fromkeys(keys))
        self._advise_exact(keys, +1)
        try:
            yield
        finally:
            self._advise_exact(keys, -1)

    def _advise_exact(self, keys: list[str], step: int) -> None:
        with self._exact_lock:
            for key in keys:
                before = self._exact.get(key, 0)
                after = max(before + step, 0)
                if after:
                    self._exact[key] = after
                else:
                    self._exact.pop(key, None)
                if bool(before) != bool(after):  # the first reader came, or the last one left
                    for start, length in self.spans([key]):
                        madvise(start, length, mmap.MADV_RANDOM if after else mmap.MADV_NORMAL)

    def read_spans(self, spans: list[tuple[int, int]], reader: SpanReader) -> None:
        """Read ``spans`` (of :meth:`row_spans` or :meth:`spans`) in without the kernel's
        readahead and map them, but the pages :meth:`hold` keeps and the spans whose every page
        is in memory already (``mincore``). A held row's span still has the pages it shares
        with its neighbours, which a cold start drops: without taking the held pages out, the
        whole row was read from the disk again."""
        if spans and not resident_spans(spans):
            missing = [s for s in self._without_held(spans) if not resident_spans([s])]
            if missing:
                reader.read(missing, self.rows_fd, self.address)

    def advise(self, keys: Iterable[str], populate: bool = True, reader: SpanReader | None = None) -> None:
        """Ask the kernel to read the pages of ``keys`` now: readahead of every range is
        queued at once (large reads, no waiting), then, with ``populate``, the pages are mapped
        in as they arrive so that the compute thread takes no page faults. Releases the GIL.
        With a ``reader`` (and ``populate``), the ranges are merged and read by it instead, with
        several large requests in flight (:mod:`automap.offload.readahead`).

        Keys mapped in before whose pages are all still in memory are skipped at the cost of
        one ``mincore`` (:meth:`resident`): a warm forward asks the kernel for nothing, so the
        prefetch takes no CPU from the threads computing."""
        keys = list(keys)
        spans = self.spans(keys)
        if self._mapped_in.issuperset(keys) and resident_spans(spans):
            return
        if populate and reader is not None:
            reader.read(self._without_held(spans), self.fd, self.address)
            self._mapped_in.update(keys)
            return
        for start, length in spans:
            madvise(start, length, mmap.MADV_WILLNEED)
        if populate:
            for start, length in spans:
                if not madvise(start, length, MADV_POPULATE_READ):
                    break  # kernels before 5.14 lack POPULATE_READ: the readahead still runs
        # Populated now, or (without populate) read by the caller next, which maps them in.
        self._mapped_in.update(keys)

    def resident(self, keys: Iterable[str]) -> bool:
        """Whether every page of ``keys`` is in memory now (``mincore``: a byte per page, about
        0.1 ms for 200 MB). Pages the kernel reclaimed since are read again by the next
        :meth:`advise`."""
        return resident_spans(self.spans(keys))

    def hold(self, key: str, row: int) -> int:
        """Keep the pages of ``row`` of ``key`` (one routed expert's rows) in this process's
        memory until :meth:`release`: each page becomes a private copy of the file's bytes
        (``MADV_POPULATE_WRITE``), which neither the kernel's reclaim of the page cache nor
        :meth:`evict` drops; the tensor still views the same addresses, nothing is swapped.
        Only the pages wholly inside the row are held (a page shared with a neighbour stays the
        page cache's). Returns the bytes held now (0: nothing held, as when a page of the row was
        written by the user — releasing it later would drop the write — or on a kernel without
        ``MADV_POPULATE_WRITE``)."""
        with self._held_lock:
            return self._hold(key, row)

    def _hold(self, key: str, row: int) -> int:
        if (key, row) in self._held:
            return self._held[key, row][1]
        spans = self.row_spans(key, [row])
        if len(spans) != 1 or self.permutations.get(key) is not None:
            return 0
        info = self.header.tensors[key]
        begin = self.address + info.begin + row * (info.nbytes // info.shape[0])
        end = begin + info.nbytes // info.shape[0]
        start, stop = -(-begin // PAGE) * PAGE, end // PAGE * PAGE
        if stop <= start or private_pages(page_range(start, stop - start)) != 0:
            return 0
        if not madvise(start, stop - start, MADV_POPULATE_WRITE):
            return 0
        self._held[key, row] = (start, stop - start)
        return stop - start

    def release(self, key: str, row: int) -> int:
        """Give back the pages :meth:`hold` kept of ``row`` of ``key``: the tensor views the
        file's bytes again (read again from the page cache or the disk when next used).
        Returns the bytes released."""
        with self._held_lock:
            span = self._held.pop((key, row), None)
            if span is not None and self.detached is None:  # a copy of its own now: nothing to give back
                madvise(span[0], span[1], mmap.MADV_DONTNEED)
        return 0 if span is None else span[1]

    def _without_held(self, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """``spans`` less the pages :meth:`hold` keeps (they need no read)."""
        with self._held_lock:
            kept = sorted(self._held.values())
        if not kept:
            return spans
        found = []
        for start, length in spans:
            at, end = start, start + length
            for begin, size in kept:
                if begin + size <= at or begin >= end:
                    continue
                if begin > at:
                    found.append((at, begin - at))
                at = max(at, begin + size)
            if end > at:
                found.append((at, end - at))
        return found

    @property
    def held_bytes(self) -> int:
        """Bytes :meth:`hold` keeps in memory now."""
        with self._held_lock:
            return sum(length for _, length in self._held.values())

    def written_bytes(self, keys: Iterable[str] | None = None) -> int | None:
        """Bytes of ``keys`` (default: all mapped) that were written in memory since mapping
        (whole pages), or None where the kernel does not say. Pages :meth:`hold` keeps are
        private copies too, of the file's own bytes: they are not counted; nor the copies made when
        a writer came (:meth:`detach`): the figure is the one taken then."""
        if self.detached is not None:
            return self.detached
        with self._held_lock:
            held = {p for start, length in self._held.values() for p in page_range(start, length)}
        pages = [
            p
            for start, length in self.spans(self._tensors if keys is None else keys)
            for p in page_range(start, length)
            if p not in held
        ]
        count = private_pages(pages)
        return None if count is None else count * PAGE

    def evict(self) -> None:
        """Drop this file's pages from this process and from the page cache, so the next read
        comes from the disk (a cold start, for benchmarks); the pages :meth:`hold` keeps stay.

        Raises:
            OffloadError: some pages were written in memory; dropping them would lose the writes.
        """
        written = self.written_bytes()
        if self.detached is not None:
            return  # no page of the tensors is the file's (a writer came): nothing to drop
        if written:
            raise OffloadError(
                f"{written} bytes of {self.path} were written in memory (copy-on-write); evicting "
                "the file's pages would lose them"
            )
        self._mapped_in.clear()
        if self._map is not None:
            with self._held_lock:
                kept = sorted((start - self.address, length) for start, length in self._held.values())
            at = 0
            for start, length in kept:  # around the rows held
                if start > at:
                    self._map.madvise(mmap.MADV_DONTNEED, at, start - at)
                at = max(at, start + length)
            if len(self._map) > at:
                self._map.madvise(mmap.MADV_DONTNEED, at, len(self._map) - at)
        os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)
