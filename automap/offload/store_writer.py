"""Writing one store's files: what matches is reused, what this call creates is recorded and
removed again on failure, and what a crashed writer left is cleaned first.

Before the first file is touched the manifest is rewritten as not complete and lists every
file the store will hold: after a crash the next writer knows which files are its own. Each file
is written under a temporary name (created exclusively, never through a link) and renamed into
place. File names come from the unit's name, cut and hashed past :data:`MAX_BASE` characters so
that no name the file system refuses is ever asked for.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

import torch

from automap.errors import AutomapError, OffloadError
from automap.offload.format import DTYPE_NAMES, OPEN_FILE_FIXES, PERMUTATIONS, memory_order, write_tensors
from automap.offload.manifest import MANIFEST, Record, checksum, read_manifest, write_manifest
from automap.offload.mapped import Identity
from automap.offload.store_files import StoreDir, is_temp_of
from automap.offload.store_lock import LOCK
from automap.sizes import format_bytes

# Longest file name stem taken from a unit's name; longer ones are cut and end in a hash. With
# the suffix and a temporary name's decoration, names stay well under the usual 255 bytes.
MAX_BASE = 120


@dataclass(frozen=True)
class TensorSpec:
    """What will be written for one tensor before it is read: the unit (file group) it goes
    with, its dtype and its shape."""

    group: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        numel = 1
        for d in self.shape:
            numel *= d
        return numel * self.dtype.itemsize


def file_base(group: str) -> str:
    """The file name stem for a unit: its name with unsafe characters replaced, cut and
    hashed when long."""
    base = re.sub(r"[^A-Za-z0-9_-]", "_", group or "root")
    if len(base) > MAX_BASE:
        base = f"{base[: MAX_BASE - 17]}-{hashlib.sha256(group.encode()).hexdigest()[:16]}"
    return base


def intact(folder: StoreDir, file: str, records: Mapping[str, Record]) -> Identity | None:
    """The file's ``(st_dev, st_ino)`` when ``file`` is a file of the store's own holding every
    record's tensor with matching bytes (checked through one descriptor, the file that is then
    mapped must be this one), else None."""
    if not folder.is_own_file(file):
        return None
    try:
        mapped = folder.map(file, [r.key for r in records.values()])
    except (AutomapError, OSError):
        return None
    try:
        for record in records.values():
            info = mapped.info(record.key)
            if (info.dtype, info.shape) != (record.dtype, record.shape):
                return None
            if checksum(mapped.tensor(record.key)) != record.crc32:
                return None
        return mapped.identity
    finally:
        mapped.close()


class StoreWriter:
    """Writes one store's files into ``folder`` (whose lock the caller holds)."""

    def __init__(self, folder: StoreDir, fresh: bool):
        self.folder, self.fresh = folder, fresh
        self.old, owned = ({}, set()) if fresh else read_manifest(folder)
        # A folder put in place of a store file is someone's, whatever the manifest says: its
        # name is neither written over (a rename onto it fails) nor removed.
        self.owned = {name for name in owned if not folder.is_dir(name)}
        self.created: list[str] = []  # names this call created (removed again on failure)
        # Each file's (st_dev, st_ino) as written (or checked, when reused): the file mapped
        # later must be that one, whatever was put under its name meanwhile.
        self.identities: dict[str, Identity] = {}
        self.marked = False  # the manifest on disk says "complete": false and lists the new files

    def write_all(
        self, specs: Mapping[str, TensorSpec], read: Callable[[str], torch.Tensor]
    ) -> dict[str, Record]:
        groups: dict[str, list[str]] = {}
        for name, spec in specs.items():
            groups.setdefault(spec.group, []).append(name)
        files = self._file_names(groups)
        planned = set(files.values())
        self.remove_leftovers(planned)
        self._check_space(specs, planned)
        records: dict[str, Record] = {}
        for group, names in groups.items():
            records.update(self._group(files[group], names, read, planned))
        write_manifest(self.folder, records, complete=True)
        return records

    def _check_space(self, specs: Mapping[str, TensorSpec], planned: set[str]) -> None:
        needed = sum(s.nbytes for s in specs.values())
        free_bytes, free_inodes = self.folder.free()
        free = free_bytes + sum(r.nbytes for r in self.old.values())
        where = self.folder.path
        if needed > free:
            raise OffloadError(
                f"the offload store needs {format_bytes(needed)} in {where} but its disk has "
                f"{format_bytes(free)} free; free space there, pass another offload_dir, or raise "
                "max_memory so that less goes to disk"
            )
        files = len(planned - self.owned) + 1  # new files, and one temporary file at a time
        if free_inodes is not None and files > free_inodes:
            raise OffloadError(
                f"the offload store needs {files} new files in {where} but its file system has "
                f"{free_inodes} free inodes; delete files there, pass another offload_dir, or raise "
                "max_memory so that less goes to disk"
            )

    def _file_names(self, groups: Mapping[str, list[str]]) -> dict[str, str]:
        taken: set[str] = {MANIFEST, LOCK}
        names = {}
        for group in groups:
            base = file_base(group)
            name, k = f"{base}.safetensors", 1
            # Never replace anything the store did not create (a user's file, folder or link).
            while name in taken or (self.folder.exists(name) and name not in self.owned):
                name, k = f"{base}-{k}.safetensors", k + 1
            taken.add(name)
            names[group] = name
        return names

    def _group(
        self, file: str, names: list[str], read: Callable[[str], torch.Tensor], planned: set[str]
    ) -> dict[str, Record]:
        values = {n: read(n).detach().to("cpu") for n in names}
        laid = {n: memory_order(t) for n, t in values.items()}  # a channels-last weight keeps its strides
        tensors = {n: stored for n, (stored, _) in laid.items()}
        permuted = {n: order for n, (_, order) in laid.items() if order is not None}
        records = {
            n: Record(
                file,
                n,
                DTYPE_NAMES[t.dtype],
                tuple(t.shape),
                t.numel() * t.element_size(),
                checksum(values[n]),
            )
            for n, t in tensors.items()
        }
        same = (
            intact(self.folder, file, records)
            if all(self.old.get(n) == r for n, r in records.items())
            else None
        )
        if same is not None:
            self.identities[file] = same
            return records  # the same bytes are on disk already
        if not self.marked:
            write_manifest(self.folder, self.old, complete=False, files=self.owned | planned)
            self.marked = True
        temp, fd = self.folder.create_temp(file, self.created)
        with open(fd, "wb", closefd=True) as f:
            info = os.fstat(fd)
            self.identities[file] = (info.st_dev, info.st_ino)
            write_tensors(f, tensors, {PERMUTATIONS: json.dumps(permuted)} if permuted else None)
        self.created.append(file)  # before the rename: undo removes whichever of the two exists
        self.folder.replace(temp, file)
        return records

    def undo(self) -> None:
        """Remove every file this call created; a reused store stays marked not complete
        (its manifest lists the files that are its own), so the next dispatch rebuilds it."""
        self.folder.remove(self.created)

    def remove_leftovers(self, planned: set[str]) -> None:
        """Temporary files of writers that crashed (the lock is ours, so none is alive): of
        the manifest, the lock file, and the files the store owns or is about to write."""
        names = self.owned | planned | {MANIFEST, LOCK}
        self.folder.remove(
            [e for e in self.folder.names() if is_temp_of(e, names) and self.folder.is_own_file(e)]
        )

    def remove_stale(self, records: Mapping[str, Record]) -> None:
        """Files the store owned that it no longer needs."""
        keep = {r.file for r in records.values()}
        self.folder.remove(sorted(self.owned - keep))


def as_offload_error(exc: BaseException, folder: StoreDir | Path) -> BaseException:
    """``exc`` as the :class:`OffloadError` a failed store write raises (AutomapErrors and
    interrupts are passed on as they are)."""
    directory = folder.path if isinstance(folder, StoreDir) else folder
    if isinstance(exc, OSError):
        where = f": {exc.filename}" if getattr(exc, "filename", None) else ""
        reason = exc.strerror or str(exc)
        if exc.errno == errno.ENOSPC and isinstance(folder, StoreDir) and _no_inodes(folder):
            reason += ", no free inodes"
        fix = _FIXES.get(exc.errno, "Free space there or pass another offload_dir")
        return OffloadError(
            f"writing the offload store in {directory} failed ({reason}{where}); nothing it wrote was "
            f"kept. {fix}"
        )
    if isinstance(exc, AutomapError) or not isinstance(exc, Exception):
        return exc
    return OffloadError(
        f"writing the offload store in {directory} failed ({type(exc).__name__}: {exc}); "
        "nothing it wrote was kept"
    )


# What to do about a failed write, by its errno (the rest: the disk is full, or quota).
_FIXES = {
    **OPEN_FILE_FIXES,
    errno.EFBIG: (
        "A file may not grow that large here: raise the process's file size limit (ulimit -f), or pass "
        "an offload_dir on a file system that takes files that large"
    ),
    errno.EROFS: "The file system is read-only: pass an offload_dir on a writable one",
    errno.EACCES: "Pass an offload_dir you may write to",
    errno.EPERM: "Pass an offload_dir you may write to",
}


def _no_inodes(folder: StoreDir) -> bool:
    try:
        return folder.free()[1] == 0
    except OSError:
        return False
