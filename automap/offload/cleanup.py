"""Removing automap's own offload stores (``automap clean DIR``, :func:`automap.clean`), and
nothing else: a store is removed only when it is a real directory of this user's holding automap's
manifest and nothing but its own single-link files, and its lock can be taken (held while it is
removed). ``offload_dir`` itself and everything else in it are never touched.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from automap.errors import OffloadError
from automap.offload.manifest import FORMAT, MANIFEST, MAX_MANIFEST_BYTES, plain_file
from automap.offload.store import STORE_PREFIX
from automap.offload.store_files import StoreDir, is_temp_of, remove_folders
from automap.offload.store_lock import LOCK, StoreLock, holder_of
from automap.sizes import format_bytes
from automap.userfiles import load_json

STORE_NAME = re.compile(rf"^{re.escape(STORE_PREFIX)}[0-9a-f]{{16}}-\d+$")


@dataclass
class CleanResult:
    """What :func:`clean` did: the stores removed (path, bytes), and those left with why."""

    removed: list[tuple[Path, int]] = field(default_factory=list)
    kept: list[tuple[Path, str]] = field(default_factory=list)

    @property
    def freed(self) -> int:
        """Bytes of the files removed."""
        return sum(size for _, size in self.removed)

    def summary(self) -> str:
        """What was removed and left, one line each, then the bytes freed."""
        lines = [f"removed {path} ({format_bytes(size)})" for path, size in self.removed]
        lines += [f"left {path}: {why}" for path, why in self.kept]
        lines.append(
            f"freed {format_bytes(self.freed)} ({len(self.removed)} store(s) removed)"
            if self.removed
            else "no automap store removed; nothing freed"
        )
        return "\n".join(lines)


def stores_in(path: str | os.PathLike[str]) -> list[Path]:
    """The store-named entries directly under ``path`` (or ``path`` itself when it is one)."""
    root = Path(path)
    if STORE_NAME.match(root.name):
        return [root]
    return sorted(root / name for name in os.listdir(root) if STORE_NAME.match(name))


def store_size(directory: str | os.PathLike[str]) -> int:
    """Bytes of the regular files directly in a store directory (0 when it cannot be read)."""
    total = 0
    try:
        with os.scandir(directory) as entries:
            for entry in entries:
                if entry.is_file(follow_symlinks=False):
                    total += entry.stat(follow_symlinks=False).st_size
    except OSError:
        return 0
    return total


def clean(path: str | os.PathLike[str] = "offload") -> CleanResult:
    """Remove the offload stores automap made under ``path`` (an ``offload_dir``, or one
    ``automap-store-*`` folder), and nothing else: not a file or folder of the user's beside
    or inside them, not a link, not a store that a live process has locked.

    Returns:
        A :class:`CleanResult`; ``print(result.summary())`` says what was removed, what was
        left and why, and the bytes freed.

    Raises:
        OffloadError: ``path`` does not exist or is not a folder.

    Example:
        >>> automap.undispatch(model)
        >>> print(automap.clean("offload").summary())
        removed offload/automap-store-3f1c0a9b2d4e5f60-0 (41.91 MiB)
        freed 41.91 MiB (1 store(s) removed)
    """
    root = Path(path)
    if not os.path.lexists(root):
        raise OffloadError(
            f"{root} does not exist; give the offload_dir a model was dispatched with "
            "(e.g. automap clean offload)"
        )
    if not root.is_dir():
        raise OffloadError(
            f"{root} is a file, not a folder; give the offload_dir a model was dispatched with"
        )
    result = CleanResult()
    for directory in stores_in(root):
        why = _remove_store(directory, result)
        if why:
            result.kept.append((directory, why))
    return result


def _remove_store(directory: Path, result: CleanResult) -> str:
    """Remove one store and record it in ``result``; or return why it is left."""
    if os.path.islink(directory):
        return "a symbolic link, not a store of automap's (left, and what it points to)"
    folder = StoreDir.open(directory)
    if folder is None:
        return "not a folder of this user's"
    lock = StoreLock.take(folder)  # first: nothing can start writing in it while it is examined
    if lock is None:
        why = f"in use by {holder_of(folder)} (a dispatched model); undispatch it first"
        folder.close()
        return why
    try:
        owned = _owned_files(folder)
        if owned is None:
            return f"no manifest of automap's ({MANIFEST}) in it: not a store of automap's"
        names = folder.names()
        foreign = [n for n in names if not ((n in owned or is_temp_of(n, owned)) and folder.is_own_file(n))]
        if foreign:
            more = f" and {len(foreign) - 3} more" if len(foreign) > 3 else ""
            listed = ", ".join(sorted(foreign)[:3])
            return f"holds what is not automap's ({listed}{more}); nothing in it removed"
        size = sum(info.st_size for n in names if (info := folder.lstat(n)) is not None)
        folder.remove(sorted(set(names) - {LOCK}) + [LOCK])  # the lock file, which marks a store, last
        remove_folders([directory])  # while the lock is held: nobody adopts it meanwhile
    finally:
        lock.release()
        folder.close()
    if os.path.lexists(directory):
        return "could not be removed whole (see the log)"
    result.removed.append((directory, size))
    return ""


def _owned_files(folder: StoreDir) -> set[str] | None:
    """The names a store's manifest makes automap's (its files, the manifest, the lock file),
    whatever the manifest's version; None when there is no manifest of automap's format."""
    try:
        data = load_json(folder.read(MANIFEST, MAX_MANIFEST_BYTES), "manifest", "", OffloadError)
    except (OSError, OffloadError):
        return None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        return None
    files = data.get("files") if isinstance(data.get("files"), list) else []
    tensors = data.get("tensors") if isinstance(data.get("tensors"), dict) else {}
    named = [e.get("file") for e in tensors.values() if isinstance(e, dict)]
    return {f for f in [*files, *named] if plain_file(f)} | {MANIFEST, LOCK}
