"""Freed host memory given back to the system after a load or dispatch.

Loading reads, converts (transformers' expert merges stack one tensor per expert into one)
and frees; glibc keeps much of what was freed in its arenas, so the process would stay tens of
MiB above the weights it holds, for good, and the run's peak would start from there instead of
from what :mod:`automap.planning.memory` predicts. ``malloc_trim(0)`` returns those free pages;
other C libraries (musl, macOS, Windows) have no such call and are left as they are.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from functools import lru_cache
from typing import Callable

log = logging.getLogger(__name__)


@lru_cache(maxsize=1)
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def trim_host_memory() -> bool:
    """Give the memory the C allocator holds free back to the system; False where it cannot."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
