"""Reading a file's bytes into the page cache without copying them anywhere: how the offload
reader (:mod:`automap.offload.readahead`) and the disk probe (:mod:`automap.disk_probe`) read,
so that the probe measures the runtime's own reads."""

from __future__ import annotations

import mmap
import os

# MADV_POPULATE_READ (Linux 5.14+) maps a range into the page tables in one call, so the
# compute thread takes no page faults; Python 3.11 lacks the constant.
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)
_SINK: list[int] = []


def send_to_page_cache(fd: int, offset: int, length: int) -> bool:
    """Read ``length`` bytes of ``fd`` at ``offset`` into the page cache, discarding them
    (``sendfile`` to ``/dev/null``: the kernel reads, nothing is copied to the process). False
    where ``sendfile`` cannot read the file (the caller reads another way)."""
    end = offset + length
    try:
        sink = _sink()
        while offset < end:
            sent = os.sendfile(sink, fd, offset, end - offset)
            if sent <= 0:
                break  # the end of the file (a truncated one is refused before any read)
            offset += sent
    except OSError:
        return False
    return True


def _sink() -> int:
    """``/dev/null``, open for writing once per process."""
    if not _SINK:
        _SINK.append(os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC))
    return _SINK[0]
