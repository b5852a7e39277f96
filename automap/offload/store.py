"""The offload store: weights kept on disk in safetensors files, read back through mmap.

Layout of an offload directory::

    automap-index.json          # written last: name -> file, key, dtype, shape, nbytes, crc32
    <unit>.safetensors          # one file per unit, written to a temporary name then renamed

A store can also *reference* tensors inside an existing safetensors checkpoint instead of
copying them (the index then names the checkpoint file). Reads are zero-copy: a tensor is a
view of a shared read-only memory map (as safetensors' own loading gives), so its pages are
file-backed and the kernel may drop them.
Before a unit's weights are read, :meth:`OffloadStore.check_unchanged` checks that its files are
still the ones that were mapped (inode, size, mtime): a file changed or truncated under a live
map would otherwise give wrong weights, or kill the process with SIGBUS.
"""
from __future__ import annotations

import ctypes
import json
import logging
import mmap
import os
import re
import struct
import tempfile
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping, NamedTuple

import torch
from safetensors.torch import save_file

from automap.errors import OffloadError

INDEX_NAME = "automap-index.json"
INDEX_VERSION = 1

# safetensors dtype names (the format's own spelling), shared with automap.load.
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
log = logging.getLogger(__name__)
_PAGE = mmap.PAGESIZE
# MADV_POPULATE_READ (Linux 5.14+) maps a range into the page tables in one call, so the
# compute thread takes no page faults; Python 3.11 lacks the constant.
_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)


class _Mapped(NamedTuple):
    """One open file of the store, checked against the index once when mapped: its map, its
    identity, and per store name the byte range of its data and the tensor viewing it (a
    slice of the whole map), so that reading a weight is a lookup."""

    mapping: mmap.mmap | None
    signature: tuple[int, int, int]
    spans: dict[str, tuple[int, int]]
    views: dict[str, torch.Tensor]
    address: int  # of the map's first byte; 0 for an empty file


_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


def _madvise(address: int, length: int, advice: int) -> bool:
    """``madvise`` through ctypes, which releases the GIL for the call: ``mmap.madvise`` keeps
    it, so a prefetch waiting on the disk would stall the thread running the model."""
    return _LIBC.madvise(address, length, advice) == 0


def _as_tensor(mapping: mmap.mmap) -> torch.Tensor:
    """The whole read-only map as one uint8 tensor. torch warns that it cannot mark a tensor
    read-only; the weights are never written (offloaded units are not trained), and a shared
    read-only map is what safetensors' own loading gives, and faster to compute from than a
    private copy-on-write one (~14 % on a Llama forward here)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(mapping, dtype=torch.uint8)


def _signature(path: Path) -> tuple[int, int, int]:
    st = os.stat(path)
    return (st.st_ino, st.st_size, st.st_mtime_ns)


@dataclass(frozen=True)
class Entry:
    """Where one tensor lives: a safetensors ``file`` (absolute or relative to the store),
    the ``key`` inside it, and what it must look like when read back."""

    file: str
    key: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    crc32: int | None = None


def checksum(tensor: torch.Tensor) -> int:
    """CRC-32 of the tensor's bytes (contiguous, on CPU)."""
    data = tensor.detach().cpu().contiguous()
    return zlib.crc32(data.reshape(-1).view(torch.uint8).numpy()) if data.numel() else 0  # type: ignore[arg-type]


def read_header(path: str | os.PathLike[str]) -> tuple[int, dict]:
    """Return ``(data_start, header)`` of a safetensors file, checking its framing.

    Raises:
        OffloadError: the file is missing, too short, or its header is not valid JSON.
    """
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise OffloadError(f"{path} is not a safetensors file: shorter than its 8-byte header size")
            (size,) = struct.unpack("<Q", raw)
            if size > 100_000_000:
                raise OffloadError(f"{path} has a corrupted safetensors header (claims {size} bytes)")
            header = json.loads(f.read(size))
    except FileNotFoundError as exc:
        raise OffloadError(f"{path} is missing") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise OffloadError(f"{path} has a corrupted safetensors header: {exc}") from exc
    header.pop("__metadata__", None)
    return 8 + size, header


class OffloadStore:
    """A directory of offloaded weights with an index, read zero-copy through mmap.

    Example:
        >>> store = OffloadStore.write("offload", {"fc.weight": torch.ones(2, 2)}, files={"fc.weight": "fc"})
        >>> store.get("fc.weight").sum()
        tensor(4.)
    """

    def __init__(self, directory: str | os.PathLike[str], entries: Mapping[str, Entry]):
        self.directory = Path(directory)
        self.entries = dict(entries)
        self._names: dict[str, list[str]] = {}  # file -> the store names it holds
        for name, entry in self.entries.items():
            self._names.setdefault(entry.file, []).append(name)
        self._maps: dict[str, _Mapped] = {}

    # ---------------------------------------------------------------- reading

    @classmethod
    def open(cls, directory: str | os.PathLike[str]) -> OffloadStore:
        """Open an existing store, checking that every file has the size its index promises."""
        index_path = Path(directory) / INDEX_NAME
        try:
            data = json.loads(index_path.read_text())
        except FileNotFoundError as exc:
            raise OffloadError(f"no offload index at {index_path}; dispatch again to rewrite the store") from exc
        except json.JSONDecodeError as exc:
            raise OffloadError(f"offload index {index_path} is corrupted ({exc}); delete the directory and dispatch again") from exc
        entries = {name: Entry(e["file"], e["key"], e["dtype"], tuple(e["shape"]), e["nbytes"], e.get("crc32"))
                   for name, e in data["tensors"].items()}
        store = cls(directory, entries)
        store.check_files()
        return store

    def path_of(self, entry: Entry) -> Path:
        return self._path(entry.file)

    def _path(self, file: str) -> Path:
        return Path(file) if os.path.isabs(file) else self.directory / file

    def check_files(self) -> None:
        """Raise :class:`OffloadError` if a file is missing, truncated or lacks a tensor."""
        for file in sorted(self._names):
            self._mapped(file)

    def _mapped(self, file: str) -> _Mapped:
        if file not in self._maps:
            self._maps[file] = self._map(file)
        return self._maps[file]

    def _map(self, file: str) -> _Mapped:
        path = self._path(file)
        start, header = read_header(path)
        end = max((int(v["data_offsets"][1]) for v in header.values()), default=0)
        size = path.stat().st_size
        if size < start + end:
            raise OffloadError(
                f"offload file {path} is truncated: {size} bytes, its header needs {start + end}; "
                "restore it, or delete the offload directory and dispatch (or load) again"
            )
        spans = {name: self._span(name, start, header) for name in self._names.get(file, [])}
        with open(path, "rb") as f:
            mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else None
        whole = _as_tensor(mapping) if mapping is not None else None
        views = {name: self._view(name, whole, *span) for name, span in spans.items()}
        address = whole.data_ptr() if whole is not None else 0
        return _Mapped(mapping, _signature(path), spans, views, address)

    def _span(self, name: str, start: int, header: Mapping[str, dict]) -> tuple[int, int]:
        """The absolute byte range of ``name`` in its file, checked against the index."""
        entry = self.entries[name]
        info = header.get(entry.key)
        if info is None:
            raise OffloadError(f"offload file {self.path_of(entry)} has no tensor {entry.key!r}; it was changed after writing")
        begin, end = (int(x) for x in info["data_offsets"])
        if info["dtype"] != entry.dtype or tuple(info["shape"]) != entry.shape or end - begin != entry.nbytes:
            raise OffloadError(
                f"offload tensor {name!r} in {self.path_of(entry)} changed after writing "
                f"(now {info['dtype']} {info['shape']}, index says {entry.dtype} {list(entry.shape)})"
            )
        return start + begin, start + end

    def _view(self, name: str, whole: torch.Tensor | None, begin: int, end: int) -> torch.Tensor:
        entry = self.entries[name]
        dtype = DTYPES[entry.dtype]
        if entry.nbytes == 0 or whole is None:
            return torch.empty(entry.shape, dtype=dtype)
        return whole[begin:end].view(dtype).view(entry.shape)

    def check_unchanged(self, names: Iterable[str]) -> None:
        """Raise :class:`OffloadError` if a file holding one of ``names`` was replaced,
        truncated or rewritten since it was mapped (one ``stat`` per file). A file that changed
        but still matches its index and checksums (touched, or restored from a copy) is
        mapped again and used."""
        for file in {self.entries[n].file for n in names}:
            mapped, path = self._mapped(file), self._path(file)
            try:
                now = _signature(path)
            except FileNotFoundError as exc:
                raise OffloadError(f"offload file {path} was deleted after it was written; "
                                   "restore it, or call automap.undispatch(model) and dispatch again") from exc
            if now != mapped.signature:
                self._remap(file, mapped, now)

    def _remap(self, file: str, old: _Mapped, now: tuple[int, int, int]) -> None:
        del self._maps[file]
        path, names = self._path(file), self._names[file]
        hint = "restore the file, or delete the offload directory and dispatch (or load) again"
        try:
            self._mapped(file)
            if any(self.entries[n].crc32 is None for n in names):
                raise OffloadError(f"offload file {path} changed after it was written (size {old.signature[1]} -> "
                                   f"{now[1]} bytes) and has no checksums to check it against; {hint}")
            self.verify(names)
        except OffloadError:
            self._maps[file] = old  # keep failing loudly until the file is put right
            raise
        log.warning("offload file %s changed on disk but still matches its checksums; using it", path)

    def get(self, name: str) -> torch.Tensor:
        """The tensor ``name`` as a zero-copy CPU view of its file."""
        return self._mapped(self.entries[name].file).views[name]

    def advise(self, names: Iterable[str], populate: bool = True) -> None:
        """Ask the kernel to bring the pages of ``names`` into memory now: readahead of every
        range is queued at once (large reads, no waiting), then, with ``populate``, the pages
        are mapped in as they arrive, so the compute thread later takes no page faults. The
        GIL is released meanwhile."""
        spans = []
        for name in names:
            mapped = self._mapped(self.entries[name].file)
            begin, end = mapped.spans[name]
            if mapped.mapping is not None and end > begin:
                spans.append((mapped.address + begin - begin % _PAGE, end - begin + begin % _PAGE))
        for start, length in spans:
            _madvise(start, length, mmap.MADV_WILLNEED)
        if populate:
            for start, length in spans:
                if not _madvise(start, length, _MADV_POPULATE_READ):
                    break  # kernels before 5.14 lack POPULATE_READ: the readahead still runs

    def drop_pages(self) -> None:
        """Unmap every page of the store from this process and ask the kernel to evict the
        files from the page cache (the next read comes from the disk: a cold start)."""
        for file, mapped in self._maps.items():
            if mapped.mapping is not None:
                mapped.mapping.madvise(mmap.MADV_DONTNEED)
            fd = os.open(self._path(file), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)

    def verify(self, names: Iterable[str] | None = None) -> None:
        """Recompute checksums and raise :class:`OffloadError` on the first mismatch."""
        for name in names if names is not None else self.entries:
            entry = self.entries[name]
            if entry.crc32 is not None and checksum(self.get(name)) != entry.crc32:
                raise OffloadError(
                    f"offload tensor {name!r} in {self.path_of(entry)} does not match its checksum; "
                    "the file was changed after writing: delete the offload directory and dispatch again"
                )

    def close(self) -> None:
        self._maps.clear()  # the maps close when the last tensor viewing them is gone

    # ---------------------------------------------------------------- writing

    @classmethod
    def write(cls, directory: str | os.PathLike[str], tensors: Mapping[str, torch.Tensor],
              files: Mapping[str, str], *, references: Mapping[str, Entry] | None = None) -> OffloadStore:
        """Write ``tensors`` (grouped into files by ``files[name]``) and the index, atomically.

        Files whose contents already match the index on disk are reused, not rewritten.
        ``references`` adds entries that point into existing safetensors files (no copy).

        Raises:
            OffloadError: the directory cannot be created or written.
        """
        root = Path(directory)
        try:
            root.mkdir(parents=True, exist_ok=True)
            probe = tempfile.NamedTemporaryFile(dir=root, prefix=".automap-probe-")
            probe.close()
        except OSError as exc:
            raise OffloadError(f"offload_dir {root} is not writable ({exc.strerror}); pass a writable directory") from exc
        old = cls._previous_entries(root)
        entries: dict[str, Entry] = dict(references or {})
        groups: dict[str, list[str]] = {}
        for name in tensors:
            groups.setdefault(files[name], []).append(name)
        written: list[Path] = []
        try:
            for group, names in groups.items():
                entries.update(cls._write_group(root, group, {n: tensors[n] for n in names}, old, written))
            cls._write_index(root, entries)
        except OSError as exc:
            for path in written:
                path.unlink(missing_ok=True)
            raise OffloadError(f"writing the offload store in {root} failed ({exc}); nothing was kept") from exc
        store = cls(root, entries)
        store.check_files()  # map now: a change from here on is caught by check_unchanged
        return store

    @staticmethod
    def _previous_entries(root: Path) -> dict[str, Entry]:
        try:
            return OffloadStore.open(root).entries
        except OffloadError:
            return {}

    @staticmethod
    def _write_group(root: Path, group: str, tensors: Mapping[str, torch.Tensor],
                     old: Mapping[str, Entry], written: list[Path]) -> dict[str, Entry]:
        file = re.sub(r"[^A-Za-z0-9_.-]", "_", group or "root") + ".safetensors"
        cpu = {n: t.detach().to("cpu").contiguous() for n, t in tensors.items()}
        entries = {
            n: Entry(file, n, DTYPE_NAMES[t.dtype], tuple(t.shape), t.numel() * t.element_size(), checksum(t))
            for n, t in cpu.items()
        }
        if all(old.get(n) == e for n, e in entries.items()) and _intact(root, entries):
            return entries  # same tensors, same bytes on disk: reuse
        tmp = root / f".{file}.tmp"
        written.append(tmp)
        save_file(cpu, str(tmp))
        os.replace(tmp, root / file)
        written.append(root / file)
        return entries

    @staticmethod
    def _write_index(root: Path, entries: Mapping[str, Entry]) -> None:
        payload = {"version": INDEX_VERSION,
                   "tensors": {n: {"file": e.file, "key": e.key, "dtype": e.dtype, "shape": list(e.shape),
                                   "nbytes": e.nbytes, "crc32": e.crc32} for n, e in entries.items()}}
        tmp = root / f".{INDEX_NAME}.tmp"
        tmp.write_text(json.dumps(payload, indent=1))
        os.replace(tmp, root / INDEX_NAME)


def checkpoint_entries(path: str | os.PathLike[str], keys: Mapping[str, str]) -> dict[str, Entry]:
    """Entries that reference tensors inside an existing safetensors checkpoint in place.

    Args:
        path: the checkpoint file (stored as an absolute path in the index).
        keys: store name -> key inside the checkpoint (often the same string).

    Raises:
        OffloadError: the file is not safetensors, or lacks one of ``keys``.

    Example:
        >>> refs = checkpoint_entries("model.safetensors", {"fc.weight": "fc.weight"})
        >>> store = OffloadStore.write("offload", {}, {}, references=refs)
    """
    absolute = Path(path).resolve()
    _, header = read_header(absolute)
    entries = {}
    for name, key in keys.items():
        info = header.get(key)
        if info is None:
            raise OffloadError(f"checkpoint {absolute} has no tensor {key!r} (wanted for {name!r}); "
                               "pass the file that holds it")
        begin, end = (int(x) for x in info["data_offsets"])
        entries[name] = Entry(str(absolute), key, info["dtype"], tuple(info["shape"]), end - begin)
    return entries


def _intact(root: Path, entries: Mapping[str, Entry]) -> bool:
    """True when the files of ``entries`` exist and hold bytes matching their checksums."""
    try:
        store = OffloadStore(root, entries)
        store.check_files()
        store.verify()
        return True
    except OffloadError:
        return False
