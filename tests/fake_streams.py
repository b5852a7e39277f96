"""A fake :class:`~automap.offload.DeviceOps` that holds :class:`~automap.offload.StagedTransfer`
to CUDA's stream rules on a CPU, and names every rule the code breaks.

What CUDA does, and what :class:`FakeOps` does instead:

- A copy issued on a stream runs *later*, in that stream's order. Here it runs only when the host
  synchronizes on an event recorded after it, or when a stream that waited on such an event
  reads its destination (the kernel would have found it done), or at :meth:`FakeOps.drain`.
  Until then the destination holds NaN (or -1 for integers): a read that comes too early sees
  garbage, as on a GPU.
- A stream may read what a copy on another stream wrote only after ``wait(stream, event)`` on an
  event recorded after the copy. The host's ``synchronize`` does not count for the compute
  stream here: it exists to drain the staging buffer, and an ordering that leans on it breaks
  the day staging is double-buffered or skipped (pinned sources).
- The DMA reads its host source when it runs, not when it is issued: the fake snapshots the
  source at issue and compares when the copy runs. Bytes that changed mean the host reused the
  staging buffer (or freed the source) before the copy finished.
- The caching allocator hands a freed device block back to the stream it was allocated on at
  once, unless ``record_stream`` (``keep_alive``) told it that another stream uses it; then it
  waits until that stream's work is done. Here a stream's reads stay "in flight" until
  :meth:`FakeOps.sync_stream`; a freed block that another stream read, still in flight and not
  kept alive for it, being handed out again is a use-after-free of device memory.

Reads by the compute stream are seen by :class:`ComputeReads`, a ``TorchDispatchMode`` on the
compute thread (every aten op's tensor arguments are checked), or by :meth:`FakeOps.read` in tests
that drive a transfer by hand. Violations are collected (the worker thread's included) and
raised together by :meth:`FakeOps.assert_clean`.

Every host synchronisation the ops are asked for is counted (:attr:`FakeOps.syncs`), and
:class:`HostSyncs` counts the aten ops that make a GPU's host wait (``.item()``, ``bool(t)``,
``nonzero``): a resident path issues none of its own.

``FakeOps(forget={"wait"})`` (or ``"synchronize"``, ``"keep_alive"``) turns that primitive into
a no-op: the same as deleting its one call in ``StagedTransfer``, so a test can show that the
fake catches each missing call.
"""

from __future__ import annotations

import itertools
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


@dataclass(eq=False)
class FakeStream:
    name: str
    issued: int = 0  # copies issued on this stream so far (their sequence numbers)
    waited: dict[FakeStream, int] = field(default_factory=dict)  # other stream -> last seq waited for
    reading: set[Block] = field(default_factory=set)  # blocks this stream read since it last synced

    def __repr__(self) -> str:
        return self.name


@dataclass(frozen=True)
class FakeEvent:
    stream: FakeStream
    seq: int  # every copy of ``stream`` numbered <= seq precedes the event


@dataclass(eq=False)
class Copy:
    stream: FakeStream
    seq: int
    dst: torch.Tensor | None
    src: torch.Tensor | None
    snapshot: torch.Tensor | None
    what: str
    done: bool = False


@dataclass(eq=False)
class Block:
    """A device allocation made by :meth:`FakeOps.empty`."""

    number: int
    stream: FakeStream
    nbytes: int
    what: str
    ref: StorageWeakRef
    written_by: Copy | None = None
    kept_for: set[FakeStream] = field(default_factory=set)
    freed: bool = False

    def __repr__(self) -> str:
        return f"device block #{self.number} ({self.what}, allocated on {self.stream})"


def describe(tensor: torch.Tensor) -> str:
    return f"{tuple(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')}"


class FakeOps:
    """:class:`~automap.offload.DeviceOps` with delayed copies and CUDA's ordering rules checked.

    Args:
        forget: primitives to turn into no-ops (``"wait"``, ``"synchronize"``, ``"keep_alive"``).
    """

    def __init__(self, forget: frozenset[str] | set[str] = frozenset()):
        self.forget = set(forget)
        self.compute = FakeStream("compute")
        self.violations: list[str] = []
        self.waits: list[tuple[str, str, int]] = []  # (waiting stream, event's stream, event's seq)
        self.pageable_copies = 0
        self.syncs = 0  # host synchronisations asked for (synchronize), forgotten ones included
        self.reused = 0  # freed device blocks handed out again
        self._lock = threading.RLock()
        self._local = threading.local()
        self._numbers_of_streams = itertools.count(1)
        self._streams = [self.compute]
        self._numbers = itertools.count(1)
        self._blocks: dict[int, Block] = {}  # storage address -> live block
        self._free: list[Block] = []  # freed blocks, oldest first, as the allocator would reuse them
        self._pending: list[Copy] = []
        self._pinned: dict[int, tuple[StorageWeakRef, int]] = {}  # storage address -> (ref, nbytes)

    # ------------------------------------------------------------------ DeviceOps

    def side_stream(self) -> FakeStream:
        with self._lock:
            stream = FakeStream(f"side-{next(self._numbers_of_streams)}")
            self._streams.append(stream)
            return stream

    def current_stream(self) -> FakeStream:
        return getattr(self._local, "stream", None) or self.compute

    @contextmanager
    def on_stream(self, stream: FakeStream) -> Iterator[FakeStream]:
        before = getattr(self._local, "stream", None)
        self._local.stream = stream
        try:
            yield stream
        finally:
            self._local.stream = before

    def empty(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        with self._lock, self._internal():
            stream = self.current_stream()
            fill = (
                float("nan")
                if dtype.is_floating_point or dtype.is_complex
                else (True if dtype == torch.bool else -1)
            )
            tensor = torch.full(shape, fill, dtype=dtype)
            self._collect_frees()
            self._hand_out_freed(stream, tensor.untyped_storage().nbytes(), describe(tensor))
            block = Block(
                next(self._numbers),
                stream,
                tensor.untyped_storage().nbytes(),
                describe(tensor),
                StorageWeakRef(tensor.untyped_storage()),
            )
            self._blocks[tensor.untyped_storage().data_ptr()] = block
            return tensor

    def pinned(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            buffer = torch.empty(nbytes, dtype=torch.uint8)
            self._pinned[buffer.untyped_storage().data_ptr()] = (
                StorageWeakRef(buffer.untyped_storage()),
                nbytes,
            )
            return buffer

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        """Count ``tensor`` as page-locked (a RAM source's pinned copy), so it is not staged."""
        with self._lock:
            self._pinned[tensor.untyped_storage().data_ptr()] = (
                StorageWeakRef(tensor.untyped_storage()),
                tensor.untyped_storage().nbytes(),
            )
            return tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        with self._lock:
            found = self._pinned.get(tensor.untyped_storage().data_ptr())
            return found is not None and not found[0].expired()

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with self._lock, self._internal():
            stream = self.current_stream()
            block = self._block_of(dst)
            if block is None:
                self.violations.append(
                    f"copy into {describe(dst)}, a tensor the ops did not allocate with empty()"
                )
                dst.copy_(src)
                return
            if not self.is_pinned(src):
                self.pageable_copies += 1
            stream.issued += 1
            job = Copy(stream, stream.issued, dst, src, src.clone(), block.what)
            block.written_by = job
            self._pending.append(job)

    def record(self, stream: FakeStream) -> FakeEvent:
        with self._lock:
            return FakeEvent(stream, stream.issued)

    def wait(self, stream: FakeStream, event: FakeEvent) -> None:
        if "wait" in self.forget:
            return
        with self._lock:
            if event.stream is not stream:
                stream.waited[event.stream] = max(stream.waited.get(event.stream, 0), event.seq)
            self.waits.append((stream.name, event.stream.name, event.seq))

    def synchronize(self, event: FakeEvent) -> None:
        with self._lock:
            self.syncs += 1
        if "synchronize" in self.forget:
            return
        with self._lock:
            self._run(event.stream, event.seq)

    def keep_alive(self, tensor: torch.Tensor, stream: FakeStream) -> None:
        if "keep_alive" in self.forget:
            return
        with self._lock:
            block = self._block_of(tensor)
            if block is not None:
                block.kept_for.add(stream)

    # ------------------------------------------------------------------ what the tests call

    def read(self, *tensors: torch.Tensor) -> None:
        """The current stream reads ``tensors`` (a kernel using them)."""
        with self._lock, self._internal():
            stream = self.current_stream()
            for tensor in tensors:
                block = self._block_of(tensor)
                if block is not None:
                    self._check_read(block, stream)

    def sync_stream(self, stream: FakeStream | None = None) -> None:
        """The host waits for ``stream`` (default: compute): its reads are no longer in flight."""
        with self._lock:
            stream = stream or self.compute
            stream.reading.clear()

    def drain(self) -> None:
        """Every stream finishes: pending copies run (their sources checked), reads complete."""
        with self._lock, self._internal():
            for job in list(self._pending):
                self._execute(job)
            for stream in self._streams:
                stream.reading.clear()
            self._collect_frees()

    def assert_clean(self) -> None:
        self.drain()
        assert not self.violations, "stream-ordering violations:\n- " + "\n- ".join(
            dict.fromkeys(self.violations)
        )

    @property
    def internal(self) -> bool:
        return getattr(self._local, "internal", False)

    # ------------------------------------------------------------------ the rules

    @contextmanager
    def _internal(self) -> Iterator[None]:
        before = self.internal
        self._local.internal = True
        try:
            yield
        finally:
            self._local.internal = before

    def _block_of(self, tensor: torch.Tensor) -> Block | None:
        if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
            return None
        try:
            block = self._blocks.get(tensor.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):  # tensors without storage (sparse, nested, meta)
            return None
        return None if block is None or block.ref.expired() else block

    def _check_read(self, block: Block, stream: FakeStream) -> None:
        job = block.written_by
        if job is not None and job.stream is not stream and stream.waited.get(job.stream, 0) < job.seq:
            self.violations.append(
                f"stream {stream} read {block} before waiting on an event recorded after the copy that wrote it "
                f"(copy #{job.seq} on {job.stream}): wait_event is missing"
            )
        elif job is not None and not job.done:
            self._run(job.stream, job.seq)  # the device would have finished it before this kernel ran
        if stream is not block.stream:
            stream.reading.add(block)

    def _run(self, stream: FakeStream, seq: int) -> None:
        for job in [j for j in self._pending if j.stream is stream and j.seq <= seq]:
            self._execute(job)

    def _execute(self, job: Copy) -> None:
        with self._internal():
            self._execute_now(job)

    def _execute_now(self, job: Copy) -> None:
        assert job.dst is not None and job.src is not None and job.snapshot is not None
        if not torch.equal(job.src, job.snapshot):
            self.violations.append(
                f"the host bytes that copy #{job.seq} on {job.stream} ({job.what}) reads{self._where(job.src)} changed "
                "before the copy ran: the staging buffer was reused before its copy finished (synchronize is missing)"
            )
        job.dst.copy_(job.src)
        job.done = True
        job.dst = job.src = job.snapshot = None  # the device copy no longer holds either side
        self._pending.remove(job)

    def _where(self, src: torch.Tensor) -> str:
        address = src.untyped_storage().data_ptr()
        if address in self._pinned:
            offset = src.data_ptr() - address
            return f" (staging bytes {offset}..{offset + src.nbytes})"
        return ""

    def _collect_frees(self) -> None:
        for address, block in list(self._blocks.items()):
            if block.ref.expired():
                del self._blocks[address]
                block.freed = True
                self._free.append(block)

    def _hand_out_freed(self, stream: FakeStream, nbytes: int, what: str) -> None:
        """What the caching allocator would do for an allocation of ``nbytes`` on ``stream``:
        hand out the oldest freed block of that stream big enough, unless a stream it was kept
        alive for still reads it. A stream still reading it that it was *not* kept for is the bug."""
        for block in self._free:
            if block.stream is not stream or block.nbytes < nbytes:
                continue
            readers = {s for s in self._streams if block in s.reading}
            if readers & block.kept_for:
                continue  # record_stream holds it back until those streams are done
            self._free.remove(block)
            self.reused += 1
            for reader in readers:
                self.violations.append(
                    f"{block} was freed while stream {reader} may still read it and handed out again for "
                    f"{what} on {stream}: the tensor was used on {reader} without keep_alive (record_stream)"
                )
                reader.reading.discard(block)
            return


class ComputeReads(TorchDispatchMode):
    """Every aten op run on this thread reads its tensor arguments on the ops' current stream:
    the compute stream's kernels, as a GPU would run them."""

    def __init__(self, ops: FakeOps):
        super().__init__()
        self.ops = ops

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if not self.ops.internal:
            self.ops.read(*[t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)])
        return func(*args, **kwargs)


# Ops whose result the host needs before it can go on (a scalar read, an output sized by the
# data): on a GPU each waits for every kernel queued before it.
SYNCING_OPS = frozenset({"_local_scalar_dense", "nonzero", "masked_select", "_unique2", "unique_dim"})


class HostSyncs(TorchDispatchMode):
    """Counts the aten ops run on this thread that synchronise a GPU's host (:data:`SYNCING_OPS`),
    by name, so that a dispatched model's count can be compared with the plain model's."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: dict[str, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = func.overloadpacket.__name__
        if name in SYNCING_OPS:
            self.ops[name] = self.ops.get(name, 0) + 1
        return func(*args, **(kwargs or {}))
