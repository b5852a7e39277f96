"""Streaming routed experts: an offloaded mixture-of-experts layer reads only the experts its
router picked.

A streamed unit's own hook (:class:`~automap.runtime.streaming.StreamWeights`) reads ahead its
*dense* part: attention, norms, router, shared experts. Its routed experts
(:func:`automap.profiling.routed.find_experts`) are left to a :class:`ReadExperts` hook on the
module that holds them, which runs once the routing is known:

- a **stacked** experts module (transformers' fused ``experts``) receives the routing as an
  argument; the hook reads the routed experts' rows of its tensors, every range at once with
  several requests in flight (:meth:`~automap.offload.Transfer.take_rows`). The rows of experts
  no token went to are never read: from a cold disk, a top-2-of-8 layer reads a quarter of its
  expert bytes.
- a **listed** expert (one module of an ``nn.ModuleList``) is called only when routed to; the
  hook reads it whole, then.

On CPU execution the weights are the source's views, so the hook only reads pages in. On an
accelerator (weights swapped in for the call) it swaps in device tensors that hold the routed
rows — the others are never read by any experts implementation, which follow the routing — and
swaps the homes back after, as the unit's hook does for its own weights, inside the unit's lock.
"""
from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from automap.kinds import torch_device
from automap.profiling.routed import Experts, find_experts, routed_rows
from automap.runtime._compile import skip_when_compiling
from automap.runtime.hooks import Hook
from automap.runtime.state import DispatchState, Group, Streamed, follow

log = logging.getLogger(__name__)


class ReadExperts(Hook):
    """Reads the routed experts of one module of a streamed unit when it is called.

    Args:
        experts: the module's routed experts.
        items: their offloaded tensors.
        group: the streamed unit they belong to.
        state: the model's dispatch state (transfer, streamed tensors).
    """

    def __init__(self, experts: Experts, items: list[Streamed], group: Group, state: DispatchState):
        super().__init__()
        assert state.transfer is not None
        self.experts, self.items, self.group, self.state = experts, items, group, state
        self.transfer = state.transfer
        self.device = torch_device(state.plan.execution_device)

    def pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self.state.undone:
            return None  # a forward racing undispatch runs on the weights in RAM
        rows = routed_rows(args, kwargs, self.experts.count) if self.experts.stacked else None
        self._bring(rows)
        return None

    def post(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self.transfer.swaps:
            self._give_back()
        return None

    @skip_when_compiling
    def _bring(self, rows: list[int] | None) -> None:
        live = [i for i in self.items if follow(i, self.state.streamed)]
        names = [i.name for i in live if i.streams]
        got = self.transfer.take_rows(f"{self.experts.module}@experts", names, rows) if names else {}
        if not self.transfer.swaps:
            return
        with torch.inference_mode(False):  # a Parameter cannot hold an inference tensor
            for item in live:
                item.tensor.data = got[item.name] if item.streams else item.home.to(self.device)

    @skip_when_compiling
    def _give_back(self) -> None:
        with torch.inference_mode(False), torch.no_grad():
            for item in self.items:
                item.tensor.data = item.home


def hook_experts(state: DispatchState, modules: dict[str, nn.Module]) -> None:
    """Give each streamed unit's routed experts a :class:`ReadExperts` hook and take them out
    of the unit's dense part, which its own hook reads ahead."""
    hooked: set[str] = set()  # a module of experts gets one hook, from the first unit streaming it
    for group in state.groups:
        by_name = {i.name: i for i in group.items}
        taken: set[str] = set()
        for experts in find_experts(modules[group.key], group.key):
            items = [by_name[n] for n in experts.tensors if n in by_name and n not in taken]
            if not items or experts.module in hooked:
                continue
            hooked.add(experts.module)
            taken.update(i.name for i in items)
            state.hooks.append(ReadExperts(experts, items, group, state).attach(modules[experts.module]))
        if taken:
            group.experts = frozenset(taken)
            log.debug("unit %s reads %d expert tensor(s) as routed", group.key, len(taken))
