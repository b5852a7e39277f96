"""Opening the files automap maps: once, non-blocking, checked to be a regular file (and, where
automap wrote the path, not a link), and identified by device and inode, so that every later
read, map and check goes through the open file rather than its name.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import torch

from automap.errors import FormatError
from automap.kinds import on_host
from automap.offload.format import OPEN_FILE_FIXES

Signature = tuple[int, int, int, int]
Identity = tuple[int, int]  # (st_dev, st_ino): which file, whatever its name holds now


def signature(path: str | os.PathLike[str] | int) -> Signature:
    """What identifies a file's contents cheaply: device, inode, size, modification time (of a
    path, or of an open file descriptor)."""
    st = os.fstat(path) if isinstance(path, int) else os.stat(path)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def open_for_map(path: str | os.PathLike[str], *, dir_fd: int | None = None, follow: bool = True) -> int:
    """A read-only descriptor of the regular file ``path`` (relative to ``dir_fd`` if given;
    a symbolic link refused unless ``follow``). Opened non-blocking, so a FIFO put in its place
    never hangs the open, and refused unless it is a regular file.

    Raises:
        FormatError: the file is missing, not a regular file, a link where none is followed, or
            cannot be opened (the message says which).
    """
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | (0 if follow else os.O_NOFOLLOW)
    shown = path if dir_fd is None else f"{path} (in the folder automap holds open)"
    try:
        fd = os.open(path, flags, dir_fd=dir_fd)
    except FileNotFoundError as exc:
        raise FormatError(f"{shown} is missing") from exc
    except OSError as exc:
        if exc.errno == errno.ELOOP and not follow:
            raise FormatError(
                f"{shown} is a symbolic link where automap wrote a file; it is not followed. "
                "Remove it, and dispatch (or load) again"
            ) from exc
        fix = OPEN_FILE_FIXES.get(exc.errno, "Make it readable")
        raise FormatError(f"{shown} cannot be read ({exc.strerror or exc}). {fix}") from exc
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise FormatError(f"{shown} is not a regular file (a folder, pipe, socket or device)")
    return fd


def reopen(fd: int) -> tuple[int, bool]:
    """``(descriptor, whether it is an open file of its own)``: a new open file (its own
    offset and readahead state) of the very inode open as ``fd``, through ``/proc/self/fd``
    (which names the open file, not a path), checked to be that inode; ``os.dup(fd)`` (sharing
    them) where that cannot be used. Raises OSError."""
    try:
        other = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return os.dup(fd), False
    one, two = os.fstat(fd), os.fstat(other)
    if (one.st_dev, one.st_ino) != (two.st_dev, two.st_ino):
        os.close(other)
        return os.dup(fd), False
    return other, True


def read_into(fd: int, view: memoryview, offset: int, least: int | None = None) -> int:
    """Fill ``view`` with the bytes of ``fd`` from ``offset`` (``preadv``: no file position, any
    thread), until ``least`` bytes (default: all of it) are there; returns the bytes read, fewer
    than ``least`` only where the file ended first (the caller says what that means)."""
    least = len(view) if least is None else least
    done = 0
    while done < least:
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            break
        done += got
    return done


# Mappings /proc/self/maps names by a path though no file holds their bytes: shared anonymous
# memory (pinned host memory from the CUDA allocator shows as "/dev/zero (deleted)") and memfds.
ANONYMOUS_FILES = ("/dev/zero", "/memfd:")


def backing_file(tensor: torch.Tensor) -> Path | None:
    """The file whose mapping holds ``tensor``'s bytes (from ``/proc/self/maps``), or None when
    they are anonymous memory (or not on the CPU): how to tell an offloaded weight, a view of a
    store or checkpoint file, from one held in RAM."""
    if not on_host(tensor.device) or tensor.numel() == 0:
        return None
    address = tensor.data_ptr()
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                start, end = (int(x, 16) for x in fields[0].split("-"))
                if start <= address < end:
                    path = fields[5].strip() if len(fields) > 5 else ""
                    return (
                        Path(path) if path.startswith("/") and not path.startswith(ANONYMOUS_FILES) else None
                    )
    except OSError:
        return None
    return None
