"""The weight sources of the built-in storage tiers, named by their entries in
:mod:`automap.kinds`: what :func:`automap.runtime.place.build_source` asks a tier for when the
plan streams units from it.

Each is ``(tensors, groups, offload_dir, execution) -> WeightSource``: ``tensors`` are the
model's (by name), ``groups`` the ones this tier holds (tensor name -> unit name), and
``execution`` the name of the device the units compute on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

import torch

from automap.kinds import attach, kind_of
from automap.offload import RamSource, WeightSource
from automap.runtime.place import write_store


def ram_source(
    tensors: Mapping[str, torch.Tensor],
    groups: Mapping[str, str],
    offload_dir: str | Path | None,
    execution: str,
) -> WeightSource:
    """CPU RAM: the tensors where they are, pinned when the execution device copies from
    pinned memory asynchronously (a GPU)."""
    return RamSource({n: tensors[n].data for n in groups}, pin=kind_of(execution).async_copies)


def store_source(
    tensors: Mapping[str, torch.Tensor],
    groups: Mapping[str, str],
    offload_dir: str | Path | None,
    execution: str,
) -> WeightSource:
    """Disk: an offload store of automap's own under ``offload_dir``, written now.

    Raises:
        DispatchError: no ``offload_dir`` was given.
        OffloadError: the store could not be written.
    """
    return write_store(dict(tensors), dict(groups), offload_dir)


# The built-in storage tiers' weight sources, attached to their kinds here (the registry in
# automap.kinds names no module above it).
attach("cpu", source=ram_source)
attach("disk", source=store_source)
