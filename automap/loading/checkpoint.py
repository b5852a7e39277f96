"""Reading checkpoints tensor by tensor: what is stored where, and one tensor at a time.

Safetensors files are read from their headers only, and each tensor is read with ``readinto``
straight into the tensor that will hold it: no whole shard, no memory map whose pages would
count against the process, no second copy. PyTorch pickles (``.bin``/``.pt``) are opened with
``torch.load(weights_only=True, mmap=True)``, whose tensors stay on disk until touched.
"""
from __future__ import annotations

import io
import json
import logging
import os
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch

from automap.errors import CheckpointError, OffloadError
from automap.offload import DTYPES, read_header

log = logging.getLogger(__name__)

SAFETENSORS = ".safetensors"
PICKLES = (".bin", ".pt", ".pth")


@dataclass(frozen=True)
class Stored:
    """One tensor of a checkpoint: its file, and for safetensors the absolute byte range."""

    key: str
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int = -1  # absolute start in ``file``; -1 for pickled tensors
    nbytes: int = 0

    @property
    def is_safetensors(self) -> bool:
        return self.offset >= 0


class Checkpoint:
    """The tensors of a checkpoint (one file or a folder of shards), read one at a time.

    Example:
        >>> with open_checkpoint("model.safetensors") as ckpt:
        ...     ckpt.read("fc.weight").shape
    """

    def __init__(self, path: Path, tensors: Mapping[str, Stored], pickled: Mapping[Path, dict]):
        self.path = path
        self.tensors = dict(tensors)
        self._pickled = dict(pickled)
        self._handles: dict[Path, io.FileIO] = {}

    @property
    def total_bytes(self) -> int:
        return sum(s.nbytes for s in self.tensors.values())

    def read(self, key: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The tensor ``key`` on CPU in ``dtype`` (default: as stored), in memory of its own."""
        stored = self.tensors[key]
        if not stored.is_safetensors:
            return self._pickled[stored.file][key].to(dtype or stored.dtype, copy=True)
        out = torch.empty(stored.shape, dtype=stored.dtype)
        if stored.nbytes:
            self._read_into(stored, memoryview(out.reshape(-1).view(torch.uint8).numpy()))  # type: ignore[arg-type]
        return out.to(dtype or stored.dtype)

    def _read_into(self, stored: Stored, view: memoryview) -> None:
        handle = self._handles.get(stored.file)
        if handle is None:
            handle = self._handles[stored.file] = io.FileIO(stored.file, "rb")
        handle.seek(stored.offset)
        done = 0
        while done < len(view):
            got = handle.readinto(view[done:])
            if not got:
                raise CheckpointError(f"{stored.file} ended while reading {stored.key!r} ({done} of "
                                      f"{len(view)} bytes); the file was truncated during the load")
            done += got

    def close(self) -> None:
        for handle in self._handles.values():
            handle.close()
        self._handles.clear()
        self._pickled.clear()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# ------------------------------------------------------------------ finding the files


def open_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """Index the checkpoint at ``path`` without reading its tensors.

    ``path`` is a ``.safetensors`` file, a ``.bin``/``.pt``/``.pth`` file, a folder with a
    ``*.index.json`` (Hugging Face sharding), or a folder of shards without one.

    Raises:
        CheckpointError: the path does not exist, holds no checkpoint, a file is corrupt or
            truncated, an index names missing files, or a pickle would run code.
    """
    root = Path(path)
    if not root.exists():
        raise CheckpointError(f"checkpoint {root} does not exist; pass a .safetensors/.bin file or a folder of shards")
    files, expected = (_files_in(root) if root.is_dir() else ([root], None))
    tensors: dict[str, Stored] = {}
    pickled: dict[Path, dict] = {}
    for file in files:
        if file.suffix == SAFETENSORS:
            found = _safetensors_entries(file)
        else:
            pickled[file] = _load_pickle(file)
            found = {k: Stored(k, file, t.dtype, tuple(t.shape), nbytes=t.numel() * t.element_size())
                     for k, t in pickled[file].items()}
        for key, stored in found.items():
            tensors.setdefault(key, stored)
    if expected is not None:
        _check_index(root, expected, tensors)
    return Checkpoint(root, tensors, pickled)


def _files_in(folder: Path) -> tuple[list[Path], dict[str, str] | None]:
    indexes = sorted(folder.glob("*.index.json"), key=lambda p: (not p.name.endswith(SAFETENSORS + ".index.json"), p.name))
    if indexes:
        weight_map = _read_index(indexes[0])
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise CheckpointError(
                f"index {indexes[0]} names {len(missing)} file(s) that are not in {folder}, first "
                f"{missing[:3]}; copy the missing shards there or fix the index"
            )
        return [folder / n for n in names], weight_map
    for pattern in (f"*{SAFETENSORS}", *(f"*{s}" for s in PICKLES)):
        files = sorted(p for p in folder.glob(pattern) if p.is_file())
        if files:
            return files, None
    raise CheckpointError(f"folder {folder} holds no checkpoint: no *.index.json, *.safetensors, *.bin, *.pt or *.pth")


def _read_index(path: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(path.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"index {path} is not a valid shard index (needs a 'weight_map' object): {exc}") from exc
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"index {path} has a 'weight_map' that is not an object of key -> file")
    return {str(k): str(v) for k, v in weight_map.items()}


def _check_index(root: Path, weight_map: Mapping[str, str], tensors: Mapping[str, Stored]) -> None:
    absent = [k for k, f in weight_map.items() if k not in tensors or tensors[k].file.name != Path(f).name]
    if absent:
        raise CheckpointError(
            f"the index of {root} lists {len(absent)} tensor(s) that are not in the file it names, first "
            f"{absent[:3]}; the shards and the index come from different saves"
        )


# ------------------------------------------------------------------ safetensors


def _safetensors_entries(file: Path) -> dict[str, Stored]:
    try:
        start, header = read_header(file)
    except OffloadError as exc:
        raise CheckpointError(f"cannot read checkpoint shard: {exc}; save or copy it again") from exc
    except AttributeError as exc:  # valid JSON that is not an object
        raise CheckpointError(f"{file} has a corrupted safetensors header (not a JSON object); save or copy it again") from exc
    size = file.stat().st_size
    entries = {}
    for key, info in header.items():
        entries[key] = _entry(file, start, key, info)
    needed = max((s.offset + s.nbytes for s in entries.values()), default=start)
    if size < needed:
        raise CheckpointError(
            f"checkpoint shard {file} is truncated: {size} bytes, its header needs {needed}; "
            "copy or download it again"
        )
    return entries


def _entry(file: Path, start: int, key: str, info: Any) -> Stored:
    if isinstance(info, dict) and info.get("dtype") not in DTYPES:
        raise CheckpointError(f"{file}: tensor {key!r} has dtype {info.get('dtype')!r}, which automap cannot read "
                              f"(it reads {', '.join(DTYPES)}); convert the checkpoint to one of those")
    try:
        dtype = DTYPES[info["dtype"]]
        shape = tuple(int(d) for d in info["shape"])
        begin, end = (int(x) for x in info["data_offsets"])
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{file} has a corrupted safetensors header at tensor {key!r} ({exc!r}); "
                              "save or copy it again") from exc
    numel = 1
    for d in shape:
        numel *= d
    if end - begin != numel * dtype.itemsize or begin < 0:
        raise CheckpointError(f"{file} has a corrupted safetensors header: {key!r} is {info['dtype']} {list(shape)} "
                              f"({numel * dtype.itemsize} bytes) but spans bytes {begin}..{end}")
    return Stored(key, file, dtype, shape, start + begin, end - begin)


# ------------------------------------------------------------------ pickles


def _load_pickle(file: Path) -> dict[str, torch.Tensor]:
    try:
        data = _torch_load(file)
    except pickle.UnpicklingError as exc:
        reason = [line for line in str(exc).splitlines() if "GLOBAL" in line]
        if not reason:
            raise CheckpointError(f"{file} is truncated or not a PyTorch checkpoint ({str(exc)[:200]}); "
                                  "save or copy it again") from exc
        raise CheckpointError(
            f"refused to load {file}: its pickle calls code that torch.load(weights_only=True) will not run "
            f"({reason[0].strip()}); loading it could execute arbitrary code. If you trust its source, convert "
            "it to safetensors yourself and load that"
        ) from exc
    except Exception as exc:  # noqa: BLE001 - any failure to parse the file means the same to the user
        raise CheckpointError(f"{file} is truncated or not a PyTorch checkpoint ({type(exc).__name__}: "
                              f"{str(exc)[:300]}); save or copy it again") from exc
    if isinstance(data, dict) and isinstance(data.get("state_dict"), dict):
        data = data["state_dict"]  # Lightning and many training scripts wrap the weights
    if not isinstance(data, dict):
        raise CheckpointError(f"{file} holds a {type(data).__name__}, not a state dict of name -> tensor")
    skipped = [k for k, v in data.items() if not isinstance(v, torch.Tensor)]
    if skipped:
        log.info("%s: ignoring %d non-tensor entries (%s)", file, len(skipped), skipped[:3])
    return {str(k): v for k, v in data.items() if isinstance(v, torch.Tensor)}


def _torch_load(file: Path) -> Any:
    try:
        return torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError as exc:
        if "mmap" not in str(exc):
            raise
    # Files from torch.save(_use_new_zipfile_serialization=False) cannot be memory-mapped.
    data = torch.load(file, map_location="cpu", weights_only=True)
    log.warning("%s uses the legacy torch.save format, which cannot be memory-mapped: read whole", file)
    return data
