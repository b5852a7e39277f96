"""Sending each tensor of a checkpoint where the plan puts it: a device, or the offload store.

Offloaded tensors that a safetensors checkpoint already holds in the target dtype are not
read at all: the store references them in place. Everything else is read one tensor at a
time; an offloaded tensor that needs converting is written to ``offload_dir`` one unit at a
time. The model itself is only changed by :func:`install`, once everything was read.
"""
from __future__ import annotations

import logging
import os
import shutil
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Mapping

import torch
from torch import nn
from tqdm import tqdm

from automap.errors import CheckpointError
from automap.loading.checkpoint import Checkpoint
from automap.loading.keys import Match
from automap.offload import DTYPE_NAMES, Entry, OffloadStore
from automap.planning import Plan
from automap.profiling.units import all_named_tensors
from automap.sizes import format_bytes

log = logging.getLogger(__name__)

# Loads shorter than this show no progress bar at all.
PROGRESS_DELAY_SECONDS = 1.0


@dataclass(frozen=True)
class Task:
    """One tensor to load: its plan name, the meta (or computed) object in the model, the
    checkpoint key (None: keep the value computed at init), target dtype and device
    (None: the offload store), and the unit whose store file it goes to."""

    name: str
    tensor: torch.Tensor
    key: str | None
    dtype: torch.dtype
    device: torch.device | None
    unit: str

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.dtype.itemsize


@dataclass
class Loaded:
    """What the load produced: new objects by id of the old ones, and the offload store."""

    fresh: dict[int, torch.Tensor] = field(default_factory=dict)
    store: OffloadStore | None = None
    referenced: int = 0
    written: int = 0


def plan_tasks(model: nn.Module, plan: Plan, match: Match, dtype: torch.dtype | None) -> list[Task]:
    """Every tensor of the model once, in execution order, with where it goes."""
    tensors = dict(all_named_tensors(model, remove_duplicate=False))
    execution = torch.device(plan.execution_device)
    tasks = []
    for unit, where in zip(plan.units, plan.placement):
        for name in unit.tensors:
            tensor = tensors[name]
            target = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
            tasks.append(Task(name, tensor, match.sources.get(name), target,
                              _destination(plan, where, name in unit.loose, execution), unit.name))
    return tasks


def _destination(plan: Plan, where: str, loose: bool, execution: torch.device) -> torch.device | None:
    """None for the offload store (disk); else the device whose memory holds the tensor:
    units offloaded to "cpu" (a GPU executes) live in host RAM, loose tensors where they run."""
    if loose and plan.is_offloaded(where):
        return execution
    return None if where == "disk" else torch.device(where)


def materialise(tasks: list[Task], checkpoint: Checkpoint, offload_dir: str | os.PathLike[str] | None,
                *, quiet: bool = False) -> Loaded:
    """Read every task's tensor to its device, and build the offload store for the rest.

    Raises:
        CheckpointError: a tensor needs writing to disk but no ``offload_dir`` was given, or
            a buffer is neither computed nor in the checkpoint.
    """
    loaded = Loaded()
    total = sum(t.nbytes for t in tasks)
    with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="automap.load", file=sys.stderr,
              disable=quiet, delay=PROGRESS_DELAY_SECONDS) as bar:
        progress = _Progress(bar, len(tasks))
        for task in tasks:
            if task.device is not None:
                loaded.fresh[id(task.tensor)] = _fetch(task, checkpoint).to(task.device)
                progress.step(task.nbytes)
        offloaded = [t for t in tasks if t.device is None]
        for task in offloaded:
            loaded.fresh[id(task.tensor)] = torch.empty(task.tensor.shape, dtype=task.dtype, device="meta")
        if offloaded:
            loaded.store = _build_store(offloaded, checkpoint, offload_dir, progress, loaded)
    return loaded


class _Progress:
    def __init__(self, bar: tqdm, count: int):
        self.bar, self.count, self.done = bar, count, 0

    def step(self, nbytes: int) -> None:
        self.done += 1
        self.bar.set_postfix_str(f"{self.done}/{self.count} tensors", refresh=False)
        self.bar.update(nbytes)


def _fetch(task: Task, checkpoint: Checkpoint) -> torch.Tensor:
    if task.key is not None:
        return checkpoint.read(task.key, task.dtype)
    if task.tensor.device.type == "meta":
        raise CheckpointError(
            f"buffer {task.name!r} is not in the checkpoint and has no value (it is on meta); build the model "
            "inside automap.empty_model(), which keeps the buffers computed at init"
        )
    return task.tensor.detach().to(task.dtype)


def _reference(task: Task, checkpoint: Checkpoint) -> Entry | None:
    """An entry pointing into the checkpoint itself, when its bytes are already right."""
    stored = checkpoint.tensors[task.key] if task.key is not None else None
    if stored is None or not stored.is_safetensors or stored.dtype != task.dtype:
        return None
    return Entry(file=str(stored.file.resolve()), key=stored.key, dtype=DTYPE_NAMES[stored.dtype],
                 shape=stored.shape, nbytes=stored.nbytes, crc32=None)


def _build_store(tasks: list[Task], checkpoint: Checkpoint, offload_dir: str | os.PathLike[str] | None,
                 progress: _Progress, loaded: Loaded) -> OffloadStore:
    references: dict[str, Entry] = {}
    to_write: dict[str, Task] = {}
    for task in tasks:
        entry = _reference(task, checkpoint)
        if entry is None:
            to_write[task.name] = task
        else:
            references[task.name] = entry
            progress.step(task.nbytes)
    loaded.referenced, loaded.written = len(references), len(to_write)
    if not to_write:
        # Nothing to write: the store lives in memory and reads the checkpoint's own files.
        return OffloadStore(Path(offload_dir) if offload_dir is not None else checkpoint.path, references)
    if offload_dir is None:
        first = next(iter(to_write))
        raise CheckpointError(
            f"the plan offloads {len(to_write)} tensor(s) (first {first!r}) that must be written to disk "
            "(converted to another dtype, read from a pickle, or buffers computed at init) but no offload_dir "
            "was given; pass offload_dir='path', or raise max_memory so that they fit in memory"
        )
    lazy = _ReadOnDemand(to_write, checkpoint, progress)
    return OffloadStore.write(offload_dir, lazy, {n: t.unit for n, t in to_write.items()}, references=references)


class _ReadOnDemand(Mapping[str, torch.Tensor]):
    """Tensors read from the checkpoint only when the store writes them (one unit at a time)."""

    def __init__(self, tasks: Mapping[str, Task], checkpoint: Checkpoint, progress: _Progress):
        self.tasks, self.checkpoint, self.progress = tasks, checkpoint, progress

    def __getitem__(self, name: str) -> torch.Tensor:
        task = self.tasks[name]
        value = _fetch(task, self.checkpoint)
        self.progress.step(task.nbytes)
        return value

    def __iter__(self) -> Iterator[str]:
        return iter(self.tasks)

    def __len__(self) -> int:
        return len(self.tasks)


def offloaded_names(model: nn.Module, tasks: list[Task]) -> set[str]:
    """Every name (tied aliases too) of a tensor that stays in the offload store."""
    offloaded = {id(t.tensor) for t in tasks if t.device is None}
    return {n for n, t in all_named_tensors(model, remove_duplicate=False) if id(t) in offloaded}


def verify_loaded(model: nn.Module, on_purpose: set[str]) -> None:
    """Every tensor holds data, except the ones offloaded on purpose."""
    left = [n for n, t in all_named_tensors(model, remove_duplicate=False)
            if t.device.type == "meta" and n not in on_purpose]
    if left:
        raise CheckpointError(f"{len(left)} tensor(s) are still on meta after loading, first {left[:3]}; "
                              "the plan does not cover them: plan this model again")


@contextmanager
def clean_on_failure(offload_dir: str | os.PathLike[str] | None) -> Iterator[None]:
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


def log_summary(model: nn.Module, tasks: list[Task], loaded: Loaded, how: str, seconds: float) -> None:
    by_device: dict[str, int] = {}
    for task in tasks:
        where = str(task.device) if task.device is not None else "offload store"
        by_device[where] = by_device.get(where, 0) + task.nbytes
    placed = ", ".join(f"{format_bytes(n)} to {d}" for d, n in by_device.items())
    log.info("loaded %s in %.1f s (keys read %s): %s; offloaded tensors referenced in place %d, written %d",
             type(model).__name__, seconds, how, placed, loaded.referenced, loaded.written)

