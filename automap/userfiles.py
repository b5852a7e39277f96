"""Files a user names: the one way automap reads them (:func:`read_json_file`: non-blocking, a
regular file checked on its descriptor, size-capped, decoded by :func:`load_json` raising only
AutomapErrors), and the one check of a path it will write (:func:`check_output_path`), made
before any long work.
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from automap.errors import AutomapError, FormatError, ReportError

# A plan JSON of 100,000 units is ~30 MB; configs and indexes are far smaller. Parsed, JSON takes
# several times its size in Python objects: this keeps a hostile file's cost well under 1 GiB.
MAX_JSON_BYTES = 64 * 2**20
# No offset, size or checksum in a valid file has more digits than this (2**64 has 20); a longer
# number only costs time (Python refuses ints of over 4,300 digits with a ValueError).
MAX_DIGITS = 40
# No config, index, manifest or plan nests deeper than a dozen levels. Python's parser recurses
# once per level: thousands of levels reach the recursion limit, where a finalizer that runs
# meanwhile fails too, so depth is counted before parsing.
MAX_DEPTH = 100
_STEPS = np.zeros(256, np.int8)  # each byte's change of depth: +1 opens, -1 closes
_STEPS[[ord("["), ord("{")]], _STEPS[[ord("]"), ord("}")]] = 1, -1
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)


class _Refused(ValueError):
    """A number or object :func:`load_json` will not read (raised from the parser's hooks)."""


def _int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_DIGITS:
        raise _Refused(f"a number of {len(text)} digits (at most {MAX_DIGITS} are read)")
    return int(text)


def _float(text: str) -> float:
    value = float(text) if len(text) <= 4 * MAX_DIGITS else float("inf")
    if value in (float("inf"), float("-inf")):
        raise _Refused(f"the number {text[:20]}{'...' if len(text) > 20 else ''} is out of range")
    return value


def _constant(text: str) -> Any:
    raise _Refused(f"{text} is not a JSON number")


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object, unless it names a key twice: Python's parser keeps the last value and
    other readers may keep the first, so which value a repeated key means is a guess."""
    found: dict[str, Any] = {}
    for key, value in pairs:
        if key in found:
            raise _Refused(f"it names {key!r} twice; readers disagree on which one counts")
        found[key] = value
    return found


def too_deep(raw: bytes) -> bool:
    """Whether the arrays and objects of the JSON text ``raw`` nest deeper than
    :data:`MAX_DEPTH` (brackets inside strings not counted), found without parsing it."""
    if raw.count(b"[") + raw.count(b"{") <= MAX_DEPTH:
        return False
    steps = _STEPS[np.frombuffer(_STRING.sub(b"", raw), np.uint8)]
    return int(np.cumsum(steps, dtype=np.int64).max(initial=0)) > MAX_DEPTH


def load_json(raw: bytes | str, what: str, hint: str, error: type[AutomapError] = FormatError) -> Any:
    """Parse ``raw`` as JSON, raising only ``error`` — never ``RecursionError``,
    ``OverflowError``, ``UnicodeDecodeError`` or the ``ValueError`` of a huge number. The
    message is ``what`` (the file and its problem: "x.json is not a valid shard index"), the
    reason, then ``hint`` (the fix).

    Example:
        >>> load_json(b'{"a": [1, 2]}', "index x.json is not valid", "save it again")
        {'a': [1, 2]}
    """
    try:
        if too_deep(raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else bytes(raw)):
            raise _Refused(f"its JSON nests deeper than {MAX_DEPTH} levels")
        text = raw.decode("utf-8") if isinstance(raw, (bytes, bytearray)) else raw
        return json.loads(
            text, parse_int=_int, parse_float=_float, parse_constant=_constant, object_pairs_hook=_object
        )
    except _Refused as exc:
        reason = str(exc)
    except RecursionError:
        reason = "its JSON is nested too deeply to read"
    except UnicodeDecodeError as exc:
        reason = f"its bytes are not UTF-8 text: byte {exc.object[exc.start]:#04x} at offset {exc.start}"
    except (ValueError, TypeError) as exc:
        reason = f"not JSON: {str(exc)[:200]}"
    raise error(f"{what} ({reason}){'; ' + hint if hint else ''}")


def read_regular(
    path: str | os.PathLike[str], limit: int, *, follow: bool = True, dir_fd: int | None = None
) -> bytes:
    """The bytes of the regular file ``path`` (at most ``limit`` of them).

    Never blocks on a FIFO or device (opened non-blocking, refused unless regular); with
    ``follow=False`` a symbolic link is refused too.

    Raises:
        OSError: the file cannot be opened or read, is a folder (``EISDIR``), is not a regular
            file (``EINVAL``), or is larger than ``limit`` (``EFBIG``).
    """
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | (0 if follow else os.O_NOFOLLOW)
    fd = os.open(path, flags, dir_fd=dir_fd)
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise OSError(errno.EISDIR, "is a folder, not a file", os.fspath(path))
        if not stat.S_ISREG(info.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", os.fspath(path))
        if info.st_size > limit:
            raise OSError(errno.EFBIG, f"larger than {limit} bytes", os.fspath(path))
        chunks, left = [], limit + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        if left <= 0:
            raise OSError(errno.EFBIG, f"larger than {limit} bytes", os.fspath(path))
        return b"".join(chunks)
    finally:
        os.close(fd)


# What each failure to open a file means for the person who named it.
_REASONS = {
    errno.ENOENT: "it does not exist",
    errno.ENOTDIR: "a folder on its path is a file",
    errno.EISDIR: "it is a folder, not a file",
    errno.EINVAL: "it is not a regular file (a FIFO, socket or device)",
    errno.EFBIG: "it is larger than automap reads ({limit:,} bytes)",
    errno.ELOOP: "its path is a loop of symbolic links",
    errno.ENAMETOOLONG: "its name is too long for the file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
}


def describe_os_error(exc: OSError, limit: int = MAX_JSON_BYTES) -> str:
    """Why ``exc`` happened, in words a user can act on."""
    reason = _REASONS.get(exc.errno or 0)
    return reason.format(limit=limit) if reason else (exc.strerror or str(exc))


def as_path(value: object, field: str, error: type[AutomapError]) -> Path:
    """``value`` as a path: a ``str`` or a ``PathLike`` of one, not empty, without NUL.

    Raises:
        ``error``: ``value`` is bytes, another type, empty or holds a NUL, named ``field``.
    """
    text = os.fspath(value) if isinstance(value, (str, os.PathLike)) else None
    if not isinstance(text, str):
        raise error(
            f"{field}={_short(value)}: give a path as a str or pathlib.Path, not a {type(value).__name__}"
        )
    if not text or "\0" in text:
        raise error(
            f"{field}={_short(value)} is no path ({'empty' if not text else 'it holds a NUL character'}); "
            "name a file or folder"
        )
    return Path(text)


def _short(value: object) -> str:
    text = repr(value) if not isinstance(value, int) or abs(value) < 10**40 else "a huge integer"
    return text if len(text) <= 80 else text[:77] + "..."


def read_bytes(
    path: str | os.PathLike[str],
    what: str,
    *,
    hint: str,
    error: type[AutomapError],
    limit: int = MAX_JSON_BYTES,
) -> bytes:
    """The bytes of the regular file ``path`` (:func:`read_regular`), any failure an ``error``
    naming ``what``, the path, why, and ``hint``."""
    try:
        return read_regular(path, limit)
    except OSError as exc:
        raise error(
            f"cannot read {what} {os.fspath(path)!r}: {describe_os_error(exc, limit)}; {hint}"
        ) from None


def read_json_file(
    path: str | os.PathLike[str],
    what: str,
    *,
    hint: str,
    error: type[AutomapError],
    limit: int = MAX_JSON_BYTES,
) -> Any:
    """The JSON value in the file ``path``, read once (:func:`read_regular`) and decoded by
    :func:`load_json`.

    Args:
        path: the file a user named.
        what: what it is, for messages ("plan JSON", "config file").
        hint: the fix, appended to every message.
        error: the :class:`~automap.errors.AutomapError` subclass to raise.
        limit: the most bytes read.

    Raises:
        ``error``: the path is missing, a folder, a FIFO or device, too large, a link loop, a
            name too long; or its bytes are not UTF-8 JSON (nested too deeply, numbers out of
            range, a key twice).

    Example:
        >>> read_json_file("plan.json", "plan JSON", hint="write it again", error=PlanError)
    """
    raw = read_bytes(path, what, hint=hint, error=error, limit=limit)
    return load_json(raw, f"{what} {os.fspath(path)!r} is not valid JSON", hint, error)


def check_output_path(path: object, what: str, suffixes: Sequence[str] = ()) -> Path:
    """``path`` as a :class:`~pathlib.Path` automap can write ``what`` to, checked before any
    long work: a str or PathLike, a known suffix (when ``suffixes`` are given), an existing and
    writable folder, a name that is not a folder, not a loop of links and not too long.

    Raises:
        ReportError: which of these fails, and what to do.
    """
    target = as_path(path, what, ReportError)
    shown = f"cannot write the {what} to {str(target)!r}"
    if suffixes and target.suffix.lower().lstrip(".") not in suffixes:
        raise ReportError(
            f"cannot draw a figure as {target.name!r}: the suffix must be one of "
            f"{', '.join('.' + f for f in suffixes)}, e.g. plan.png"
        )
    folder = target.parent
    try:
        folder_info = os.stat(folder)
    except OSError as exc:
        raise ReportError(
            f"{shown}: folder {str(folder)!r} {_folder_reason(exc)}; create it or choose another path"
        ) from None
    if not stat.S_ISDIR(folder_info.st_mode):
        raise ReportError(f"{shown}: {str(folder)!r} is not a folder; choose another path")
    _check_name(target, shown, suffixes)
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ReportError(f"{shown}: folder {str(folder)!r} is not writable; choose another path")
    return target


def _folder_reason(exc: OSError) -> str:
    return "does not exist" if exc.errno == errno.ENOENT else f"cannot be used ({describe_os_error(exc)})"


def _check_name(target: Path, shown: str, suffixes: Sequence[str]) -> None:
    """The name itself: not too long, not a folder, not a link automap cannot resolve."""
    try:
        info = os.lstat(target)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise ReportError(f"{shown}: {describe_os_error(exc)}; choose another name") from None
    if stat.S_ISLNK(info.st_mode):
        try:
            info = os.stat(target)
        except FileNotFoundError:
            return  # a dangling link is replaced, as a missing file is created
        except OSError as exc:
            raise ReportError(
                f"{shown}: {describe_os_error(exc)}; remove the link or choose another name"
            ) from None
    if stat.S_ISDIR(info.st_mode):
        example = str(target / ("plan." + (suffixes[0] if suffixes else "json")))
        raise ReportError(f"{shown}: it is a folder; name a file in it, e.g. {example!r}")
    if not stat.S_ISREG(info.st_mode):
        raise ReportError(
            f"{shown}: it is not a regular file (a FIFO, socket or device); choose another name"
        )
