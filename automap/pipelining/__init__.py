"""Micro-batch pipelining in one process: a plan's stages (runs of units on one device) work on
successive micro-batches at once (GPipe fill-drain), with the same outputs and gradients as the
plain model. The design is in ``docs/pipeline.md``.
"""

from automap.pipelining.cost import StageCost, best_chunks, pipeline_seconds, stage_costs
from automap.pipelining.microbatch import (
    batch_size,
    chunk_sizes,
    chunks_for_split_size,
    merge_outputs,
    split_batch,
)
from automap.pipelining.runner import Chunks, Pipeline
from automap.pipelining.stages import Stage, plan_stages
from automap.pipelining.wrap import pipeline

__all__ = [
    "Chunks",
    "Pipeline",
    "Stage",
    "StageCost",
    "batch_size",
    "best_chunks",
    "chunk_sizes",
    "chunks_for_split_size",
    "merge_outputs",
    "pipeline",
    "pipeline_seconds",
    "plan_stages",
    "split_batch",
    "stage_costs",
]
