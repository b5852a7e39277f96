"""Reading ahead with several requests in flight: a unit's tensors merged into contiguous ranges,
cut into large chunks, the chunks read on several threads at once, every page of the unit in
memory afterwards and the values unchanged."""

from __future__ import annotations

import os
import threading

import torch
from safetensors.torch import save_file

from automap.offload import CheckpointSource
from automap.offload.pages import PAGE
from automap.offload.readahead import Chunk, ReadAhead, chunked, coalesce


class Gated(ReadAhead):
    """A real reader whose first two requests each wait for the other to start: if requests
    were issued one at a time, the first would wait alone and the barrier would break."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.barrier = threading.Barrier(2, timeout=20)
        self.chunks: list[tuple[int, int]] = []
        self._seen = threading.Lock()

    def read_chunk(self, chunk: Chunk) -> None:
        with self._seen:
            self.chunks.append((chunk.address, chunk.length))
            first_two = len(self.chunks) <= 2
        if first_two:
            self.barrier.wait()
        super().read_chunk(chunk)


def _checkpoint(tmp_path) -> tuple[os.PathLike, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    weights = {
        "layer.q": torch.randn(1024, 1024),
        "layer.k": torch.randn(1024, 1024),
        "layer.norm": torch.randn(1024),
        "other.w": torch.randn(512, 1024),
    }
    path = tmp_path / "model.safetensors"
    save_file(weights, str(path))
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)  # dirty pages would survive the eviction
    os.close(fd)
    return path, weights


def test_prefetch_keeps_several_large_reads_of_a_unit_in_flight(tmp_path):
    path, weights = _checkpoint(tmp_path)
    source = CheckpointSource({n: (path, n) for n in weights})
    reader = source.reader = Gated(workers=4, chunk_bytes=1 << 20)
    unit = ["layer.q", "layer.k", "layer.norm"]
    mapped = source.files[path.resolve()]
    source.evict()
    assert not mapped.resident(unit)
    source.prefetch(unit)
    assert not reader.barrier.broken, "the first two requests were not in flight together"
    assert reader.peak_in_flight >= 2 and mapped.resident(unit)
    # The three tensors lie side by side: one range, cut into chunks of 1 MB that cover it exactly.
    span = coalesce(mapped.spans(unit))
    assert len(span) == 1 and span[0][1] >= sum(weights[n].nbytes for n in unit)
    assert sorted(reader.chunks) == chunked(span, 1 << 20) and len(reader.chunks) == reader.requests >= 8
    assert all(length <= 1 << 20 for _, length in reader.chunks)
    assert all(torch.equal(source.get(n), t) for n, t in weights.items())
    calls = reader.requests
    source.prefetch(unit)
    assert reader.requests == calls, "a unit mapped in and resident is not read again"
    reader.close()


def test_ranges_merge_where_they_touch_and_cut_at_page_boundaries():
    spans = [(10 * PAGE, 2 * PAGE), (0, PAGE), (PAGE, PAGE), (12 * PAGE, 0), (11 * PAGE, 3 * PAGE)]
    assert coalesce(spans, gap=0) == [(0, 2 * PAGE), (10 * PAGE, 4 * PAGE)]
    assert coalesce(spans, gap=8 * PAGE) == [(0, 14 * PAGE)]
    pieces = chunked([(0, 14 * PAGE)], 4 * PAGE + 1)
    assert pieces == [(0, 4 * PAGE), (4 * PAGE, 4 * PAGE), (8 * PAGE, 4 * PAGE), (12 * PAGE, 2 * PAGE)]


def test_page_transfer_reads_two_units_ahead_and_reads_a_stale_guess_again(tmp_path):
    """CPU execution keeps two units in flight; a guess read before the pages were dropped
    (the previous forward's, then an eviction) is read again when asked for anew."""
    from automap.offload import PageTransfer

    path, weights = _checkpoint(tmp_path)
    source = CheckpointSource({n: (path, n) for n in weights})
    mapped = source.files[path.resolve()]
    transfer = PageTransfer(source)
    units = [("q", ["layer.q"]), ("k", ["layer.k"]), ("other", ["other.w"])]
    source.evict()
    transfer.prefetch_after(units)
    assert list(transfer._pending) == ["q", "k"], "two units ahead, not three"
    transfer.drain()  # the worker read them
    assert mapped.resident(["layer.q", "layer.k"])
    source.evict()
    assert not mapped.resident(["layer.q", "layer.k"])
    transfer.prefetch_after(units[:2])
    transfer.drain()
    assert mapped.resident(["layer.q", "layer.k"]), "the guesses made before the eviction were read again"
    assert torch.equal(transfer.take("q", ["layer.q"])["layer.q"], weights["layer.q"])
    transfer.close()


_FORK = """
import os, signal, sys, torch
from safetensors.torch import save_file
from automap.offload import CheckpointSource
from automap.offload.readahead import ReadAhead

path = sys.argv[1]
save_file({"a": torch.randn(1024, 1024), "b": torch.randn(1024, 1024)}, path)
source = CheckpointSource({n: (path, n) for n in "ab"})
reader = source.reader = ReadAhead(workers=4, chunk_bytes=1 << 18)
source.evict()
source.prefetch(["a", "b"])  # the pool's threads exist now
assert reader.requests >= 8
reader._count.acquire()  # as if a reading thread held the lock at the fork
pid = os.fork()
if pid == 0:  # the child reads the same unit through its own threads
    signal.alarm(20)  # a deadlock on the parent's lock or threads ends here, with SIGALRM
    source.evict()
    source.prefetch(["a", "b"])
    assert torch.equal(source.get("a"), source.get("a").clone())
    os._exit(0 if reader.requests >= 8 else 3)
reader._count.release()
_, status = os.waitpid(pid, 0)
print("child", status)
sys.exit(0 if status == 0 else 1)
"""


def test_a_forked_child_reads_with_threads_of_its_own(tmp_path):
    # DataLoader workers and other forks inherit a dispatched model: the parent's pool threads do
    # not exist in the child, and the lock one of them held at the fork would never be released.
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _FORK, str(tmp_path / "w.safetensors")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
