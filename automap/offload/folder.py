"""Which folder the offload store of a plan's disk units goes to, and the one error dispatch and
load raise when there is none or it is too small.

A :class:`~automap.Plan` records the ``offload_dir`` it was sized for (the disk budget is the
free space there). Dispatching or loading it without a folder uses that one; with another
folder, the room there is checked first, before anything is written, because the plan's disk
budget says nothing about it.
"""

from __future__ import annotations

import os
from pathlib import Path

from automap.devices import free_disk_bytes
from automap.errors import OffloadDirError
from automap.planning import Plan
from automap.sizes import format_bytes


def no_offload_dir(what: str, why: str = "") -> OffloadDirError:
    """The error for weights that must be written to disk with no folder to write them to:
    ``what`` names them (``"2 units (fc1, fc2)"``), ``why`` says why they need writing."""
    return OffloadDirError(
        f"the plan offloads {what} to disk{why} but no offload_dir was given; pass "
        "offload_dir='path/to/dir' or raise max_memory so everything fits"
    )


def store_folder(plan: Plan, given: str | os.PathLike[str] | None, needed_bytes: int) -> Path | None:
    """The folder for the store of ``plan``'s disk units: ``given``, else the folder the plan
    was sized for (None when neither names one).

    Args:
        needed_bytes: what the store will hold (the weights of the disk units that must be
            written); checked against the free space of ``given`` when the plan was sized for
            another folder.

    Raises:
        OffloadDirError: ``given`` is not the plan's folder and has less free space than
            ``needed_bytes``; nothing was written.
    """
    if given is None:
        return None if plan.offload_dir is None else Path(plan.offload_dir)
    folder = Path(given)
    if plan.offload_dir is None or needed_bytes == 0 or same_folder(folder, plan.offload_dir):
        return folder
    free = free_disk_bytes(folder)
    if needed_bytes > free:
        raise OffloadDirError(
            f"the plan was sized for offload_dir {plan.offload_dir!r}, but it is given {str(folder)!r}, which has "
            f"{format_bytes(free)} free for the {format_bytes(needed_bytes)} its disk units need; pass "
            f"offload_dir={plan.offload_dir!r} (or none: the plan's folder is used), free "
            f"{format_bytes(needed_bytes - free)} there, or plan again with offload_dir={str(folder)!r}"
        )
    return folder


def stored_bytes(plan: Plan) -> int:
    """Weight bytes of the units on a tier that stores only (disk): what a store under
    ``offload_dir`` holds at most."""
    return sum(u.weight_bytes for u, p in zip(plan.units, plan.placements) if p.in_store)


def same_folder(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> bool:
    """Whether two paths name one folder (compared resolved: links and ``..`` followed)."""
    return os.path.realpath(a) == os.path.realpath(b)


def recorded_folder(offload_dir: str | os.PathLike[str] | None) -> str | None:
    """``offload_dir`` as a plan records it: absolute, so the plan's JSON names the same folder
    wherever it is read; None for none."""
    return os.path.abspath(offload_dir) if offload_dir else None
