"""Reading checkpoints tensor by tensor: one reader per format (:data:`READERS`), a folder read as
``from_pretrained`` reads it.

Invariants: safetensors headers go through the one validating parser and tensors are read straight
into the tensor that holds them; pickles load with ``weights_only=True``; automap's own stores are
never read as checkpoints.
"""

from __future__ import annotations

import abc
import io
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch

from automap.errors import CheckpointError, FormatError
from automap.offload import MappedFile, load_json, open_for_map, read_regular
from automap.offload.opening import read_into
from automap.offload.format import header_of
from automap.loading.pickles import load_pickle

log = logging.getLogger(__name__)

# A shard index lists each tensor in ~60 bytes: room for millions of tensors.
MAX_INDEX_BYTES = 256 << 20


@dataclass(frozen=True)
class Stored:
    """One tensor of a checkpoint: its key, file, dtype, shape and size; ``offset`` is where
    its bytes start in the file when the format stores them raw (safetensors)."""

    key: str
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    offset: int = 0


class Reader(abc.ABC):
    """One checkpoint file: its tensors, read one at a time.

    Attributes:
        in_place: whether its tensors are raw bytes in the file that the offload runtime can
            map and read where they are (see :class:`automap.offload.CheckpointSource`).
    """

    in_place = False

    def __init__(self, path: Path):
        self.path = path
        self.tensors: dict[str, Stored] = {}
        self.extras: dict[str, Any] = {}  # modules' extra state that is no tensor (pickles only)

    @abc.abstractmethod
    def read(self, stored: Stored) -> torch.Tensor:
        """``stored`` on CPU as stored, in memory of its own."""

    def release(self) -> None:
        """Close what this reader holds open to read (it opens it again when asked to read)."""
        return None

    def close(self) -> None:
        return None


class SafetensorsReader(Reader):
    """A safetensors file: its header read and validated through one descriptor, the file's
    identity (device, inode, size, modification time) recorded, the descriptor closed again (a
    folder of thousands of shards holds no descriptors while it is indexed). Every later open,
    to read tensors or to map them in place, is checked to be that very file, unchanged; else
    :class:`CheckpointError` names it, and nothing of the other file is read."""

    in_place = True

    def __init__(self, path: Path):
        super().__init__(path)
        fd = open_for_map(path)  # a FormatError is a CheckpointError too
        try:
            header = header_of(fd, path)
            info = os.fstat(fd)
        finally:
            os.close(fd)
        self.identity = (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)
        self.tensors = {
            key: Stored(key, path, info.torch_dtype, info.shape, info.nbytes, info.begin)
            for key, info in header.tensors.items()
        }
        self._handle: io.FileIO | None = None

    def open_checked(self) -> int:
        """A new read-only descriptor of the file whose header was read (the caller closes it).

        Raises:
            CheckpointError: the name now holds another file, or the file changed since.
        """
        fd = open_for_map(self.path)
        info = os.fstat(fd)
        if (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns) != self.identity:
            os.close(fd)
            raise CheckpointError(
                f"{self.path} was replaced or changed since automap read its header; nothing of it "
                "was read. Leave the checkpoint alone while it loads, and load again"
            )
        return fd

    def map(self, keys: list[str]) -> MappedFile:
        """The file mapped (for its tensors read in place), through one checked descriptor."""
        return MappedFile(self.path, keys, fd=self.open_checked(), identity=self.identity[:2])

    def read(self, stored: Stored) -> torch.Tensor:
        out = torch.empty(stored.shape, dtype=stored.dtype)
        if stored.nbytes:
            self._read_into(stored, memoryview(out.reshape(-1).view(torch.uint8).numpy()))  # type: ignore[arg-type]
        return out

    def _read_into(self, stored: Stored, view: memoryview) -> None:
        if self._handle is None:
            self._handle = io.FileIO(self.open_checked(), "rb", closefd=True)
        done = read_into(self._handle.fileno(), view, stored.offset)
        if done < len(view):
            raise CheckpointError(
                f"{self.path} ended while reading {stored.key!r} ({done} of "
                f"{len(view)} bytes); the file was truncated during the load"
            )

    def release(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None

    def close(self) -> None:
        self.release()


class PickleReader(Reader):
    def __init__(self, path: Path):
        super().__init__(path)
        self._data, self.extras = load_pickle(path)
        self.tensors = {
            k: Stored(k, path, t.dtype, tuple(t.shape), t.numel() * t.element_size())
            for k, t in self._data.items()
        }

    def read(self, stored: Stored) -> torch.Tensor:
        return self._data[stored.key].clone()

    def close(self) -> None:
        self._data = {}


READERS: dict[str, type[Reader]] = {
    ".safetensors": SafetensorsReader,
    ".bin": PickleReader,
    ".pt": PickleReader,
    ".pth": PickleReader,
    ".ckpt": PickleReader,
}
SAFETENSORS = ".safetensors"
INDEX_SUFFIX = (
    ".index.json"  # a Hugging Face shard index: model.safetensors.index.json, pytorch_model.bin.index.json
)


class Checkpoint:
    """The tensors of a checkpoint (one file or a folder of shards), read one at a time.

    Example:
        >>> with open_checkpoint("model.safetensors") as ckpt:
        ...     ckpt.read("fc.weight").shape
    """

    def __init__(self, path: Path, tensors: Mapping[str, Stored], readers: Mapping[Path, Reader]):
        self.path = path
        self.tensors = dict(tensors)
        self.readers = dict(readers)
        self.extras = {k: v for reader in self.readers.values() for k, v in reader.extras.items()}
        self._last: Reader | None = None  # the one reader that may hold a file open (see read)

    def extra_state(self, key: str) -> Any:
        """The extra state saved under ``key`` (what a module's ``get_extra_state`` returned):
        a tensor, or in a pickle any value ``torch.load(weights_only=True)`` reads."""
        return self.extras[key] if key in self.extras else self.read(key)

    @property
    def total_bytes(self) -> int:
        return sum(s.nbytes for s in self.tensors.values())

    def read(self, key: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The tensor ``key`` on CPU in ``dtype`` (default: as stored), in memory of its own."""
        stored = self.tensors[key]
        reader = self.readers[stored.file]
        if self._last is not None and self._last is not reader:
            self._last.release()  # one file open at a time, whatever the number of shards (no EMFILE)
        self._last = reader
        return reader.read(stored).to(dtype or stored.dtype)

    def map(self, file: Path, keys: list[str]) -> MappedFile:
        """``file`` (a safetensors file of this checkpoint) mapped for ``keys``, read in place:
        checked to be the file whose header was read.

        Raises:
            CheckpointError: it was replaced or changed since, or it is not a safetensors file.
        """
        reader = self.readers[file]
        if not isinstance(reader, SafetensorsReader):
            raise CheckpointError(f"{file} is not a safetensors file; its tensors cannot be read in place")
        return reader.map(keys)

    def same_values(self, a: str, b: str, chunk: int = 16 << 20) -> bool:
        """Whether keys ``a`` and ``b`` hold the same dtype, shape and bytes: raw tensors are
        compared ``chunk`` bytes at a time, never held whole."""
        first, second = self.tensors[a], self.tensors[b]
        if (first.dtype, first.shape) != (second.dtype, second.shape):
            return False
        if not (self.in_place(a) and self.in_place(b)):
            return torch.equal(self.read(a), self.read(b))
        with open(first.file, "rb") as one, open(second.file, "rb") as other:
            for start in range(0, first.nbytes, chunk):
                length = min(chunk, first.nbytes - start)
                if os.pread(one.fileno(), length, first.offset + start) != os.pread(
                    other.fileno(), length, second.offset + start
                ):
                    return False
        return True

    def in_place(self, key: str) -> bool:
        """Whether tensor ``key`` can be read where it is in its file (safetensors)."""
        return self.readers[self.tensors[key].file].in_place

    def close(self) -> None:
        for reader in self.readers.values():
            reader.close()

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
        raise CheckpointError(
            f"checkpoint {root} does not exist; pass a .safetensors/.bin file or a folder of shards"
        )
    if root.is_dir():
        files, expected = _files_in(root)
    elif root.name.endswith(INDEX_SUFFIX):
        files, expected = _indexed(root)  # the index names the shards beside it
    else:
        files, expected = [root], None
    tensors: dict[str, Stored] = {}
    readers: dict[Path, Reader] = {}
    for file in files:
        reader = readers[file] = _reader_for(file)
        for key, stored in reader.tensors.items():
            if expected is not None:
                if Path(expected.get(key, "")).name == file.name:
                    tensors[key] = stored  # the index says which shard holds a key
                else:
                    tensors.setdefault(key, stored)
            elif key in tensors:
                raise CheckpointError(
                    f"tensor {key!r} is in both {tensors[key].file.name} and {file.name} in {root}, and there is no "
                    "index saying which to use; remove the stale copy, or pass the one file you mean"
                )
            else:
                tensors[key] = stored
    if expected is not None:
        _check_index(root, expected, tensors)
    return Checkpoint(root, tensors, readers)


def _reader_for(file: Path) -> Reader:
    reader = READERS.get(file.suffix)
    if reader is None:
        raise CheckpointError(
            f"{file} is not a checkpoint automap reads; give a file ending in "
            f"{', '.join(READERS)} or a folder of them"
        )
    return reader(file)


# What transformers' from_pretrained reads in a model folder, in its order: the first present wins
# (hub repos often keep older .bin shards, variants or a consolidated copy beside the safetensors).
CANONICAL = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
# Weights that are not the model's: a PEFT adapter saved beside it.
NOT_MODEL = re.compile(r"adapter_model\.(safetensors|bin)")


def _files_in(folder: Path) -> tuple[list[Path], dict[str, str] | None]:
    """The checkpoint files of ``folder``: transformers' own file names first (:data:`CANONICAL`),
    else a shard index, else every checkpoint file of the first format present (safetensors,
    then pickles), never training states (:data:`NOT_WEIGHTS`), adapters or old automap stores."""
    for name in CANONICAL:
        found = folder / name
        if found.is_file():
            log.debug("%s: reading %s, as from_pretrained does", folder, name)
            return _indexed(found) if name.endswith(INDEX_SUFFIX) else ([found], None)
    indexes = sorted(
        folder.glob(f"*{INDEX_SUFFIX}"),
        key=lambda p: (not p.name.endswith(SAFETENSORS + INDEX_SUFFIX), p.name),
    )
    if indexes:
        return _indexed(indexes[0])
    skip = _legacy_store_files(folder)
    for pattern in (f"*{SAFETENSORS}", *(f"*{s}" for s in READERS if s != SAFETENSORS)):
        files = sorted(
            p
            for p in folder.glob(pattern)
            if p.is_file()
            and p.name not in skip
            and not _not_weights(p.name)
            and not NOT_MODEL.fullmatch(p.name)
        )
        if files:
            return files, None
    raise CheckpointError(
        f"folder {folder} holds no checkpoint: no *.index.json, *.safetensors, *.bin, *.pt or *.pth"
        f"{_foreign_note(folder)}"
    )


# Weights of other frameworks that hub folders hold instead of PyTorch's, and how to get those.
FOREIGN = {
    ".h5": ("TensorFlow", "from_tf=True"),
    ".msgpack": ("Flax", "from_flax=True"),
    ".gguf": ("GGUF", "gguf_file=..."),
}


def _foreign_note(folder: Path) -> str:
    """What a folder without PyTorch weights holds instead (``tf_model.h5``), and how to
    convert it: empty when it holds none of :data:`FOREIGN`."""
    found = sorted(p.name for p in folder.iterdir() if p.suffix in FOREIGN and p.is_file())
    if not found:
        return ""
    framework, flag = FOREIGN[Path(found[0]).suffix]
    return (
        f"; it holds {framework} weights ({', '.join(found[:3])}), which automap does not read. Convert them once "
        f"with transformers (AutoModel...from_pretrained(folder, {flag}).save_pretrained(folder); transformers 5 "
        "reads only GGUF so, TensorFlow and Flax weights need transformers 4.x) and load the safetensors it writes"
    )


def _indexed(index: Path) -> tuple[list[Path], dict[str, str]]:
    """The shard files a Hugging Face index names (beside it), and its ``weight_map``."""
    folder = index.parent
    weight_map = _read_index(index)
    names = sorted(set(weight_map.values()))
    outside = [n for n in names if not _plain_name(n)]
    if outside:
        raise CheckpointError(
            f"index {index} names {outside[0]!r}, which is not a file name inside {folder}; shard indexes "
            "list plain file names (no folders, no '..'). Fix the index, or load the shards from their own folder"
        )
    missing = [n for n in names if not (folder / n).exists()]
    if missing:
        raise CheckpointError(
            f"index {index} names {len(missing)} file(s) that are not in {folder}, first "
            f"{missing[:3]}; copy the missing shards there or fix the index"
        )
    odd = [n for n in names if not (folder / n).is_file()]
    if odd:
        raise CheckpointError(
            f"index {index} names {odd[0]!r}, which is in {folder} but is no regular file (a "
            "folder, pipe or device); put the shard file there under that name, or fix the index"
        )
    return [folder / n for n in names], weight_map


# What training writes beside the weights (transformers' Trainer, accelerate's save_state): pickles
# of arguments, optimizer and scheduler states, random states. Never weights; their pickles hold
# objects a safe load refuses.
NOT_WEIGHTS = re.compile(
    r"(training_args|optimizer(_\d+)?|scheduler(_\d+)?|scaler|rng_state(_\d+)?|"
    r"random_states(_\d+)?)\.(bin|pt|pth|pkl)"
)


def _not_weights(name: str) -> bool:
    """Whether ``name`` is a file training writes beside a model's weights (:data:`NOT_WEIGHTS`)."""
    return NOT_WEIGHTS.fullmatch(name) is not None


def _plain_name(name: str) -> bool:
    """A file name that stays in its folder: no separators, no '..', not absolute."""
    return bool(name) and name == Path(name).name and name not in (".", "..") and "\\" not in name


def _legacy_store_files(folder: Path) -> set[str]:
    """Files an automap offload store of before version 0.2 wrote straight into ``folder``
    (listed by its ``automap-index.json``): they are automap's copies, never the checkpoint.
    Stores of today live in ``automap-store-*`` folders, which a glob of ``folder`` never reads."""
    index = folder / "automap-index.json"
    if not index.is_file():
        return set()
    try:
        data = load_json(read_regular(index, MAX_INDEX_BYTES), f"old store index {index} is damaged", "")
    except (OSError, FormatError):
        return set()
    tensors = data.get("tensors") if isinstance(data, dict) else None
    entries = tensors.values() if isinstance(tensors, dict) else ()
    names = [e.get("file") for e in entries if isinstance(e, dict)]
    found = {f for f in names if isinstance(f, str) and _plain_name(f)}
    if found:
        log.info(
            "%s: not reading %d file(s) of an old automap offload store (%s)",
            folder,
            len(found),
            ", ".join(sorted(found)[:3]),
        )
    return found


def _read_index(path: Path) -> dict[str, str]:
    """The ``weight_map`` of a shard index (``model.safetensors.index.json``,
    ``pytorch_model.bin.index.json``), read by the one JSON reader and checked: an object of
    tensor name -> file name.

    Raises:
        FormatError: (a CheckpointError) the index cannot be read, is not JSON, or has no such map.
    """
    hint = "save the checkpoint again, or fix or remove the index"
    try:
        raw = read_regular(path, MAX_INDEX_BYTES)
    except OSError as exc:
        raise FormatError(f"index {path} cannot be read ({exc.strerror or exc}); {hint}") from exc
    data = load_json(raw, f"index {path} is not a valid shard index", hint)
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise FormatError(
            f"index {path} is not a valid shard index: it needs a 'weight_map' object of tensor name "
            f"-> file name; {hint}"
        )
    return weight_map


def _check_index(root: Path, weight_map: Mapping[str, str], tensors: Mapping[str, Stored]) -> None:
    absent = [k for k, f in weight_map.items() if k not in tensors or tensors[k].file.name != Path(f).name]
    if absent:
        raise CheckpointError(
            f"the index of {root} lists {len(absent)} tensor(s) that are not in the file it names, first "
            f"{absent[:3]}; the shards and the index come from different saves"
        )
