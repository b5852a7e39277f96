"""Splitting a batch into micro-batches and joining their outputs again."""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from automap.errors import PipelineError


def batch_size(args: tuple, kwargs: Mapping[str, Any]) -> int:
    """The leading dimension of the first tensor among the inputs (the batch to split)."""
    leaves, _ = tree_flatten((args, dict(kwargs)))
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return int(leaf.shape[0])
    raise PipelineError(
        "the inputs hold no tensor with a batch dimension to split into micro-batches; "
        "pass the batch as a tensor whose first dimension is the sample index"
    )


def split_batch(args: tuple, kwargs: Mapping[str, Any], chunks: int) -> list[tuple[tuple, dict]]:
    """Split every input tensor whose first dimension is the batch into ``chunks`` parts (sizes
    differ by at most one, as ``torch.tensor_split`` makes them); other inputs go to every part.

    Raises:
        PipelineError: ``chunks`` exceeds the batch size.
    """
    batch = batch_size(args, kwargs)
    if chunks > batch:
        raise PipelineError(
            f"chunks={chunks} but the batch has only {batch} sample(s); every micro-batch "
            f"needs at least one, so use chunks <= {batch} or a larger batch"
        )
    leaves, spec = tree_flatten((args, dict(kwargs)))
    parts = [leaf.tensor_split(chunks) if _is_batched(leaf, batch) else (leaf,) * chunks for leaf in leaves]
    return [tree_unflatten([p[i] for p in parts], spec) for i in range(chunks)]


def _is_batched(value: Any, batch: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == batch


def merge_outputs(outputs: Sequence[Any]) -> Any:
    """Concatenate the micro-batches' outputs along the batch dimension, keeping their
    structure (tuples, dicts, ``ModelOutput``); ``None`` and identical non-tensors pass.

    Raises:
        PipelineError: an output is a scalar tensor (a loss) or an object (a KV cache) that
            has no batch dimension to concatenate.
    """
    flat = [tree_flatten(out) for out in outputs]
    spec = flat[0][1]
    merged = [_merge_leaf(i, [leaves[i] for leaves, _ in flat]) for i in range(len(flat[0][0]))]
    return tree_unflatten(merged, spec)


def _merge_leaf(position: int, values: list[Any]) -> Any:
    first = values[0]
    if isinstance(first, torch.Tensor):
        if first.dim() == 0:
            raise PipelineError(
                f"output #{position} is a scalar tensor (a loss?), which has no batch dimension to join "
                "across micro-batches; return per-sample outputs and compute the loss on pipe(x)"
            )
        return torch.cat(values)
    if all(v is first or v == first for v in values[1:]):
        return first
    raise PipelineError(
        f"output #{position} is a {type(first).__name__} that differs per micro-batch and cannot be joined; "
        "turn it off (for transformers models pass use_cache=False) or return tensors"
    )


def input_bytes(args: tuple, kwargs: Mapping[str, Any]) -> int:
    """Bytes of every tensor among the inputs."""
    leaves, _ = tree_flatten((args, dict(kwargs)))
    return sum(x.numel() * x.element_size() for x in leaves if isinstance(x, torch.Tensor))


def chunk_sizes(batch: int, chunks: int) -> list[int]:
    """Sizes of the micro-batches :func:`split_batch` makes (the tutorial's ``split_size`` is the first)."""
    return [batch // chunks + (1 if i < batch % chunks else 0) for i in range(chunks)]


def chunks_for_split_size(batch: int, split_size: int) -> int:
    """The tutorial's ``split_size`` (samples per micro-batch) as a chunk count."""
    return max(1, math.ceil(batch / split_size))
