"""A load as one step: the checkpoint's tensors read (:func:`~automap.loading.materialise.materialise`),
installed in the model and dispatched — all of it, or none of it, whatever stops it (an error,
Ctrl-C at any moment)."""

from __future__ import annotations

import os

from torch import nn

from automap.interrupts import completed, deferred
from automap.loading.checkpoint import Checkpoint
from automap.loading.keys import Match
from automap.loading.matching import set_extra_states
from automap.loading.materialise import Loaded, Task, materialise, offloaded_names, verify_loaded
from automap.offload.store import collecting
from automap.planning import Plan
from automap.runtime import dispatch_plan, state_of
from automap.runtime.swap import install


def load_and_dispatch(
    model: nn.Module,
    chosen: Plan,
    tasks: list[Task],
    ckpt: Checkpoint,
    folder: str | os.PathLike[str] | None,
    match: Match,
    quiet: bool,
) -> Loaded:
    """Read the tensors, install them and dispatch ``model``: all of it, or none of it.

    This call's one record of what it changed: the stores it created (each in ``created`` in
    the step that makes it) and the tensors it installed (``undo``, kept in the same held
    section as the install). Whatever stops the call before the model is dispatched, an
    interrupt included, puts back exactly those; once dispatched, the complete result stays."""
    created: list = []
    undo: dict | None = None
    try:
        with collecting(created):
            loaded = materialise(tasks, ckpt, folder, quiet=quiet)  # cleans up what it wrote if it fails
        on_purpose = offloaded_names(model, tasks)
        with deferred():
            undo = install(model, loaded.fresh)
        verify_loaded(model, on_purpose)
        set_extra_states(model, ckpt, match)
        dispatch_plan(model, chosen, source=loaded.source)
    except BaseException:
        if state_of(model) is None:
            completed(lambda: _undo_load(model, undo, created))
        raise
    return loaded


def _undo_load(model: nn.Module, undo: dict | None, created: list) -> None:
    """Put back what an unfinished load changed (safe to run twice): the skeleton's tensors as
    they were, and no store this load created left on disk."""
    if undo is not None:
        install(model, undo)
    for store in created:
        store.close(discard=True)
