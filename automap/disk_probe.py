"""How :mod:`automap.machine` measures a file system: its read rate out of the page cache, read
as the offload reader reads, and what a read costs a computation running beside it. Nothing
here records anything; :mod:`automap.machine` keeps the figures."""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from automap.machine_probes import LAYER_SHAPE, ProbeLayer, median_seconds
from automap.page_cache import MADV_POPULATE_READ, send_to_page_cache

log = logging.getLogger(__name__)

_DISK_BYTES = 64 * 2**20
_DISK_CHUNK = 16 * 2**20  # 4 in flight: a read ahead has several requests in flight at once
_DISK_READS = 3
_DISK_IN_FLIGHT = 4
_RANDOM_PIECE = 64 * 2**10


def measure_disk(folder: str) -> tuple[float, float]:
    """Bytes/s read from a 64 MiB file in ``folder``'s file system, out of the page cache, the
    way a CPU's offloaded units are read (``automap.offload.readahead``: each request sent into
    the page cache and its pages mapped in; here 16 MiB requests 4 in flight, as reads ahead of
    several units are), and the compute time a byte read costs a computation on torch's threads
    running beside it (:func:`compute_loss`). The best rate of three reads, the median cost of
    three more. ``(0.0, 0.0)`` when the folder cannot be written (the defaults are kept)."""
    try:
        with tempfile.TemporaryDirectory(prefix="automap-calibration-", dir=folder) as own:
            path = os.path.join(own, "read-rate")
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
            try:
                for _ in range(_DISK_BYTES // _RANDOM_PIECE):  # pieces a heap chunk holds
                    os.write(fd, os.urandom(_RANDOM_PIECE))
                os.fsync(fd)
            finally:
                os.close(fd)
            rate = max(_read_rate(path) for _ in range(_DISK_READS))
            probe = _probe_layer()  # one layer for the three reads beside it
            return rate, statistics.median(compute_loss(path, probe) for _ in range(_DISK_READS))
    except OSError as exc:
        log.info("disk read rate not measured in %s: %s", folder, exc)
        return 0.0, 0.0


def _probe_layer() -> tuple[ProbeLayer, Any]:
    """The float32 probe layer and an input for it, at :data:`LAYER_SHAPE`."""
    import torch

    hidden, tokens = LAYER_SHAPE
    return ProbeLayer(hidden, torch.device("cpu"), torch.float32, tokens=tokens), torch.randn(
        1, tokens, hidden
    )


def compute_loss(path: str, probe: tuple[ProbeLayer, Any] | None = None) -> float:
    """Seconds per byte a computation on torch's threads loses while the file at ``path`` is
    read beside it (as :func:`_read_rate` reads it): the probe layer's calls during the read,
    less as many calls' time alone. Where torch's threads fill the cores, the read's own CPU
    time (the kernel's page-cache and page-table work) is taken from them, and a thread held
    back holds the others at the op's end; measured here about twice the read's CPU time. Where
    a core is spare it is about 0. An error of the read raises it. ``probe``: the layer and
    its input (:func:`_probe_layer`, made here when not given)."""
    import torch

    layer, x = probe or _probe_layer()
    failed: list[OSError] = []

    def read() -> None:
        try:
            _read_rate(path)
        except OSError as exc:
            failed.append(exc)

    with torch.no_grad():
        alone = median_seconds(lambda: layer(x), lambda: None, within=0.03)
        reader = threading.Thread(target=read, name="automap-calibration-read")
        calls, started = 0, time.perf_counter()
        reader.start()
        while reader.is_alive():
            layer(x)
            calls += 1
        beside = time.perf_counter() - started
        reader.join()
    if failed:
        raise failed[0]
    return max(beside - calls * alone, 0.0) / _DISK_BYTES


def _read_rate(path: str) -> float:
    """Bytes/s of one read of the file at ``path``, its pages dropped first."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        with mmap.mmap(fd, _DISK_BYTES, prot=mmap.PROT_READ) as mapped:

            def one(start: int) -> None:
                send_to_page_cache(fd, start, _DISK_CHUNK)  # where it cannot read, populate reads
                with contextlib.suppress(OSError):  # kernels before 5.14 lack it: pages are cached
                    mapped.madvise(MADV_POPULATE_READ, start, _DISK_CHUNK)

            started = time.perf_counter()
            with ThreadPoolExecutor(_DISK_IN_FLIGHT) as pool:
                list(pool.map(one, range(0, _DISK_BYTES, _DISK_CHUNK)))
            return _DISK_BYTES / (time.perf_counter() - started)
    finally:
        os.close(fd)
