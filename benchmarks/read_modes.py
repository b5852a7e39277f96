"""How fast, and how exactly, the two ways automap reads a store's pages work on this disk.

A routed expert is a range of a few MB inside its layer's file, between the rows of experts no
token went to. automap reads such ranges with the reader of :mod:`automap.offload.readahead`
(``sendfile`` to ``/dev/null`` on several threads, then the pages are mapped in), through one
of two descriptors of the file:

- ``readahead``: the kernel's readahead on (whole tensors): large reads into large folios, but
  each request reads up to ``read_ahead_kb`` past its end;
- ``exact``: ``POSIX_FADV_RANDOM`` (routed rows): exactly the pages asked for, in 4 KiB pages.

For each mode and a few worker/chunk settings this reads, cold, ``--spans`` ranges of
``--span-mib`` each, spaced apart in a scratch file, and reports the median seconds, the rate,
and the bytes brought into memory against those asked for (``mincore``).

    python -m benchmarks.read_modes --dir /tmp --runs 5
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import statistics
import tempfile
import time
from pathlib import Path

from automap.offload.readahead import ReadAhead

PAGE = mmap.PAGESIZE
LIBC = ctypes.CDLL(None, use_errno=True)
LIBC.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)
SETTINGS = ((16, 1 << 20), (32, 512 << 10), (8, 4 << 20), (4, 16 << 20))  # (workers, chunk bytes)


def resident_bytes(address: int, length: int) -> int:
    pages = length // PAGE
    vector = ctypes.create_string_buffer(pages)
    if LIBC.mincore(address, length, vector) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return sum(b & 1 for b in vector.raw) * PAGE


def measure(
    path: Path, exact: bool, workers: int, chunk: int, spans: int, span_bytes: int, runs: int
) -> dict:
    fd = os.open(path, os.O_RDONLY)
    try:
        if exact:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        mapped = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
        view = (ctypes.c_char * len(mapped)).from_buffer(mapped)
        base = ctypes.addressof(view)
        reader = ReadAhead(workers, chunk)
        seconds, read = [], []
        stride = 4 * span_bytes  # three spans' worth of unread rows between two read ones
        for run in range(runs):
            mapped.madvise(mmap.MADV_DONTNEED)  # pages mapped here stay cached: unmap them first
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            first = (run * 7 * span_bytes) % max(PAGE, len(mapped) - spans * stride)
            first -= first % PAGE
            wanted = [(base + first + i * stride, span_bytes) for i in range(spans)]
            start = time.perf_counter()
            reader.read(wanted, fd, base)
            seconds.append(time.perf_counter() - start)
            read.append(resident_bytes(base + first, min(spans * stride, len(mapped) - first)))
        del view
        mapped.close()
    finally:
        os.close(fd)
    median = statistics.median(seconds)
    asked = spans * span_bytes
    return {
        "mode": "exact" if exact else "readahead",
        "workers": workers,
        "chunk_bytes": chunk,
        "median_seconds": median,
        "bytes_per_second": asked / median,
        "read_vs_asked": statistics.median(read) / asked,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--dir", default=tempfile.gettempdir(), help="where the scratch file goes (the disk measured)"
    )
    parser.add_argument("--span-mib", type=float, default=4.5, help="one routed expert's rows of one tensor")
    parser.add_argument("--spans", type=int, default=4)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--json")
    args = parser.parse_args()
    span = int(args.span_mib * (1 << 20)) // PAGE * PAGE
    size = (args.runs * 7 + 4 * args.spans + 4) * span
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="automap-read-modes-") as folder:
        path = Path(folder) / "scratch"
        with open(path, "wb") as f:
            for _ in range(-(-size // (16 << 20))):
                f.write(os.urandom(16 << 20))
            f.flush()
            os.fsync(f.fileno())
        rows = [
            measure(path, exact, w, c, args.spans, span, args.runs)
            for w, c in SETTINGS
            for exact in (False, True)
        ]
    for row in rows:
        print(
            f"{row['mode']:9s} {row['workers']:2d} x {row['chunk_bytes'] >> 10:5d} KiB: "
            f"{row['median_seconds'] * 1e3:6.1f} ms, {row['bytes_per_second'] / 1e9:.2f} GB/s, "
            f"read {row['read_vs_asked']:.2f}x the bytes asked for"
        )
    print(json.dumps(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
