"""Checkpoint tensors read in place: a user's safetensors files, mapped copy-on-write, opened
read-only, never written and never copied. A file changed on disk is followed, kept or refused
by what changed (docs/offload-safety.md).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Mapping

from automap.errors import AutomapError, OffloadError
from automap.offload.format import header_of
from automap.offload.mapped import MappedFile, Signature
from automap.offload.source import MappedSource

log = logging.getLogger(__name__)


class CheckpointSource(MappedSource):
    """Tensors of safetensors checkpoint files, by their names in the model.

    Args:
        entries: model tensor name -> (checkpoint file, key inside it).
        files: files already mapped (by the reader that read their headers), by the paths of
            ``entries``; the rest are opened here.

    Raises:
        FormatError: a file is not valid safetensors.
        OffloadError: a file lacks a key.

    Example:
        >>> source = CheckpointSource({"lm_head.weight": (Path("model.safetensors"), "lm_head.weight")})
    """

    kind = "checkpoint file"

    def __init__(
        self, entries: Mapping[str, tuple[Path, str]], files: Mapping[Path, MappedFile] | None = None
    ):
        resolved = {Path(p): Path(p).resolve() for p, _ in entries.values()}
        super().__init__(
            {n: (resolved[Path(p)], k) for n, (p, k) in entries.items()},
            {resolved[Path(p)]: mapped for p, mapped in (files or {}).items()},
        )

    @property
    def fix(self) -> str:
        return (
            "restore the checkpoint, or load the model again (automap.undispatch(model), then "
            "automap.load); automap reads offloaded weights from the checkpoint in place"
        )

    def accept_change(self, mapped: MappedFile, now: Signature) -> None:
        try:  # the header of the file mapped, not of whatever its name names now (moved, replaced)
            header = header_of(mapped.fd, mapped.path)
        except AutomapError as exc:
            raise OffloadError(
                f"{self.kind} {mapped.path} changed after automap mapped it and is no longer "
                f"readable ({exc}); {self.fix}"
            ) from exc
        moved = [k for k in mapped.keys if header.tensors.get(k) != mapped.info(k)]
        if moved:
            raise OffloadError(
                f"{self.kind} {mapped.path} was rewritten with another layout (tensor {moved[0]!r} "
                f"moved) while automap read offloaded weights from it; {self.fix}"
            )
        if mapped.written_bytes():
            raise OffloadError(
                f"{self.kind} {mapped.path} was rewritten while tensors read from it had been changed "
                f"in memory; the two cannot be merged: {self.fix}"
            )
        log.warning(
            "%s %s was rewritten in place with the same layout; the model now uses its new contents",
            self.kind,
            mapped.path,
        )

    def close(self, discard: bool = False) -> None:
        return None  # nothing was created: the files are the user's
