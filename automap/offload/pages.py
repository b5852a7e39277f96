"""What the kernel says and does about the pages of a map: advice (``madvise``, through ctypes so
the GIL is released), which pages are in memory (``mincore``) and which hold a private copy
(``/proc/self/pagemap``).
"""

from __future__ import annotations

import ctypes
import mmap
import struct
from typing import Iterable

PAGE = mmap.PAGESIZE
# MADV_POPULATE_WRITE (Linux 5.14+) on a private file map gives each page a private copy of the
# file's bytes in one call: pages the page cache's reclaim (or a cold start) no longer drops.
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)

_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_LIBC.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)
_RESIDENT = bytes(range(1, 256, 2))  # mincore's byte per page: bit 0 set = in memory (the rest reserved)


def madvise(address: int, length: int, advice: int) -> bool:
    """``madvise`` through ctypes, which releases the GIL for the call: ``mmap.madvise`` keeps
    it, so a prefetch waiting on the disk would stall the thread running the model."""
    return _LIBC.madvise(address, length, advice) == 0


def resident_spans(spans: Iterable[tuple[int, int]]) -> bool:
    """Whether every page of the page-aligned ``(address, length)`` spans is in memory."""
    for start, length in spans:
        vector = ctypes.create_string_buffer((length + PAGE - 1) // PAGE)
        if _LIBC.mincore(start, length, vector) != 0 or vector.raw.translate(None, _RESIDENT):
            return False
    return True


def page_range(address: int, length: int) -> range:
    return range(address // PAGE, (address + length - 1) // PAGE + 1) if length > 0 else range(0)


def private_pages(pages: Iterable[int]) -> int | None:
    """How many of the virtual ``pages`` (page numbers) hold a private copy — written since
    they were mapped — according to ``/proc/self/pagemap``; None where it cannot be read."""
    wanted = sorted(set(pages))
    if not wanted:
        return 0
    count = 0
    try:
        with open("/proc/self/pagemap", "rb") as pagemap:
            start = 0
            while start < len(wanted):
                end = start
                while end + 1 < len(wanted) and wanted[end + 1] == wanted[end] + 1:
                    end += 1
                pagemap.seek(wanted[start] * 8)
                for (entry,) in struct.iter_unpack("<Q", pagemap.read((end - start + 1) * 8)):
                    present, swapped, file_page = entry >> 63 & 1, entry >> 62 & 1, entry >> 61 & 1
                    count += bool(swapped or (present and not file_page))
                start = end + 1
    except OSError:
        return None
    return count
