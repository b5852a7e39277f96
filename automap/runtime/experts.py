"""Streaming routed experts: an offloaded mixture-of-experts layer reads only the experts its
router picked, once the routing is known, and reads ahead the experts it guesses for the next
layer.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from automap.kinds import kind_of, torch_device
from automap.offload import HoldingSource, WeightSource
from automap.offload.transfer import read_rows
from automap.planning.experts import CacheChange, HotExperts, cache_room, reads_whole
from automap.profiling.routed import Experts, find_experts, guess_rows, routed_rows, router_of, routing_of
from automap.runtime._compile import skip_when_compiling
from automap.runtime.hooks import Hook
from automap.runtime.state import DispatchState, Group, Streamed, follow, state_of
from automap.runtime.values import send

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
        self.guess: Guess | None = None  # the next layer's experts, read while this one computes
        self.reads: ExpertReads | None = None  # the model's: whether experts are read ahead whole
        self.cache: ExpertsCache | None = None  # the model's hot experts kept in memory

    def pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self.state.undone:
            return None  # a forward racing undispatch runs on the weights in RAM
        rows = routed_rows(args, kwargs, self.experts.count) if self.experts.stacked else None
        if self.reads is not None and rows is not None:
            kept = self.cache.kept(self.experts.module) if self.cache is not None else set()
            self.reads.observe(len(set(rows) - kept), self.experts.count - len(kept))
        if self.guess is not None and rows is not None and not self.group.whole:
            self._guess_next(args, kwargs)  # first: the next layer's reads queue beside this one's
        change = self.cache.routed(self, rows) if self.cache is not None and rows is not None else None
        self._bring(rows)
        if change is not None and (change.hold or change.drop):
            self.cache.apply(change)  # in the background: the rows just read are kept from the page cache
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
    def _guess_next(self, args: tuple, kwargs: dict) -> None:
        assert self.guess is not None
        hidden = next(
            (a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and a.is_floating_point()),
            None,
        )
        routing = routing_of(args, kwargs)
        if hidden is None or routing is None or hidden.shape[-1] != self.guess.router.shape[-1]:
            return
        try:
            rows = guess_rows(hidden, self.guess.router, routing.shape[-1] if routing.dim() else 1)
        except RuntimeError as exc:  # a guess must never break a forward: stop guessing here
            log.debug("no guesses after %s: %s", self.experts.module, exc)
            self.guess = None
            return
        self.guess.reads.submit(self.transfer.source, self.guess.names, rows)

    @skip_when_compiling
    def _give_back(self) -> None:
        with torch.inference_mode(False), torch.no_grad():
            for item in self.items:
                item.tensor.data = item.home


@dataclass
class Guess:
    """What a :class:`ReadExperts` hook needs to read the next stacked experts ahead: their
    router's weight, their offloaded tensors' names, and the reads in the background."""

    router: torch.Tensor
    names: list[str]
    reads: ExpertReads


class ExpertReads(Hook):
    """The model's reading of routed experts beside their hooks: the background reads of
    guessed experts (one worker, each guess a hint: a failed or late one costs nothing but its
    bytes), and whether the streamed units read their experts ahead whole (what the last call
    routed to, by :func:`~automap.planning.experts.reads_whole`; CPU execution only). Attached to nothing;
    undispatch detaches it, which stops the worker."""

    def __init__(self, groups: list[Group]) -> None:
        super().__init__()
        self.groups = groups
        self.cache: ExpertsCache | None = None
        self._pool: ThreadPoolExecutor | None = ThreadPoolExecutor(1, thread_name_prefix="automap-experts")

    def observe(self, routed: int, whole: int) -> None:
        """A call routed to ``routed`` experts not kept in memory, of ``whole`` not kept in its
        layer: read the experts ahead whole from now on if the cost model predicts that faster
        (:func:`~automap.planning.experts.reads_whole`), by rows if not."""
        ahead = reads_whole(routed, whole)
        for group in self.groups:
            group.whole = ahead

    def submit(self, source: WeightSource, names: list[str], rows: list[int]) -> None:
        self.run(read_rows, source, names, rows)

    def run(self, work: Any, *args: Any) -> None:
        """Run ``work(*args)`` on the worker, after what was submitted before (a hint: dropped
        once undispatch stopped the worker)."""
        pool = self._pool
        if pool is None:
            return
        try:
            pool.submit(work, *args)
        except RuntimeError:  # undispatch stopped the worker meanwhile: a hint, dropped
            log.debug("background work on experts dropped: the model was undispatched")

    def settle(self) -> None:
        """Wait for the reads submitted so far (one worker: they run in order)."""
        if self._pool is not None:
            self._pool.submit(lambda: None).result()

    def forget_threads(self) -> None:
        """In a forked child: the parent's worker does not exist here; guess no more."""
        self._pool = None

    def detach(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)


class ExpertsCache:
    """The model's hot experts kept in host memory: :class:`~automap.planning.experts.HotExperts`
    (which experts, within the room the plan leaves in host RAM: :func:`cache_room`) applied to
    a source of files (:class:`~automap.offload.HoldingSource`). A kept expert's rows are private
    pages of the same map the parameter views (nothing swapped, nothing copied on the compute
    path): a cold start or the kernel's reclaim of the page cache leaves them, so its next call
    reads nothing. Kept and given back on the experts' worker, after the call that read it.

    A module whose tensors were written in place since dispatch (their version counter moved)
    is left as it is: giving back its pages would drop the write.

    ``policy.hits``/``policy.misses`` count the routed experts found kept or not, per call
    (:func:`expert_cache` gives it for a dispatched model).
    """

    def __init__(self, policy: HotExperts, source: HoldingSource, reads: ExpertReads):
        self.policy, self.source, self.reads = policy, source, reads
        self._lock = threading.Lock()  # forwards may run on several threads
        self._tensors: dict[str, list[Streamed]] = {}
        self._versions: dict[str, list[int]] = {}
        self._row_bytes: dict[str, int] = {}

    def add(self, hook: ReadExperts) -> None:
        items = [i for i in hook.items if i.streams]
        if items:
            self._tensors[hook.experts.module] = items
            self._versions[hook.experts.module] = [i.tensor._version for i in items]
            self._row_bytes[hook.experts.module] = sum(i.home.nbytes // hook.experts.count for i in items)
            hook.cache = self

    def routed(self, hook: ReadExperts, rows: list[int]) -> CacheChange | None:
        """Count one call of ``hook``'s experts on ``rows``; what to keep and give back."""
        module = hook.experts.module
        if module not in self._tensors:
            return None
        with self._lock:
            return self.policy.access([(module, r) for r in rows], self._row_bytes[module])

    def apply(self, change: CacheChange) -> None:
        self.reads.run(self._apply, change)

    def _written(self, module: str) -> bool:
        return [i.tensor._version for i in self._tensors[module]] != self._versions[module]

    def _apply(self, change: CacheChange) -> None:
        for module, row in change.drop:
            if not self._written(module):
                for item in self._tensors[module]:
                    self.source.release_rows(item.name, row)
        for module, row in change.hold:
            held = [self.source.hold_rows(item.name, row) for item in self._tensors[module]]
            if self._written(module) or not all(held):
                for item in self._tensors[module]:
                    self.source.release_rows(item.name, row)
                with self._lock:
                    self.policy.refuse((module, row))

    def kept(self, module: str) -> set[int]:
        """The experts of ``module`` kept now."""
        with self._lock:
            return {row for name, row in self.policy.held if name == module}

    @property
    def held_bytes(self) -> int:
        """Bytes of experts kept now (as the policy counts them)."""
        return self.policy.used


def link_cache(hooks: list[ReadExperts], reads: ExpertReads, state: DispatchState) -> None:
    """A cache of hot experts for the stacked experts hooks, where the plan leaves host room
    and the experts live in files (a store or a checkpoint)."""
    room = cache_room(state.plan)
    if room <= 0 or not isinstance(state.source, HoldingSource):
        return
    cache = ExpertsCache(HotExperts(room), state.source, reads)
    for hook in hooks:
        cache.add(hook)
    reads.cache = cache
    log.debug("hot experts kept in up to %d bytes of host memory", room)


def link_guesses(hooks: list[ReadExperts], modules: dict[str, nn.Module], state: DispatchState) -> None:
    """The stacked experts hooks share the model's :class:`ExpertReads`, and each guesses the
    next one's experts (in the order the units run) where the next one's router is found."""
    stacked = [h for h in hooks if h.experts.stacked]
    if not stacked:
        return
    assert state.transfer is not None
    reads = ExpertReads([] if state.transfer.swaps else [h.group for h in stacked])  # swaps: rows only
    for hook in stacked:
        hook.reads = reads
    for hook, after in zip(stacked, stacked[1:]):
        module = modules[after.experts.module]
        router = router_of(modules[after.experts.module.rpartition(".")[0]], module, after.experts.count)
        names = [i.name for i in after.items]
        if router is not None and names:
            hook.guess = Guess(router, names, reads)
    link_cache(stacked, reads, state)
    state.hooks.append(reads)


def expert_cache(model: nn.Module) -> ExpertsCache | None:
    """The hot experts a dispatched ``model`` keeps in memory (hit rate: ``.policy.hit_rate``),
    or None when it keeps none."""
    state = state_of(model)
    reads = next((h for h in state.hooks if isinstance(h, ExpertReads)), None) if state is not None else None
    return reads.cache if reads is not None else None


def hook_experts(state: DispatchState, modules: dict[str, nn.Module]) -> None:
    """Give each streamed unit's routed experts a :class:`ReadExperts` hook and take them out
    of the unit's dense part, which its own hook reads ahead."""
    added: list[ReadExperts] = []
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
            added.append(ReadExperts(experts, items, group, state).attach(modules[experts.module]))
        if taken:
            group.experts = frozenset(taken)
            log.debug("unit %s reads %d expert tensor(s) as routed", group.key, len(taken))
    state.hooks.extend(added)
    link_guesses(added, modules, state)


# ------------------------------------------------------------------ per call: CPU or streamed


def call_tokens(args: tuple, kwargs: dict) -> int:
    """The tokens a call of an experts module carries: the rows of its routing (one per token),
    else those of its first floating tensor (all dimensions but the last)."""
    routing = routing_of(args, kwargs)
    if routing is not None and routing.dim():
        return int(routing.numel() // routing.shape[-1]) if routing.dim() > 1 else int(routing.shape[0])
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim():
            return int(value.numel() // value.shape[-1])
    return 0


class ExpertsByCall(Hook):
    """Routed experts whose weights live in CPU RAM and which the CPU computes (activations
    cross the link) at small calls, but which run on the accelerator, their weights copied
    there for the call, from ``stream_from`` tokens per call: the cost model's choice per phase
    (:class:`~automap.planning.experts.ExpertsLayer`), made at each call, so that a decode step
    computes them where they are and a long prefill streams them.

    It takes the place of the unit's input hook. A streamed call holds the dispatch's lock from
    before to after (the module's tensors are swapped for the call), and happens only without
    autograd (a backward through copies would leave gradients on the accelerator): a call with
    gradients enabled computes on the CPU.
    """

    def __init__(self, home: torch.device, accelerator: torch.device, stream_from: int, state: DispatchState):
        super().__init__()
        self.home, self.accelerator, self.stream_from, self.state = home, accelerator, stream_from, state
        self.streamed_calls = 0  # how many calls ran on the accelerator (tests, benchmarks)
        self._inside = threading.local()  # per thread: the homes swapped out for this call

    def pre(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        tokens = call_tokens(args, kwargs)
        if tokens >= self.stream_from and not torch.is_grad_enabled() and not self.state.undone:
            self._swap_in(module)
            self.streamed_calls += 1
            return send(args, self.accelerator), send(kwargs, self.accelerator)
        moved_args, moved_kwargs = send(args, self.home), send(kwargs, self.home)
        return None if moved_args is args and moved_kwargs is kwargs else (moved_args, moved_kwargs)

    def post(self, module: nn.Module, args: tuple, output: Any) -> None:
        homes = getattr(self._inside, "homes", None)
        if homes is None:
            return None
        self._inside.homes = None
        try:
            with torch.inference_mode(False), torch.no_grad():
                for tensor, home in homes:
                    tensor.data = home
        finally:
            self.state.lock.release()
        return None

    @skip_when_compiling
    def _swap_in(self, module: nn.Module) -> None:
        self.state.lock.acquire()
        homes = []
        try:
            # Outside inference_mode: a Parameter cannot hold an inference tensor.
            with torch.inference_mode(False), torch.no_grad():
                for tensor in (*module.parameters(), *module.buffers()):
                    homes.append((tensor, tensor.data))
                    tensor.data = tensor.data.to(
                        self.accelerator, non_blocking=tensor.data.is_pinned(), copy=True
                    )
        except BaseException:
            with torch.inference_mode(False), torch.no_grad():
                for tensor, home in homes:
                    tensor.data = home
            self.state.lock.release()
            raise
        self._inside.homes = homes


def hook_experts_by_call(plan: Any, modules: dict[str, nn.Module], state: DispatchState) -> set[str]:
    """An :class:`ExpertsByCall` hook on each unit of routed experts in CPU RAM that the CPU
    computes and the plan streams from some token count on, to the accelerator the rest of
    their layer computes on; returns their names (they take no other input hook)."""
    if plan.experts is None:
        return set()
    placements = {u.name: p for u, p in zip(plan.units, plan.placements)}
    around: dict[str, set[str]] = {}  # layer -> where its other pieces compute
    for unit, placement in zip(plan.units, plan.placements):
        if unit.split_from and not unit.experts:
            around.setdefault(unit.split_from, set()).add(placement.compute)
    hooked = set()
    for layer in plan.experts.layers:
        placement = placements.get(layer.unit)
        if placement is None or placement.offloaded or layer.stream_from <= 0 or layer.unit not in modules:
            continue
        accelerators = {d for d in around.get(layer.layer, ()) if kind_of(d).is_accelerator}
        if not kind_of(placement.compute).is_host or len(accelerators) != 1:
            continue
        home = torch_device(placement.compute)
        state.hooks.append(
            ExpertsByCall(home, torch_device(accelerators.pop()), layer.stream_from, state).attach(
                modules[layer.unit]
            )
        )
        hooked.add(layer.unit)
    return hooked
