"""Loading to an accelerator through pinned staging: a checkpoint's tensors are read from their
file (or copied by the host) into page-locked buffers and from there to the device on a side
stream, so that the reads into some buffers overlap the device's copies out of the others (a
copy from pageable memory, as ``tensor.to("cuda")`` makes, is staged by the driver one piece at
a time, the host waiting for each).
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from automap.errors import CheckpointError
from automap.kinds import kind_of, on_host, torch_device
from automap.offload.opening import read_into

log = logging.getLogger(__name__)

# Buffers of 32 MiB, a size that runs the host-to-device copy at its full rate on PCIe and
# NVLink-C2C hosts: two for tensors the host copies in (converted, built, small ones packed
# together), four for tensors read from their file straight into them, as many reads in flight.
SLOTS = 2
READ_SLOTS = 4
SLOT_BYTES = 32 << 20
OPEN_FILES = 16  # checkpoint files held open at once by a load's reads (a folder may have thousands)
ALIGN = 512  # each piece starts on this boundary of its buffer (the device's copy engines like it)


def staging_bytes(nbytes: int) -> int:
    """Page-locked host memory a staged load of ``nbytes`` to an accelerator holds at most
    (both rings, each no larger than the load)."""
    pieces = -(-nbytes // SLOT_BYTES)
    return (min(SLOTS, pieces) + min(READ_SLOTS, pieces)) * SLOT_BYTES


def stages_to(device: torch.device | str) -> bool:
    """Whether a load to ``device`` stages its copies: an accelerator whose copies run on a side
    stream from pinned memory (``async_copies``: CUDA) and whose kind names
    :class:`~automap.offload.DeviceOps`; elsewhere a tensor is sent with ``.to``, as staging
    would overlap nothing."""
    kind = kind_of(device)
    return not kind.is_host and kind.async_copies and kind.factory("ops") is not None


def staged_ops(device: torch.device) -> Any | None:
    """The :class:`~automap.offload.DeviceOps` a load to ``device`` stages its copies with, or
    None where it does not stage them (:func:`stages_to`)."""
    return kind_of(device).factory("ops")(torch_device(str(device))) if stages_to(device) else None


class StagedCopies:
    """Copies tensors to one device through page-locked buffers: host tensors copied into
    :data:`SLOTS` of them (:meth:`send`), stored ones read from their file into :attr:`reads`
    (:meth:`send_file`).

    Each returns the device tensor at once, its copy in flight; :meth:`finish` makes
    the device's current stream wait for every copy and returns when the host may drop the
    buffers. A buffer is refilled only after the device's copy out of it ended (an event
    recorded after it, waited for by the host).

    Args:
        ops: the device's stream, event and copy primitives.
        device: the device (a tensor that is not dense bytes is sent there with ``.to``).
        slots: buffers in the ring.
        slot_bytes: the size of each (a larger tensor goes in pieces).
    """

    def __init__(self, ops: Any, device: torch.device, slots: int = SLOTS, slot_bytes: int = SLOT_BYTES):
        self.ops, self.device, self.slot_bytes = ops, device, max(ALIGN, slot_bytes // ALIGN * ALIGN)
        self.stream = ops.side_stream()
        self._buffers: list[torch.Tensor | None] = [None] * max(1, slots)
        self._events: list[Any] = [None] * len(self._buffers)
        self._slot, self._used = 0, 0
        self.copies = 0  # host-to-device copies issued from the buffers the host copies into
        self.reads = FileReads(ops, self.stream, slot_bytes=slot_bytes)

    @property
    def pinned_bytes(self) -> int:
        return sum(b.numel() for b in self._buffers if b is not None) + self.reads.pinned_bytes

    def send_file(self, shape: torch.Size, dtype: torch.dtype, fd: int, offset: int) -> torch.Tensor:
        """A tensor of the device holding the raw bytes of ``fd`` at ``offset`` (a tensor of
        ``shape`` and ``dtype`` stored as is), read straight into the buffers, its copies in
        flight."""
        out = self.ops.empty(shape, dtype)
        target = _bytes_of(out)
        if target is not None and target.numel():
            self.reads.put(target, fd, offset)
        return out

    def send(self, value: torch.Tensor) -> torch.Tensor:
        """A tensor of the device equal to ``value`` (a host tensor), its copy issued."""
        source = _bytes_of(value)
        if source is None or not on_host(value.device):
            return value.to(self.device)
        out = self.ops.empty(value.shape, value.dtype)
        if value.numel() == 0:
            return out
        target = _bytes_of(out)
        assert target is not None and target.numel() == source.numel()
        for start in range(0, source.numel(), self.slot_bytes):
            self._put(target[start : start + self.slot_bytes], source[start : start + self.slot_bytes])
        return out

    def finish(self) -> None:
        """Every copy issued so far done before the device's current stream goes on (it waits,
        the host does not), and the buffers free for the host once this returns."""
        self.reads.finish()
        last = self.ops.record(self.stream)  # after every copy issued, the current buffer's too
        self.ops.wait(self.ops.current_stream(), last)
        self.ops.synchronize(last)  # the buffers are dropped after this: their copies must have run
        self.reads.drop_buffers()
        self._buffers = [None] * len(self._buffers)
        self._events = [None] * len(self._events)
        self._slot, self._used = 0, 0

    def _put(self, target: torch.Tensor, source: torch.Tensor) -> None:
        size = -(-source.numel() // ALIGN) * ALIGN
        if self._used + size > self.slot_bytes:
            self._seal()
        buffer = self._buffer()
        piece = buffer[self._used : self._used + source.numel()]
        piece.copy_(source)  # the host's share: reads the checkpoint's pages
        with self.ops.on_stream(self.stream):
            self.ops.copy(target, piece)
        self.copies += 1
        self._used += size

    def _seal(self) -> None:
        """The current buffer's copies are all issued: mark their end, move to the next buffer
        and wait (on the host) until the device's copies out of it ended."""
        if not self._used:
            return
        self._events[self._slot] = self.ops.record(self.stream)
        self._slot, self._used = (self._slot + 1) % len(self._buffers), 0
        if self._events[self._slot] is not None:
            self.ops.synchronize(self._events[self._slot])
            self._events[self._slot] = None

    def _buffer(self) -> torch.Tensor:
        buffer = self._buffers[self._slot]
        if buffer is None:
            buffer = self._buffers[self._slot] = self.ops.pinned(self.slot_bytes)
        return buffer


class FileReads:
    """Tensors read from their file straight into :data:`READ_SLOTS` page-locked buffers, a
    piece per buffer, every buffer's read in flight at once on threads of its own (``preadv``
    releases the GIL), each piece's host-to-device copy issued on the side stream as soon as its
    read ended. A buffer is read into again once the copy out of it ended (its event).

    Args:
        ops: the device's stream, event and copy primitives.
        stream: the side stream the copies run on.
        slots: buffers (and reads in flight).
        slot_bytes: the size of each.
    """

    def __init__(self, ops: Any, stream: Any, slots: int = READ_SLOTS, slot_bytes: int = SLOT_BYTES):
        self.ops, self.stream, self.slot_bytes = ops, stream, max(ALIGN, slot_bytes // ALIGN * ALIGN)
        self._buffers: list[torch.Tensor | None] = [None] * max(1, slots)
        # Per buffer: None (free), ("read", future, target, buffer) or ("copy", event).
        self._state: list[Any] = [None] * len(self._buffers)
        self._next = 0
        self._pool: ThreadPoolExecutor | None = None
        self.copies = 0

    @property
    def pinned_bytes(self) -> int:
        return sum(b.numel() for b in self._buffers if b is not None)

    def put(self, target: torch.Tensor, fd: int, offset: int) -> None:
        """Read ``target.numel()`` bytes of ``fd`` at ``offset`` into ``target`` (bytes of a
        device tensor), in pieces of a buffer each."""
        for start in range(0, target.numel(), self.slot_bytes):
            piece = target[start : start + self.slot_bytes]
            slot = self._next
            self._next = (slot + 1) % len(self._buffers)
            self._settle(slot)
            buffer = self._buffer(slot)[: piece.numel()]
            future = self._executor().submit(_pread_all, fd, buffer, offset + start)
            self._state[slot] = ("read", future, piece, buffer)
            for other in range(len(self._state)):  # copies whose reads ended go now, in any order
                state = self._state[other]
                if state is not None and state[0] == "read" and state[1].done():
                    self._issue(other)

    def finish(self) -> Any:
        """Issue every copy still waiting for its read; the event after the last (None if none)."""
        try:
            for slot in range(len(self._state)):
                if self._state[slot] is not None and self._state[slot][0] == "read":
                    self._issue(slot)
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True, cancel_futures=True)
                self._pool = None
        return self.ops.record(self.stream) if self.copies else None

    def drop_buffers(self) -> None:
        """After :meth:`finish`'s event passed: the buffers go back."""
        self._buffers = [None] * len(self._buffers)
        self._state = [None] * len(self._state)

    def _settle(self, slot: int) -> None:
        """Buffer ``slot`` free: its read's copy issued, and that copy ended (the host waits)."""
        if self._state[slot] is not None and self._state[slot][0] == "read":
            self._issue(slot)
        if self._state[slot] is not None:
            self.ops.synchronize(self._state[slot][1])
            self._state[slot] = None

    def _issue(self, slot: int) -> None:
        _, future, target, buffer = self._state[slot]
        self._state[slot] = None
        future.result()  # a read that failed raises here, its copy never issued
        with self.ops.on_stream(self.stream):
            self.ops.copy(target, buffer)
        self.copies += 1
        self._state[slot] = ("copy", self.ops.record(self.stream))

    def _buffer(self, slot: int) -> torch.Tensor:
        buffer = self._buffers[slot]
        if buffer is None:
            buffer = self._buffers[slot] = self.ops.pinned(self.slot_bytes)
        return buffer

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(len(self._buffers), thread_name_prefix="automap-load-read")
        return self._pool


def _pread_all(fd: int, buffer: torch.Tensor, offset: int) -> None:
    """Fill ``buffer`` (bytes) from ``fd`` at ``offset``.

    Raises:
        CheckpointError: the file ended first (it was truncated during the load).
    """
    view = memoryview(buffer.numpy())
    done = read_into(fd, view, offset)
    if done < len(view):
        raise CheckpointError(
            f"a checkpoint file ended {len(view) - done} bytes short of a tensor at byte "
            f"{offset + done}; it was truncated during the load"
        )


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor | None:
    """The bytes of a contiguous tensor, flat (a view); None for one laid out otherwise or
    whose elements are not whole bytes (quantized, sparse, sub-byte dtypes)."""
    if tensor.layout != torch.strided or tensor.is_quantized or not tensor.is_contiguous():
        return None
    try:
        flat = tensor.reshape(-1)
        return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)
    except RuntimeError:
        return None


class DeviceSends:
    """A load's tensors sent to their devices: staged through pinned buffers where the
    device's kind has stream ops (:class:`StagedCopies`, one per device), with ``.to``
    elsewhere. :meth:`finish` once every tensor was sent, before any is used."""

    def __init__(self, ops_for: Any = None):
        self._ops_for = ops_for or staged_ops
        self._staged: dict[torch.device, StagedCopies | None] = {}
        self._files: dict[Any, int] = {}  # descriptors of the files read straight into buffers

    def send(self, value: torch.Tensor, device: torch.device) -> torch.Tensor:
        staged = self._copies(device)
        return staged.send(value) if staged is not None else value.to(device)

    def stages(self, device: torch.device) -> bool:
        """Whether tensors to ``device`` go through page-locked buffers."""
        return self._copies(device) is not None

    def send_file(
        self, device: torch.device, shape: torch.Size, dtype: torch.dtype, file: Any, opener: Any, offset: int
    ) -> torch.Tensor:
        """Raw bytes of ``file`` at ``offset`` (a tensor of ``shape`` and ``dtype`` stored as
        is) to ``device``, read straight into its buffers (``device`` must stage: :meth:`stages`).
        ``opener()`` opens ``file`` checked, once for the load."""
        staged = self._copies(device)
        assert staged is not None
        if file not in self._files:
            if len(self._files) >= OPEN_FILES:  # a folder of many shards: their reads end, they close
                self._close_files()
            self._files[file] = opener()
        return staged.send_file(shape, dtype, self._files[file], offset)

    def _close_files(self) -> None:
        for copies in self._staged.values():
            if copies is not None:
                copies.reads.finish()  # their copies issued; the reads' threads stopped
        files, self._files = self._files, {}
        for fd in files.values():
            os.close(fd)

    def _copies(self, device: torch.device) -> StagedCopies | None:
        if device not in self._staged:
            ops = self._ops_for(device)
            self._staged[device] = StagedCopies(ops, device) if ops is not None else None
        return self._staged[device]

    def finish(self, failed: bool = False) -> None:
        """Wait for the copies in flight; after a ``failed`` load (its own error on its way
        out), an error of the device's here is logged rather than raised over it."""
        staged, self._staged = [s for s in self._staged.values() if s is not None], {}
        error: Exception | None = None
        for copies in staged:  # each finishes, whatever another raised: its reads end there
            try:
                copies.finish()
            except Exception as exc:
                error = error or exc
                log.debug("staged copies to a device did not finish", exc_info=True)
        files, self._files = self._files, {}
        for fd in files.values():  # no read into the buffers is left running
            os.close(fd)
        if error is not None and not failed:
            raise error
