"""The safetensors format: the one validating header parser automap uses for checkpoints and its
own store files alike, and a writer that streams tensors to disk without copying them.

A safetensors file is an 8-byte little-endian header length, a JSON header mapping each tensor
name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets into the data that follows
the header), an optional ``"__metadata__"`` object of strings, then the bytes. A header is only
trusted after every rule holds: it is a JSON object; every entry has a known dtype, a shape of
non-negative integers and two integer offsets; ``end - begin`` is exactly the tensor's size;
ranges lie inside the file and do not overlap. A file that breaks one is refused with a
:class:`~automap.errors.FormatError` naming the file, the tensor and the fix, never read.

The writer exists because ``safetensors.torch.save_file`` first copies every tensor of the file
into Python ``bytes`` (a unit's worth of extra memory) and reports a full disk as its own error
type; here each tensor's bytes go from its memory straight to the file, and a failing write is a
plain ``OSError`` that the store turns into an :class:`~automap.errors.OffloadError`.
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch

from automap.errors import FormatError

# safetensors dtype names (the format's own spelling).
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
# Larger headers exist only in broken or hostile files (a 70B checkpoint's is well under 1 MB).
MAX_HEADER_BYTES = 100_000_000
_HINT = "save or copy it again"


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a safetensors file: its key, dtype (the format's name), shape and its
    absolute byte range ``[begin, end)`` in the file."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


@dataclass(frozen=True)
class Header:
    """A validated safetensors header: where the data starts, the tensors, the metadata."""

    path: Path
    data_start: int
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]
    file_size: int

    @property
    def needed(self) -> int:
        """Bytes the file must have: up to the end of its last tensor."""
        return max((t.end for t in self.tensors.values()), default=self.data_start)


def read_header(path: str | os.PathLike[str]) -> Header:
    """Read and validate the header of the safetensors file at ``path``.

    Raises:
        FormatError: the file is missing, too short, truncated, or its header breaks a rule
            of the format (the message names the rule, the tensor and the fix).

    Example:
        >>> read_header("model.safetensors").tensors["lm_head.weight"].shape
        (32000, 4096)
    """
    file = Path(path)
    try:
        with open(file, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            raw = f.read(8)
            if len(raw) != 8:
                raise FormatError(f"{file} is not a safetensors file: shorter than its 8-byte header size; {_HINT}")
            (length,) = struct.unpack("<Q", raw)
            if length > min(MAX_HEADER_BYTES, size - 8):
                raise FormatError(f"{file} has a corrupted safetensors header: it claims {length} bytes of "
                                  f"header in a file of {size}; {_HINT}")
            text = f.read(length)
    except FileNotFoundError as exc:
        raise FormatError(f"{file} is missing") from exc
    except IsADirectoryError as exc:
        raise FormatError(f"{file} is a directory, not a safetensors file") from exc
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise FormatError(f"{file} has a corrupted safetensors header (not JSON: {exc}); {_HINT}") from exc
    return _validated(file, data, 8 + length, size)


def _validated(file: Path, data: Any, start: int, size: int) -> Header:
    if not isinstance(data, dict):
        raise FormatError(f"{file} has a corrupted safetensors header: a JSON {type(data).__name__}, "
                          f"not an object of tensor name -> entry; {_HINT}")
    metadata = data.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise FormatError(f"{file} has a corrupted safetensors header: '__metadata__' must map strings to "
                          f"strings; {_HINT}")
    tensors = {key: _entry(file, key, info, start) for key, info in data.items()}
    spans = sorted((t.begin, t.end, t.key) for t in tensors.values() if t.end > t.begin)
    for (_, end, first), (begin, _, second) in zip(spans, spans[1:]):
        if begin < end:
            raise FormatError(f"{file} has a corrupted safetensors header: tensors {first!r} and {second!r} "
                              f"overlap (bytes {begin - start}..{end - start}); {_HINT}")
    needed = max((t.end for t in tensors.values()), default=start)
    if size < needed:
        raise FormatError(f"{file} is truncated: {size} bytes, its header needs {needed}; {_HINT}")
    return Header(file, start, tensors, dict(metadata), size)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _entry(file: Path, key: str, info: Any, start: int) -> TensorInfo:
    where = f"{file} has a corrupted safetensors header at tensor {key!r}"
    if not isinstance(info, dict):
        raise FormatError(f"{where}: its entry is a {type(info).__name__}, not an object; {_HINT}")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in DTYPES:
        raise FormatError(f"{file}: tensor {key!r} has dtype {dtype!r}, which automap cannot read (it reads "
                          f"{', '.join(DTYPES)}); convert the file to one of those")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise FormatError(f"{where}: shape {shape!r} is not a list of non-negative integers; {_HINT}")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(x) for x in offsets):
        raise FormatError(f"{where}: data_offsets {offsets!r} is not two integers; {_HINT}")
    begin, end = offsets
    numel = 1
    for d in shape:
        numel *= d
    expected = numel * DTYPES[dtype].itemsize
    if begin < 0 or end - begin != expected:
        raise FormatError(f"{where}: it is {dtype} {shape} ({expected} bytes) but spans bytes {begin}..{end}; "
                          f"{_HINT}")
    return TensorInfo(key, dtype, tuple(shape), start + begin, start + end)


# ------------------------------------------------------------------ writing


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    return memoryview(flat.contiguous().view(torch.uint8).numpy())  # type: ignore[arg-type]


# Where each tensor's data starts in a file automap writes: a multiple of this many bytes, as
# torch's CPU allocator aligns tensors. Kernels (oneDNN's convolutions among them) pick their
# path by alignment, so a weight read in place from a less aligned offset computes a slightly
# different result (~1e-7 relative) than the same weight in RAM; aligned, they match bit for bit.
DATA_ALIGN = 64
PADDING = "__automap_padding_"


def encode_header(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> tuple[bytes, list[str]]:
    """The header bytes for ``tensors`` and the order their data follows it in: largest
    element size first (as safetensors orders them). Every tensor starts at a multiple of
    :data:`DATA_ALIGN` bytes in the file: the header is padded with spaces to end there, and
    the zero bytes after a tensor whose size is not a multiple are declared as a ``U8``
    padding entry (:data:`PADDING`), since the format allows no unindexed gaps: the file stays
    one that the safetensors library itself reads."""
    order = sorted(tensors, key=lambda n: (-tensors[n].element_size(), n))
    if any(n.startswith(PADDING) for n in order):
        raise FormatError(f"tensor names starting with {PADDING!r} are reserved for padding in automap's files")
    entries: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name in order:
        t = tensors[name]
        if t.dtype not in DTYPE_NAMES:
            raise FormatError(f"tensor {name!r} has dtype {t.dtype}, which safetensors cannot store")
        nbytes = t.numel() * t.element_size()
        gap = -offset % DATA_ALIGN
        if gap:
            entries[f"{PADDING}{len(entries)}"] = {"dtype": "U8", "shape": [gap], "data_offsets": [offset, offset + gap]}
            offset += gap
        entries[name] = {"dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % DATA_ALIGN)
    return struct.pack("<Q", len(text)) + text, order


def write_file(path: str | os.PathLike[str], tensors: Mapping[str, torch.Tensor],
               metadata: Mapping[str, str] | None = None) -> int:
    """Write ``tensors`` as a new safetensors file at ``path``, which must not exist (it is
    created exclusively, so no existing file is ever replaced). Returns the bytes written.

    Raises:
        OSError: the file exists, or the write failed (disk full, quota, I/O error); the
            partial file is left for the caller, who created it, to remove.
    """
    head, order = encode_header(tensors, metadata)
    written = 0
    with open(path, "xb") as f:
        written += f.write(head)
        for name in order:
            written += f.write(bytes(-(written - len(head)) % DATA_ALIGN))
            if tensors[name].numel():
                written += f.write(_bytes_of(tensors[name]))
    return written
