"""``chunks="auto"``: the tutorial's ``split_size`` sweep, predicted from the plan's profile.

A stage's whole-batch time ``t`` (its units' FLOPs over its device's speed, plus the transfer
into it) splits over ``m`` micro-batches, but every micro-batch also pays a fixed cost per op
(dispatch and kernel launch) and a hand-off to the next stage. On a GPU the launches overlap
the kernels, so a micro-batch costs ``max(t/m, fixed)``; on a CPU they add up, ``t/m + fixed``.
A GPipe pass costs the first micro-batch's trip through every stage plus ``m - 1`` periods,
and the period is the busiest *real* device's share: stages mapped to one device never overlap.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from automap.devices import make_device
from automap.pipelining.stages import Stage
from automap.planning import Plan
from automap.planning.cost import flop_seconds
from automap.planning.predict import cuts

# Round figures, as in automap.devices. An op (a leaf module's forward) costs ~10 us of
# dispatch and launch; its backward about twice that. A hand-off is a thread wake-up plus a
# copy's latency.
OP_SECONDS = 10e-6
HANDOFF_SECONDS = 100e-6
MAX_AUTO_CHUNKS = 64
ASYNC_KINDS = ("cuda", "xpu", "mps")


@dataclass(frozen=True)
class StageCost:
    """What one stage costs, as :func:`pipeline_seconds` sees it.

    Attributes:
        seconds: the whole batch's compute plus the transfer into the stage.
        fixed_seconds: paid by every micro-batch whatever its size (op launches).
        device: the real device; stages on one device take turns.
        asynchronous: launches overlap execution (GPUs), so fixed and compute costs overlap.
    """

    seconds: float
    fixed_seconds: float
    device: str
    asynchronous: bool = False

    def micro_seconds(self, chunks: int) -> float:
        """One micro-batch's time in this stage when the batch is split in ``chunks``."""
        share = self.seconds / chunks
        busy = max(share, self.fixed_seconds) if self.asynchronous else share + self.fixed_seconds
        return busy + HANDOFF_SECONDS


def pipeline_seconds(costs: Sequence[StageCost], chunks: int) -> float:
    """Predicted time of one GPipe pass over ``costs`` with ``chunks`` micro-batches."""
    per = [c.micro_seconds(chunks) for c in costs]
    busy: dict[str, float] = {}
    for cost, seconds in zip(costs, per):
        busy[cost.device] = busy.get(cost.device, 0.0) + seconds
    return sum(per) + (chunks - 1) * max(busy.values())


def best_chunks(costs: Sequence[StageCost], batch: int) -> int:
    """The micro-batch count with the least :func:`pipeline_seconds` (the smallest on ties),
    at most ``batch`` and :data:`MAX_AUTO_CHUNKS`."""
    candidates = range(1, max(1, min(batch, MAX_AUTO_CHUNKS)) + 1)
    return min(candidates, key=lambda m: (pipeline_seconds(costs, m), m))


def stage_costs(
    plan: Plan,
    stages: Sequence[Stage],
    devices: Sequence[torch.device],
    model: nn.Module,
    scale: float,
    training: bool,
) -> list[StageCost]:
    """Each stage's :class:`StageCost` on the device it really runs on.

    Args:
        scale: the call's batch over the profile's (FLOPs and transfers scale with it).
        training: count forward + backward FLOPs and op launches.
    """
    units = {u.name: u for u in plan.units}
    modules = dict(model.named_modules())
    into = {cut.after: cut.seconds for cut in cuts(plan)}
    passes = 3 if training else 1
    result = []
    for stage, device in zip(stages, devices):
        spec = plan.device(stage.device)
        speed = (
            spec.flops_per_second
            if spec.kind == device.type
            else make_device(str(device), 0).flops_per_second
        )
        flops = sum(
            units[n].train_flops if training and units[n].train_flops else passes * units[n].flops
            for n in stage.units
        )
        ops = sum(_ops(modules[n]) for n in stage.units)
        result.append(
            StageCost(
                scale * (flop_seconds(flops, speed) + into.get(stage.units[0], 0.0)),
                passes * ops * OP_SECONDS,
                str(device),
                device.type in ASYNC_KINDS,
            )
        )
    return result


def _ops(module: nn.Module) -> int:
    """Leaf modules inside ``module``: a stand-in for the ops it launches."""
    return max(1, sum(1 for m in module.modules() if not any(True for _ in m.children())))
