"""Peak resident memory of this process, anonymous and file-backed counted apart.

Samples ``RssAnon`` and ``RssFile`` from ``/proc/self/status`` on a background thread (every
``interval`` seconds) so that short peaks inside a call are seen. Use it in a fresh subprocess
so that earlier work in the same interpreter does not pollute the baseline.

    with MemWatch() as watch:
        work()
    print(watch.peak_anon_bytes - watch.base_anon_bytes)

Also what the benchmarks share around it: ``read_io`` (bytes read and written), ``evict``
(cold page cache for given files) and ``run_fresh`` (a worker in a fresh interpreter).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterable


def read_status() -> dict[str, int]:
    """``RssAnon``, ``RssFile``, ``RssShmem`` and ``VmHWM`` of this process, in bytes."""
    values: dict[str, int] = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("RssAnon", "RssFile", "RssShmem", "VmHWM", "VmRSS"):
                values[key] = int(rest.split()[0]) * 1024
    return values


def read_io() -> dict[str, int]:
    """Bytes this process read from and wrote to storage (``/proc/self/io``)."""
    values: dict[str, int] = {}
    with open("/proc/self/io") as f:
        for line in f:
            key, _, rest = line.partition(":")
            values[key] = int(rest)
    return {"read_bytes": values.get("read_bytes", 0), "write_bytes": values.get("write_bytes", 0)}


def evict(paths: Iterable[Path]) -> None:
    """Drop the files' pages from the page cache (only these files), so the next reads hit disk.
    They must not be mapped in this process; files it cannot write are not flushed first."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            if os.access(path, os.W_OK):
                os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


class MemWatch:
    """Context manager recording baseline and peak anonymous / file-backed RSS."""

    def __init__(self, interval: float = 0.002):
        self.interval = interval
        self.base_anon_bytes = self.base_file_bytes = 0
        self.peak_anon_bytes = self.peak_file_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        now = read_status()
        self.peak_anon_bytes = max(self.peak_anon_bytes, now["RssAnon"])
        self.peak_file_bytes = max(self.peak_file_bytes, now["RssFile"])

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            time.sleep(self.interval)

    def __enter__(self) -> MemWatch:
        now = read_status()
        self.base_anon_bytes, self.base_file_bytes = now["RssAnon"], now["RssFile"]
        self.peak_anon_bytes, self.peak_file_bytes = self.base_anon_bytes, self.base_file_bytes
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def result(self) -> dict[str, int]:
        return {
            "base_anon_bytes": self.base_anon_bytes,
            "peak_anon_bytes": self.peak_anon_bytes,
            "peak_anon_above_base_bytes": self.peak_anon_bytes - self.base_anon_bytes,
            "base_file_bytes": self.base_file_bytes,
            "peak_file_bytes": self.peak_file_bytes,
            "peak_file_above_base_bytes": self.peak_file_bytes - self.base_file_bytes,
        }


def run_fresh(module: str, *args: str, timeout: float = 1800) -> dict[str, Any]:
    """Run ``python -m module args...`` in a fresh interpreter; it must print one JSON object
    as its last stdout line, which is returned."""
    result = subprocess.run(
        [sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=timeout
    )
    if result.returncode != 0:
        raise RuntimeError(f"{module} {' '.join(args)} failed:\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])
