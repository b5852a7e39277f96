"""Cold reads past the page cache: a unit's offloaded tensors read with ``O_DIRECT`` (aligned
ranges, several large requests in flight) into a ring of buffers automap owns, for a model whose
offloaded bytes do not fit in the page cache (:func:`reads_direct`, ``AUTOMAP_COLD_READS``).

Invariants: a ring buffer is handed out again only when no tensor views it any more (its
storage's use count), so nothing a unit let escape is ever overwritten; a tensor written in
memory since it was mapped is never read from its file (its home is used instead).
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from automap.errors import OffloadError
from automap.kinds import attach
from automap.offload.mapped import MappedFile
from automap.offload.opening import read_into
from automap.offload.readahead import coalesce
from automap.offload.source import MappedSource, SourceSet, WeightSource
from automap.offload.transfer import PageTransfer, Transfer

log = logging.getLogger(__name__)

BLOCK = 4096  # O_DIRECT's alignment of offsets, lengths and addresses (every common logical block size divides it)
REQUEST_BYTES = 8 << 20  # each request a long transfer; 8 of them in flight: this machine's disk at its best
WORKERS = 8
SLOTS = 3  # the unit computing and two read ahead
GAP = 64 << 10  # bytes between two tensors read rather than split into two requests
ENV = "AUTOMAP_COLD_READS"
SETTINGS = ("auto", "direct", "mapped")


def page_cache_bytes() -> int | None:
    """What the page cache can hold now: ``MemAvailable`` of ``/proc/meminfo`` (None if unknown)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def reads_direct(file_bytes: int, cache_bytes: int | None, setting: str | None = None) -> bool:
    """The rule: offloaded units are read past the page cache when their file-backed bytes do
    not fit in it (the mapped path would read every byte from the disk on every forward, and pay
    the kernel's page-cache work for it), through the page cache (zero-copy, warm after the
    first forward) when they do, or when the page cache's room is not known (None).
    ``setting`` (default: ``AUTOMAP_COLD_READS``) overrides it:
    ``direct`` or ``mapped``; ``auto`` is the rule.

    Raises:
        OffloadError: ``setting`` is none of ``auto``, ``direct``, ``mapped``.
    """
    setting = (os.environ.get(ENV, "auto") if setting is None else setting).strip().lower() or "auto"
    if setting not in SETTINGS:
        raise OffloadError(
            f"{ENV}={setting!r} is not a setting; give one of {', '.join(SETTINGS)} (or unset it)"
        )
    if setting != "auto":
        return setting == "direct"
    return cache_bytes is not None and file_bytes > cache_bytes


def file_bytes(source: WeightSource) -> int:
    """Bytes of ``source``'s tensors that are read from files."""
    total = 0
    for name in source.names():
        entry = mapped_entry(source, name)
        total += entry[1].info(entry[2]).nbytes if entry is not None else 0
    return total


def open_direct(fd: int) -> int | None:
    """A new ``O_DIRECT`` descriptor of the inode open as ``fd`` (through ``/proc/self/fd``,
    checked to be that inode, one aligned block read as a probe), or None where the file system
    has no ``O_DIRECT`` (``EINVAL``: ramfs, tmpfs before Linux 6.6) or it cannot be opened."""
    try:
        other = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC | os.O_DIRECT)
    except OSError as exc:
        log.debug("no O_DIRECT for descriptor %d: %s", fd, exc)
        return None
    one, two = os.fstat(fd), os.fstat(other)
    probe = aligned_empty(BLOCK)
    try:
        if (one.st_dev, one.st_ino) != (two.st_dev, two.st_ino):
            raise OSError(errno.ESTALE, "another file")
        os.preadv(other, [memoryview(probe.numpy())], 0)
    except OSError as exc:
        log.debug("no O_DIRECT for descriptor %d: %s", fd, exc)
        os.close(other)
        return None
    return other


def aligned_empty(nbytes: int) -> torch.Tensor:
    """``nbytes`` of uninitialised host memory starting on a :data:`BLOCK` boundary."""
    raw = torch.empty(nbytes + BLOCK, dtype=torch.uint8)
    start = -raw.data_ptr() % BLOCK
    return raw[start : start + nbytes]


@dataclass(frozen=True)
class Piece:
    """One tensor of a unit: ``name``, its file key, and where its bytes land in the buffer."""

    name: str
    path: Path
    key: str
    at: int


@dataclass(frozen=True)
class Request:
    """``length`` bytes at ``offset`` of ``path`` into the buffer at ``at``, of which the first
    ``needed`` must be there (an aligned range may run past the file's end)."""

    path: Path
    offset: int
    at: int
    length: int
    needed: int


@dataclass(frozen=True)
class UnitReads:
    """What reading one unit takes: its pieces, its requests, the buffer's size."""

    pieces: tuple[Piece, ...]
    requests: tuple[Request, ...]
    nbytes: int


def unit_reads(
    tensors: Sequence[tuple[str, MappedFile, str]], request_bytes: int = REQUEST_BYTES
) -> UnitReads:
    """The aligned superset of each file's ranges of ``tensors`` (``(name, file, key)``), ranges
    within :data:`GAP` merged, laid out one after another in one buffer and cut into requests."""
    pieces, requests, at = [], [], 0
    by_path: dict[Path, list[tuple[str, MappedFile, str]]] = {}
    for name, mapped, key in tensors:
        by_path.setdefault(mapped.path, []).append((name, mapped, key))
    for path, entries in by_path.items():
        infos = {key: entries[0][1].info(key) for _, _, key in entries}
        spans = [
            (i.begin - i.begin % BLOCK, -(-i.end // BLOCK) * BLOCK - i.begin + i.begin % BLOCK)
            for i in infos.values()
            if i.nbytes
        ]
        placed = []
        for start, length in coalesce(spans, GAP):
            placed.append((start, at))
            end = max(i.end for i in infos.values() if i.nbytes and start <= i.begin < start + length)
            for offset in range(start, start + length, request_bytes):
                size = min(request_bytes, start + length - offset)
                requests.append(Request(path, offset, at + offset - start, size, min(size, end - offset)))
            at += length
        for name, _, key in entries:
            info = infos[key]
            home = next((a + info.begin - s for s, a in reversed(placed) if s <= info.begin), 0)
            pieces.append(Piece(name, path, key, home))
    return UnitReads(tuple(pieces), tuple(requests), at)


def mapped_entry(source: WeightSource, name: str) -> tuple[MappedSource, MappedFile, str] | None:
    """The mapped source, file and key behind ``name``, or None when it is not read from a file."""
    if isinstance(source, SourceSet):
        source = source.source_of(name)
    if not isinstance(source, MappedSource):
        return None
    path, key = source.entries[name]
    return source, source.files[path], key


class Ring:
    """``slots`` reusable buffers, each handed out only while nothing views the one before."""

    def __init__(self, slots: int = SLOTS):
        self._buffers: list[torch.Tensor | None] = [None] * slots
        self._idle = [0] * slots  # each buffer's storage use count while nothing else views it
        self._lock = threading.Lock()

    @staticmethod
    def _uses(buffer: torch.Tensor) -> int:
        return torch._C._storage_Use_Count(buffer.untyped_storage()._cdata)

    def acquire(self, nbytes: int) -> tuple[torch.Tensor, threading.Lock] | None:
        """A free buffer of at least ``nbytes`` (grown if smaller) and the lock the caller holds
        until its views exist; None when every slot is in use."""
        self._lock.acquire()
        for index, buffer in enumerate(self._buffers):
            if buffer is None or self._uses(buffer) <= self._idle[index]:
                if buffer is None or buffer.numel() < nbytes:
                    self._buffers[index] = buffer = None
                    self._buffers[index] = buffer = aligned_empty(nbytes)
                    self._idle[index] = self._uses(
                        buffer
                    )  # its own references: the slot's tensor and its base
                return buffer, self._lock
        self._lock.release()
        return None

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self._buffers if b is not None)


class DirectReads:
    """Reads units' tensors past the page cache into :class:`Ring` buffers (``read``), for
    :class:`DirectTransfer`. Built by :func:`direct_reads`."""

    def __init__(self, source: WeightSource, descriptors: dict[Path, int]):
        self.source, self.descriptors = source, descriptors
        self.ring = Ring()
        self._pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="automap-direct")
        self._layouts: dict[tuple[str, ...], UnitReads] = {}
        self._versions: dict[str, int] = {}  # each home's version when first read from its file
        self.written: set[str] = set()  # tensors written in memory: their homes are used, never the file
        self._finalizer = weakref.finalize(self, _close_all, list(descriptors.values()))

    def forget_threads(self) -> None:
        """In a forked child: a fresh pool (the parent's threads do not exist here)."""
        self._pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="automap-direct")

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._finalizer()

    def read(self, names: Sequence[str], spare: bool) -> dict[str, torch.Tensor] | None:
        """``names``, each read from its file into a ring buffer (or its home where it was written
        in memory, or is not in a file). Without a free slot: None if ``spare`` (a read ahead
        waits for the next chance), else a buffer of its own.

        Raises:
            OffloadError: a file ended before a tensor's bytes (truncated while read).
        """
        fresh = [n for n in names if self._from_file(n)]
        got = {n: self.source.get(n) for n in names if n not in fresh}
        if not fresh:
            return got
        layout = self._layout(tuple(fresh))
        held = self.ring.acquire(layout.nbytes)
        if held is None and spare:
            return None
        buffer = aligned_empty(layout.nbytes) if held is None else held[0]
        try:
            views = {p.name: self._view(buffer, p) for p in layout.pieces}
        finally:
            if held is not None:
                held[1].release()
        futures = [self._pool.submit(self._request, buffer, r) for r in layout.requests]
        wait(futures)  # every request ended before an error is raised: none writes into a buffer reused since
        for future in futures:
            future.result()
        for piece in layout.pieces:
            if piece.at % self._entry(piece.name)[0].info(piece.key).torch_dtype.itemsize:
                views[piece.name] = shaped(views[piece.name].clone(), *self._entry(piece.name))
        return {**got, **views}

    def _from_file(self, name: str) -> bool:
        """Whether ``name`` is read from its file: it is in one this reads, holds bytes, and was
        not written in memory (pages written before dispatch, or its home's version moved since)."""
        entry = mapped_entry(self.source, name)
        if name in self.written or entry is None or entry[1].path not in self.descriptors:
            return False
        if not entry[1].info(entry[2]).nbytes:
            return False
        version = self.source.get(name)._version
        if name not in self._versions:
            self._versions[name] = version
            if entry[1].written_bytes([entry[2]]) != 0:  # None: the kernel does not say, the home is safe
                self.written.add(name)
        elif self._versions[name] != version:
            self.written.add(name)
        return name not in self.written

    def _layout(self, names: tuple[str, ...]) -> UnitReads:
        if names not in self._layouts:
            self._layouts[names] = unit_reads([(n, *self._entry(n)) for n in names])
        return self._layouts[names]

    def _entry(self, name: str) -> tuple[MappedFile, str]:
        entry = mapped_entry(self.source, name)
        assert entry is not None
        return entry[1], entry[2]

    def _view(self, buffer: torch.Tensor, piece: Piece) -> torch.Tensor:
        """The tensor of ``piece`` viewing ``buffer``; its raw bytes where its offset does not suit
        its dtype (:meth:`read` copies it once read)."""
        mapped, key = self._entry(piece.name)
        info = mapped.info(key)
        raw = buffer[piece.at : piece.at + info.nbytes]
        return raw if piece.at % info.torch_dtype.itemsize else shaped(raw, mapped, key)

    def _request(self, buffer: torch.Tensor, request: Request) -> None:
        fd = self.descriptors[request.path]
        target = memoryview(buffer[request.at : request.at + request.length].numpy())
        done = read_into(fd, target, request.offset, least=request.needed)
        if done < request.needed:
            raise OffloadError(
                f"offload file {request.path} ended at byte {request.offset + done} while automap read "
                f"it, before the {request.needed - done} bytes more its tensors need: it was truncated "
                "or rewritten under the model; restore it, or drop this model and dispatch (or load) it "
                "again"
            )


def shaped(raw: torch.Tensor, mapped: MappedFile, key: str) -> torch.Tensor:
    """The bytes ``raw`` of tensor ``key`` of ``mapped`` as that tensor (dtype, shape, and the
    memory order it was stored in), as :class:`MappedFile` views its map."""
    info = mapped.info(key)
    flat = raw.view(info.torch_dtype).view(info.shape)
    order = mapped.permutations.get(key)
    return flat if order is None else flat.permute(order)


def _close_all(descriptors: list[int]) -> None:
    for fd in descriptors:
        try:
            os.close(fd)
        except OSError:
            pass


def direct_reads(source: WeightSource) -> DirectReads | None:
    """Direct reads of ``source``'s files, or None when one of them has no ``O_DIRECT`` (then
    every unit is read through the page cache, as with the rule saying so)."""
    files = {}
    for name in source.names():
        entry = mapped_entry(source, name)
        if entry is not None:
            files[entry[1].path] = entry[1]
    descriptors: dict[Path, int] = {}
    for path, mapped in files.items():
        fd = open_direct(mapped.fd)
        if fd is None:
            log.info("%s cannot be read with O_DIRECT; offloaded units are read through the page cache", path)
            _close_all(list(descriptors.values()))
            return None
        descriptors[path] = fd
    return DirectReads(source, descriptors) if descriptors else None


class DirectTransfer(Transfer):
    """CPU execution past the page cache: each unit's tensors read with ``O_DIRECT`` into a ring
    buffer (:mod:`automap.offload.direct`), up to two units ahead as the ring has room. The
    runtime swaps the parameters to them for the unit's forward and back to their homes (the
    mapped tensors, which ``state_dict()`` sees) after, as for staged copies.

    Example:
        >>> transfer = DirectTransfer(store, direct_reads(store))
    """

    swaps = True
    lookahead = 2

    def __init__(self, source: WeightSource, reads: DirectReads):
        super().__init__(source)
        self.reads = reads
        self._written: set[str] = set()  # units whose tensors were written since their last read

    def _ahead(self, names: tuple[str, ...]) -> dict[str, torch.Tensor] | None:
        return self.reads.read(names, spare=True)

    def discard(self, key: str) -> None:
        # The runtime saw the unit's tensors written in place through their parameters (which
        # hold the homes between forwards): from here on, the homes are what holds their values.
        with self._state:
            self._written.add(key)
        super().discard(key)

    def take(self, key: str, names: Sequence[str]) -> dict[str, torch.Tensor]:
        self.source.check_unchanged(names)
        with self._state:
            if key in self._written:
                self._written.discard(key)
                self.reads.written.update(names)
        future = self._claim(key)
        # A read ahead that failed is read again now, which raises its error properly.
        got = None if future is None or future.exception() is not None else future.result()
        if got is None or any(n not in got for n in names):
            got = self.reads.read(names, spare=False)
        return {n: got[n] for n in names}

    def take_rows(
        self, key: str, names: Sequence[str], rows: Sequence[int] | None
    ) -> dict[str, torch.Tensor]:
        # Routed experts: the rows the routing chose, read through the page cache as the page
        # path reads them (a few small ranges); their homes are what the runtime swaps in.
        self._read_rows(names, rows)
        return {n: self.source.get(n) for n in names}

    def forget_threads(self) -> None:
        super().forget_threads()
        self.reads.forget_threads()

    def close(self) -> None:
        super().close()
        self.reads.close()


def host_transfer(source: WeightSource, buffers: int | None = None) -> Transfer:
    """The CPU's transfer: :class:`DirectTransfer` where :func:`reads_direct` says the offloaded
    files do not fit in the page cache, their file system has ``O_DIRECT``, and the budget has
    room for the ring (``buffers``: how many buffers of the largest offloaded unit fit beside the
    plan's predicted peak; None: unknown), else :class:`~automap.offload.transfer.PageTransfer`.

    Raises:
        OffloadError: ``AUTOMAP_COLD_READS`` holds no setting.
    """
    fits = buffers is None or buffers > SLOTS  # the ring, and one buffer of its own when every slot is held
    wanted = reads_direct(file_bytes(source), page_cache_bytes())
    if wanted and not fits:
        log.info(
            "reads past the page cache need %d buffers of the largest offloaded unit beside the run; "
            "the budget has room for %d: offloaded units are read through the page cache",
            SLOTS + 1,
            buffers,
        )
    reads = direct_reads(source) if wanted and fits else None
    return PageTransfer(source) if reads is None else DirectTransfer(source, reads)


attach("cpu", transfer=host_transfer)  # the registry in automap.kinds names no module above it
