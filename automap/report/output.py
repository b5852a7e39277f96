"""Writing a report file the user named (plan JSON, figures, benchmark rows) so that a failure —
a full disk, a quota, Ctrl-C — leaves the file that was there before untouched: the bytes go to
a temporary file beside it, which replaces it only once complete."""

from __future__ import annotations

import os
import stat
import tempfile
from contextlib import suppress
from pathlib import Path
from typing import BinaryIO, Callable


def replace_whole(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """Write ``path`` through ``write`` (given the open file), all or nothing. A symbolic link
    is written through, to the file it names; a file that was there keeps its permissions.

    Raises:
        OSError: the file could not be written; ``path`` is as it was and no temporary is left.
    """
    target = path.resolve() if path.is_symlink() else path
    handle, temp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(handle, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        try:
            mode = stat.S_IMODE(os.stat(target).st_mode)
        except FileNotFoundError:
            mode = 0o644
        os.chmod(temp, mode)
        os.replace(temp, target)
    except BaseException:
        with suppress(OSError):
            os.unlink(temp)
        raise
