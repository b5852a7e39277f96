"""What each op of a trace reads of the model's weights: the most bytes of each weight one op
read, which a decode step's prediction reads from memory (an embedding's lookup gathers a few
rows of its matrix, a view reads nothing, a matmul reads all of it)."""

from __future__ import annotations

from typing import Any

import torch

from automap.profiling.metaops import op_tensors

# Ops that read only the rows of a weight they gather (an embedding's lookup).
LOOKUPS = frozenset(
    getattr(torch.ops.aten, name)
    for name in ("embedding", "embedding_bag", "_embedding_bag", "index_select", "gather", "take", "index")
)
_ALL = 1 << 62  # an op that reads the whole of each weight it is given


class WeightReads:
    """The most bytes of each weight (by state name) one op read, noted op by op."""

    def __init__(self) -> None:
        self.most: dict[str, int] = {}
        self._views: dict[Any, bool] = {}

    def of_op(self, func: Any, out: Any) -> int:
        """The most bytes of a weight argument the op ``func`` reads: none for a view (``t``,
        ``view``), the bytes it gathers for a lookup (an embedding's rows), else all of it."""
        view = self._views.get(func)
        if view is None:
            view = self._views[func] = any(
                r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns
            )
        if view:
            return 0
        if func._overloadpacket in LOOKUPS:
            return sum(o.numel() * o.element_size() for o in op_tensors((out,), {}))
        return _ALL

    def note(self, name: str, t: torch.Tensor, nbytes: int) -> None:
        """An op read up to ``nbytes`` of the weight ``name`` through ``t``."""
        nbytes = min(nbytes, t.numel() * t.element_size())
        if nbytes > self.most.get(name, 0):
            self.most[name] = nbytes
