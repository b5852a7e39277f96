"""Sending each tensor of a checkpoint where the plan puts it: a device, or a weight source.

Invariants: offloaded safetensors tensors already in the target dtype are referenced in place, not
read; the model changes only at the caller's install, once everything was read.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from automap.errors import CheckpointError
from automap.kinds import torch_device
from automap.progress import bar as progress_bar
from automap.loading.checkpoint import Checkpoint, SafetensorsReader, Stored
from automap.loading.convert import Recipe
from automap.loading.keys import Match
from automap.loading.staged import DeviceSends
from automap.offload import CheckpointSource, OffloadStore, SourceSet, TensorSpec, WeightSource
from automap.offload.folder import no_offload_dir
from automap.planning import Plan
from automap.planning.placement import Placement
from automap.profiling.units import all_named_tensors
from automap.sizes import format_bytes

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Task:
    """One tensor to load: its plan name, the meta (or computed) object in the model, the
    checkpoint key (None: built by a recipe, or keep the value computed at init), target dtype
    and device (None: the offload store), the unit whose store file it goes to, and the
    transformers recipe that builds it with the name it builds it as (None: read by key)."""

    name: str
    tensor: torch.Tensor
    key: str | None
    dtype: torch.dtype
    device: torch.device | None
    unit: str
    built: tuple[Recipe, str] | None = None

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.dtype.itemsize


@dataclass
class Loaded:
    """What the load produced: new objects by id of the old ones, and the weight source of the
    offloaded tensors (the checkpoint in place, a store, or both)."""

    fresh: dict[int, torch.Tensor] = field(default_factory=dict)
    source: WeightSource | None = None
    referenced: int = 0
    written: int = 0

    def discard(self) -> None:
        """Undo what the load wrote (a store it created) and release what it holds."""
        if self.source is not None:
            self.source.close(discard=True)


def plan_tasks(model: nn.Module, plan: Plan, match: Match, dtype: torch.dtype | None) -> list[Task]:
    """Every tensor of the model once, in execution order, with where it goes. ``dtype`` is
    the one of the weights (parameters and what the checkpoint holds); buffers the model
    computes keep their own, as accelerate's and transformers' loads keep them (Llama's rotary
    ``inv_freq`` stays float32 in a bfloat16 model)."""
    tensors = dict(all_named_tensors(model, remove_duplicate=False))
    tasks = []
    for unit, placement in zip(plan.units, plan.placements):
        for name in unit.tensors:
            tensor = tensors[name]
            weight = isinstance(tensor, nn.Parameter) or name in match.sources or name in match.built
            target = dtype if dtype is not None and tensor.is_floating_point() and weight else tensor.dtype
            tasks.append(
                Task(
                    name,
                    tensor,
                    match.sources.get(name),
                    target,
                    _destination(placement, name in unit.loose),
                    unit.name,
                    match.built.get(name),
                )
            )
    return tasks


def _destination(placement: Placement, loose: bool) -> torch.device | None:
    """None for a weight source (the unit's home stores only: disk); else the device whose
    memory holds the tensor: units streamed from "cpu" (a GPU executes) live in host RAM,
    loose tensors of an offloaded unit where it computes."""
    if loose and placement.offloaded:
        return torch_device(placement.compute)
    return None if placement.in_store else torch_device(placement.home)


def materialise(
    tasks: list[Task],
    checkpoint: Checkpoint,
    offload_dir: str | os.PathLike[str] | None,
    *,
    quiet: bool = False,
) -> Loaded:
    """Read every task's tensor to its device, and build the weight source for the rest.

    Raises:
        OffloadDirError: a tensor needs writing to disk but no ``offload_dir`` was given (a
            CheckpointError, and the DispatchError dispatch raises for the same).
        CheckpointError: a buffer is neither computed nor in the checkpoint.
        OffloadError: the store could not be written (nothing of it is left).
    """
    loaded = Loaded()
    total = sum(t.nbytes for t in tasks)
    with progress_bar(total, "automap.load", unit="B", quiet=quiet) as bar:
        reader = _Reader(checkpoint)
        progress = _Progress(bar, len(tasks))
        sends = DeviceSends()
        try:
            for task in tasks:
                if task.device is not None:
                    loaded.fresh[id(task.tensor)] = _send(task, reader, sends)
                    progress.step(task.nbytes)
        except BaseException:
            sends.finish(failed=True)
            raise
        sends.finish()  # the copies in flight end before anything uses (or drops) their tensors
        offloaded = [t for t in tasks if t.device is None]
        if offloaded:
            loaded.source = _build_source(offloaded, reader, offload_dir, progress, loaded)
    return loaded


def _send(task: Task, reader: _Reader, sends: DeviceSends) -> torch.Tensor:
    """``task``'s tensor on its device: a stored tensor that needs no conversion read from its
    file straight into the device's staging buffers, where it stages (:class:`DeviceSends`)."""
    assert task.device is not None
    raw = reader.raw(task)
    if raw is None or not sends.stages(task.device):
        return sends.send(reader.fetch(task), task.device)
    file, stored = raw
    shape, offset = torch.Size(stored.shape), stored.offset
    return sends.send_file(task.device, shape, stored.dtype, stored.file, file.open_checked, offset)


class _Progress:
    def __init__(self, bar: tqdm, count: int):
        self.bar, self.count, self.done = bar, count, 0

    def step(self, nbytes: int) -> None:
        self.done += 1
        self.bar.set_postfix_str(f"{self.done}/{self.count} tensors", refresh=False)
        self.bar.update(nbytes)


class _Reader:
    """Each task's value on CPU: read by key, built by its recipe (once per recipe: the other
    tensors a recipe builds wait here until their tasks come), or the value computed at init."""

    def __init__(self, checkpoint: Checkpoint):
        self.checkpoint = checkpoint
        self.waiting: dict[int, dict[str, torch.Tensor]] = {}

    def fetch(self, task: Task) -> torch.Tensor:
        if task.key is not None:
            return self.checkpoint.read(task.key, task.dtype)
        if task.built is not None:
            return self._built(*task.built).to(task.dtype)
        return _computed(task)

    def raw(self, task: Task) -> tuple[SafetensorsReader, Stored] | None:
        """Where ``task``'s bytes lie as they are to be loaded (a safetensors tensor already in
        its dtype), or None (converted, built, computed, or from a pickle)."""
        if task.key is None or task.built is not None:
            return None
        stored = self.checkpoint.tensors[task.key]
        file = self.checkpoint.readers[stored.file]
        if not isinstance(file, SafetensorsReader) or stored.dtype != task.dtype:
            return None
        return file, stored

    def _built(self, recipe: Recipe, target: str) -> torch.Tensor:
        if id(recipe) not in self.waiting:
            self.waiting[id(recipe)] = recipe.build(self.checkpoint.read)
        made = self.waiting[id(recipe)]
        value = made.pop(target)
        if not made:
            del self.waiting[id(recipe)]
        return value


def _computed(task: Task) -> torch.Tensor:
    if task.tensor.device.type == "meta":
        raise CheckpointError(missing_value_message([task.name], isinstance(task.tensor, nn.Parameter)))
    return task.tensor.detach().to(task.dtype)


def _in_place(task: Task, checkpoint: Checkpoint) -> bool:
    """Whether the checkpoint's own bytes of ``task`` can serve as its weights, unconverted."""
    return (
        task.key is not None
        and checkpoint.in_place(task.key)
        and checkpoint.tensors[task.key].dtype == task.dtype
    )


def store_bytes(tasks: list[Task], checkpoint: Checkpoint) -> int:
    """Bytes of the offloaded tasks that must be written to a store (the rest are referenced
    in the checkpoint, in place)."""
    return sum(t.nbytes for t in tasks if t.device is None and not _in_place(t, checkpoint))


def _build_source(
    tasks: list[Task],
    reader: _Reader,
    offload_dir: str | os.PathLike[str] | None,
    progress: _Progress,
    loaded: Loaded,
) -> WeightSource:
    checkpoint = reader.checkpoint
    references = {
        t.name: (checkpoint.tensors[t.key].file, t.key)
        for t in tasks
        if _in_place(t, checkpoint)
        if t.key is not None
    }
    to_write = {t.name: t for t in tasks if t.name not in references}
    for task in tasks:
        if task.name in references:
            progress.step(task.nbytes)
    loaded.referenced, loaded.written = len(references), len(to_write)
    if to_write and offload_dir is None:
        raise no_offload_dir(
            f"{len(to_write)} tensor(s) (first {next(iter(to_write))!r})",
            " that must be written there (converted to another dtype, merged by transformers' "
            "checkpoint conversion, read from a pickle, or buffers computed at init)",
        )
    sources: list[WeightSource] = [_in_place_source(references, checkpoint)] if references else []
    if to_write:
        assert offload_dir is not None
        specs = {n: TensorSpec(t.unit, t.dtype, tuple(t.tensor.shape)) for n, t in to_write.items()}
        sources.append(
            OffloadStore.write(offload_dir, specs, lambda name: _written(to_write[name], reader, progress))
        )
    return sources[0] if len(sources) == 1 else SourceSet(sources)


def _in_place_source(references: dict[str, tuple[Path, str]], checkpoint: Checkpoint) -> CheckpointSource:
    """The checkpoint's own bytes of ``references``, each file mapped through one descriptor
    checked to be the file whose header was read (never reopened by name afterwards)."""
    keys: dict[Path, list[str]] = {}
    for file, key in references.values():
        keys.setdefault(file, []).append(key)
    files = {}
    try:
        for file, wanted in keys.items():
            files[file] = checkpoint.map(file, wanted)
        return CheckpointSource(references, files)
    except BaseException:
        for mapped in files.values():
            mapped.close()
        raise


def _written(task: Task, reader: _Reader, progress: _Progress) -> torch.Tensor:
    """A tensor read for the store when it writes its unit (one unit in memory at a time)."""
    value = reader.fetch(task)
    progress.step(task.nbytes)
    return value


def offloaded_names(model: nn.Module, tasks: list[Task]) -> set[str]:
    """Every name (tied aliases too) of a tensor that stays in the offload store."""
    offloaded = {id(t.tensor) for t in tasks if t.device is None}
    return {n for n, t in all_named_tensors(model, remove_duplicate=False) if id(t) in offloaded}


def verify_loaded(model: nn.Module, on_purpose: set[str]) -> None:
    """Every tensor holds data, except the ones offloaded on purpose."""
    left = [
        n
        for n, t in all_named_tensors(model, remove_duplicate=False)
        if t.device.type == "meta" and n not in on_purpose
    ]
    if left:
        raise CheckpointError(
            f"{len(left)} tensor(s) are still on meta after loading, first {left[:3]}; "
            "the plan does not cover them: plan this model again"
        )


def log_summary(model: nn.Module, tasks: list[Task], loaded: Loaded, match: Match, seconds: float) -> None:
    by_device: dict[str, int] = {}
    for task in tasks:
        where = str(task.device) if task.device is not None else "disk"
        by_device[where] = by_device.get(where, 0) + task.nbytes
    placed = ", ".join(f"{format_bytes(n)} to {d}" for d, n in by_device.items())
    log.info(
        "loaded %s in %.1f s (keys read %s): %s; offloaded tensors referenced in place %d, written %d%s",
        type(model).__name__,
        seconds,
        match.how,
        placed,
        loaded.referenced,
        loaded.written,
        f"; {match.converted}" if match.converted else "",
    )


def noted(plan: Plan, match: Match) -> Plan:
    """``plan`` with what transformers' conversion did among its choices, for its report."""
    if match.converted is None or match.converted in plan.choices:
        return plan
    choices = plan.choices + (match.converted,)
    return dataclasses.replace(plan, provenance=dataclasses.replace(plan.provenance, choices=choices))


def missing_value_message(names: list[str], parameter: bool) -> str:
    """What to say of model tensors on meta that the checkpoint does not hold."""
    listed = f"{names[0]!r}" if len(names) == 1 else f"{len(names)} tensors, first {names[:3]}"
    if parameter:
        return (
            f"parameter {listed} is not in the checkpoint and the model holds no value for it (it is on meta); load "
            "a checkpoint saved from this model class (one with that module), or build the model with real "
            "weights for that module and the rest inside automap.empty_model()"
        )
    return (
        f"buffer {listed} is not in the checkpoint and has no value (it is on meta); build the model inside "
        "automap.empty_model(), which keeps the buffers computed at init, or load a checkpoint that holds it"
    )
