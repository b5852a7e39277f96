"""Loading checkpoints larger than memory: plan on meta, then stream each tensor to its place.

    with automap.empty_model():
        model = LlamaForCausalLM(config)
    model = automap.load(model, "llama-checkpoint/", max_memory={"cpu": "8GiB"}, offload_dir="off")
"""
from __future__ import annotations

import logging
import os
import shutil
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator

import torch
from torch import nn

from automap.api import DeviceMap, plan
from automap.devices import MaxMemory, check_present
from automap.dispatch import check_not_dispatched, dispatch_plan
from automap.dispatch.swap import install
from automap.errors import CheckpointError
from automap.load.checkpoint import Checkpoint, open_checkpoint
from automap.load.empty import empty_model
from automap.load.keys import match_keys
from automap.load.materialise import Loaded, Task, materialise, plan_tasks
from automap.profile import ExampleInputs
from automap.profile.units import all_named_tensors
from automap.units import format_bytes

log = logging.getLogger(__name__)

__all__ = ["Checkpoint", "empty_model", "load", "open_checkpoint"]


def load(model: nn.Module, checkpoint: str | os.PathLike[str], device_map: DeviceMap = "auto",
         max_memory: MaxMemory | None = None, *, offload_dir: str | os.PathLike[str] | None = None,
         dtype: torch.dtype | None = None, no_split: Iterable[str | type] | None = None,
         example_inputs: ExampleInputs | None = None, quiet: bool = False) -> nn.Module:
    """Load ``checkpoint`` into ``model``, each tensor straight to its planned device or store.

    The model is planned on meta first; then every tensor is read on its own (never a whole
    shard) to its GPU or to CPU RAM, or kept in the offload store. Offloaded tensors of a
    safetensors checkpoint already in the target dtype are referenced in place: nothing is
    copied or written. Tied weights stay tied; buffers missing from the checkpoint keep the
    values computed at init (build the model in :func:`empty_model`).

    Args:
        model: a skeleton from :func:`empty_model` (or any model; its weights are replaced).
        checkpoint: a ``.safetensors`` file, a ``.bin``/``.pt``/``.pth`` file, or a folder of
            shards (with or without ``model.safetensors.index.json``).
        device_map, max_memory, no_split, example_inputs: as for :func:`automap.plan`; pass a
            :class:`~automap.Plan` as ``device_map`` to use the planner's other options.
        offload_dir: where offloaded tensors that need writing go (converted dtype, a pickled
            source, buffers computed at init in a unit on disk). Not needed when every offloaded
            tensor comes from a safetensors checkpoint already in the target dtype.
        dtype: convert floating-point weights and buffers to this dtype on the way, as
            ``model.to(dtype)`` would.
        quiet: no progress bar (it only appears for loads longer than a second).

    Returns:
        ``model``, loaded and dispatched; :func:`automap.undispatch` brings it back to CPU.

    Raises:
        CheckpointError: missing, corrupt, truncated or unsafe checkpoint; missing, unexpected
            or mis-shaped keys. Nothing is left half-written in ``offload_dir``.
        PlanError, DispatchError: as for :func:`automap.dispatch`.

    Example:
        >>> model = automap.load(model, "gpt2/model.safetensors", max_memory={"cpu": "200MB"})
    """
    check_not_dispatched(model)
    start = time.perf_counter()
    with open_checkpoint(checkpoint) as ckpt:
        match = match_keys(model, ckpt)
        chosen = plan(model, device_map, max_memory, no_split=no_split, example_inputs=example_inputs,
                      dtype=dtype, offload_dir=None if offload_dir is None else Path(offload_dir))
        for device in chosen.used_devices:
            check_present(device)  # before reading anything
        tasks = plan_tasks(model, chosen, match, dtype)
        with _clean_on_failure(offload_dir):
            loaded = materialise(tasks, ckpt, offload_dir, quiet=quiet)
            on_purpose = _offloaded_names(model, tasks)
            undo = install(model, loaded.fresh)
            try:
                _verify(model, on_purpose)
                dispatch_plan(model, chosen, store=loaded.store)
            except BaseException:
                install(model, undo)  # the skeleton as it was: nothing half-loaded either
                raise
    _log_summary(model, tasks, loaded, match.how, time.perf_counter() - start)
    return model


def _offloaded_names(model: nn.Module, tasks: list[Task]) -> set[str]:
    """Every name (tied aliases too) of a tensor that stays in the offload store."""
    offloaded = {id(t.tensor) for t in tasks if t.device is None}
    return {n for n, t in all_named_tensors(model, remove_duplicate=False) if id(t) in offloaded}


def _verify(model: nn.Module, on_purpose: set[str]) -> None:
    """Every tensor holds data, except the ones offloaded on purpose."""
    left = [n for n, t in all_named_tensors(model, remove_duplicate=False)
            if t.device.type == "meta" and n not in on_purpose]
    if left:
        raise CheckpointError(f"{len(left)} tensor(s) are still on meta after loading, first {left[:3]}; "
                              "the plan does not cover them: plan this model again")


@contextmanager
def _clean_on_failure(offload_dir: str | os.PathLike[str] | None) -> Iterator[None]:
    """On any error, remove what this load created in ``offload_dir`` (and the folder itself
    when the load created it), so no half-written store is left behind."""
    if offload_dir is None:
        yield
        return
    root = Path(offload_dir)
    existed = root.exists()
    before = set(os.listdir(root)) if existed else set()
    try:
        yield
    except BaseException:
        if not existed:
            shutil.rmtree(root, ignore_errors=True)
        elif root.is_dir():
            for name in set(os.listdir(root)) - before:
                path = root / name
                shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
        raise


def _log_summary(model: nn.Module, tasks: list[Task], loaded: Loaded, how: str, seconds: float) -> None:
    by_device: dict[str, int] = {}
    for task in tasks:
        where = str(task.device) if task.device is not None else "offload store"
        by_device[where] = by_device.get(where, 0) + task.nbytes
    placed = ", ".join(f"{format_bytes(n)} to {d}" for d, n in by_device.items())
    log.info("loaded %s in %.1f s (keys read %s): %s; offloaded tensors referenced in place %d, written %d",
             type(model).__name__, seconds, how, placed, loaded.referenced, loaded.written)

