"""A plan's stages as ranks of a distributed pipeline: one stage per rank (:func:`rank_stages`)
and ``torch.distributed.pipelining``'s ``split_spec`` (:func:`split_spec`), for
:mod:`automap.distributed` and the plan exports alike.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from automap.errors import PipelineError
from automap.pipelining.stages import Stage, plan_stages
from automap.planning import Plan

if TYPE_CHECKING:
    from torch.distributed.pipelining import SplitPoint


def rank_stages(plan: Plan, world_size: int | None = None) -> tuple[Stage, ...]:
    """The plan's stages, one per rank, checked against ``world_size`` when given.

    Raises:
        PipelineError: the plan offloads weights, or its stage count differs from ``world_size``.
    """
    if plan.offloaded_units:
        raise PipelineError(
            f"the plan offloads {len(plan.offloaded_units)} unit(s) to CPU/disk; a distributed "
            "plan needs one device per rank: use automap.distributed.plan_for_ranks(model, n)"
        )
    stages = plan_stages(plan)
    if world_size is not None and len(stages) != world_size:
        raise PipelineError(
            f"the plan has {len(stages)} stage(s) ({', '.join(s.device for s in stages)}) but there are "
            f"{world_size} rank(s); each rank runs one stage, so plan with "
            f"automap.distributed.plan_for_ranks(model, world_size={world_size}) or start {len(stages)} processes"
        )
    return stages


def split_spec(plan: Plan) -> dict[str, SplitPoint]:
    """``torch.distributed.pipelining.pipeline``'s ``split_spec`` for ``plan``: a
    ``SplitPoint.BEGINNING`` at the first unit of every stage after the first.

    Example:
        >>> split_spec(plan)
        {'model.layers.2': <SplitPoint.BEGINNING: 1>}
    """
    return split_points(rank_stages(plan))


def split_points(stages: tuple[Stage, ...]) -> dict[str, SplitPoint]:
    """A ``SplitPoint.BEGINNING`` at the first unit of every stage after the first."""
    from torch.distributed.pipelining import SplitPoint

    return {stage.units[0]: SplitPoint.BEGINNING for stage in stages[1:]}
