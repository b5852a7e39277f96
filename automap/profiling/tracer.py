"""The traced run: one forward (and backward) on the meta device, counting FLOPs per segment (a
unit's call, or the code before the next unit) and following each storage from its producer to
its readers, for flows between units and activation peaks.
"""

from __future__ import annotations

import bisect
import logging
import weakref
from collections import Counter, defaultdict
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from automap.profiling.fallback import MetaLimit, meta_limit
from automap.profiling.metarules import flop_formulas
from automap.profiling.metaops import (
    MemoTable,
    arg_specs,
    decomposes,
    op_tensors,
    pack_saved,
    storage_of,
    tensors_in,
    unique_bytes,
)
from automap.profiling.result import INPUT, OUTPUT, Flow, TraceResult
from automap.profiling.weight_reads import WeightReads

log = logging.getLogger(__name__)

_INPUT_SEG, _OUTPUT_SEG = -1, -2


@dataclass
class _Segment:
    unit: str | None  # innermost unit running; None between units
    frontier: int  # units first-called when the segment began


@dataclass
class _Storage:
    uid: int
    segment: int
    nbytes: int
    ref: weakref.ref
    saved: bool = False  # autograd saved it for the backward: a forward with grad keeps it


@dataclass
class _Call:
    name: str
    entry_live: int
    peak_live: int
    input_bytes: int


def _state_storages(state: Mapping[str, torch.Tensor]) -> dict[int, str]:
    """The first name of each storage of the model's weights, by ``id``."""
    names: dict[int, str] = {}
    for name, t in state.items():
        st = storage_of(t)
        if st is not None:
            names.setdefault(id(st), name)
    return names


class Tracer(TorchDispatchMode):
    """Attributes ops, FLOPs, tensor flows and live bytes to units (see the module docstring)."""

    def __init__(self, state: Mapping[str, torch.Tensor], record_inputs: bool, probe_backward: bool) -> None:
        super().__init__()
        self.total_flops = 0
        self.record_inputs = record_inputs
        self.probe_backward = probe_backward
        self.in_backward = False
        self.state_storage = _state_storages(state)
        self.segments: list[_Segment] = []
        self.seg_flops: list[int] = []
        self.seg_ops: list[int] = []
        self.marks: list[int] = []
        self.bwd_flops: dict[int, int] = defaultdict(int)
        self.result = TraceResult()
        self.position: dict[str, int] = {}
        self.calls: Counter[str] = Counter()
        self.active: list[_Call] = []
        self.storages: dict[int, _Storage] = {}
        self.live = 0
        self.peak = 0
        self.kept = 0  # bytes freed in this trace that a forward with grad would keep for its backward
        self.train_peak = 0
        self.raw_flows: dict[tuple[int, int, tuple], tuple[int, int]] = {}
        self.seg_use: dict[str, int] = {}
        self.readers: defaultdict[str, set[str | None]] = defaultdict(set)
        self._uid = 0
        self._probing = False
        self._leaf: torch.Tensor | None = None
        self._writes: dict[Any, bool] = {}
        self.weight_reads = WeightReads()
        self.memo = MemoTable()
        self.flop_formulas = flop_formulas()  # FlopCounterMode's, and grouped matmuls' (metarules.py)
        self.fused = 0
        self._assumed = False

    # ------------------------------------------------------------------ dispatch

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self._probing:
            return func(*args, **kwargs)
        if func is torch.ops.aten._local_scalar_dense.default and args[0].is_meta:
            return self._truth(args[0])
        formula = self.flop_formulas.get(func._overloadpacket)
        if formula is None and decomposes(func):
            # As FlopCounterMode does: an op without a formula is counted through its decomposition.
            with self:
                decomposed = func.decompose(*args, **kwargs)
            if decomposed is not NotImplemented:
                return decomposed
        try:
            out, flops = self.memo.run(func, formula, args, kwargs)
        except (RuntimeError, NotImplementedError) as exc:
            limit = meta_limit(func, args, kwargs, exc)
            if limit is None:
                raise
            raise limit from exc
        self.total_flops += flops
        if self.in_backward:
            self._backward_op(flops)
        else:
            self._forward_op(func, args, kwargs, out, flops)
        return out

    def _truth(self, t: torch.Tensor) -> bool:
        """A yes/no question about values meta tensors lack (``if mask.all():``) is answered
        yes, the common case (no padding, not packed); any other value cannot be made up.

        Raises:
            MetaLimit: the model reads a number from a tensor.
        """
        if t.dtype != torch.bool:
            raise MetaLimit(
                f"it reads a {str(t.dtype).removeprefix('torch.')} value from a tensor "
                "(Tensor.item() or int(tensor)), and meta tensors have no values"
            )
        if not self._assumed:
            log.info("the model branches on a tensor's value; on meta it is taken as True")
            self._assumed = True
        return True

    def _forward_op(self, func: Any, args: tuple, kwargs: dict, out: Any, flops: int) -> None:
        seg = len(self.segments) - 1
        self.seg_flops[seg] += flops
        self.seg_ops[seg] += 1
        weight_read = self.weight_reads.of_op(func, out)
        for t in op_tensors(args, kwargs):
            self._read(t, seg, weight_read)
        writes = self._writes.get(func)
        if writes is None:
            writes = self._writes[func] = any(
                a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments
            )
        for t in op_tensors((out,), {}):
            self._wrote(t, seg, writes)

    def _read(self, t: torch.Tensor, seg: int, weight_read: int = 0) -> None:
        st = storage_of(t)
        if st is None:
            return
        name = self.state_storage.get(id(st))
        if name is not None:
            self.weight_reads.note(name, t, weight_read)
            self.seg_use.setdefault(name, seg)
            self.readers[name].add(self.segments[seg].unit)
            return
        rec = self.storages.get(id(st))
        if rec is not None and rec.segment != seg:
            view = (rec.uid, t.storage_offset(), tuple(t.shape), tuple(t.stride()))
            self.raw_flows[(rec.segment, seg, view)] = (t.numel() * t.element_size(), rec.nbytes)

    def _wrote(self, t: torch.Tensor, seg: int, writes: bool) -> None:
        st = storage_of(t)
        if st is None or id(st) in self.state_storage:
            return
        rec = self.storages.get(id(st))
        if rec is None:
            self._track(st, seg)
        elif writes:
            rec.segment = seg  # an in-place op makes new data: `out += identity`

    def _track(self, st: torch.UntypedStorage, seg: int) -> None:
        key, uid = id(st), self._uid
        self._uid += 1
        ref = weakref.ref(st, lambda _r: self._free(key, uid))
        self.storages[key] = _Storage(uid, seg, 0, ref)
        if not self.fused:
            self._count(self.storages[key], st.nbytes())

    def _count(self, rec: _Storage, nbytes: int) -> None:
        rec.nbytes = nbytes
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        self.train_peak = max(self.train_peak, self.live + self.kept)
        for call in self.active:
            call.peak_live = max(call.peak_live, self.live)

    def fused_output(self, out: Any) -> None:
        """Count the result of a fused kernel, whose intermediates were not counted."""
        for t in tensors_in(out):
            st = storage_of(t)
            rec = self.storages.get(id(st)) if st is not None else None
            if rec is not None and rec.nbytes == 0:
                self._count(rec, st.nbytes())  # type: ignore[union-attr]

    def _free(self, key: int, uid: int) -> None:
        rec = self.storages.get(key)
        if rec is not None and rec.uid == uid:
            del self.storages[key]
            self.live -= rec.nbytes
            if rec.saved and not self.in_backward:
                self.kept += rec.nbytes

    def keep(self, nbytes: int) -> None:
        """Count ``nbytes`` kept until the backward that no traced op made (a fused kernel's own
        saved state)."""
        self.kept += nbytes
        self.train_peak = max(self.train_peak, self.live + self.kept)

    def pack_saved(self, t: torch.Tensor) -> tuple:
        """:func:`~automap.profiling.metaops.pack_saved`, noting that a forward with grad keeps
        ``t``'s storage until the backward (``train_peak``)."""
        st = storage_of(t)
        rec = self.storages.get(id(st)) if st is not None and not self.in_backward else None
        if rec is not None:
            rec.saved = True
        return pack_saved(t)

    def _backward_op(self, flops: int) -> None:
        node = torch._C._current_autograd_node()
        seg = len(self.segments) - 1
        if node is not None:
            seg = max(bisect.bisect_right(self.marks, node._sequence_nr()) - 1, 0)
        self.bwd_flops[seg] += flops

    # ----------------------------------------------------------------- segments

    def begin(self, unit: str | None) -> None:
        """Start a segment: a unit call begins or ends."""
        self.segments.append(_Segment(unit, len(self.result.order)))
        self.seg_flops.append(0)
        self.seg_ops.append(0)
        self.marks.append(self._sequence_number() if self.probe_backward else 0)

    @contextmanager
    def probing(self) -> Iterator[None]:
        """Inside, ops run untraced: tensors made to ask torch something are not the model's."""
        self._probing = True
        try:
            yield
        finally:
            self._probing = False

    def _sequence_number(self) -> int:
        """The autograd sequence number now: nodes created later have larger ones."""
        with self.probing():
            with torch.enable_grad():
                if self._leaf is None:
                    self._leaf = torch.zeros((), device="meta", requires_grad=True)
                return int(self._leaf.view_as(self._leaf).grad_fn._sequence_nr())  # type: ignore[union-attr]

    def pre_hook(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if name not in self.position:
                self.position[name] = len(self.result.order)
                self.result.order.append(name)
                if self.record_inputs:
                    self.result.unit_inputs[name] = arg_specs((args, kwargs))
            self.calls[name] += 1
            self.active.append(_Call(name, self.live, self.live, unique_bytes((args, kwargs))))
            self.begin(name)

        return hook

    def post_hook(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            call = self.active.pop()
            r = self.result
            r.input_bytes[name] = max(r.input_bytes.get(name, 0), call.input_bytes)
            r.output_bytes[name] = max(r.output_bytes.get(name, 0), unique_bytes(output))
            peak = call.input_bytes + call.peak_live - call.entry_live
            r.peak_bytes[name] = max(r.peak_bytes.get(name, 0), peak)
            self.begin(self.active[-1].name if self.active else None)

        return hook

    def add_inputs(self, tree: Any) -> None:
        for t in tensors_in(tree):
            st = storage_of(t)
            if st is not None and id(st) not in self.storages and id(st) not in self.state_storage:
                self._track(st, _INPUT_SEG)

    def add_outputs(self, tree: Any) -> None:
        for t in tensors_in(tree):
            self._read(t, _OUTPUT_SEG)

    def where(self) -> str:
        """Where the forward is now, for error messages."""
        if self.active:
            call = self.active[-1]
            return f"inside unit {call.name!r} (call {self.calls[call.name]})"
        if self.result.order:
            return f"after unit {self.result.order[-1]!r}, in code between units"
        return "before the first unit"

    # ------------------------------------------------------------------ results

    def finish(self, total_flops: int) -> TraceResult:
        """Resolve segments to units and return the per-unit results."""
        owner, tpos = self._resolve()
        r = self.result
        r.calls = dict(self.calls)
        for seg, unit in enumerate(owner):
            if unit is not None:
                r.flops[unit] = r.flops.get(unit, 0) + self.seg_flops[seg]
                r.ops[unit] = r.ops.get(unit, 0) + self.seg_ops[seg]
                if self.probe_backward and not r.stopped:  # else not measured: 0, never a guess
                    r.train_flops[unit] = (
                        r.train_flops.get(unit, 0) + self.seg_flops[seg] + self.bwd_flops.get(seg, 0)
                    )
        r.first_use = {name: unit for name, seg in self.seg_use.items() if (unit := owner[seg]) is not None}
        r.readers = {name: frozenset(units) for name, units in self.readers.items()}
        r.flows = self._flows(owner, tpos)
        r.total_flops = total_flops
        r.forward_peak = self.peak
        r.weight_reads = dict(self.weight_reads.most)
        r.train_peak = self.train_peak if self.probe_backward else 0
        return r

    def producers(self) -> dict[int, str]:
        """The unit that produced (or last wrote) each storage alive now, by ``id``."""
        owner, _ = self._resolve()
        return {
            key: unit
            for key, rec in self.storages.items()
            if rec.segment >= 0 and (unit := owner[rec.segment]) is not None
        }

    def _resolve(self) -> tuple[list[str | None], list[int]]:
        """Each segment's unit and execution position; code between units goes to the next
        unit to run for the first time (or the last unit, after the last one)."""
        order = self.result.order
        owner: list[str | None] = []
        tpos: list[int] = []
        for seg in self.segments:
            if seg.unit is not None:
                owner.append(seg.unit)
                tpos.append(max(seg.frontier - 1, 0))
            elif not order:
                owner.append(None)
                tpos.append(0)
            else:
                k = min(seg.frontier, len(order) - 1)
                owner.append(order[k])
                tpos.append(k)
        return owner, tpos

    def _flows(self, owner: list[str | None], tpos: list[int]) -> list[Flow]:
        end_of_model = len(self.result.order)
        tensor_ids: dict[tuple, int] = {}
        flows: set[Flow] = set()
        for (ps, cs, view), (nbytes, storage_bytes) in self.raw_flows.items():
            src = INPUT if ps == _INPUT_SEG else owner[ps]
            dst = OUTPUT if cs == _OUTPUT_SEG else owner[cs]
            if src is None or dst is None or src == dst:
                continue
            start = -1 if ps == _INPUT_SEG else tpos[ps]
            end = end_of_model if cs == _OUTPUT_SEG else max(tpos[cs], start)
            tid = tensor_ids.setdefault(view, len(tensor_ids))
            flows.add(Flow(src, dst, start, end, tid, view[0], nbytes, storage_bytes))
        return sorted(flows, key=lambda f: (f.start, f.end, f.src, f.dst, f.tensor))
