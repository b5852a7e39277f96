"""Rows of a mapped file kept in memory (:meth:`MappedFile.hold`): private copies of the file's
bytes that a cold start (:meth:`MappedFile.evict`) leaves, not counted as the user's writes,
given back by :meth:`MappedFile.release`; rows the user wrote are never taken."""

from __future__ import annotations

import ctypes
import os

import torch
from safetensors.torch import save_file

from automap.offload.mapped import MappedFile
from automap.offload.pages import PAGE

LIBC = ctypes.CDLL(None, use_errno=True)
LIBC.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)


def _resident(tensor: torch.Tensor) -> int:
    start = tensor.data_ptr() // PAGE * PAGE
    length = tensor.data_ptr() + tensor.nbytes - start
    vector = ctypes.create_string_buffer((length + PAGE - 1) // PAGE)
    assert LIBC.mincore(start, length, vector) == 0
    return sum(b & 1 for b in vector.raw)


def _mapped(tmp_path) -> tuple[MappedFile, torch.Tensor]:
    stacked = torch.randn(4, 64, 64)  # four "experts" of 16 KiB each
    save_file({"experts": stacked, "other": torch.randn(8)}, str(tmp_path / "w.safetensors"))
    descriptor = os.open(tmp_path / "w.safetensors", os.O_RDONLY)
    os.fsync(descriptor)  # written back: the page cache may drop its pages (evict)
    os.close(descriptor)
    return MappedFile(tmp_path / "w.safetensors"), stacked


def test_a_held_row_survives_a_cold_start_and_is_not_counted_as_written(tmp_path):
    mapped, stacked = _mapped(tmp_path)
    held = mapped.hold("experts", 2)
    assert 0 < held <= stacked[2].nbytes and mapped.held_bytes == held
    assert mapped.written_bytes() == 0
    mapped.evict()  # refuses written pages: held ones are not the user's
    tensor = mapped.tensor("experts")
    assert _resident(tensor[2]) * PAGE >= held
    assert _resident(tensor[0]) == 0 and _resident(tensor[3]) == 0
    assert torch.equal(tensor, stacked)


def test_a_released_row_is_the_file_s_again(tmp_path):
    mapped, stacked = _mapped(tmp_path)
    mapped.hold("experts", 1)
    assert mapped.release("experts", 1) > 0 and mapped.held_bytes == 0
    assert mapped.release("experts", 1) == 0  # nothing held
    mapped.evict()
    assert _resident(mapped.tensor("experts")[1]) == 0
    assert torch.equal(mapped.tensor("experts"), stacked)


def test_a_row_the_user_wrote_is_not_held_so_releasing_can_never_drop_the_write(tmp_path):
    mapped, _ = _mapped(tmp_path)
    tensor = mapped.tensor("experts")
    tensor[3].fill_(7.0)
    assert mapped.hold("experts", 3) == 0 and mapped.held_bytes == 0
    assert mapped.written_bytes() >= tensor[3].nbytes // PAGE * PAGE
    assert mapped.release("experts", 3) == 0
    assert bool((tensor[3] == 7.0).all())


class _Recorded:
    """A reader that notes the spans it is asked for and reads nothing."""

    def __init__(self) -> None:
        self.spans: list[tuple[int, int]] = []

    def read(self, spans, fd: int, base: int) -> None:
        self.spans.extend(spans)


def test_a_held_row_is_not_read_from_the_disk_again_after_a_cold_start(tmp_path):
    """A held row's span also covers the pages it shares with its neighbours, which a cold start
    drops. Reading the routed rows must ask the disk for those pages only, not the whole row
    again (Mixtral at batch 4 with every routed expert kept read 350 MiB a forward for it)."""
    mapped, _ = _mapped(tmp_path)
    held = mapped.hold("experts", 2)
    assert held > 0
    mapped.evict()
    reader = _Recorded()
    row = mapped.row_spans("experts", [2])
    mapped.read_spans(row, reader)
    asked = sum(n for _, n in reader.spans)
    assert asked == sum(n for _, n in row) - held
    assert all(n <= PAGE for _, n in reader.spans)  # the pages shared with the neighbours, no more
    reader.spans.clear()
    other = mapped.row_spans("experts", [0])
    mapped.read_spans(other, reader)  # a row not held is read whole
    assert sum(n for _, n in reader.spans) == sum(n for _, n in other)
