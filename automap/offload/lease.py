"""Read leases on the files automap maps (Linux ``F_SETLEASE``): another process that opens one
for writing or truncates it waits while automap moves the bytes its tensors view out of the file
into memory of its own, in place (``mremap``; their size in RAM, only when someone writes the
file), so that no read of a map ever faults past the file's end (SIGBUS). A truncation drops a
file's pages from every map, copy-on-write copies included: only memory not the file's survives.

The break signal goes to automap's own thread (``F_SETOWN_EX``), which waits for it with the
signal blocked: neither the main thread nor a Python handler is needed. The files leased are one
dict changed by single (atomic) operations, no lock: a file closed by the garbage collector
inside any step cannot wait on a lock that step holds. Limits: docs/offload-safety.md.
"""

from __future__ import annotations

import ctypes
import fcntl
import logging
import mmap
import os
import signal
import struct
import threading
import weakref
from typing import Iterable, Protocol

log = logging.getLogger(__name__)

F_SETSIG, F_SETOWN_EX, F_OWNER_TID = 10, 15, 0
F_SETLEASE, F_GETLEASE = getattr(fcntl, "F_SETLEASE", 1024), getattr(fcntl, "F_GETLEASE", 1025)
# Real-time signals near the top of the range: libraries that use some (glibc's threads, profilers,
# JVMs) take them from the bottom; the first of these whose action nobody set is automap's.
CANDIDATES = range(signal.SIGRTMAX - 7, signal.SIGRTMAX - 1) if hasattr(signal, "SIGRTMAX") else range(0)
_PAGE = mmap.PAGESIZE
_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.mmap.restype = ctypes.c_void_p
_LIBC.mmap.argtypes = (
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
)
_LIBC.mremap.restype = ctypes.c_void_p
_LIBC.mremap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
_LIBC.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_LIBC.signal.restype = ctypes.c_void_p
_LIBC.signal.argtypes = (ctypes.c_int, ctypes.c_void_p)
_FAILED = ctypes.c_void_p(-1).value  # MAP_FAILED
_MREMAP_MAYMOVE, _MREMAP_FIXED = 1, 2
_SIG_IGN = 1
_MAP_FIXED = 0x10


class Leaseholder(Protocol):
    """What holds a lease: an open file (``fd``) and what to do when a writer comes."""

    fd: int

    def detach(self) -> None:
        """Stop reading the file: called on automap's lease thread, while the writer waits."""


class _Watcher:
    """The process's one lease thread: the signal it owns, and the files leased to it."""

    def __init__(self) -> None:
        self.signal = self._own_signal()
        self.holders: dict[int, weakref.ref[Leaseholder]] = {}
        self.tid = 0
        if self.signal:
            started = threading.Event()
            threading.Thread(target=self._run, args=(started,), name="automap-leases", daemon=True).start()
            started.wait()

    @staticmethod
    def _own_signal() -> int:
        """A real-time signal whose action nobody set, now ignored by the process (a break
        signal sent to the process rather than to the lease thread then does no harm); 0: none."""
        for number in CANDIDATES:
            if signal.getsignal(number) not in (signal.SIG_DFL, None):
                continue
            before = _LIBC.signal(number, _SIG_IGN)
            if before is None:  # SIG_DFL: it was nobody's
                return number
            _LIBC.signal(number, before)  # someone's handler (or ignored on purpose): leave it
        return 0

    def _run(self, started: threading.Event) -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, {self.signal})
        self.tid = threading.get_native_id()
        started.set()
        while True:
            signal.sigwaitinfo({self.signal})
            try:
                self.serve()
            except Exception:  # noqa: BLE001 - the thread must outlive any one break
                log.exception("serving a lease break failed")

    def serve(self) -> None:
        """Detach every leased file whose lease a writer is breaking, then let the writer go."""
        for key, ref in self.holders.copy().items():  # copied at once: no collection can run inside
            holder = ref()
            if holder is None:
                self.claim(key)
            elif breaking(holder.fd) and self.claim(key):
                _let_go(holder)

    def claim(self, key: int) -> bool:
        """Take ``key`` off the files leased; False if another thread did first (it serves it)."""
        return self.holders.pop(key, None) is not None


def breaking(fd: int) -> bool:
    """Whether a writer is breaking the read lease on ``fd`` (or it holds none)."""
    try:
        return fcntl.fcntl(fd, F_GETLEASE) != fcntl.F_RDLCK
    except OSError:
        return False


def _let_go(holder: Leaseholder) -> None:
    try:
        holder.detach()
    except Exception:  # noqa: BLE001 - the writer must be let go whatever happened
        log.exception("detaching %r from its file failed; a read of it may now fault", holder)
    finally:
        try:
            fcntl.fcntl(holder.fd, F_SETLEASE, fcntl.F_UNLCK)
        except OSError:
            pass


_watcher: _Watcher | None = None
_watcher_lock = threading.Lock()


def _forget_in_child() -> None:
    """A forked child has no lease thread (only the forking thread is copied): it starts its own."""
    global _watcher, _watcher_lock
    _watcher, _watcher_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_in_child)


def watcher() -> _Watcher:
    """The process's lease thread, started on first use. Once started it is read without the
    lock, so an interrupt that ever left the lock taken cannot stall every later lease."""
    global _watcher
    found = _watcher
    if found is None:
        with _watcher_lock:
            if _watcher is None:
                _watcher = _Watcher()
        found = _watcher
    return found


def take(holder: Leaseholder) -> str | None:
    """Take a read lease on ``holder.fd`` for ``holder`` (until it is closed or a writer comes).
    Returns None when it holds one, else why none could be taken (the file is then only
    checked before reads, as without leases); never raises."""
    lease = watcher()
    if not lease.signal:
        return "no real-time signal is free for the lease thread"
    try:
        fcntl.fcntl(holder.fd, F_SETSIG, lease.signal)
        fcntl.fcntl(holder.fd, F_SETLEASE, fcntl.F_RDLCK)
    except OSError as exc:
        return f"no read lease ({exc.strerror or exc})"
    lease.holders[id(holder)] = weakref.ref(holder)
    try:  # taking a lease made the process the signal's owner: the lease thread is to be
        fcntl.fcntl(holder.fd, F_SETOWN_EX, struct.pack("ii", F_OWNER_TID, lease.tid))
    except OSError as exc:
        if lease.claim(id(holder)):
            fcntl.fcntl(holder.fd, F_SETLEASE, fcntl.F_UNLCK)
        return f"no read lease (the signal cannot go to the lease thread: {exc.strerror or exc})"
    if breaking(holder.fd) and lease.claim(id(holder)):  # a writer came before: its signal was ignored
        _let_go(holder)
    return None


def drop(holder: Leaseholder) -> None:
    """Forget ``holder`` (before its descriptor is closed, which ends the lease)."""
    if _watcher is not None:
        _watcher.holders.pop(id(holder), None)


def merged(spans: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Page-aligned ``(address, length)`` spans merged where they touch or overlap, whole pages."""
    found: list[tuple[int, int]] = []
    for start, length in sorted(spans):
        end = -(-(start + length) // _PAGE) * _PAGE
        if found and start <= found[-1][0] + found[-1][1]:
            found[-1] = (found[-1][0], max(found[-1][1], end - found[-1][0]))
        else:
            found.append((start, end - start))
    return found


def detach(spans: Iterable[tuple[int, int]]) -> int:
    """Replace the pages of ``spans`` (page-aligned, of a file map) by anonymous memory holding
    the same bytes (what this process sees, its own writes included), at the same addresses:
    from then on no change of the file reaches them. Returns the bytes copied.

    Raises:
        OSError: no memory for the copy (the spans still map the file).
    """
    total = 0
    for start, length in merged(spans):
        copy = _LIBC.mmap(
            None, length, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0
        )
        if copy in (None, _FAILED):
            raise OSError(ctypes.get_errno(), f"no memory to copy {length} bytes of a mapped file")
        ctypes.memmove(copy, start, length)
        if _LIBC.mremap(copy, length, length, _MREMAP_MAYMOVE | _MREMAP_FIXED, start) != start:
            error = ctypes.get_errno()
            _LIBC.munmap(copy, length)
            raise OSError(error, "mremap over a mapped file failed")
        total += length
    return total


def attach(spans: Iterable[tuple[int, int]], fd: int, base: int) -> None:
    """Map the file ``fd`` (mapped copy-on-write at ``base``) over ``spans`` again, in place of
    what :func:`detach` put there: the tensors view the file's bytes as they are now.

    Raises:
        OSError: the map failed (the spans keep their copies).
    """
    for start, length in merged(spans):
        done = _LIBC.mmap(
            start, length, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | _MAP_FIXED, fd, start - base
        )
        if done != start:
            raise OSError(ctypes.get_errno(), "mapping the file again failed")
