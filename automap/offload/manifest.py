"""A store's manifest, ``automap-store.json``: which tensors the store holds, in which of its
files, with which checksums, and whether it was written to the end.

It is read through the one JSON reader (:func:`automap.offload.format.load_json`) and then
checked field by field — types, bounds, plain file names — so a manifest that is missing,
damaged, hostile, of another format or version, or not complete only ever means "rebuild the
store" (:func:`read_manifest` never raises). It is written under a temporary name and renamed
over the old one, never through a link (:meth:`~automap.offload.store_files.StoreDir.write_new`).
"""

from __future__ import annotations

import json
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch

from automap.errors import FormatError
from automap.offload.format import DTYPES, MAX_DIMS, load_json, read_regular
from automap.offload.store_files import StoreDir

MANIFEST = "automap-store.json"
FORMAT = "automap-offload-store"
VERSION = 2
# A manifest lists each tensor in ~150 bytes: this is room for over a million tensors.
MAX_MANIFEST_BYTES = 256 << 20


@dataclass(frozen=True)
class Record:
    """One stored tensor: its file in the store, its key there, and what it must look like."""

    file: str
    key: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    crc32: int


def checksum(tensor: torch.Tensor) -> int:
    """CRC-32 of the tensor's bytes (contiguous, on CPU)."""
    data = tensor.detach().cpu().contiguous()
    return zlib.crc32(data.reshape(-1).view(torch.uint8).numpy()) if data.numel() else 0  # type: ignore[arg-type]


def plain_file(name: Any) -> bool:
    """A store file's name: ``*.safetensors``, no folder, not hidden (temporary names are)."""
    return (
        isinstance(name, str)
        and name.endswith(".safetensors")
        and "/" not in name
        and "\\" not in name
        and not name.startswith(".")
        and "\0" not in name
    )


def write_manifest(
    folder: StoreDir, records: Mapping[str, Record], complete: bool, files: Iterable[str] = ()
) -> None:
    """Write the manifest (to a temporary name, then renamed over the old one). ``files`` are
    further files the store owns beyond those its records name (about to be written)."""
    owned = sorted({r.file for r in records.values()} | set(files))
    payload = {
        "format": FORMAT,
        "version": VERSION,
        "complete": complete,
        "files": owned,
        "tensors": {n: {**asdict(r), "shape": list(r.shape)} for n, r in records.items()},
    }
    folder.write_new(MANIFEST, json.dumps(payload, indent=1).encode())


def is_manifest(folder: StoreDir) -> bool:
    """Whether ``folder`` holds a manifest of automap's format (any version, complete or not).
    It is always whole JSON: written under a temporary name and renamed."""
    try:
        data = load_json(
            folder.read(MANIFEST, MAX_MANIFEST_BYTES), f"manifest {folder / MANIFEST} is damaged", ""
        )
    except (OSError, FormatError):
        return False
    return isinstance(data, dict) and data.get("format") == FORMAT


def read_manifest(directory: Path | StoreDir) -> tuple[dict[str, Record], set[str]]:
    """``(records, owned files)`` of a store's manifest. Records only from a complete manifest
    of this format and version — anything else (missing, a link, not JSON, another schema or
    version, interrupted, out of bounds) gives none, and the store is rebuilt; owned files from
    any manifest of this format, so that a rebuild may replace them. Never raises."""
    where = directory.path if isinstance(directory, StoreDir) else Path(directory)
    try:
        if isinstance(directory, StoreDir):
            raw = directory.read(MANIFEST, MAX_MANIFEST_BYTES)
        else:
            raw = read_regular(where / MANIFEST, MAX_MANIFEST_BYTES, follow=False)
        data = load_json(raw, f"manifest {where / MANIFEST} is damaged", "automap rebuilds the store")
    except (OSError, FormatError):
        return {}, set()
    if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("version") != VERSION:
        return {}, set()
    records: dict[str, Record] = {}
    tensors = data.get("tensors")
    if data.get("complete") is True and isinstance(tensors, dict):
        try:
            records = {name: parse_record(entry) for name, entry in tensors.items()}
        except FormatError:
            records = {}
    files = data.get("files")
    owned = {f for f in files if plain_file(f)} if isinstance(files, list) else set()
    return records, owned | {r.file for r in records.values()}


def _int(value: Any, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value < high


def parse_record(entry: Any) -> Record:
    """One manifest entry, every field checked.

    Raises:
        FormatError: a field is missing, of the wrong type or out of bounds.
    """
    if not isinstance(entry, dict):
        raise FormatError(f"a manifest entry is a {type(entry).__name__}, not an object")
    file, key, dtype, shape = entry.get("file"), entry.get("key"), entry.get("dtype"), entry.get("shape")
    nbytes, crc = entry.get("nbytes"), entry.get("crc32")
    if not plain_file(file) or not isinstance(key, str) or not isinstance(dtype, str) or dtype not in DTYPES:
        raise FormatError("a manifest entry names a bad file, key or dtype")
    if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(_int(d, 0, 1 << 63) for d in shape):
        raise FormatError("a manifest entry has a bad shape")
    if not _int(nbytes, 0, 1 << 63) or not _int(crc, 0, 1 << 32):
        raise FormatError("a manifest entry has a bad size or checksum")
    return Record(file, key, dtype, tuple(shape), nbytes, crc)
