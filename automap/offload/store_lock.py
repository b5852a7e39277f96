"""One live model per store: an ``flock`` on the store directory, taken before its lock file
exists and dropped by the kernel when its holder exits (``kill -9`` included); a forked child
never inherits it.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
import weakref

from automap.errors import FormatError
from automap.offload.format import load_json
from automap.offload.store_files import StoreDir

LOCK = "automap-store.lock"
_LIVE: weakref.WeakSet[StoreLock] = weakref.WeakSet()


class StoreLock:
    """An exclusive ``flock`` on a store directory, held until :meth:`release` (or until the
    object is collected, or the process exits)."""

    def __init__(self, fd: int, folder: StoreDir):
        self.fd, self.path = fd, folder.path / LOCK
        self._finalizer = weakref.finalize(self, os.close, fd)
        _LIVE.add(self)

    @classmethod
    def take(cls, folder: StoreDir) -> StoreLock | None:
        """The lock on ``folder``, or None when another holder has it."""
        fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=folder.fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return None
        return cls(fd, folder)

    @staticmethod
    def mark(folder: StoreDir) -> None:
        """Write the lock file saying who holds the lock (a new file renamed over the old).

        Raises:
            OSError: it cannot be written (an immutable lock file, a full disk).
        """
        holder = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
        folder.write_new(LOCK, json.dumps(holder).encode())

    def release(self) -> None:
        self._finalizer()
        _LIVE.discard(self)

    def forget(self) -> None:
        """Close this process's descriptor without a trace (in a forked child: the parent
        keeps the lock)."""
        if self._finalizer.detach() is not None:
            try:
                os.close(self.fd)
            except OSError:
                pass
        _LIVE.discard(self)


def _forget_all_in_child() -> None:
    for lock in list(_LIVE):
        lock.forget()


os.register_at_fork(after_in_child=_forget_all_in_child)


def holder_of(folder: StoreDir) -> str:
    """Who holds a store's lock, as its lock file says ("pid 123 on host")."""
    try:
        info = load_json(folder.read(LOCK, 4096), f"lock file {folder / LOCK} is damaged", "")
    except (OSError, FormatError):
        return "another process"
    if not isinstance(info, dict):
        return "another process"
    return f"pid {str(info.get('pid'))[:20]} on {str(info.get('host'))[:100]}"
