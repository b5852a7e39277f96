"""Micro-batch pipelining in one process: the model-parallel tutorial's ``split_size`` trick,
automated for any model a :class:`~automap.planning.Plan` splits.

A plan's *stages* are the contiguous runs of units that compute on one device. The batch is
split into ``chunks`` micro-batches; each runs the model's own ``forward`` on a thread of its
own, and a turnstile per stage lets micro-batches into that stage one at a time, in order. So
stage k works on micro-batch i while stage k+1 works on micro-batch i-1 (GPipe's fill-drain
schedule), and any model whose units a plan can place pipelines without being rewritten as an
``nn.Sequential``. Why this design, and what it costs, is in ``docs/pipeline.md``.

    >>> pipe = automap.pipeline(automap.dispatch(model, plan), chunks=4)
    >>> loss_fn(pipe(x), y).backward()  # same outputs and gradients as model(x)
"""
from automap.pipelining.cost import StageCost, best_chunks, pipeline_seconds, stage_costs
from automap.pipelining.microbatch import (batch_size, chunk_sizes, chunks_for_split_size, merge_outputs,
                                           split_batch)
from automap.pipelining.runner import Chunks, Pipeline
from automap.pipelining.stages import Stage, plan_stages
from automap.pipelining.wrap import pipeline

__all__ = ["Chunks", "Pipeline", "Stage", "StageCost", "batch_size", "best_chunks", "chunk_sizes",
           "chunks_for_split_size", "merge_outputs", "pipeline", "pipeline_seconds", "plan_stages", "split_batch",
           "stage_costs"]
