"""Weight sources: the one protocol (:class:`WeightSource`) through which the runtime and the
loader see offloaded weights, and the RAM and composite sources. A new kind of source implements
it here; nothing in ``automap/runtime/`` changes.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Collection, Iterable, Mapping, Protocol, Sequence, runtime_checkable

import torch

from automap.errors import OffloadError
from automap.offload.readahead import ROUTED, SHARED, ReadAhead
from automap.offload.mapped import MappedFile, Signature

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SourceStats:
    """What a source holds, for :func:`automap.placement`: bytes read from files (file-backed
    pages, no anonymous memory until written), bytes in host RAM (of which pinned), and bytes
    written in memory over file-backed tensors (copy-on-write; None: the kernel does not say)."""

    file_bytes: int = 0
    ram_bytes: int = 0
    pinned_bytes: int = 0
    written_bytes: int | None = 0

    def __add__(self, other: SourceStats) -> SourceStats:
        written = (
            None
            if self.written_bytes is None or other.written_bytes is None
            else self.written_bytes + other.written_bytes
        )
        return SourceStats(
            self.file_bytes + other.file_bytes,
            self.ram_bytes + other.ram_bytes,
            self.pinned_bytes + other.pinned_bytes,
            written,
        )


@runtime_checkable
class WeightSource(Protocol):
    """Offloaded weights by name. Every method may be called from several threads."""

    def names(self) -> Collection[str]:
        """The tensor names this source holds."""

    def get(self, name: str) -> torch.Tensor:
        """The tensor ``name`` as a real CPU tensor (true shape, dtype and values); the same
        object on every call, so a parameter can hold it between uses."""

    def prefetch(self, names: Sequence[str], populate: bool = True) -> None:
        """Bring ``names`` close: into the page cache and, with ``populate``, mapped into this
        process (that may block, so the runtime calls it on a worker thread); without, only
        queue the reads and return. A hint: doing nothing is correct."""

    def check_unchanged(self, names: Iterable[str]) -> None:
        """Raise :class:`~automap.errors.OffloadError` when the bytes behind ``names`` can no
        longer be trusted (a file truncated under them, or rewritten with other contents),
        naming them; a file deleted or replaced under its name is fine when its bytes are
        still held (a map)."""

    def stats(self) -> SourceStats:
        """Bytes held, for the placement report."""

    def close(self, discard: bool = False) -> None:
        """Give up the source (locks released). With ``discard``, also remove whatever this
        source itself created on disk (a failed dispatch or load)."""


@runtime_checkable
class RowSource(Protocol):
    """A :class:`WeightSource` that can also read part of a tensor: some of the rows along its
    first dimension (the routed experts of a tensor that stacks every expert). A source without
    it has whole tensors read instead."""

    def prefetch_rows(self, names: Sequence[str], rows: Sequence[int] | None) -> None:
        """Bring ``rows`` of each of ``names`` (every row: None) into memory and map them in,
        reading nothing around them (they are read once the routing is known, and what lies
        beside them is experts no token went to); returns when they are there (a hint: doing
        nothing is correct)."""


@runtime_checkable
class HoldingSource(Protocol):
    """A :class:`WeightSource` whose tensors live in files and can keep some rows in memory
    (the hot experts of a tensor that stacks them: :class:`~automap.runtime.experts.HotExperts`)
    while the rest stays the page cache's, which a cold start or memory pressure drops."""

    def hold_rows(self, name: str, row: int) -> int:
        """Keep ``row`` of ``name`` in memory; the bytes held (0: it cannot be)."""

    def release_rows(self, name: str, row: int) -> int:
        """Stop keeping ``row`` of ``name``; the bytes given back."""


class RamSource:
    """Tensors kept in host RAM, pinned for fast copies when an accelerator executes.

    Example:
        >>> source = RamSource({"fc.weight": weight}, pin=torch.cuda.is_available())
    """

    def __init__(self, tensors: Mapping[str, torch.Tensor], pin: bool = False):
        self._tensors = {n: (t.pin_memory() if pin and t.numel() else t) for n, t in tensors.items()}
        self.pinned = pin

    def names(self) -> Collection[str]:
        return self._tensors.keys()

    def get(self, name: str) -> torch.Tensor:
        return self._tensors[name]

    def prefetch(self, names: Sequence[str], populate: bool = True) -> None:
        return None  # already in RAM

    def check_unchanged(self, names: Iterable[str]) -> None:
        return None

    def prefetch_rows(self, names: Sequence[str], rows: Sequence[int] | None) -> None:
        return None  # already in RAM

    def stats(self) -> SourceStats:
        nbytes = sum(t.numel() * t.element_size() for t in self._tensors.values())
        return SourceStats(ram_bytes=nbytes, pinned_bytes=nbytes if self.pinned else 0)

    def close(self, discard: bool = False) -> None:
        self._tensors = {}


class MappedSource:
    """Tensors read through copy-on-write maps of safetensors files.

    Args:
        entries: tensor name -> (file, key inside it).
        files: the files already open and mapped, by path (the rest are opened by path here).

    Subclasses decide what a changed file means (:meth:`accept_change`).
    """

    kind = "offload file"

    def __init__(
        self, entries: Mapping[str, tuple[Path, str]], files: Mapping[Path, MappedFile] | None = None
    ):
        self.entries = dict(entries)
        by_file: dict[Path, list[str]] = {}
        for path, key in self.entries.values():
            by_file.setdefault(path, []).append(key)
        # Files opened (and checked) by the caller are used as they are: never opened again by name.
        given = dict(files or {})
        self.files = {
            path: given[path] if path in given else MappedFile(path, keys) for path, keys in by_file.items()
        }
        self._names_in = {path: [n for n, (p, _) in self.entries.items() if p == path] for path in by_file}
        self._lock = threading.Lock()  # one thread at a time decides about a changed file
        self.reader: ReadAhead = SHARED  # several large reads in flight
        self.row_reader: ReadAhead = ROUTED  # routed experts: more, smaller requests

    def names(self) -> Collection[str]:
        return self.entries.keys()

    def get(self, name: str) -> torch.Tensor:
        path, key = self.entries[name]
        return self.files[path].tensor(key)

    def file_of(self, name: str) -> Path:
        return self.entries[name][0]

    def prefetch(self, names: Sequence[str], populate: bool = True) -> None:
        for path, keys in self._keys_by_file(names).items():
            self.files[path].advise(keys, populate, self.reader)

    def prefetch_rows(self, names: Sequence[str], rows: Sequence[int] | None) -> None:
        """Read ``rows`` of each of ``names`` (whole tensors: None) with several requests in
        flight and without the kernel's readahead (the file ranges of every tensor of one file
        merged into one read)."""
        for path, keys in self._keys_by_file(names).items():
            mapped = self.files[path]
            if rows is None:
                mapped.read_spans(mapped.spans(keys), self.row_reader)
                continue
            with mapped.faulting_exactly(keys):
                mapped.read_spans([s for key in keys for s in mapped.row_spans(key, rows)], self.row_reader)

    def hold_rows(self, name: str, row: int) -> int:
        path, key = self.entries[name]
        return self.files[path].hold(key, row)

    def release_rows(self, name: str, row: int) -> int:
        path, key = self.entries[name]
        return self.files[path].release(key, row)

    def _keys_by_file(self, names: Iterable[str]) -> dict[Path, list[str]]:
        found: dict[Path, list[str]] = {}
        for name in names:
            path, key = self.entries[name]
            found.setdefault(path, []).append(key)
        return found

    def check_unchanged(self, names: Iterable[str]) -> None:
        for path in {self.entries[n][0] for n in names}:
            self.check_file(path)

    def check_file(self, path: Path) -> None:
        """Raise :class:`OffloadError` when the mapped file was truncated under the tensors
        (naming them) or rewritten in place with other bytes; accept what its kind accepts.
        One ``fstat`` of the file automap mapped: what became of its name (deleted, replaced,
        moved, a relative path after ``os.chdir``) does not matter, the map holds the bytes."""
        mapped = self.files[path]
        now = mapped.changed()
        if now is None:
            return
        with self._lock:
            if mapped.signature == now:
                return  # another thread accepted it meanwhile
            lost = mapped.lost(size=now[2])
            if lost:
                raise OffloadError(self.truncated(mapped, now[2], lost))
            why = mapped.attach()  # after a writer came, the file is read again only under a lease
            if why:
                raise OffloadError(
                    f"{self.kind} {mapped.path} changed: another process wrote it while tensors were "
                    f"read from it, and automap keeps copies of their bytes in memory until it can "
                    f"read the file again, which it cannot now ({why}); {self.fix}"
                )
            self.accept_change(mapped, now)
            mapped.signature = now

    def truncated(self, mapped: MappedFile, size: int, lost: list[str]) -> str:
        """The message for a file truncated in place under tensors (file keys ``lost``)."""
        by_key = {key: name for name, (p, key) in self.entries.items() if p == mapped.path}
        names = [by_key.get(k, k) for k in lost]
        listed = ", ".join(repr(n) for n in names[:3]) + (
            f" and {len(names) - 3} more" if len(names) > 3 else ""
        )
        fate = (
            "reading them would kill the process (SIGBUS)"
            if mapped.detached is None
            else "automap copied them into memory when the writer came, so no read of them raises SIGBUS"
        )
        return (
            f"{self.kind} {mapped.path} is truncated: {size} bytes in place, its header needs "
            f"{mapped.header.needed}; the bytes of tensor{'s' if len(names) > 1 else ''} {listed} are gone from "
            f"it, and {fate}: restore it (its former contents: the model then works "
            "again, and automap.undispatch reads them back); if they are lost, drop this model and load or build it "
            "again"
        )

    @property
    def fix(self) -> str:
        return (
            "restore it (then the model works again, and automap.undispatch reads it back); if it is lost, drop "
            "this model and dispatch (or load) it again"
        )

    def accept_change(self, mapped: MappedFile, now: Signature) -> None:
        """The file was rewritten in place (same inode, still long enough): raise if the
        bytes the tensors view can no longer be trusted."""
        raise OffloadError(f"{self.kind} {mapped.path} changed after automap mapped it; {self.fix}")

    def stats(self) -> SourceStats:
        written: int | None = 0
        for mapped in self.files.values():
            more = mapped.written_bytes()
            written = None if written is None or more is None else written + more
        return SourceStats(
            file_bytes=sum(self.get(n).numel() * self.get(n).element_size() for n in self.entries),
            written_bytes=written,
        )

    def evict(self) -> None:
        """Drop every page of the files from memory (a cold start, for benchmarks)."""
        for mapped in self.files.values():
            mapped.evict()

    def close(self, discard: bool = False) -> None:
        return None  # the maps close when the last tensor viewing them is gone


class SourceSet:
    """Several sources behind one :class:`WeightSource` (the store, the checkpoint, RAM)."""

    def __init__(self, sources: Sequence[WeightSource]):
        self.sources = [s for s in sources if s is not None]
        self._by_name: dict[str, WeightSource] = {}
        for source in self.sources:
            for name in source.names():
                self._by_name.setdefault(name, source)

    def names(self) -> Collection[str]:
        return self._by_name.keys()

    def source_of(self, name: str) -> WeightSource:
        return self._by_name[name]

    def get(self, name: str) -> torch.Tensor:
        return self._by_name[name].get(name)

    def _split(self, names: Iterable[str]) -> dict[int, tuple[WeightSource, list[str]]]:
        found: dict[int, tuple[WeightSource, list[str]]] = {}
        for name in names:
            source = self._by_name[name]
            found.setdefault(id(source), (source, []))[1].append(name)
        return found

    def prefetch(self, names: Sequence[str], populate: bool = True) -> None:
        for source, part in self._split(names).values():
            source.prefetch(part, populate)

    def prefetch_rows(self, names: Sequence[str], rows: Sequence[int] | None) -> None:
        for source, part in self._split(names).values():
            if isinstance(source, RowSource):
                source.prefetch_rows(part, rows)
            else:
                source.prefetch(part)

    def check_unchanged(self, names: Iterable[str]) -> None:
        for source, part in self._split(names).values():
            source.check_unchanged(part)

    def hold_rows(self, name: str, row: int) -> int:
        source = self._by_name[name]
        return source.hold_rows(name, row) if isinstance(source, HoldingSource) else 0

    def release_rows(self, name: str, row: int) -> int:
        source = self._by_name[name]
        return source.release_rows(name, row) if isinstance(source, HoldingSource) else 0

    def stats(self) -> SourceStats:
        total = SourceStats()
        for source in self.sources:
            total = total + source.stats()
        return total

    def close(self, discard: bool = False) -> None:
        for source in self.sources:
            source.close(discard)
