"""Loading to an accelerator through pinned staging: a checkpoint's tensors are copied by the
host into a ring of page-locked buffers and from there to the device on a side stream, so that
the host's copy of one buffer overlaps the device's copy of the one before (a copy from
pageable memory, as ``tensor.to("cuda")`` makes, is staged by the driver one piece at a time,
the host waiting for each).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from automap.kinds import kind_of, on_host, torch_device

log = logging.getLogger(__name__)

# Four buffers of 32 MiB: the host fills one while the device copies from the others; a
# buffer of this size runs the host-to-device copy at its full rate on PCIe and NVLink-C2C hosts.
SLOTS = 4
SLOT_BYTES = 32 << 20
ALIGN = 512  # each piece starts on this boundary of its buffer (the device's copy engines like it)


def staging_bytes(nbytes: int) -> int:
    """Page-locked host memory a staged load of ``nbytes`` to an accelerator holds at most."""
    return min(SLOTS * SLOT_BYTES, -(-nbytes // SLOT_BYTES) * SLOT_BYTES) if nbytes > 0 else 0


def stages_to(device: torch.device | str) -> bool:
    """Whether a load to ``device`` stages its copies: an accelerator whose kind names
    :class:`~automap.offload.DeviceOps` (elsewhere a tensor is sent with ``.to``)."""
    kind = kind_of(device)
    return not kind.is_host and kind.factory("ops") is not None


def staged_ops(device: torch.device) -> Any | None:
    """The :class:`~automap.offload.DeviceOps` a load to ``device`` stages its copies with, or
    None where it does not stage them (:func:`stages_to`)."""
    return kind_of(device).factory("ops")(torch_device(str(device))) if stages_to(device) else None


class StagedCopies:
    """Copies host tensors to one device through :data:`SLOTS` page-locked buffers.

    :meth:`send` returns the device tensor at once, its copy in flight; :meth:`finish` makes
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
        self.copies = 0  # host-to-device copies issued (tests, benchmarks)

    @property
    def pinned_bytes(self) -> int:
        return sum(b.numel() for b in self._buffers if b is not None)

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
        last = self.ops.record(self.stream)  # after every copy issued, the current buffer's too
        self.ops.wait(self.ops.current_stream(), last)
        self.ops.synchronize(last)  # the buffers are dropped after this: their copies must have run
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

    def send(self, value: torch.Tensor, device: torch.device) -> torch.Tensor:
        if device not in self._staged:
            ops = self._ops_for(device)
            self._staged[device] = StagedCopies(ops, device) if ops is not None else None
        staged = self._staged[device]
        return staged.send(value) if staged is not None else value.to(device)

    def finish(self, failed: bool = False) -> None:
        """Wait for the copies in flight; after a ``failed`` load (its own error on its way
        out), an error of the device's here is logged rather than raised over it."""
        staged, self._staged = [s for s in self._staged.values() if s is not None], {}
        for copies in staged:
            try:
                copies.finish()
            except Exception:
                if not failed:
                    raise
                log.debug("the staged copies of a failed load did not finish", exc_info=True)
