"""The files of an offload store, reached only through a handle on its directory: every file
created exclusively without following links and renamed into place, so no write of automap's
follows a link or touches a file it did not create.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import stat
import weakref
from pathlib import Path
from typing import Iterable

from automap.errors import OffloadError
from automap.offload.format import read_regular
from automap.offload.mapped import Identity, MappedFile, open_for_map

log = logging.getLogger(__name__)

_TEMP = re.compile(r"^\.(?P<name>.+)\.\d+(-\d+)?\.tmp$")


def temp_name(name: str, k: int = 0) -> str:
    """The temporary name this process writes ``name`` under before renaming it into place."""
    return f".{name}.{os.getpid()}{f'-{k}' if k else ''}.tmp"


def is_temp_of(entry: str, names: Iterable[str]) -> bool:
    """Whether ``entry`` is a temporary name (of any process) of one of ``names``."""
    match = _TEMP.match(entry)
    return bool(match) and match["name"] in set(names)


class StoreDir:
    """A store directory held open by file descriptor; every operation is relative to it.

    Example:
        >>> folder = StoreDir.open(Path("offload/automap-store-0123456789abcdef-0"))
        >>> folder.write_new("automap-store.json", b"{}")
    """

    def __init__(self, path: Path, fd: int):
        self.path, self.fd = path, fd
        self._finalizer = weakref.finalize(self, os.close, fd)

    @classmethod
    def open(cls, path: Path) -> StoreDir | None:
        """The directory at ``path`` if it is a real directory (not a link) owned by this user,
        else None (why is logged)."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            log.info(
                "%s is not a directory automap can use as a store (%s); passing it over", path, exc.strerror
            )
            return None
        owner = os.fstat(fd).st_uid
        if owner != os.geteuid():
            os.close(fd)
            log.info("%s belongs to uid %d, not to this user; passing it over", path, owner)
            return None
        return cls(path, fd)

    def __truediv__(self, name: str) -> Path:
        return self.path / name

    def close(self) -> None:
        self._finalizer()
        self.fd = -1

    def lstat(self, name: str) -> os.stat_result | None:
        try:
            return os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return None

    def exists(self, name: str) -> bool:
        """Whether anything — a file, a folder, a link, even a dangling one — has this name."""
        return self.lstat(name) is not None

    def is_dir(self, name: str) -> bool:
        """Whether ``name`` is a real directory (a link to one is not): no file can be renamed
        over it, and it is never automap's to write or remove."""
        info = self.lstat(name)
        return info is not None and stat.S_ISDIR(info.st_mode)

    def is_own_file(self, name: str) -> bool:
        """A regular file of this user's with no other name (no hard link to a user's file)."""
        info = self.lstat(name)
        return (
            info is not None
            and stat.S_ISREG(info.st_mode)
            and info.st_uid == os.geteuid()
            and info.st_nlink == 1
        )

    def names(self) -> list[str]:
        return os.listdir(self.fd)

    def shared(self) -> bool:
        """Whether another user may create, rename or remove names in this folder (group or
        others may write it): then nothing in it can be trusted to be what automap wrote."""
        return bool(os.fstat(self.fd).st_mode & (stat.S_IWGRP | stat.S_IWOTH))

    def map(
        self, name: str, keys: Iterable[str] | None = None, identity: Identity | None = None
    ) -> MappedFile:
        """The file ``name`` of this folder mapped (:class:`MappedFile`), opened once relative
        to the held directory without following a link, refused unless it is a regular file of
        this user's and (given ``identity``) the very file automap wrote.

        Raises:
            FormatError, OffloadError: as :class:`MappedFile`, or the file is not this user's.
        """
        fd = open_for_map(name, dir_fd=self.fd, follow=False)
        owner = os.fstat(fd).st_uid
        if owner != os.geteuid():
            os.close(fd)
            raise OffloadError(
                f"{self / name} belongs to uid {owner}, not to this user: it is not the file automap "
                "wrote, and it is not read. Remove it, and dispatch (or load) again"
            )
        return MappedFile(self / name, keys, fd=fd, identity=identity)

    def writable(self) -> bool:
        """Whether files can be created and removed here (false for an immutable folder)."""
        return os.access(".", os.W_OK | os.X_OK, dir_fd=self.fd)

    def read(self, name: str, limit: int) -> bytes:
        """A regular file's bytes, never through a link. Raises OSError."""
        return read_regular(name, limit, follow=False, dir_fd=self.fd)

    def create_temp(self, name: str, created: list[str]) -> tuple[str, int]:
        """``(temporary name, write descriptor)`` of a new file to be renamed to ``name``. The
        name is in ``created`` before the file exists (an interrupt between the two leaves
        nothing unrecorded for the caller's cleanup) and taken out if another file has it."""
        for k in range(100):
            temp = temp_name(name, k)
            created.append(temp)
            try:
                fd = os.open(
                    temp,
                    os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                    0o644,
                    dir_fd=self.fd,
                )
            except FileExistsError:
                created.pop()
                continue
            return temp, fd  # an interrupt at os.open may come after the file was made: the name stays
        raise OSError(errno.EEXIST, "100 temporary names are taken", str(self / temp_name(name)))

    def write_new(self, name: str, data: bytes) -> None:
        """Write ``data`` as ``name``: to a new temporary file, then renamed over ``name``."""
        created: list[str] = []
        try:
            temp, fd = self.create_temp(name, created)
            with open(fd, "wb", closefd=True) as f:
                f.write(data)
            self.replace(temp, name)
        except BaseException:
            self.remove(created)
            raise

    def replace(self, source: str, target: str) -> None:
        os.replace(source, target, src_dir_fd=self.fd, dst_dir_fd=self.fd)

    def remove(self, names: Iterable[str]) -> None:
        """Unlink ``names`` (files this process created, or the store's own): a link is removed
        itself, never what it points to. Never raises: cleanup must not hide a failure."""
        for name in names:
            try:
                os.unlink(name, dir_fd=self.fd)
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("could not remove %s: %s", self / name, exc)

    def free(self) -> tuple[int, int | None]:
        """``(free bytes, free inodes)`` of the file system; inodes None where it does not count them."""
        info = os.statvfs(self.fd)
        return info.f_bavail * info.f_frsize, (info.f_favail if info.f_files else None)


def _missing(path: Path) -> bool:
    """Whether nothing has this name (a folder that cannot be searched is not "missing")."""
    try:
        os.lstat(path)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return False


def remove_folders(folders: Iterable[Path]) -> None:
    """``rmdir`` each folder that this process created, innermost first, if it is empty:
    anything still in it is not automap's to remove."""
    for folder in sorted(folders, key=lambda p: len(p.parts), reverse=True):
        try:
            folder.rmdir()
        except OSError:
            pass


def make_root(root: Path) -> list[Path]:
    """Create ``root`` (and missing parents) and return the directories this call created.

    Each folder is made with one ``mkdir`` (atomic): of two callers making the same new folder
    at once (threads, processes), exactly one creates it and owns it (its cleanup may remove it
    again, if empty); the other finds it made and uses it as a folder it did not create (never
    removes it).

    Raises:
        OffloadError: ``root`` is a dangling link or a file, is on a file system that holds no
            files (``/proc``, ``/sys``), or cannot be created or written; the message says which.
    """
    check_offload_dir(root)
    missing = []
    probe = root
    while _missing(probe):
        missing.append(probe)
        if probe.parent == probe:
            break
        probe = probe.parent
    made: list[Path] = []
    try:
        if os.path.lexists(root) and not root.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, "it is a file, not a directory", str(root))
        for path in reversed(missing):
            try:
                os.mkdir(path)
            except FileExistsError:
                if not path.is_dir():  # a file or a dangling link came meanwhile: not a folder to use
                    raise NotADirectoryError(
                        errno.ENOTDIR, "it is a file, not a directory", str(path)
                    ) from None
                continue  # another caller made it just now: theirs, used but never removed here
            made.append(path)
        if not os.access(root, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, "permission denied", str(root))
    except OSError as exc:
        remove_folders(made)
        raise OffloadError(
            f"offload_dir {root} is not writable ({exc.strerror}); pass a writable directory"
        ) from exc
    return made


# File systems that are kernel interfaces and store no files of anyone's.
_PSEUDO = {
    "proc",
    "sysfs",
    "debugfs",
    "tracefs",
    "devpts",
    "cgroup",
    "cgroup2",
    "securityfs",
    "bpf",
    "configfs",
    "pstore",
    "efivarfs",
    "fusectl",
    "mqueue",
    "binfmt_misc",
}


def check_offload_dir(root: str | os.PathLike[str]) -> None:
    """Refuse, before anything is planned or created, an ``offload_dir`` that is a dangling
    symbolic link, leads through a loop of them, or lies on a pseudo file system (``/proc``, ``/sys``), where "writing" it
    would fail with a misleading reason (``File exists``, or no free space).

    Raises:
        OffloadError: naming the problem and the fix.
    """
    root = Path(root)
    try:
        os.stat(root)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # os.path.exists says False as for a dangling link
            raise OffloadError(
                f"offload_dir {root} leads through a loop of symbolic links; fix the links, or pass "
                "a real directory"
            ) from None
    if os.path.islink(root) and not os.path.exists(root):
        raise OffloadError(
            f"offload_dir {root} is a symbolic link to {os.readlink(root)}, which does not exist; "
            "create that directory, or pass another offload_dir"
        )
    existing = root
    while _missing(existing) and existing.parent != existing:
        existing = existing.parent
    kind = mount_type(existing)
    if kind in _PSEUDO:
        raise OffloadError(
            f"offload_dir {root} is on {kind}, a kernel interface that stores no files; pass a "
            "directory on a disk, e.g. offload_dir='offload'"
        )


def mount_type(path: Path) -> str | None:
    """The type of the file system holding ``path`` (``ext4``, ``tmpfs``, ``proc``...), from the
    mount table; None where that cannot be read."""
    target = os.path.realpath(path)
    best, kind = "", None
    try:
        with open("/proc/self/mounts") as mounts:
            for line in mounts:
                fields = line.split()
                point = fields[1].replace("\\040", " ") if len(fields) > 2 else ""
                inside = target == point or target.startswith(point.rstrip("/") + "/")
                if point and inside and len(point) >= len(best):
                    best, kind = point, fields[2]
    except OSError:
        return None
    return kind
