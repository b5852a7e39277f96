"""The load's own peak: what :func:`automap.load` holds in host RAM at its most (the weights
placed in RAM, automap's own state, and for a moment the tensors the largest conversion makes),
predicted from its tasks before it reads anything.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, Callable, Iterable

import torch
from torch import nn

from automap.kinds import kind_of, on_host
from automap.loading.materialise import Task, noted, plan_tasks
from automap.loading.staged import stages_to, staging_bytes
from automap.planning import Plan
from automap.planning.model import Origin
from automap.runtime import check_devices_present
from automap.sizes import format_bytes

log = logging.getLogger(__name__)

MiB = 2**20

# automap's and Python's own state after a load (the plan and its trace's leftovers, the
# skeleton's objects, hooks): measured 12 MiB above the post-import baseline with every weight
# on disk (benchmarks/fit.py, Llama and Mixtral cases); also part of the CPU kind's runtime base.
LOAD_BASE_BYTES = 12 * MiB
# A merge holds its sources, the stacked pieces and the merged tensor at once (see above), and
# glibc keeps some of what it frees: 4.3-4.4 copies measured at the peak (Mixtral-shaped
# checkpoints, benchmarks/fit.py); 5 is the bound a budget is planned against.
MERGE_COPIES = 5


def load_peak_bytes(tasks: Iterable[Task]) -> int:
    """Predicted peak host RAM of loading ``tasks`` (bytes above the process's state before it)."""
    tasks = list(tasks)
    resident = sum(t.nbytes for t in tasks if _in_ram(t))
    transient: dict[int, int] = {}  # per recipe: what its merge holds beyond the resident result
    for t in tasks:
        if t.built is not None:
            copies = MERGE_COPIES - 1 if _in_ram(t) else MERGE_COPIES
            transient[id(t.built[0])] = transient.get(id(t.built[0]), 0) + copies * t.nbytes
    to_devices: dict[str, int] = {}  # bytes sent to each accelerator, through pinned staging
    for t in tasks:
        if t.device is not None and stages_to(t.device):
            to_devices[str(t.device)] = to_devices.get(str(t.device), 0) + t.nbytes
    staging = sum(staging_bytes(n) for n in to_devices.values())
    return LOAD_BASE_BYTES + resident + max(transient.values(), default=0) + staging


def _in_ram(task: Task) -> bool:
    return task.device is not None and on_host(task.device)


def load_plan(
    model: nn.Module, match: Any, dtype: torch.dtype | None, planned: Callable[[Any], Plan]
) -> tuple[Plan, list[Task]]:
    """The plan of a load and its tasks, with the load's predicted peak (:func:`load_peak_bytes`).
    When the load's conversions (merged experts) would take the CPU over its budget, planned
    again keeping that much of the budget free, so the load holds it too.

    Raises:
        DeviceError: a device of the plan is not on this machine (before anything is read).
    """
    chosen = noted(planned(None), match)
    check_devices_present(chosen)  # before reading anything
    tasks = plan_tasks(model, chosen, match, dtype)
    host = next((d for d in chosen.devices if kind_of(d).is_host), None)
    over = load_peak_bytes(tasks) - host.capacity_bytes if host is not None and host.capacity_bytes else 0
    if over > 0 and chosen.origin is Origin.STRATEGY:
        log.info(
            "the load's conversions need %s more than the CPU's room beside the run: planned again keeping it",
            format_bytes(over),
        )
        chosen = noted(planned({host.name: over}), match)
        tasks = plan_tasks(model, chosen, match, dtype)
    return replace(chosen, inputs=replace(chosen.inputs, load_peak_bytes=load_peak_bytes(tasks))), tasks
