"""How :mod:`automap.machine` measures this machine: short probes, each the median of a few
timed runs after a warm-up (on a machine shared with other jobs, their load included, as a
run would see it). Nothing here records anything; :mod:`automap.machine` keeps the figures."""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from automap.kinds import kind_of, registered_kinds, torch_device

log = logging.getLogger(__name__)

DTYPES = ("float32", "bfloat16", "float16")
_DISK_BYTES = 64 * 2**20
_DISK_CHUNK = 16 * 2**20  # 4 in flight: a read ahead has several requests in flight at once
_DISK_READS = 3
_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux's value
_DISK_IN_FLIGHT = 4
_RANDOM_PIECE = 64 * 2**10


def _median_seconds(
    run: Callable[[], None], sync: Callable[[], None], repeats: int = 30, within: float = 0.1
) -> float:
    """The median of up to ``repeats`` timed runs (after one warm-up), at least
    :data:`_MIN_SAMPLES` and as many more as fit in ``within`` seconds: what a run sees (on a
    machine shared with other jobs, their load of the moment included). Runs so slow that
    the minimum would take over :data:`_CAP` times ``within`` stop there (one run at least):
    a loaded machine is measured less precisely, not for long."""
    run()
    sync()
    times: list[float] = []
    while (
        len(times) < repeats
        and (len(times) < _MIN_SAMPLES or sum(times) < within)
        and not (times and sum(times) > _CAP * within)
    ):
        started = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def measure_computing() -> dict[str, dict[str, Any]]:
    """The CPU's and each accelerator's figures, by device name."""
    figures = {"cpu": measure_cpu()}
    for kind in registered_kinds():
        count = kind.present_count() if kind.is_accelerator else None
        for i in range(count or 0):
            name = f"{kind.name}:{i}" if kind.indexed else kind.name
            try:
                figures[name] = measure_accelerator(name)
            except Exception as exc:  # a device that cannot run the probe keeps its defaults
                log.warning("could not measure %s: %s", name, exc)
    return figures


def matmul_rates(device: Any, size: int, sync: Callable[[], None]) -> dict[str, float]:
    """FLOP/s of a ``size/2 x size`` by ``size x size`` matmul per dtype on ``device``. A dtype
    the device computes slowly (float16 on most CPUs: a 256-wide product on one thread takes
    over :data:`_SLOW_SECONDS`) is measured at 256, so the probe stays short."""
    import torch

    rates = {}
    for name in DTYPES:
        dtype = getattr(torch, name)
        n = size if not _slow(device, dtype, sync) else 256
        a = torch.ones(n // 2, n, device=device, dtype=dtype)
        b = torch.ones(n, n, device=device, dtype=dtype)
        rates[name] = 2 * (n // 2) * n * n / _median_seconds(lambda a=a, b=b: torch.mm(a, b), sync)
    return rates


def _slow(device: Any, dtype: Any, sync: Callable[[], None]) -> bool:
    """Whether a 128 x 256 by 256 x 256 product takes over :data:`_SLOW_SECONDS` on one
    thread (one thread: no thread waits for a neighbour's core, so the answer is the dtype's)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a = torch.ones(128, 256, device=device, dtype=dtype)
        b = torch.ones(256, 256, device=device, dtype=dtype)
        return _median_seconds(lambda: torch.mm(a, b), sync, within=0.02) > _SLOW_SECONDS
    finally:
        torch.set_num_threads(threads)


# A probe stops once its runs took this many times its time budget.
_CAP = 4
# Timed runs a probe takes at least: on a shared machine one in a few runs gets its cores.
_MIN_SAMPLES = 5
# The layer probes run longer than the others: with torch's threads on every core, a layer's
# rate moves by a quarter from one tenth of a second to the next (the other cores' load of the
# moment); over a fifth of a second, by about a tenth.
_LAYER_WITHIN = 0.2
_LAYER_REPEATS = 200
# A dtype whose 128 x 256 by 256 x 256 product takes this long is not measured larger.
_SLOW_SECONDS = 0.005


# The layers the CPU's compute rate is measured on, (hidden, tokens): small and large. A
# model's ops whose FLOPs fall between theirs run at a rate between the two (larger matmuls
# keep the vector units busier); ``planning.cost.compute_rate`` interpolates. Both at 128
# tokens: the large layer's activations stay under 2 MiB, and what the probe frees leaves no
# heap chunk a weight allocated later would be carved from (at 256 tokens one in three
# calibrations left one: ``tests/devices/test_machine.py``).
LAYER_SHAPES = ((512, 128), (1024, 128))
# The aten ops one call of the layer runs (``tests/devices/test_machine.py`` counts them).
LAYER_OPS = 40


def layer_flops(hidden: int, tokens: int) -> int:
    """The FLOPs of one call of the layer (``hidden`` wide, on ``tokens`` tokens) as
    :class:`~torch.utils.flop_counter.FlopCounterMode` counts them on meta, as the profiler
    counts a model's: the linear layers and the attention, whole (``tests/devices/
    test_machine.py`` checks the two agree)."""
    linear = 4 * hidden * hidden + 3 * (hidden * 11 // 4) * hidden
    return 2 * tokens * linear + 4 * tokens * tokens * hidden


# The FLOPs per op of the small and the large layer: where their rates apply.
LAYER_OP_FLOPS = tuple(layer_flops(*shape) / LAYER_OPS for shape in LAYER_SHAPES)


def layer_rates(
    device: Any, sync: Callable[[], None], hidden: int = 512, tokens: int = 128
) -> dict[str, float]:
    """FLOP/s per dtype of a transformer layer in miniature on ``device`` (norms, attention,
    a gated MLP, residuals; ``tokens`` x ``hidden``), its FLOPs counted as the profiler counts
    a model's (:class:`~torch.utils.flop_counter.FlopCounterMode`: matmuls and attention): the
    rate a model's counted FLOPs run at, the work between the matmuls included (slow in a
    dtype the CPU has no vector units for, bfloat16's norms and activations on many). A dtype
    whose 256-wide product is slow (:func:`_slow`) is measured on that product instead."""
    import torch

    rates = {}
    for name in DTYPES:
        dtype = getattr(torch, name)
        if _slow(device, dtype, sync):
            a = torch.ones(128, 256, device=device, dtype=dtype)
            b = torch.ones(256, 256, device=device, dtype=dtype)
            rates[name] = 2 * 128 * 256 * 256 / _median_seconds(lambda a=a, b=b: torch.mm(a, b), sync)
            continue
        layer = _Layer(hidden, device, dtype)
        x = torch.randn(1, tokens, hidden, device=device).to(dtype)
        seconds = _median_seconds(
            lambda layer=layer, x=x: layer(x), sync, repeats=_LAYER_REPEATS, within=_LAYER_WITHIN
        )
        rates[name] = layer_flops(hidden, tokens) / seconds
        del layer, x  # one layer's arena held at a time
    return rates


class _Layer:
    """A Llama-like layer of plain tensors: RMS norms, attention, a SiLU-gated MLP."""

    def __init__(self, hidden: int, device: Any, dtype: Any, heads: int = 8) -> None:
        arena = _Arena(12.25 * hidden * hidden * dtype.itemsize + 5 * 64, device)

        def weight(rows: int, cols: int) -> Any:
            return arena.take((rows, cols), dtype).normal_(std=cols**-0.5)

        self.heads, self.hidden = heads, hidden
        self.qkv, self.out = weight(3 * hidden, hidden), weight(hidden, hidden)
        self.gate, self.up, self.down = (
            weight(hidden * 11 // 4, hidden),
            weight(hidden * 11 // 4, hidden),
            weight(hidden, hidden * 11 // 4),
        )

    @staticmethod
    def norm(x: Any) -> Any:
        """RMS norm computed in float32 and cast back, as transformers' models compute it."""
        import torch

        wide = x.float()
        return (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)

    def __call__(self, x: Any) -> Any:
        from torch.nn import functional as F

        batch, tokens, _ = x.shape
        h = self.norm(x)
        q, k, v = F.linear(h, self.qkv).view(batch, tokens, 3, self.heads, -1).transpose(1, 3).unbind(2)
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(x.shape)
        x = x + F.linear(attention, self.out)
        h = self.norm(x)
        return x + F.linear(F.silu(F.linear(h, self.gate)) * F.linear(h, self.up), self.down)


def measure_cpu() -> dict[str, Any]:
    """The CPU's compute rate per dtype on a small and a large layer (:func:`layer_rates`,
    :data:`LAYER_SHAPES`), how fast it reads weights per dtype (:func:`matvec_rates`: its memory
    bandwidth and the cost of each row) and the time one op costs beside its work
    (:func:`op_seconds`)."""
    import torch

    (small, tokens), (large, large_tokens) = LAYER_SHAPES
    with torch.no_grad():
        rates = layer_rates(torch.device("cpu"), lambda: None, small, tokens)
        large_rates = layer_rates(torch.device("cpu"), lambda: None, large, large_tokens)
        reads = {name: matvec_rates(getattr(torch, name)) for name in DTYPES}
        per_op = op_seconds()
    return {
        "flops_per_second": rates,
        "large_flops_per_second": large_rates,
        "memory_bytes_per_second": {name: bandwidth for name, (bandwidth, _) in reads.items()},
        "row_seconds": {name: row for name, (_, row) in reads.items()},
        "op_seconds": per_op,
    }


def matvec_rates(dtype: Any, nbytes: int = 64 * 2**20, rounds: int = 15) -> tuple[float, float]:
    """``(bytes/s, seconds per row)`` of a decode step's reads on the CPU: a vector through
    distinct matrices (``nbytes`` in all, twice a large L3 cache, read once each per run,
    as a decode step reads each weight) rows :data:`_NARROW` and :data:`_WIDE` elements long.
    A matrix-vector product pays for each row (a dot product's start and its sum) beside its
    bytes; the two widths part the two: ``seconds = bytes / bandwidth + rows * row_seconds``.
    The widths take turns, ``rounds`` times, and the row's cost is the median of the rounds'
    differences: a shared machine's load of the moment weighs on both alike."""
    import torch
    from torch.nn import functional as F

    runs = {}
    arena = _Arena(nbytes)
    for width in (_NARROW, _WIDE):
        rows = max(nbytes // (width * dtype.itemsize * _MATRICES), 1)
        arena.used = 0  # both widths view the same bytes: twice the L3 apart, read from memory
        matrices = [arena.take((rows, width), dtype).fill_(1) for _ in range(_MATRICES)]
        vector = torch.ones(1, width, dtype=dtype)

        def run(matrices: list[Any] = matrices, vector: Any = vector) -> float:
            started = time.perf_counter()
            for matrix in matrices:
                F.linear(vector, matrix)
            return time.perf_counter() - started

        run()  # warm-up
        runs[width] = (run, rows * _MATRICES)
    (narrow, narrow_rows), (wide, wide_rows) = runs[_NARROW], runs[_WIDE]
    pairs = [(narrow(), wide()) for _ in range(rounds)]
    runs.clear()
    row = max(statistics.median(n - w for n, w in pairs) / (narrow_rows - wide_rows), 0.0)
    seconds = statistics.median(w for _, w in pairs)
    size = wide_rows * _WIDE * dtype.itemsize
    return size / max(seconds - wide_rows * row, seconds / 2), row


def op_seconds() -> float:
    """Seconds an op costs beside its work, as a decode step runs its ops: a decoder layer
    written as transformers writes its layers, 64 wide on one token (:class:`~automap.
    probe_block.Block`; its ops' work is nothing), each run timed right after a
    matrix-vector product has streamed a weight through the caches, over the
    :data:`BLOCK_OPS` aten ops it runs."""
    import torch
    from torch.nn import functional as F

    from automap.probe_block import Block

    block = Block()
    x = torch.ones(1, 1, block.hidden)
    arena = _Arena(64 * 2**20)
    matrices = [arena.take((1024, 1024), torch.float32).fill_(1) for _ in range(16)]  # 2x a large L3
    vector = torch.ones(1, 1024)
    with torch.no_grad():
        block(x)
        times = []
        for _ in range(3):
            for matrix in matrices:
                F.linear(vector, matrix)
                started = time.perf_counter()
                block(x)
                times.append(time.perf_counter() - started)
    return statistics.median(times) / BLOCK_OPS


# The aten ops one call of probe_block.Block dispatches, as the profiler's tracer counts a
# model's (counted here, not at run time: a dispatch mode's first use imports torch._dynamo,
# a second, and tests/devices/test_machine.py checks the count).
BLOCK_OPS = 81


# The two row lengths (elements) matrix-vector reads are measured at, and the matrices read.
_NARROW, _WIDE, _MATRICES = 1024, 4096, 8


class _Arena:
    """The probes' large tensors, carved from one allocation of at least :data:`_ARENA_BYTES`.

    glibc serves an allocation over its mmap threshold (128 KiB at start) with a mapping of its
    own, and freeing one raises the threshold to its size, up to 32 MiB: a probe freeing 16 MiB
    matrices would leave the user's process serving its later weights from the heap, which a
    decode step then reads 7-15 % slower (measured here). A single allocation over 32 MiB is
    mapped and unmapped without moving the threshold, so calibration leaves the allocator as it
    found it."""

    def __init__(self, nbytes: float, device: Any = "cpu") -> None:
        import torch

        self.buffer = torch.empty(max(int(nbytes), _ARENA_BYTES), dtype=torch.uint8, device=device)
        self.used = 0

    def take(self, shape: tuple[int, ...], dtype: Any) -> Any:
        """An uninitialised tensor of ``shape`` and ``dtype`` in the arena, 64-byte aligned."""
        count = 1
        for size in shape:
            count *= size
        nbytes = count * dtype.itemsize
        if self.used + nbytes > self.buffer.numel():
            raise ValueError(f"probe arena of {self.buffer.numel()} bytes cannot hold {nbytes} more")
        view = self.buffer[self.used : self.used + nbytes].view(dtype).view(shape)
        self.used += -(-nbytes // 64) * 64
        return view


_ARENA_BYTES = 33 * 2**20  # over glibc's largest dynamic mmap threshold (32 MiB on 64-bit)


def measure_accelerator(name: str, *, size: int = 4096, copy_bytes: int = 256 * 2**20) -> dict[str, Any]:
    """An accelerator's copy rate from pinned host memory (``copy_bytes``), its memory bandwidth
    (a copy on it reads and writes) and its matmul rate per dtype (``size``, see
    :func:`matmul_rates`)."""
    import torch

    device = torch_device(name)
    kind = kind_of(name)
    synchronize = kind.factory("synchronize")

    def sync() -> None:
        if synchronize is not None:
            synchronize(device)

    with torch.no_grad():
        host = torch.empty(copy_bytes, dtype=torch.uint8)
        try:
            host = host.pin_memory()
        except RuntimeError:
            pass
        target = torch.empty_like(host, device=device)
        link = host.nbytes / _median_seconds(
            lambda: target.copy_(host, non_blocking=True),
            sync,
        )
        other = torch.empty_like(target)
        memory = (
            2
            * target.nbytes
            / _median_seconds(
                lambda: other.copy_(target),
                sync,
            )
        )
        rates = matmul_rates(device, size, sync)
        host = target = other = None  # the buffers go before the rest is measured
    api = kind.torch_api()
    if hasattr(api, "empty_cache"):  # the probe's blocks back to the device: free memory reads as before
        api.empty_cache()
    return {"flops_per_second": rates, "link_bytes_per_second": link, "memory_bytes_per_second": memory}


def measure_disk(folder: str) -> tuple[float, float]:
    """Bytes/s read from a 64 MiB file in ``folder``'s file system, out of the page cache, the
    way a CPU's offloaded units are read (``automap.offload.readahead``: each request sent into
    the page cache and its pages mapped in; here 16 MiB requests 4 in flight, as reads ahead of
    several units are), and the CPU seconds the process spent per byte read (the kernel's
    page-cache and page-table work: time a CPU that computes meanwhile loses). The best rate
    and the median CPU cost of three reads: the cost moves with what the other cores do.
    ``(0.0, 0.0)`` when the folder cannot be written (the defaults are kept)."""
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
            rates, costs = zip(*(_read_rate(path) for _ in range(_DISK_READS)))
            return max(rates), statistics.median(costs)
    except OSError as exc:
        log.info("disk read rate not measured in %s: %s", folder, exc)
        return 0.0, 0.0


def _read_rate(path: str) -> tuple[float, float]:
    """``(bytes/s, CPU seconds per byte)`` of one read of the file at ``path``, its pages
    dropped first."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        with open(os.devnull, "wb") as sink, mmap.mmap(fd, _DISK_BYTES, prot=mmap.PROT_READ) as mapped:

            def one(start: int) -> None:
                at, end = start, start + _DISK_CHUNK
                with contextlib.suppress(OSError):  # a file system sendfile cannot read: populate reads
                    while at < end and (sent := os.sendfile(sink.fileno(), fd, at, end - at)) > 0:
                        at += sent
                with contextlib.suppress(OSError):  # kernels before 5.14 lack it: pages are cached
                    mapped.madvise(_POPULATE_READ, start, _DISK_CHUNK)

            started, cpu = time.perf_counter(), time.process_time()  # every thread's, user and kernel
            with ThreadPoolExecutor(_DISK_IN_FLIGHT) as pool:
                list(pool.map(one, range(0, _DISK_BYTES, _DISK_CHUNK)))
            seconds = time.perf_counter() - started
            return _DISK_BYTES / seconds, (time.process_time() - cpu) / _DISK_BYTES
    finally:
        os.close(fd)
