"""The offload store: a directory automap creates inside ``offload_dir``, marks as its own and
locks, holding the weights of units placed on disk, read back copy-on-write.

Invariants: automap never creates, replaces, truncates or deletes a file it did not create; one
live model per store (``flock``); a store is complete only when its manifest says so.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterable, Iterator, Mapping

import torch

from automap.errors import OffloadError
from automap.offload.format import DTYPE_NAMES, write_file
from automap.offload.manifest import (
    FORMAT,
    MANIFEST,
    VERSION,
    Record,
    checksum,
    is_manifest,
    read_manifest,
    write_manifest,
)
from automap.offload.mapped import MappedFile, Signature
from automap.offload.source import MappedSource
from automap.interrupts import deferred
from automap.offload.store_files import StoreDir, check_offload_dir, is_temp_of, make_root, remove_folders
from automap.offload.store_lock import LOCK, StoreLock, holder_of
from automap.offload.store_writer import StoreWriter, TensorSpec, as_offload_error, intact

__all__ = [
    "FORMAT",
    "LOCK",
    "MANIFEST",
    "STORE_PREFIX",
    "VERSION",
    "OffloadStore",
    "Record",
    "TensorSpec",
    "check_offload_dir",
    "checksum",
    "fingerprint_of",
    "intact",
    "read_manifest",
    "write_file",
]

log = logging.getLogger(__name__)

STORE_PREFIX = "automap-store-"
MAX_STORES = 10_000
ROOT_TRIES = 5  # offload_dir made again when another caller removed it between our making and our use


class OffloadStore(MappedSource):
    """A locked store directory of offloaded weights, read copy-on-write through mmap.

    Build one with :meth:`write`; it holds its lock until :meth:`close`.

    Example:
        >>> store = OffloadStore.write("offload", {"fc.weight": TensorSpec("fc", torch.float32, (2, 2))},
        ...                            lambda name: torch.ones(2, 2))
        >>> store.get("fc.weight").sum()
        tensor(4.)
    """

    kind = "offload store file"

    def __init__(
        self,
        folder: StoreDir,
        records: Mapping[str, Record],
        lock: StoreLock,
        *,
        created: Iterable[str] = (),
        fresh: bool = False,
        made: Iterable[Path] = (),
        files: Mapping[Path, MappedFile] | None = None,
    ):
        super().__init__(
            {n: (folder / r.file, r.key) for n, r in records.items()},
            map_files(folder, records) if files is None else files,
        )
        self.folder, self.directory, self.records, self.lock = folder, folder.path, dict(records), lock
        # What this call created, for close(discard=True): files, whether the store directory
        # is new, and the folders above it that it had to make.
        self._created, self._fresh, self._made = list(created), fresh, list(made)

    @property
    def fix(self) -> str:
        return (
            "restore it, or call automap.undispatch(model) and dispatch (or load) again; automap will "
            "rebuild the store"
        )

    def accept_change(self, mapped: MappedFile, now: Signature) -> None:
        """A store file rewritten in place is used only if every tensor still matches its
        checksum (a touched file, or one restored from a copy)."""
        for name in self._names_in[mapped.path]:
            if checksum(self.get(name)) != self.records[name].crc32:
                raise OffloadError(
                    f"offload tensor {name!r} in {mapped.path} does not match its checksum; the file "
                    f"was changed after writing: {self.fix}"
                )
        log.warning("offload file %s changed on disk but still matches its checksums; using it", mapped.path)

    def verify(self) -> None:
        """Recompute every checksum and raise :class:`OffloadError` on the first mismatch."""
        for path in self.files:
            self.accept_change(self.files[path], self.files[path].signature)

    def close(self, discard: bool = False) -> None:
        """Release the lock; the files stay for the next dispatch of the same weights. With
        ``discard``, a store this call created is removed again (only its own files). Safe to
        call again: a store closed stays closed."""
        if self.folder.fd < 0:
            return
        if discard and self._fresh:
            self.folder.remove([*self._created, MANIFEST, LOCK])
            remove_folders([self.directory])  # before the lock goes: nobody can adopt it meanwhile
        self.lock.release()
        self.folder.close()
        if discard and self._fresh:
            remove_folders(self._made)

    # -------------------------------------------------------------- writing

    @classmethod
    def write(
        cls,
        offload_dir: str | os.PathLike[str],
        specs: Mapping[str, TensorSpec],
        read: Callable[[str], torch.Tensor],
    ) -> OffloadStore:
        """Store the tensors named in ``specs`` (``read(name)`` gives each, one unit at a time)
        in a store directory of automap's own under ``offload_dir``, reusing a free store of the
        same tensors when there is one.

        Raises:
            OffloadError: ``offload_dir`` cannot be created or written, the disk is full, or a
                write failed; nothing this call wrote is left behind.
        """
        unstorable = [(n, s.dtype) for n, s in specs.items() if s.dtype not in DTYPE_NAMES]
        if unstorable:
            name, dtype = unstorable[0]
            raise OffloadError(
                f"{len(unstorable)} offloaded tensor(s) have a dtype the offload store (safetensors) cannot hold, first "
                f"{name!r} ({str(dtype).replace('torch.', '')}); keep its module in memory (map it to 'cpu' or a GPU), "
                "or convert it to a dtype safetensors has"
            )
        root = Path(offload_dir)
        made = make_root(root)
        fingerprint = fingerprint_of(specs)
        started: list[Path] = []  # a store this call made, until _fill has it (or has removed it)
        try:
            for attempt in range(ROOT_TRIES):
                try:
                    for directory in candidates(root, fingerprint):
                        store = cls._reuse(directory, specs, read, made)
                        if store is not None:
                            return store
                    folder, lock = new_store_dir(root, fingerprint, started)
                    break
                except FileNotFoundError:
                    # offload_dir was removed meanwhile: made by another caller whose dispatch
                    # failed and removed it again (it was empty). Made again, by this call then.
                    if attempt == ROOT_TRIES - 1:
                        raise
                    made.extend(make_root(root))
            return cls._fill(folder, lock, specs, read, fresh=True, made=made, started=started)
        except BaseException as exc:
            discard_started(started)  # an interrupt between the two calls: the new store's first files go
            remove_folders(made)
            wrapped = as_offload_error(exc, root)
            if wrapped is exc:
                raise
            raise wrapped from exc

    @classmethod
    def _reuse(
        cls,
        directory: Path,
        specs: Mapping[str, TensorSpec],
        read: Callable[[str], torch.Tensor],
        made: list[Path],
    ) -> OffloadStore | None:
        """The store at ``directory`` filled with ``specs``, or None when it is passed over."""
        taken = take_store(directory)
        if taken is None:
            return None
        try:
            return cls._fill(*taken, specs, read, fresh=False, made=made)
        except OffloadError as exc:
            if not isinstance(exc.__cause__, PermissionError):
                raise
            log.warning("offload store %s cannot be written (%s); making another", directory, exc.__cause__)
            return None

    @classmethod
    def _fill(
        cls,
        folder: StoreDir,
        lock: StoreLock,
        specs: Mapping[str, TensorSpec],
        read: Callable[[str], torch.Tensor],
        *,
        fresh: bool,
        made: list[Path],
        started: list[Path] | None = None,
    ) -> OffloadStore:
        writer: StoreWriter | None = None
        try:
            writer = StoreWriter(folder, fresh)
            if started:
                started.clear()  # its cleanup is this one's from here
            records = writer.write_all(specs, read)
            files = map_files(folder, records, writer.identities)
            with deferred():  # built and known to the caller together (see collecting)
                store = cls(
                    folder, records, lock, created=writer.created, fresh=fresh, made=made, files=files
                )
                _collected(store)
        except BaseException as exc:
            wrapped = as_offload_error(exc, folder)
            if writer is not None:
                writer.undo()
            if fresh:
                folder.remove([MANIFEST, LOCK])
                remove_folders([folder.path])
            lock.release()
            folder.close()
            if wrapped is exc:
                raise
            raise wrapped from exc
        writer.remove_stale(records)
        return store


def map_files(
    folder: StoreDir, records: Mapping[str, Record], identities: Mapping[str, tuple[int, int]] | None = None
) -> dict[Path, MappedFile]:
    """Each file of the store mapped through the held folder (never by its path, never through
    a link), and checked to be the very file written (``identities``: its ``st_dev``/``st_ino``
    when written); the maps then hold those bytes whatever becomes of the names.

    Raises:
        OffloadError, FormatError: a file is missing, a link, another user's, or not the one
            written (it was replaced); it is not read.
    """
    keys: dict[str, list[str]] = {}
    for record in records.values():
        keys.setdefault(record.file, []).append(record.key)
    files: dict[Path, MappedFile] = {}
    try:
        for file, wanted in keys.items():
            files[folder / file] = folder.map(file, wanted, (identities or {}).get(file))
    except BaseException:
        for mapped in files.values():
            mapped.close()
        raise
    return files


def fingerprint_of(specs: Mapping[str, TensorSpec]) -> str:
    """A short hash of what a store holds (names, units, dtypes, shapes), naming its directory
    so that the same model finds its own store again."""
    items = sorted((n, s.group, str(s.dtype), list(s.shape)) for n, s in specs.items())
    return hashlib.sha256(json.dumps(items).encode()).hexdigest()[:16]


def candidates(root: Path, fingerprint: str) -> list[Path]:
    """Names under ``root`` of stores made for the same tensors, in the order they were made
    (whether each is a store automap may use is :func:`take_store`'s to say)."""
    pattern = re.compile(rf"^{re.escape(STORE_PREFIX + fingerprint)}-(\d+)$")
    found = [(int(m[1]), name) for name in os.listdir(root) if (m := pattern.match(name))]
    return [root / name for _, name in sorted(found)]


def take_store(directory: Path) -> tuple[StoreDir, StoreLock] | None:
    """The store at ``directory`` opened and locked, or None when it is passed over: not a real
    directory of this user's, its lock file not a plain file of ours, a folder in place of its
    manifest (which could never be written), unwritable, in use by a live process, or its lock
    file cannot be rewritten (immutable)."""
    folder = StoreDir.open(directory)
    if folder is None:
        return None
    if not folder.is_own_file(LOCK) or folder.is_dir(MANIFEST) or not folder.writable() or folder.shared():
        log.info(
            "%s is not a store automap can use (its lock file is not a plain file of ours, a folder has its "
            "manifest's name, the folder is not writable, or others may write in it); passing it over",
            directory,
        )
        folder.close()
        return None
    lock = StoreLock.take(folder)
    if lock is None:
        log.info("offload store %s is in use by %s; making another", directory, holder_of(folder))
        folder.close()
        return None
    try:
        StoreLock.mark(folder)
    except OSError as exc:
        log.info(
            "offload store %s: its lock file cannot be rewritten (%s); passing it over",
            directory,
            exc.strerror,
        )
        lock.release()
        folder.close()
        return None
    return folder, lock


# The list a caller (a dispatch) keeps the stores it made in, per thread (see collecting).
_collector = threading.local()


@contextmanager
def collecting(into: list) -> Iterator[None]:
    """Inside, each store this thread builds is appended to ``into`` in the same step as it is
    built: an interrupt between the store's making and its return to the caller (which only
    then could record it) cannot leave a store on disk that the caller's rollback does not know."""
    previous = getattr(_collector, "into", None)
    _collector.into = into
    try:
        yield
    finally:
        _collector.into = previous


def _collected(store: OffloadStore) -> None:
    into = getattr(_collector, "into", None)
    if into is not None:
        into.append(store)


def new_store_dir(root: Path, fingerprint: str, started: list[Path]) -> tuple[StoreDir, StoreLock]:
    """Create the next free ``automap-store-<fingerprint>-<n>`` (mkdir is atomic, so two
    processes never get the same one), lock it, then write its manifest and lock file: whoever
    sees the lock file finds the lock held. A directory of ours that a crash left before its
    lock file existed is taken over.

    Raises:
        OSError: the directory or its first files cannot be created (disk full, no inodes);
            nothing is left behind.
        OffloadError: ``root`` already holds :data:`MAX_STORES` stores of this model.
    """
    for n in range(MAX_STORES):
        directory = root / f"{STORE_PREFIX}{fingerprint}-{n}"
        made = False
        try:
            with deferred():  # made and known to be ours together: an interrupt comes after
                try:
                    os.mkdir(directory, 0o700)  # its files are this user's alone to change
                    made = True
                    started.append(directory)
                except FileExistsError:
                    pass
            if not made:
                taken = adopt(directory)
                if taken is not None:
                    return taken
                continue
            folder = StoreDir.open(directory)
            lock = StoreLock.take(folder) if folder is not None else None
        except BaseException:  # an interrupt before the store could start: the empty folder goes
            if made:
                remove_folders([directory])
            raise
        if folder is not None and lock is not None:
            return start_store(folder, lock)
        if folder is not None:
            folder.close()  # another process took it over between our mkdir and our lock
    raise OffloadError(
        f"{root} already holds {MAX_STORES:,} offload stores of this model; delete the "
        f"{STORE_PREFIX}{fingerprint}-* directories that no process uses"
    )


def discard_started(started: list[Path]) -> None:
    """Remove the first files (manifest, lock file) of stores made by this call that nothing
    holds yet, and their directories if nothing else is in them."""
    for directory in started:
        folder = StoreDir.open(directory)
        if folder is not None:
            folder.remove([MANIFEST, LOCK])
            folder.close()
        remove_folders([directory])


def adopt(directory: Path) -> tuple[StoreDir, StoreLock] | None:
    """``directory`` locked and started afresh if it is one of ours that a crash left before
    its lock file existed: a folder of this user's holding nothing but automap's manifest (a
    file of that name that is not one is the user's) and temporary files, and no live writer.
    Else None: it is not touched."""
    folder = StoreDir.open(directory)
    if folder is None:
        return None
    lock = StoreLock.take(folder) if not folder.exists(LOCK) else None
    if lock is None:
        folder.close()
        return None
    entries = folder.names()
    ours = all((e == MANIFEST or is_temp_of(e, {MANIFEST, LOCK})) and folder.is_own_file(e) for e in entries)
    if not ours or (MANIFEST in entries and not is_manifest(folder)):
        lock.release()
        folder.close()
        return None
    folder.remove(entries)
    log.info("taking over %s, left unfinished by a writer that died", directory)
    return start_store(folder, lock)


def start_store(folder: StoreDir, lock: StoreLock) -> tuple[StoreDir, StoreLock]:
    """Write a new store's manifest (not complete) and then its lock file; on failure remove
    them and the directory again."""
    try:
        write_manifest(folder, {}, complete=False)
        StoreLock.mark(folder)
    except BaseException:
        folder.remove([MANIFEST, LOCK])
        remove_folders([folder.path])
        lock.release()
        folder.close()
        raise
    return folder, lock
