"""The offload store: a directory automap creates, marks as its own and locks, holding the weights
of units placed on disk in safetensors files, read back copy-on-write through mmap.

Layout, inside the ``offload_dir`` the user gave (which may hold anything of theirs)::

    offload_dir/
      automap-store-<fingerprint>-<n>/     # created by automap with mkdir; nothing else is
        automap-store.lock                 # created first; flock()ed while a model uses the store
        automap-store.json                 # the manifest: marker, version, "complete", tensors
        <unit>.safetensors                 # one file per unit, written under a temporary name

The rules (see docs/offload-safety.md):

- automap writes only inside a store directory it created; it never creates, replaces,
  truncates or deletes a file it did not create — files in a store are only ever replaced or
  removed when the store's own manifest lists them, or when this process wrote them.
- One live model per store: the lock is an ``flock`` held for as long as the model is
  dispatched, so a second dispatch — this process or another — finds it held and builds a
  store of its own. The kernel drops the lock when its holder exits, ``kill -9`` included, so a
  stale lock is simply a free one.
- The manifest is written last with ``"complete": true`` and rewritten ``false`` before any file
  of a reused store is touched, so a store interrupted mid-write is detected and rebuilt. A
  store whose manifest is missing, damaged, of another version or not complete is rebuilt; a
  directory without automap's lock file is never touched.
- Files whose bytes already match (same tensors, same checksums) are reused, not rewritten.
- A failed write (disk full, quota, I/O or permission error) removes what it wrote — and the
  store directory, and ``offload_dir`` itself, when it created them — and raises
  :class:`~automap.errors.OffloadError`.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import time
import weakref
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import torch

from automap.errors import AutomapError, OffloadError
from automap.offload.format import DTYPE_NAMES, write_file
from automap.offload.mapped import MappedFile, Signature
from automap.offload.source import MappedSource
from automap.sizes import format_bytes

log = logging.getLogger(__name__)

STORE_PREFIX = "automap-store-"
MANIFEST = "automap-store.json"
LOCK = "automap-store.lock"
FORMAT = "automap-offload-store"
VERSION = 2


@dataclass(frozen=True)
class Record:
    """One stored tensor: its file in the store, its key there, and what it must look like."""

    file: str
    key: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    crc32: int


@dataclass(frozen=True)
class TensorSpec:
    """What will be written for one tensor before it is read: the unit (file group) it goes
    with, its dtype and its shape."""

    group: str
    dtype: torch.dtype
    shape: tuple[int, ...]


def checksum(tensor: torch.Tensor) -> int:
    """CRC-32 of the tensor's bytes (contiguous, on CPU)."""
    data = tensor.detach().cpu().contiguous()
    return zlib.crc32(data.reshape(-1).view(torch.uint8).numpy()) if data.numel() else 0  # type: ignore[arg-type]


# ------------------------------------------------------------------ the lock


class StoreLock:
    """An exclusive ``flock`` on a store's lock file, held until :meth:`release` (or until the
    object is collected, or the process exits). The file also says who holds it, for messages."""

    def __init__(self, fd: int, path: Path):
        self.fd, self.path = fd, path
        self._finalizer = weakref.finalize(self, os.close, fd)

    @classmethod
    def acquire(cls, path: Path, create: bool) -> StoreLock | None:
        """The lock, or None when another holder has it (or, without ``create``, when the file
        does not exist: then the directory is not a store automap finished creating)."""
        flags = os.O_RDWR | ((os.O_CREAT | os.O_EXCL) if create else 0)
        try:
            fd = os.open(path, flags, 0o644)
        except FileNotFoundError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}).encode())
        return cls(fd, path)

    def release(self) -> None:
        self._finalizer()


def holder_of(path: Path) -> str:
    """Who holds a store's lock, as the lock file says ("pid 123 on host")."""
    try:
        info = json.loads(path.read_text() or "{}")
        return f"pid {info.get('pid')} on {info.get('host')}"
    except (OSError, ValueError):
        return "another process"


# ------------------------------------------------------------------ the store


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

    def __init__(self, directory: Path, records: Mapping[str, Record], lock: StoreLock, *,
                 created: Iterable[Path] = (), fresh: bool = False, made: Iterable[Path] = ()):
        super().__init__({n: (directory / r.file, r.key) for n, r in records.items()})
        self.directory, self.records, self.lock = directory, dict(records), lock
        # What this call created, for close(discard=True): files, whether the store directory
        # is new, and the folders above it that it had to make.
        self._created, self._fresh, self._made = list(created), fresh, list(made)

    @property
    def fix(self) -> str:
        return ("restore it, or call automap.undispatch(model) and dispatch (or load) again; automap will "
                "rebuild the store")

    def accept_change(self, mapped: MappedFile, now: Signature) -> None:
        """A store file rewritten in place is used only if every tensor still matches its
        checksum (a touched file, or one restored from a copy)."""
        for name in self._names_in[mapped.path]:
            if checksum(self.get(name)) != self.records[name].crc32:
                raise OffloadError(f"offload tensor {name!r} in {mapped.path} does not match its checksum; the file "
                                   f"was changed after writing: {self.fix}")
        log.warning("offload file %s changed on disk but still matches its checksums; using it", mapped.path)

    def verify(self) -> None:
        """Recompute every checksum and raise :class:`OffloadError` on the first mismatch."""
        for path in self.files:
            self.accept_change(self.files[path], self.files[path].signature)

    def close(self, discard: bool = False) -> None:
        """Release the lock; the files stay for the next dispatch of the same weights. With
        ``discard``, a store this call created is removed again (only its own files)."""
        if discard and self._fresh:
            remove_created(self.directory, [*self._created, self.directory / MANIFEST])
        self.lock.release()
        if discard and self._fresh:
            remove_created(self.directory, [self.directory / LOCK], remove_folder=True)
            remove_folders(self._made)

    # -------------------------------------------------------------- writing

    @classmethod
    def write(cls, offload_dir: str | os.PathLike[str], specs: Mapping[str, TensorSpec],
              read: Callable[[str], torch.Tensor]) -> OffloadStore:
        """Store the tensors named in ``specs`` (``read(name)`` gives each, one unit at a time)
        in a store directory of automap's own under ``offload_dir``, reusing a free store of the
        same tensors when there is one.

        Raises:
            OffloadError: ``offload_dir`` cannot be created or written, the disk is full, or a
                write failed; nothing this call wrote is left behind.
        """
        root = Path(offload_dir)
        made = make_root(root)
        fingerprint = fingerprint_of(specs)
        try:
            for directory in candidates(root, fingerprint):
                lock = StoreLock.acquire(directory / LOCK, create=False)
                if lock is not None:
                    return cls._fill(directory, lock, specs, read, fresh=False, made=made)
                log.info("offload store %s is in use by %s; making another", directory, holder_of(directory / LOCK))
            directory, lock = new_store_dir(root, fingerprint)
            return cls._fill(directory, lock, specs, read, fresh=True, made=made)
        except BaseException:
            remove_folders(made)
            raise

    @classmethod
    def _fill(cls, directory: Path, lock: StoreLock, specs: Mapping[str, TensorSpec],
              read: Callable[[str], torch.Tensor], *, fresh: bool, made: list[Path]) -> OffloadStore:
        writer = _Writer(directory, fresh)
        try:
            records = writer.write_all(specs, read)
            store = cls(directory, records, lock, created=writer.created, fresh=fresh, made=made)
        except BaseException as exc:
            writer.undo()
            lock.release()
            if fresh:
                remove_created(directory, [directory / MANIFEST, directory / LOCK], remove_folder=True)
            wrapped = _as_offload_error(exc, directory)
            if wrapped is exc:
                raise
            raise wrapped from exc
        writer.remove_stale(records)
        return store


def _as_offload_error(exc: BaseException, directory: Path) -> BaseException:
    if isinstance(exc, OSError):
        where = f": {exc.filename}" if getattr(exc, "filename", None) else ""
        return OffloadError(f"writing the offload store in {directory} failed ({exc.strerror or exc}{where}); "
                            "nothing it wrote was kept. Free space there or pass another offload_dir")
    if isinstance(exc, AutomapError) or not isinstance(exc, Exception):
        return exc
    return OffloadError(f"writing the offload store in {directory} failed ({type(exc).__name__}: {exc}); "
                        "nothing it wrote was kept")


class _Writer:
    """Writes one store's files: reuses what matches, records what it creates, undoes it all.

    Before the first file is touched the manifest is rewritten as not complete and lists every
    file the store will hold: after a crash the next writer knows which files are its own."""

    def __init__(self, directory: Path, fresh: bool):
        self.directory, self.fresh = directory, fresh
        self.old, self.owned = ({}, set()) if fresh else read_manifest(directory)
        self.created: list[Path] = []  # files this call created (removed again on failure)
        self.marked = False  # the manifest on disk says "complete": false and lists the new files

    def write_all(self, specs: Mapping[str, TensorSpec], read: Callable[[str], torch.Tensor]) -> dict[str, Record]:
        groups: dict[str, list[str]] = {}
        for name, spec in specs.items():
            groups.setdefault(spec.group, []).append(name)
        files = self._file_names(groups)
        self._check_space(specs)
        records: dict[str, Record] = {}
        for group, names in groups.items():
            records.update(self._group(files[group], names, read, set(files.values())))
        write_manifest(self.directory, records, complete=True)
        return records

    def _check_space(self, specs: Mapping[str, TensorSpec]) -> None:
        needed = sum(_nbytes(s) for s in specs.values())
        free = shutil.disk_usage(self.directory).free + sum(r.nbytes for r in self.old.values())
        if needed > free:
            raise OffloadError(f"the offload store needs {format_bytes(needed)} in {self.directory} but its disk has "
                               f"{format_bytes(free)} free; free space there, pass another offload_dir, or raise "
                               "max_memory so that less goes to disk")

    def _file_names(self, groups: Mapping[str, list[str]]) -> dict[str, str]:
        taken: set[str] = {MANIFEST, LOCK}
        names = {}
        for group in groups:
            base = re.sub(r"[^A-Za-z0-9_-]", "_", group or "root")
            name, k = f"{base}.safetensors", 1
            # Never replace a file the store did not create (something a user put there).
            while name in taken or ((self.directory / name).exists() and name not in self.owned):
                name, k = f"{base}-{k}.safetensors", k + 1
            taken.add(name)
            names[group] = name
        return names

    def _group(self, file: str, names: list[str], read: Callable[[str], torch.Tensor],
               planned: set[str]) -> dict[str, Record]:
        tensors = {n: read(n).detach().to("cpu").contiguous() for n in names}
        records = {n: Record(file, n, DTYPE_NAMES[t.dtype], tuple(t.shape), t.numel() * t.element_size(), checksum(t))
                   for n, t in tensors.items()}
        if all(self.old.get(n) == r for n, r in records.items()) and intact(self.directory / file, records):
            return records  # the same bytes are on disk already
        if not self.marked:
            write_manifest(self.directory, self.old, complete=False, files=self.owned | planned)
            self.marked = True
        tmp = self.directory / f".{file}.{os.getpid()}.tmp"
        self.created.append(tmp)
        write_file(tmp, tensors)
        final = self.directory / file
        os.replace(tmp, final)
        self.created[-1] = final
        return records

    def undo(self) -> None:
        """Remove every file this call created; a reused store stays marked not complete
        (its manifest lists the files that are its own), so the next dispatch rebuilds it."""
        remove_created(self.directory, self.created)

    def remove_stale(self, records: Mapping[str, Record]) -> None:
        """Files the store owned that it no longer needs, and temporary files of writers that
        crashed: every one of them listed as the store's own by its manifest."""
        keep = {r.file for r in records.values()}
        stale = [self.directory / f for f in self.owned - keep]
        for path in self.directory.iterdir():
            match = _TMP.match(path.name)
            if match and match["file"] in self.owned | keep:
                stale.append(path)
        remove_created(self.directory, stale)


_TMP = re.compile(r"^\.(?P<file>.+\.safetensors)\.\d+\.tmp$")


def _nbytes(spec: TensorSpec) -> int:
    numel = 1
    for d in spec.shape:
        numel *= d
    return numel * spec.dtype.itemsize


def fingerprint_of(specs: Mapping[str, TensorSpec]) -> str:
    """A short hash of what a store holds (names, units, dtypes, shapes), naming its directory
    so that the same model finds its own store again."""
    items = sorted((n, s.group, str(s.dtype), list(s.shape)) for n, s in specs.items())
    return hashlib.sha256(json.dumps(items).encode()).hexdigest()[:16]


def make_root(root: Path) -> list[Path]:
    """Create ``root`` (and missing parents) and return the directories this created.

    Raises:
        OffloadError: ``root`` is a file, or cannot be created or written.
    """
    missing = []
    probe = root
    while not probe.exists():
        missing.append(probe)
        if probe.parent == probe:
            break
        probe = probe.parent
    try:
        if root.exists() and not root.is_dir():
            raise NotADirectoryError(20, "not a directory", str(root))
        for path in reversed(missing):
            os.mkdir(path)
        if not os.access(root, os.W_OK | os.X_OK):
            raise PermissionError(13, "permission denied", str(root))
    except OSError as exc:
        remove_folders(missing)
        raise OffloadError(f"offload_dir {root} is not writable ({exc.strerror}); pass a writable directory") from exc
    return list(reversed(missing))


def candidates(root: Path, fingerprint: str) -> list[Path]:
    """Store directories under ``root`` made for the same tensors, oldest name first."""
    found = [p for p in root.glob(f"{STORE_PREFIX}{fingerprint}-*") if p.is_dir() and (p / LOCK).is_file()]
    return sorted(found, key=lambda p: (len(p.name), p.name))


def new_store_dir(root: Path, fingerprint: str) -> tuple[Path, StoreLock]:
    """Create the next free ``automap-store-<fingerprint>-<n>`` (mkdir is atomic, so two
    processes never get the same one) and lock it before anything else is written there."""
    for n in range(10_000):
        directory = root / f"{STORE_PREFIX}{fingerprint}-{n}"
        try:
            os.mkdir(directory)
        except FileExistsError:
            continue
        lock = StoreLock.acquire(directory / LOCK, create=True)
        assert lock is not None, "a lock file in a directory this process just created"
        write_manifest(directory, {}, complete=False)
        return directory, lock
    raise OffloadError(f"{root} already holds 10,000 offload stores of this model; delete the "
                       f"{STORE_PREFIX}{fingerprint}-* directories that no process uses")


def write_manifest(directory: Path, records: Mapping[str, Record], complete: bool,
                   files: Iterable[str] = ()) -> None:
    """Write the manifest (to a temporary name, then renamed over the old one). ``files`` are
    further files the store owns beyond those its records name (about to be written)."""
    owned = sorted({r.file for r in records.values()} | set(files))
    payload = {"format": FORMAT, "version": VERSION, "complete": complete, "files": owned,
               "tensors": {n: {**asdict(r), "shape": list(r.shape)} for n, r in records.items()}}
    tmp = directory / f".{MANIFEST}.{os.getpid()}.tmp"
    try:
        tmp.write_text(json.dumps(payload, indent=1))
        os.replace(tmp, directory / MANIFEST)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_manifest(directory: Path) -> tuple[dict[str, Record], set[str]]:
    """``(records, owned files)`` of a store's manifest. Records only from a complete manifest
    of this format and version — anything else (missing, not JSON, another schema or version,
    interrupted) gives none, and the store is rebuilt; owned files from any manifest of this
    format, so that a rebuild may replace them."""
    try:
        data = json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError):
        return {}, set()
    if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("version") != VERSION:
        return {}, set()
    try:
        records = {str(n): _record(e) for n, e in data["tensors"].items()} if data.get("complete") is True else {}
    except (KeyError, TypeError, ValueError, AttributeError):
        records = {}
    files = data.get("files")
    owned = {f for f in files if _plain_file(f)} if isinstance(files, list) else set()
    return records, owned | {r.file for r in records.values()}


def _plain_file(name: Any) -> bool:
    return isinstance(name, str) and name.endswith(".safetensors") and "/" not in name and "\\" not in name \
        and not name.startswith(".")


def _record(entry: Any) -> Record:
    fields = {k: entry[k] for k in ("file", "key", "dtype", "shape", "nbytes", "crc32")}
    if not _plain_file(fields["file"]):
        raise ValueError(f"bad file name {fields['file']!r}")
    return Record(fields["file"], str(fields["key"]), str(fields["dtype"]), tuple(int(d) for d in fields["shape"]),
                  int(fields["nbytes"]), int(fields["crc32"]))


def intact(path: Path, records: Mapping[str, Record]) -> bool:
    """True when ``path`` exists and holds every record's tensor with matching bytes."""
    try:
        mapped = MappedFile(path, [r.key for r in records.values()])
    except AutomapError:
        return False
    for record in records.values():
        info = mapped.info(record.key)
        if (info.dtype, info.shape) != (record.dtype, record.shape) or checksum(mapped.tensor(record.key)) != record.crc32:
            return False
    return True


def remove_created(folder: Path, files: Iterable[Path], *, remove_folder: bool = False) -> None:
    """Remove ``files`` (created by this process, or listed by the store's own manifest), then,
    with ``remove_folder``, ``folder`` itself if that left it empty. Never raises: cleanup after
    a failure must not hide the failure."""
    for path in files:
        try:
            path.unlink(missing_ok=True)
        except OSError as exc:
            log.warning("could not remove %s: %s", path, exc)
    if remove_folder:
        remove_folders([folder])


def remove_folders(folders: Iterable[Path]) -> None:
    """``rmdir`` each folder that this process created, innermost first, if it is empty:
    anything still in it is not automap's to remove."""
    for folder in sorted(folders, key=lambda p: len(p.parts), reverse=True):
        try:
            folder.rmdir()
        except OSError:
            pass
