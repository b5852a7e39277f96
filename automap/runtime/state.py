"""What a dispatched model carries: its plan, hook objects, original devices, streamed tensors
and their weight source, found through :func:`state_of`; and the :class:`Gate` that lets
:func:`automap.undispatch` wait for forwards in flight."""

from __future__ import annotations

import os
import threading
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch import nn

from automap.errors import DispatchError
from automap.offload import SourceStats, Transfer, WeightSource
from automap.planning import Plan
from automap.runtime.hooks import Hook


@dataclass(eq=False)
class Streamed:
    """An offloaded tensor: the live object in the model, its name in the source, what it
    holds between uses (``home``), whether it is a buffer, and — on an accelerator, where a
    copy stands in for it while a unit runs — how many units hold it in and its version
    counter when it went in (to write back what they changed).

    ``view`` is the source's real CPU tensor (a copy-on-write view of a file, or host RAM),
    ``home`` at dispatch. torch's API may rebind the tensor's data (``param.data = t``,
    ``m.apply(...)``) or replace the object in its module (``load_state_dict(assign=True)``,
    ``m.weight = Parameter(...)``): :func:`follow` then adopts what the model holds now as the
    home, which is what forwards use and what :func:`automap.undispatch` keeps. ``slot`` is
    the module table and key the tensor sits under, to find a replaced object."""

    tensor: torch.Tensor
    name: str
    home: torch.Tensor
    is_buffer: bool
    users: int = 0
    version: int = 0
    view: torch.Tensor | None = None
    slot: tuple[dict[str, Any], str] | None = None

    def __post_init__(self) -> None:
        if self.view is None:
            self.view = self.home

    @property
    def streams(self) -> bool:
        """Whether the home is still the source's tensor (nothing adopted)."""
        return self.home is self.view


def holds(tensor: torch.Tensor, home: torch.Tensor) -> bool:
    """Whether ``tensor``'s data is ``home`` (same memory, layout and dtype)."""
    return (
        tensor.data_ptr() == home.data_ptr()
        and tensor.dtype == home.dtype
        and tensor.shape == home.shape
        and tensor.device == home.device
        and tensor.stride() == home.stride()
    )


def data_ptr(tensor: torch.Tensor) -> int:
    """Where ``tensor``'s data starts; 0 when it has none: empty, or a wrapper of torch.func's
    transforms (``functional_call`` inside ``torch.func.grad``), which has no storage of its own."""
    if not tensor.numel():
        return 0
    try:
        return tensor.data_ptr()
    except RuntimeError:
        return 0


def follow(item: Streamed, streamed: dict[int, Streamed]) -> bool:
    """Catch up with what torch's API did to ``item``'s tensor since dispatch, between uses:
    a replaced object is followed in its module, rebound data becomes the home (adopted).

    Returns:
        False when the tensor's slot now holds another offloaded tensor, a stand-in of
        torch.func's transforms, or nothing (nothing left to bring in for this item), else True.
    """
    if item.slot is not None:
        table, key = item.slot
        live = table[key] if key in table else None  # a TorchScript module's tables have no get()
        if live is None or (live is not item.tensor and id(live) in streamed):
            return False
        if live.numel() and not data_ptr(live):  # torch.func's stand-in for this call: not ours to move
            return False
        item.tensor = live
    if not holds(item.tensor, item.home):
        item.home = item.tensor.data
    return True


@dataclass(eq=False)
class Group:
    """The offloaded tensors one unit needs (its own and tied ones owned elsewhere), and the
    group expected to run after it (prefetched while this one computes). ``experts``: the names
    of those its routed experts hold, which their own hooks read once the routing is known
    (:mod:`automap.runtime.experts`); the rest is the unit's *dense* part, read ahead (with the
    experts, whole, while ``whole``: when most experts are routed to, reading whole layers ahead
    beats reading most of them on demand)."""

    key: str
    where: str
    items: list[Streamed]
    next: Group | None = None
    experts: frozenset[str] = frozenset()
    whole: bool = False  # read the experts ahead too, whole (most of them are routed to: CPU execution)

    @property
    def names(self) -> list[str]:
        return [i.name for i in self.items]

    @property
    def dense(self) -> list[Streamed]:
        """The items the unit's own hook brings in (all but the routed experts')."""
        return [i for i in self.items if i.name not in self.experts]

    @property
    def ahead(self) -> list[Streamed]:
        """The items read ahead of the unit: its dense part, and its experts when ``whole``."""
        return self.items if self.whole else self.dense


class Gate:
    """Forwards in flight through a dispatched model, per thread, so that
    :func:`automap.undispatch` waits for them to finish (and refuses new ones meanwhile)
    instead of pulling weights from under them. The model's own hook enters and leaves it.

    A forward starting while an undispatch runs waits for its end, then is refused (or goes on,
    if the undispatch failed and the model stays dispatched): refused at once, it would leave
    torch's call of the model through its error path, which walks the model's live hook table
    while the undispatch removes hooks from it ("OrderedDict mutated during iteration")."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._active: dict[int, int] = {}  # thread id -> forwards of the model it is inside
        self.closed = False
        self.done = False  # the undispatch finished: the model is plain

    def enter(self, model: str) -> None:
        with self._cond:
            me = threading.get_ident()
            if self.closed and me not in self._active:  # a thread inside a forward finishes it
                while self.closed and not self.done:
                    self._cond.wait()
            if self.done:
                raise DispatchError(
                    f"{model} was undispatched by another thread (automap.undispatch) as this "
                    "forward started; run it again on the undispatched model, or dispatch it again"
                )
            self._active[me] = self._active.get(me, 0) + 1

    def leave(self) -> None:
        with self._cond:
            me = threading.get_ident()
            left = self._active.get(me, 0) - 1
            if left > 0:
                self._active[me] = left
            else:
                self._active.pop(me, None)
                self._cond.notify_all()

    def close(self) -> None:
        """Hold new forwards (:meth:`enter`) and wait until no *other* thread is inside one (the
        calling thread's own are its business; a thread that died inside one no longer counts)."""
        with self._cond:
            self.closed = True
            while True:
                alive = {t.ident for t in threading.enumerate()}
                if not any(t != threading.get_ident() and t in alive for t in self._active):
                    return
                self._cond.wait(0.05)

    def reopen(self) -> None:
        """The undispatch failed: forwards go on (those waiting too)."""
        with self._cond:
            self.closed = False
            self._cond.notify_all()

    def finish(self) -> None:
        """The undispatch finished: forwards waiting for it are refused."""
        with self._cond:
            self.done = True
            self._cond.notify_all()


@dataclass
class DispatchState:
    """Everything :func:`automap.undispatch` needs, and what :func:`automap.placement` reads.

    Attributes:
        plan: the plan the model was dispatched with.
        hooks: hook objects attached to the model's modules (detached by undispatch).
        tensor_hooks: handles of hooks on tensors (refusing gradients of offloaded weights).
        refusing: which tensors have one (an offloaded weight unfrozen after dispatch gets
            its own at its unit's next forward with gradients on).
        original: id of each tensor dispatch moved -> (the tensor, the device it was on).
        source: where offloaded tensors live between uses (None: nothing is offloaded).
        owned: the sources this dispatch created or was handed (closed by undispatch).
        transfer: brings offloaded weights to the execution device.
        streamed: id of each offloaded tensor -> its :class:`Streamed` record.
        groups: one per unit that streams weights, in plan order.
        replaced: meta tensors replaced by real ones, by id of the replacement (rollback).
        lock: held while a unit runs with weights swapped in (accelerator execution), so that
            forwards from several threads take turns through streamed units.
        gate: forwards in flight, which undispatch waits for.
        undoing: held by undispatch (one at a time per model).
        undone: set (under ``lock``) once undispatch put the weights back; a streamed unit's
            hook that runs later (a forward racing undispatch) refuses with DispatchError.
        guard: what refuses or reroutes torch's own API on the dispatched model (``.to``,
            ``.half``, pickling, ``state_dict``), see :mod:`automap.runtime.guard`.
    """

    plan: Plan
    hooks: list[Hook] = field(default_factory=list)
    tensor_hooks: list[torch.utils.hooks.RemovableHandle] = field(default_factory=list)
    refusing: set[int] = field(default_factory=set)  # ids of the offloaded tensors with a refusing hook
    original: dict[int, tuple[torch.Tensor, torch.device]] = field(default_factory=dict)
    source: WeightSource | None = None
    owned: list[WeightSource] = field(default_factory=list)
    transfer: Transfer | None = None
    streamed: dict[int, Streamed] = field(default_factory=dict)
    groups: list[Group] = field(default_factory=list)
    replaced: dict[int, torch.Tensor] = field(default_factory=dict)
    lock: threading.RLock = field(default_factory=threading.RLock)
    gate: Gate = field(default_factory=Gate)
    undoing: threading.Lock = field(default_factory=threading.Lock)
    undone: bool = False
    guard: Any = None
    root: weakref.ref[nn.Module] | None = None
    members: list[weakref.ref[nn.Module]] = field(default_factory=list)
    finalizers: list[weakref.finalize] = field(default_factory=list)

    @property
    def model(self) -> nn.Module | None:
        """The module that was dispatched, or None once it was collected (a part of it kept)."""
        return self.root() if self.root is not None else None

    def live(self) -> list[nn.Module]:
        """The modules of the dispatch still alive (the whole model, or the parts a user kept)."""
        return [m for m in (ref() for ref in self.members) if m is not None]

    def release(self) -> None:
        """The last module of the dispatch was collected without :func:`automap.undispatch`:
        stop the transfer's workers, drop the hooks on offloaded tensors and give up the
        sources (the store's lock: the next dispatch of the same weights reuses it). Runs
        from the garbage collector, in whatever thread it ran in."""
        if self.undone:
            return
        self.undone = True
        for handle in self.tensor_hooks:
            handle.remove()
        for hook in self.hooks:
            try:
                hook.detach()
            except RuntimeError:  # a worker of the hook's own pool collected the model: it stops by itself
                pass
        if self.transfer is not None:
            try:
                self.transfer.close()
            except RuntimeError:  # run by one of the transfer's own workers, which cannot join itself
                pass
        for source in self.owned:
            source.close()
        self.streamed.clear()
        self.groups.clear()
        self.original.clear()

    def streamed_ids(self) -> set[int]:
        """ids of the model's tensors that live in the weight source now (what torch's API
        rebound or replaced since dispatch is the model's own, not the source's)."""
        return {id(i.tensor) for i in self.streamed.values() if i.streams and holds(i.tensor, i.home)}

    def stats(self) -> SourceStats:
        """Bytes behind the offloaded tensors (files, RAM, pinned, written copy-on-write),
        including the transfer's pinned staging buffer."""
        found = self.source.stats() if self.source is not None else SourceStats()
        pinned = self.transfer.pinned_bytes if self.transfer is not None else 0
        return found + SourceStats(pinned_bytes=pinned)


# Every module a dispatch hooked or guarded -> that dispatch's state: a part the user keeps after
# dropping the model (``model = peft_model.merge_and_unload()``, ``backbone = model.backbone;
# del model``) still knows its dispatch, so it can be converted, undispatched or dispatched again.
_STATES: weakref.WeakKeyDictionary[nn.Module, DispatchState] = weakref.WeakKeyDictionary()


def state_of(model: nn.Module) -> DispatchState | None:
    """The dispatch state ``model`` belongs to (it was dispatched, or is a part of a module that
    was), or None when it is not dispatched (or not a module)."""
    return _STATES.get(model) if isinstance(model, nn.Module) else None


def remember(model: nn.Module, state: DispatchState) -> None:
    """Record that ``model`` and each of its modules belong to ``state``; when the last of them
    is collected, the state is released (:meth:`DispatchState.release`)."""
    modules = list(model.modules())
    left = [len(modules)]

    def collected() -> None:
        left[0] -= 1
        if left[0] == 0:
            state.release()

    state.root = weakref.ref(model)
    for module in modules:
        _STATES[module] = state
        state.members.append(weakref.ref(module))
        state.finalizers.append(weakref.finalize(module, collected))


def forget(state: DispatchState) -> None:
    """Drop ``state`` from every module it was recorded on (after :func:`automap.undispatch`
    undid it, or a dispatch failed)."""
    for finalizer in state.finalizers:
        finalizer.detach()
    state.finalizers.clear()
    for module in state.live():
        if _STATES.get(module) is state:
            del _STATES[module]


def _stop_prefetch_in_child() -> None:
    """A forked child (a DataLoader worker) has none of its parent's threads, but inherits its
    transfers, whose worker pool believes its idle threads still run: a prefetch queued there
    is never done, and the forward that waits for it hangs for ever. Each transfer (and each
    reader of guessed experts) starts afresh without prefetching in the child, taking no lock a
    parent's thread may have held at the fork; its forwards read their pages as they fault
    them in, with the same values."""
    for state in {id(s): s for s in list(_STATES.values())}.values():
        if state.transfer is not None:
            state.transfer.forget_threads()
        for hook in state.hooks:
            forget = getattr(hook, "forget_threads", None)  # ExpertReads: its worker is the parent's
            if forget is not None:
                forget()


os.register_at_fork(after_in_child=_stop_prefetch_in_child)


# Models a dispatch or load is placing now, and the thread doing it: the check that a model is
# not dispatched and the record that it is being dispatched are one step (under the lock), so
# two threads dispatching one model cannot both pass the check and hook it twice.
_CLAIMS_LOCK = threading.Lock()
_CLAIMS: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()


@contextmanager
def claimed(model: nn.Module) -> Iterator[None]:
    """Hold ``model`` for this thread's dispatch (or load) while inside: another thread's
    dispatch of it, or of a model sharing a module with it, is refused meanwhile. Nested
    claims by the same thread (load, then the dispatch it ends with) are one claim.

    Raises:
        DispatchError: ``model`` is dispatched, or another thread is dispatching it (or a
            model sharing a module with it).
    """
    me = threading.get_ident()
    nested = True  # until this call is known to take a claim of its own (an interrupt may come anywhere)
    try:
        with _CLAIMS_LOCK:
            nested = _CLAIMS.get(model) == me
            if not nested and model in _CLAIMS:
                raise DispatchError(
                    f"{type(model).__name__} is being dispatched (or loaded) by another thread right now; a model "
                    "is dispatched once: wait for that call and use the model it returns, or give each thread its "
                    "own model (copy.deepcopy)"
                )
            check_not_dispatched(model)
            _CLAIMS[model] = me
        yield
    finally:
        if not nested:
            with _CLAIMS_LOCK:
                if _CLAIMS.get(model) == me:
                    del _CLAIMS[model]


def check_not_dispatched(model: nn.Module) -> None:
    """Raise :class:`DispatchError` when ``model`` is dispatched already, by automap or by
    accelerate (before planning it again, which would fail on the hooked model with a less
    useful message)."""
    state = _STATES.get(model)
    if state is not None and state.model is model:
        raise DispatchError(
            f"{type(model).__name__} is already dispatched; call automap.undispatch(model) first"
        )
    check_no_overlap(model)
    check_no_accelerate_hooks(model)


def check_no_overlap(model: nn.Module) -> None:
    """Raise :class:`DispatchError` when ``model`` shares a module with a model automap
    dispatched, or another thread is dispatching (:func:`claimed`): a submodule dispatched alone, ``model`` itself a part of a dispatched model, or
    a module both hold. A second dispatch would hook and guard that module twice, and undoing
    either one would leave the other's hooks and overrides behind."""
    mine = {id(module): name for name, module in model.named_modules(remove_duplicate=False)}
    what = type(model).__name__
    for name, module in model.named_modules(remove_duplicate=False):
        state = _STATES.get(module)
        if state is not None and state.model is None and not state.undone:
            raise DispatchError(
                f"{what}'s module {name or '(the model)'!r} ({type(module).__name__}) is still hooked by an earlier "
                "dispatch whose model is gone; call automap.undispatch on it first (automap.dispatch and "
                "automap.load do that themselves)"
            )
    roots = {id(r): r for r in (s.model for s in list(_STATES.values())) if r is not None}
    for other in list(roots.values()) + [m for m in list(_CLAIMS.keys()) if m is not model]:
        theirs = next((name for name, module in other.named_modules() if id(module) in mine), None)
        if theirs is None:
            continue
        kind = type(other).__name__
        if id(other) in mine:
            raise DispatchError(
                f"{what}'s submodule {mine[id(other)]!r} ({kind}) is dispatched already; call "
                f"automap.undispatch on it first, then dispatch the whole {what} once"
            )
        if any(module is model for module in other.modules()):
            raise DispatchError(
                f"{what} is a part of a {kind} that automap dispatched; a model is dispatched as one: call "
                f"automap.undispatch on that {kind} first, or leave this part placed as the whole model's plan put it"
            )
        raise DispatchError(
            f"{what} shares its module {mine[id(other.get_submodule(theirs))]!r} with a {kind} that automap dispatched "
            f"(its {theirs!r}); dispatching both would hook it twice: call automap.undispatch on that {kind} first, "
            "or give each model its own copy (copy.deepcopy)"
        )


def check_no_accelerate_hooks(model: nn.Module) -> None:
    """Refuse a model that accelerate dispatched (``dispatch_model``, ``cpu_offload``,
    ``from_pretrained(device_map=...)``): its hooks replace the modules' forwards and move
    weights behind automap's back. automap does not remove them itself: only the caller knows
    whether the weights they would leave on meta matter."""
    hooked = [
        name or "(the model)"
        for name, module in model.named_modules()
        if hasattr(module, "_hf_hook") and _moves_weights(module._hf_hook)
    ]
    if hooked:
        raise DispatchError(
            f"{type(model).__name__} is dispatched by accelerate: {len(hooked)} module(s) carry its hooks (first "
            f"{hooked[:3]}). Remove them before automap places it: from accelerate.hooks import "
            "remove_hook_from_module; remove_hook_from_module(model, recurse=True) — weights accelerate offloaded "
            "come back only if the model had them before its dispatch; otherwise load it with automap.load, or "
            "from_pretrained without device_map"
        )


def _moves_weights(hook: object) -> bool:
    """Whether an accelerate hook places or streams weights. transformers' ``generate`` adds to
    the encoder of a model with ``hf_device_map`` (which automap's drop-ins set, as accelerate
    does) an ``AlignDevicesHook(io_same_device=True)`` that only returns the encoder's outputs
    on its input's device: no dispatch of accelerate's, and no reason to refuse the next one."""
    from accelerate.hooks import AlignDevicesHook, SequentialHook  # installed: a module carries its hook

    hooks = hook.hooks if isinstance(hook, SequentialHook) else (hook,)
    return not all(
        isinstance(h, AlignDevicesHook)
        and h.execution_device is None
        and not h.offload
        and h.weights_map is None
        and not h.place_submodules
        for h in hooks
    )
