"""The disk's bound for a cold forward: offloaded bytes / the disk's best read rate, measured now.

Most NVMe drives and cloud volumes serve a deep queue of requests several times faster than one
sequential stream, so the best rate is the better of two cold reads of the same byte ranges:
one reader going through them in order, and ``readers`` threads each reading its own share at
once. Both read through the page cache (evicted first) into a reused buffer with ``preadv``.

    python -m benchmarks.diskbound /tmp/automap-bench/model.safetensors
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

from benchmarks.memwatch import evict

BLOCK = 16 << 20


def merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``(offset, length)`` ranges sorted and merged where they touch."""
    out: list[tuple[int, int]] = []
    for start, length in sorted(ranges):
        if out and start <= out[-1][0] + out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], start + length - out[-1][0]))
        else:
            out.append((start, length))
    return out


def shares(ranges: list[tuple[int, int]], count: int) -> list[list[tuple[int, int]]]:
    """The ranges cut into ``count`` consecutive shares of (about) equal bytes."""
    total = sum(length for _, length in ranges)
    size = -(-total // count)
    out: list[list[tuple[int, int]]] = [[] for _ in range(count)]
    done = 0
    for start, length in ranges:
        while length:
            index = min(done // size, count - 1)
            take = min(length, (index + 1) * size - done) if index < count - 1 else length
            out[index].append((start, take))
            start, length, done = start + take, length - take, done + take
    return out


def _read(fd: int, ranges: list[tuple[int, int]]) -> None:
    buffer = memoryview(bytearray(BLOCK))
    for start, length in ranges:
        for offset in range(start, start + length, BLOCK):
            os.preadv(fd, [buffer[: min(BLOCK, start + length - offset)]], offset)


def cold_read_seconds(path: Path, ranges: list[tuple[int, int]], readers: int) -> float:
    """Seconds to read ``ranges`` of ``path`` cold with ``readers`` threads (one share each)."""
    evict([path])
    fd = os.open(path, os.O_RDONLY)
    try:
        threads = [threading.Thread(target=_read, args=(fd, share)) for share in shares(ranges, readers)]
        start = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return time.perf_counter() - start
    finally:
        os.close(fd)
        evict([path])


def disk_bound(path: Path, ranges: list[tuple[int, int]] | None = None, readers: int = 4) -> dict:
    """Cold reads of ``ranges`` (default: the whole file) by one reader and by ``readers`` in
    flight; the bound is their bytes over the better rate."""
    ranges = merged(ranges or [(0, path.stat().st_size)])
    nbytes = sum(length for _, length in ranges)
    one = cold_read_seconds(path, ranges, 1)
    many = cold_read_seconds(path, ranges, readers)
    best = nbytes / min(one, many)
    return {
        "bytes": nbytes,
        "one_reader_bytes_per_second": nbytes / one,
        f"readers_{readers}_bytes_per_second": nbytes / many,
        "best_bytes_per_second": best,
        "bound_seconds": nbytes / best,
    }


if __name__ == "__main__":
    print(disk_bound(Path(sys.argv[1])))
