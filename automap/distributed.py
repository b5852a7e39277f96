"""One plan across processes: a :class:`~automap.planning.Plan`'s stages handed to
``torch.distributed.pipelining`` as its ``split_spec`` (each stage's first unit a
``SplitPoint.BEGINNING``), on one hypothetical device per rank.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Literal, Mapping

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, pipeline
from torch.distributed.pipelining.schedules import PipelineScheduleSingle

from automap.compose import Tracing, plan_strategy, traced_profile
from automap.devices import detect_devices
from automap.errors import AutomapError, PipelineError
from automap.pipelining import split_batch
from automap.pipelining.ranks import rank_stages, split_points, split_spec

__all__ = ["build_stage", "make_schedule", "plan_for_ranks", "rank_stages", "split_spec"]
from automap.planning import Plan
from automap.profiling import ExampleInputs

log = logging.getLogger(__name__)

SCHEDULES: dict[str, type[PipelineScheduleSingle]] = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
ScheduleName = Literal["gpipe", "1f1b"]
# Links between ranks as the planner sees them: effectively free (see plan_for_ranks).
FREE_LINK_BYTES_PER_SECOND = 1e18


def plan_for_ranks(
    model: nn.Module,
    world_size: int,
    *,
    example_inputs: ExampleInputs | None = None,
    memory_per_rank: int | str | None = None,
    no_split: Iterable[str | type] | None = None,
) -> Plan:
    """Plan ``model`` over ``world_size`` processes: one hypothetical device per rank
    (``cuda:0`` ... ``cuda:{n-1}``, whatever the ranks really run on), balanced by FLOPs.

    The links between ranks are modelled as free: the schedules send activations while the
    next micro-batch computes, so a pipeline's period is its slowest stage's compute. (A plan
    for one process charges transfers to the stages, and for a small model may rightly keep
    everything on one device; a distributed plan must use every rank.)

    Args:
        example_inputs: as for :func:`automap.plan`; FLOPs are measured with them.
        memory_per_rank: each rank's budget (int bytes or ``"20GiB"``); default: room for the
            whole model twice, so the split is chosen by compute alone.
        no_split: as for :func:`automap.plan`.

    Raises:
        PipelineError: fewer units than ranks, or a balanced split that leaves a rank empty.
        PlanError: the model does not fit in ``world_size`` x ``memory_per_rank``.

    Example:
        >>> plan = plan_for_ranks(model, 4, example_inputs=(ids,))
        >>> split_spec(plan)
    """
    if world_size < 1:
        raise PipelineError(f"world_size must be >= 1, got {world_size}")
    prof = traced_profile(model, Tracing(example_inputs), no_split=no_split)
    if len(prof.units) < world_size:
        raise PipelineError(
            f"{type(model).__name__} has {len(prof.units)} placement unit(s) but there are "
            f"{world_size} ranks; use fewer ranks or smaller units (no_split=[])"
        )
    if memory_per_rank is None:
        memory_per_rank = 2 * max(sum(u.weight_bytes for u in prof.units), 1)
    budget: dict[int | str, int | str] = {rank: memory_per_rank for rank in range(world_size)}
    devices = detect_devices(budget, links={"cuda": FREE_LINK_BYTES_PER_SECOND})
    chosen = plan_strategy(prof, devices, "balanced", Tracing(None))  # the ranks' profile: planned as it is
    rank_stages(chosen, world_size)
    return chosen


@dataclass
class RankPipeline:
    """What one rank runs: its stage of the split model and the schedule that drives it.

    Attributes:
        stage: the ``PipelineStage`` (its ``submod`` holds this rank's parameters, named as in
            the whole model).
        schedule: call ``schedule.step(x)`` on the first rank, ``schedule.step(target=y,
            losses=[])`` on the last, ``schedule.step()`` on the others.
        module: this rank's part of the model (``stage.submod``).
    """

    stage: PipelineStage
    schedule: PipelineScheduleSingle
    module: nn.Module
    rank: int
    world_size: int

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.world_size - 1


def build_stage(
    model: nn.Module,
    plan: Plan,
    example_args: tuple[Any, ...],
    *,
    rank: int,
    world_size: int,
    device: torch.device | str,
    chunks: int,
    schedule: ScheduleName = "gpipe",
    loss_fn: Callable[..., torch.Tensor] | None = None,
    example_kwargs: Mapping[str, Any] | None = None,
    group: torch.distributed.ProcessGroup | None = None,
) -> RankPipeline:
    """Split ``model`` where ``plan`` says and build this rank's stage and schedule.

    Every rank calls it with the same model (same weights: seed it or load one checkpoint),
    the same plan and inputs shaped like the batch it will step with.

    Args:
        example_args, example_kwargs: a whole batch (its shape is what matters); its first
            micro-batch is what ``torch.export`` traces.
        rank, world_size, group: this process's place in the (default) process group.
        device: where this rank's stage runs (``cuda:{local_rank}`` or ``cpu``).
        chunks: micro-batches per step.
        schedule: ``"gpipe"`` (fill-drain) or ``"1f1b"`` (one forward, one backward).
        loss_fn: ``loss_fn(output, target)`` per micro-batch; needed for training steps.

    Raises:
        PipelineError: the plan's stage count differs from ``world_size``, an unknown schedule,
            bad chunks, or the model could not be traced.
    """
    if schedule not in SCHEDULES:
        raise PipelineError(f"unknown schedule {schedule!r}; use one of {', '.join(SCHEDULES)}")
    if not 0 <= rank < world_size:
        raise PipelineError(f"rank {rank} is outside 0..{world_size - 1}")
    stages = rank_stages(plan, world_size)
    spec = split_points(stages)
    mb_args, mb_kwargs = split_batch(tuple(example_args), dict(example_kwargs or {}), chunks)[0]
    try:
        pipe = pipeline(model, mb_args=mb_args, mb_kwargs=mb_kwargs or None, split_spec=spec)
    except AutomapError:
        raise
    except Exception as exc:
        raise PipelineError(
            f"torch.distributed.pipelining could not trace {type(model).__name__} with "
            f"torch.export ({type(exc).__name__}: {exc}); make its forward exportable or "
            "build PipelineStage objects by hand from the plan's stages"
        ) from exc
    if pipe.num_stages != world_size:
        raise PipelineError(
            f"tracing cut {type(model).__name__} into {pipe.num_stages} stage(s), not {world_size}: "
            f"a split point in {sorted(spec)} is not called as a module in forward"
        )
    stage = pipe.build_stage(rank, torch.device(device), group)
    log.info(
        "rank %d/%d runs stage %d (%s, ...) with %s, %d micro-batches",
        rank,
        world_size,
        rank,
        ", ".join(stages[rank].units[:3]),
        schedule,
        chunks,
    )
    return RankPipeline(
        stage, make_schedule(stage, schedule, chunks, loss_fn), stage.submod, rank, world_size
    )


def make_schedule(
    stage: PipelineStage,
    schedule: ScheduleName,
    chunks: int,
    loss_fn: Callable[..., torch.Tensor] | None = None,
) -> PipelineScheduleSingle:
    """A schedule of the named kind over an existing stage (to switch, say, from a GPipe
    evaluation to 1F1B training without tracing again). Gradients are averaged over the
    micro-batches, so with equal micro-batches and a mean loss they equal the whole batch's."""
    if schedule not in SCHEDULES:
        raise PipelineError(f"unknown schedule {schedule!r}; use one of {', '.join(SCHEDULES)}")
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise PipelineError(f"chunks must be a positive int, got {chunks!r}")
    return SCHEDULES[schedule](stage, n_microbatches=chunks, loss_fn=loss_fn, scale_grads=True)
