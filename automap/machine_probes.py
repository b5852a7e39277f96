"""How :mod:`automap.machine` measures this machine: short probes, each the median of a few
timed runs after a warm-up (on a machine shared with other jobs, their load included, as a
run would see it). Nothing here records anything; :mod:`automap.machine` keeps the figures."""

from __future__ import annotations

import itertools
import logging
import statistics
import time
from collections.abc import Callable, Collection
from typing import Any

from automap.kinds import kind_of, registered_kinds, torch_device

log = logging.getLogger(__name__)

DTYPES = ("float32", "bfloat16", "float16")


def median_seconds(
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
        rates[name] = 2 * (n // 2) * n * n / median_seconds(lambda a=a, b=b: torch.mm(a, b), sync)
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
        return median_seconds(lambda: torch.mm(a, b), sync, within=0.02) > _SLOW_SECONDS
    finally:
        torch.set_num_threads(threads)


def _small_product_rate(device: Any, dtype: Any, sync: Callable[[], None]) -> float:
    """FLOP/s of a 128 x 256 by 256 x 256 product: how a dtype the device computes slowly is
    measured (a larger probe would take long)."""
    import torch

    a = torch.ones(128, 256, device=device, dtype=dtype)
    b = torch.ones(256, 256, device=device, dtype=dtype)
    return 2 * 128 * 256 * 256 / median_seconds(lambda: torch.mm(a, b), sync)


# A probe stops once its runs took this many times its time budget.
_CAP = 4
# Timed runs a probe takes at least: on a shared machine one in a few runs gets its cores.
_MIN_SAMPLES = 5
# The layer probes run longer than the others: with torch's threads on every core, a layer's
# rate moves by a quarter from one tenth of a second to the next (the other cores' load of the
# moment); over a fifth of a second, by about a tenth.
_LAYER_WITHIN = 0.2
_LAYER_REPEATS = 200
# The large matmul's rate moves little from one window to the next (no small ops whose threads
# wait for one another): half the layer's time is enough.
_MATMUL_WITHIN = 0.1
# The probe layer's copies fill this much: twice a large L3 cache (32 MiB), as a model's layers
# do, so that each call reads its weights from memory.
_BEYOND_CACHE = 64 * 2**20
# A dtype whose 128 x 256 by 256 x 256 product takes this long is not measured larger.
_SLOW_SECONDS = 0.005


# The layer the CPU's compute rate is measured on, (hidden, tokens), and the large matmul
# beside it, (tokens, in, out): a linear layer of 1024 x 2816 over 512 tokens. A model's ops
# whose FLOPs fall between theirs run at a rate between the two: a unit of large matmuls and
# few small ops between them (GPT-2's blocks over 512 tokens, a wide ``lm_head``) runs near
# the matmul's rate, one whose norms, rotary embeddings and gating weigh as much as in the
# layer at the layer's; ``planning.cost.compute_rate`` interpolates. The layer at 128 tokens:
# its activations stay under 2 MiB, and what the probe frees leaves no heap chunk a weight
# allocated later would be carved from (``tests/devices/test_machine.py``); the matmul writes
# into its arena and allocates nothing.
LAYER_SHAPE = (512, 128)
MATMUL_SHAPE = (512, 1024, 2816)
# The aten ops one call of the layer runs (``tests/devices/test_machine.py`` counts them).
LAYER_OPS = 54


def layer_flops(hidden: int, tokens: int) -> int:
    """The FLOPs of one call of the layer (``hidden`` wide, on ``tokens`` tokens) as
    :class:`~torch.utils.flop_counter.FlopCounterMode` counts them on meta, as the profiler
    counts a model's: the linear layers and the attention, whole (``tests/devices/
    test_machine.py`` checks the two agree)."""
    linear = 4 * hidden * hidden + 3 * (hidden * 11 // 4) * hidden
    return 2 * tokens * linear + 4 * tokens * tokens * hidden


def _matmul_flops() -> int:
    tokens, inputs, outputs = MATMUL_SHAPE
    return 2 * tokens * inputs * outputs


# The FLOPs per op of the layer and of the matmul: where their rates apply.
PROBE_OP_FLOPS = (layer_flops(*LAYER_SHAPE) / LAYER_OPS, float(_matmul_flops()))


def layer_rates(
    device: Any,
    sync: Callable[[], None],
    hidden: int = 512,
    tokens: int = 128,
    slow: Collection[str] | None = None,
) -> dict[str, float]:
    """FLOP/s per dtype of a transformer layer in miniature on ``device`` (norms, attention
    with rotary embeddings, a gated MLP, residuals; ``tokens`` x ``hidden``; copies of it
    called in turns, :func:`_copies`), its FLOPs counted as the profiler counts
    a model's (:class:`~torch.utils.flop_counter.FlopCounterMode`: matmuls and attention): the
    rate a model's counted FLOPs run at, the work between the matmuls included (slow in a
    dtype the CPU has no vector units for, bfloat16's norms and activations on many). A dtype
    whose 256-wide product is slow (``slow``, asked of :func:`slow_dtypes` when not given) is
    measured on that product instead."""
    import torch

    def rate(dtype: Any) -> float:
        turns = itertools.cycle(_copies(hidden, device, dtype, tokens))  # one arena held at a time
        x = torch.randn(1, tokens, hidden, device=device).to(dtype)
        seconds = median_seconds(lambda: next(turns)(x), sync, repeats=_LAYER_REPEATS, within=_LAYER_WITHIN)
        return layer_flops(hidden, tokens) / seconds

    return _per_dtype(device, sync, rate, slow)


def slow_dtypes(device: Any, sync: Callable[[], None]) -> set[str]:
    """The names of :data:`DTYPES` whose 256-wide product ``device`` computes slowly (:func:`_slow`)."""
    import torch

    return {name for name in DTYPES if _slow(device, getattr(torch, name), sync)}


def _per_dtype(
    device: Any, sync: Callable[[], None], rate: Callable[[Any], float], slow: Collection[str] | None
) -> dict[str, float]:
    """``rate(dtype)`` for each of :data:`DTYPES`; a dtype in ``slow`` (:func:`slow_dtypes`
    when None) is measured on the 256-wide product instead (a larger probe would take long)."""
    import torch

    slow = slow_dtypes(device, sync) if slow is None else slow
    return {
        name: _small_product_rate(device, getattr(torch, name), sync)
        if name in slow
        else rate(getattr(torch, name))
        for name in DTYPES
    }


def _copies(hidden: int, device: Any, dtype: Any, tokens: int) -> list[ProbeLayer]:
    """As many copies of a probe layer as :data:`_BEYOND_CACHE` holds, in one arena: called in
    turns, each reads its weights from memory, as a model's layers do at every forward (one
    layer called again and again keeps its weights in the cache; in bfloat16 at two threads
    that ran 8 % faster than its copies in turns, measured here)."""
    per = ProbeLayer.nbytes(hidden, dtype, tokens=tokens)
    arena = _Arena(per * max(1, _BEYOND_CACHE // per), device)
    first = ProbeLayer(hidden, device, dtype, tokens=tokens, arena=arena)
    return [first] + [
        ProbeLayer(hidden, device, dtype, tokens=tokens, arena=arena, like=first)
        for _ in range(_BEYOND_CACHE // per - 1)
    ]


class ProbeLayer:
    """A Llama-like layer of plain tensors: RMS norms, attention with rotary embeddings, a
    SiLU-gated MLP. ``tokens`` is the length it is called on (its rotary tables')."""

    def __init__(
        self,
        hidden: int,
        device: Any,
        dtype: Any,
        heads: int = 8,
        tokens: int = 128,
        arena: _Arena | None = None,
        like: ProbeLayer | None = None,
    ) -> None:
        """Its tensors are carved from ``arena`` (one of its own by default: :meth:`nbytes`),
        drawn at random, or copied from ``like``'s (a copy of a layer: faster than drawing)."""
        arena = arena or _Arena(self.nbytes(hidden, dtype, heads, tokens), device)

        def take(rows: int, cols: int, name: str) -> Any:
            tensor = arena.take((rows, cols), dtype)
            if like is not None:
                return tensor.copy_(getattr(like, name))
            return tensor.uniform_(-1, 1) if name in ("cos", "sin") else tensor.normal_(std=cols**-0.5)

        self.heads, self.hidden = heads, hidden
        # Rotary tables of ``tokens`` positions, in the layer's dtype as transformers casts them.
        self.cos, self.sin = (take(tokens, hidden // heads, name) for name in ("cos", "sin"))
        wide = hidden * 11 // 4
        self.qkv, self.out = take(3 * hidden, hidden, "qkv"), take(hidden, hidden, "out")
        self.gate, self.up, self.down = (
            take(wide, hidden, "gate"),
            take(wide, hidden, "up"),
            take(hidden, wide, "down"),
        )

    @staticmethod
    def nbytes(hidden: int, dtype: Any, heads: int = 8, tokens: int = 128) -> int:
        """The bytes one layer's tensors take in an arena, alignment included."""
        return int((12.25 * hidden * hidden + 2 * tokens * (hidden // heads)) * dtype.itemsize) + 7 * 64

    def rotate(self, x: Any) -> Any:
        """Rotary position embedding as transformers applies it to queries and keys."""
        import torch

        half = x.shape[-1] // 2
        return x * self.cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * self.sin

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
        q, k = self.rotate(q), self.rotate(k)
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(x.shape)
        x = x + F.linear(attention, self.out)
        h = self.norm(x)
        return x + F.linear(F.silu(F.linear(h, self.gate)) * F.linear(h, self.up), self.down)


def large_matmul_rates(
    device: Any, sync: Callable[[], None], slow: Collection[str] | None = None
) -> dict[str, float]:
    """FLOP/s per dtype of a large linear layer's matmul (:data:`MATMUL_SHAPE`) on ``device``,
    written into its own arena (nothing allocated per call). A dtype whose 256-wide product is
    slow (``slow``, as in :func:`layer_rates`) is measured on that product instead."""
    import torch

    tokens, inputs, outputs = MATMUL_SHAPE

    def rate(dtype: Any) -> float:
        arena = _Arena(
            (tokens * inputs + outputs * inputs + tokens * outputs) * dtype.itemsize + 3 * 64, device
        )
        x = arena.take((tokens, inputs), dtype).normal_()
        weight = arena.take((outputs, inputs), dtype).normal_(std=inputs**-0.5)
        out = arena.take((tokens, outputs), dtype)

        def mm() -> None:
            torch.mm(x, weight.t(), out=out)

        return _matmul_flops() / median_seconds(mm, sync, repeats=_LAYER_REPEATS, within=_MATMUL_WITHIN)

    return _per_dtype(device, sync, rate, slow)


def measure_cpu() -> dict[str, Any]:
    """The CPU's compute rate per dtype on a transformer layer and on a large matmul
    (:func:`layer_rates`, :func:`large_matmul_rates`), how fast it reads weights per dtype
    (:func:`matvec_rates`: its memory bandwidth and the cost of each row) and the time one op
    costs beside its work (:func:`op_seconds`)."""
    import torch

    hidden, tokens = LAYER_SHAPE
    cpu, sync = torch.device("cpu"), lambda: None
    with torch.no_grad():
        slow = slow_dtypes(cpu, sync)  # asked once for both probes
        rates = layer_rates(cpu, sync, hidden, tokens, slow)
        large_rates = large_matmul_rates(cpu, sync, slow)
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
        link = host.nbytes / median_seconds(
            lambda: target.copy_(host, non_blocking=True),
            sync,
        )
        other = torch.empty_like(target)
        memory = (
            2
            * target.nbytes
            / median_seconds(
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
