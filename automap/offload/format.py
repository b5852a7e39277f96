"""The safetensors format: the one validating header parser for checkpoints and store files
alike, the one JSON reader (:func:`load_json`), and a writer that streams tensors to disk.

Invariant: a header is trusted only after every rule holds, and nothing but
:class:`~automap.errors.FormatError` escapes the parsers (:func:`load_json` comes from
:mod:`automap.userfiles`).
"""

from __future__ import annotations

import errno
import json
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Mapping

import torch

from automap.errors import FormatError
from automap.kinds import on_host
from automap.userfiles import load_json, read_regular  # noqa: F401 - read_regular re-exported

# safetensors dtype names (the format's own spelling).
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
    "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
    "C64": torch.complex64,
    "U64": torch.uint64,
    "U32": torch.uint32,
    "U16": torch.uint16,
}
if hasattr(torch, "float8_e8m0fnu"):  # MX block scales (torch 2.7 and later)
    DTYPES["F8_E8M0"] = torch.float8_e8m0fnu
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
# Larger headers exist only in broken or hostile files (a 70B checkpoint's is well under 1 MB).
MAX_HEADER_BYTES = 100_000_000
# More dimensions than this exist only in damaged or hostile files.
MAX_DIMS = 64
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


# When no file may be opened, the fix is the limit's, not the file's (reading or writing a store).
OPEN_FILE_FIXES = {
    errno.EMFILE: "The process may open no more files: raise its limit (ulimit -n) and try again",
    errno.ENFILE: "The system may open no more files: close some, or raise fs.file-max, and try again",
}


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
        fd = os.open(file, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError as exc:
        raise FormatError(f"{file} is missing") from exc
    except OSError as exc:
        fix = OPEN_FILE_FIXES.get(exc.errno, "Make it readable")
        raise FormatError(f"{file} cannot be read ({exc.strerror or exc}). {fix}") from exc
    try:
        return header_of(fd, file)
    finally:
        os.close(fd)


def header_of(fd: int, file: str | os.PathLike[str]) -> Header:
    """The validated header of the safetensors file open as ``fd`` (named ``file`` in
    messages): of the file itself, whatever its name holds now. Reads with ``pread``, so the
    descriptor's offset is left as it is.

    Raises:
        FormatError: as :func:`read_header`.
    """
    file = Path(file)
    length, size, text = _read_head(file, fd)
    data = load_json(text, f"{file} has a corrupted safetensors header", _HINT)
    return _validated(file, data, 8 + length, size)


def _read_head(file: Path, fd: int) -> tuple[int, int, bytes]:
    """``(header length, file size, header bytes)`` of the open safetensors file ``fd``."""
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise FormatError(f"{file} is a directory, not a safetensors file")
        if not stat.S_ISREG(info.st_mode):
            raise FormatError(
                f"{file} is not a regular file (a pipe, socket or device); pass a safetensors file"
            )
        size = info.st_size
        raw = os.pread(fd, 8, 0)
        if len(raw) != 8:
            raise FormatError(
                f"{file} is not a safetensors file: shorter than its 8-byte header size; {_HINT}"
            )
        (length,) = struct.unpack("<Q", raw)
        if length > min(MAX_HEADER_BYTES, size - 8):
            raise FormatError(
                f"{file} has a corrupted safetensors header: it claims {length} bytes of "
                f"header in a file of {size}; {_HINT}"
            )
        text = os.pread(fd, length, 8)
    except OSError as exc:
        raise FormatError(f"{file} cannot be read ({exc.strerror or exc}); {_HINT}") from exc
    if len(text) != length:
        raise FormatError(
            f"{file} is truncated: its header needs {length} bytes, {len(text)} were read; {_HINT}"
        )
    return length, size, text


def _validated(file: Path, data: Any, start: int, size: int) -> Header:
    if not isinstance(data, dict):
        raise FormatError(
            f"{file} has a corrupted safetensors header: a JSON {type(data).__name__}, "
            f"not an object of tensor name -> entry; {_HINT}"
        )
    metadata = data.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise FormatError(
            f"{file} has a corrupted safetensors header: '__metadata__' must map strings to strings; {_HINT}"
        )
    tensors = {key: _entry(file, key, info, start) for key, info in data.items()}
    spans = sorted((t.begin, t.end, t.key) for t in tensors.values() if t.end > t.begin)
    for (_, end, first), (begin, _, second) in zip(spans, spans[1:]):
        if begin < end:
            raise FormatError(
                f"{file} has a corrupted safetensors header: tensors {_short(first)} and "
                f"{_short(second)} "
                f"overlap (bytes {begin - start}..{end - start}); {_HINT}"
            )
    needed = max((t.end for t in tensors.values()), default=start)
    if size < needed:
        raise FormatError(f"{file} is truncated: {size} bytes, its header needs {needed}; {_HINT}")
    return Header(file, start, tensors, dict(metadata), size)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _entry(file: Path, key: str, info: Any, start: int) -> TensorInfo:
    where = f"{file} has a corrupted safetensors header at tensor {_short(key)}"
    if not isinstance(info, dict):
        raise FormatError(f"{where}: its entry is a {type(info).__name__}, not an object; {_HINT}")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise FormatError(
            f"{file}: tensor {_short(key)} has dtype {_short(dtype)}, which automap cannot read "
            f"(it reads {', '.join(DTYPES)}); convert the file to one of those"
        )
    if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(_is_int(d) and d >= 0 for d in shape):
        raise FormatError(
            f"{where}: shape {_short(shape)} is not a list of non-negative integers (at most "
            f"{MAX_DIMS}); {_HINT}"
        )
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(x) for x in offsets):
        raise FormatError(f"{where}: data_offsets {_short(offsets)} is not two integers; {_HINT}")
    begin, end = offsets
    numel = 1
    for d in shape:
        numel *= d
    expected = numel * DTYPES[dtype].itemsize
    if begin < 0 or end - begin != expected:
        raise FormatError(
            f"{where}: it is {dtype} {shape} ({expected} bytes) but spans bytes {begin}..{end}; {_HINT}"
        )
    return TensorInfo(key, dtype, tuple(shape), start + begin, start + end)


# ------------------------------------------------------------------ writing


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().reshape(-1)
    if not on_host(flat.device):
        flat = flat.cpu()
    return memoryview(flat.contiguous().view(torch.uint8).numpy())  # type: ignore[arg-type]


# Where each tensor's data starts in a file automap writes: a multiple of this many bytes, as
# torch's CPU allocator aligns tensors. Kernels (oneDNN's convolutions among them) pick their
# path by alignment, so a weight read in place from a less aligned offset computes a slightly
# different result (~1e-7 relative) than the same weight in RAM; aligned, they match bit for bit.
DATA_ALIGN = 64
PADDING = "__automap_padding_"


# The ``__metadata__`` key under which automap's store files record, as JSON, the tensors kept
# in their memory order (a channels-last convolution weight, a transposed parameter): name ->
# the permutation of the stored (contiguous) dims that gives the tensor back with its strides.
PERMUTATIONS = "automap.permutations"


def dense_order(tensor: torch.Tensor) -> list[int] | None:
    """The permutation that gives ``tensor`` back from the contiguous tensor its bytes form in
    memory (a channels-last or transposed weight), or None when it is contiguous, or its
    elements overlap or leave gaps (no permutation lays it out). Nothing is copied."""
    if tensor.dim() < 2 or tensor.is_contiguous():
        return None
    order = sorted(range(tensor.dim()), key=lambda d: (-tensor.stride(d), d))
    if not tensor.permute(order).is_contiguous():
        return None
    return [order.index(d) for d in range(tensor.dim())]


def memory_order(tensor: torch.Tensor) -> tuple[torch.Tensor, list[int] | None]:
    """``tensor`` as contiguous bytes to store, and :func:`dense_order`'s permutation that gives
    its strides back (so its kernels and its layout after undispatch): the bytes as they are
    where a permutation lays them out, else a contiguous copy and None."""
    back = dense_order(tensor)
    if back is None:
        return tensor.contiguous(), None
    order = sorted(range(tensor.dim()), key=lambda d: back[d])  # the inverse of back
    return tensor.permute(order), back


def permutations_of(header: Header) -> dict[str, tuple[int, ...]]:
    """The permutations a store file's metadata records (:data:`PERMUTATIONS`), each checked
    against its tensor's dims.

    Raises:
        FormatError: the entry is not JSON naming tensors of the file with permutations of their dims.
    """
    text = header.metadata.get(PERMUTATIONS)
    if text is None:
        return {}
    found = load_json(text, f"{header.path}: its {PERMUTATIONS!r} metadata is not valid JSON", _HINT)
    if not isinstance(found, dict):
        raise FormatError(f"{header.path}: its {PERMUTATIONS!r} metadata is not a JSON object; {_HINT}")
    checked: dict[str, tuple[int, ...]] = {}
    for name, order in found.items():
        info = header.tensors.get(name)
        if (
            info is None
            or not isinstance(order, list)
            or not all(type(d) is int for d in order)
            or sorted(order) != list(range(len(info.shape)))
        ):
            raise FormatError(
                f"{header.path}: {PERMUTATIONS!r} metadata gives {name!r} the order {order!r}, "
                f"which is not one of its dims; {_HINT}"
            )
        checked[name] = tuple(order)
    return checked


def encode_header(
    tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> tuple[bytes, list[str]]:
    """The header bytes for ``tensors`` and the order their data follows it in: largest
    first. In a unit's file that puts stacked experts (read by rows, without readahead) before
    the dense tensors (read whole, with it), so the kernel's readahead past the dense part runs
    into the end of the file, not into experts no token went to. Every tensor starts at a multiple of
    :data:`DATA_ALIGN` bytes in the file: the header is padded with spaces to end there, and
    the zero bytes after a tensor whose size is not a multiple are declared as a ``U8``
    padding entry (:data:`PADDING`), since the format allows no unindexed gaps: the file stays
    one that the safetensors library itself reads."""
    order = sorted(tensors, key=lambda n: (-tensors[n].nbytes, n))
    if any(n.startswith(PADDING) for n in order):
        raise FormatError(
            f"tensor names starting with {PADDING!r} are reserved for padding in automap's files"
        )
    entries: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name in order:
        t = tensors[name]
        if t.dtype not in DTYPE_NAMES:
            raise FormatError(f"tensor {name!r} has dtype {t.dtype}, which safetensors cannot store")
        nbytes = t.numel() * t.element_size()
        gap = -offset % DATA_ALIGN
        if gap:
            entries[f"{PADDING}{len(entries)}"] = {
                "dtype": "U8",
                "shape": [gap],
                "data_offsets": [offset, offset + gap],
            }
            offset += gap
        entries[name] = {
            "dtype": DTYPE_NAMES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % DATA_ALIGN)
    return struct.pack("<Q", len(text)) + text, order


def write_file(
    path: str | os.PathLike[str],
    tensors: Mapping[str, torch.Tensor],
    metadata: Mapping[str, str] | None = None,
) -> int:
    """Write ``tensors`` as a new safetensors file at ``path``, which must not exist: it is
    created exclusively, and never through a symbolic link, so no existing file is ever replaced
    or written through. Returns the bytes written.

    Raises:
        OSError: the name exists (a file or a link), or the write failed (disk full, quota, I/O
            error); the partial file is left for the caller, who created it, to remove.
    """

    def opener(name: str, flags: int) -> int:
        return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)

    with open(path, "xb", opener=opener) as f:
        return write_tensors(f, tensors, metadata)


def write_tensors(
    f: BinaryIO, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> int:
    """Write ``tensors`` in the safetensors format to the open binary file ``f`` (at its
    start); returns the bytes written. Raises OSError when a write fails."""
    head, order = encode_header(tensors, metadata)
    written = f.write(head)
    for name in order:
        written += f.write(bytes(-(written - len(head)) % DATA_ALIGN))
        if tensors[name].numel():
            written += f.write(_bytes_of(tensors[name]))
    f.flush()
    return written
