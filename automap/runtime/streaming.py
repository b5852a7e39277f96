"""The hook of a unit whose weights are offloaded (:class:`StreamWeights`), and the model's check
of the files behind them (:class:`CheckFiles`).

Invariant: between forwards every offloaded tensor holds its home (a real CPU tensor of its weight
source), so state_dict, printing and optimizers see true values at all times.
"""

from __future__ import annotations

import logging
import threading
from contextlib import AbstractContextManager, ExitStack, nullcontext
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from automap.errors import DispatchError
from automap.kinds import torch_device
from automap.offload import Transfer
from automap.runtime._compile import skip_when_compiling
from automap.runtime.gradients import refuse_gradients
from automap.runtime.hooks import Hook
from automap.runtime.state import DispatchState, Gate, Group, data_ptr, follow

log = logging.getLogger(__name__)

# Runs a block outside torch.func's transforms (grad, vmap): the copies made there are plain
# tensors, as outside a transform. Absent from a torch, the block runs as it is.
outside_transforms: Callable[[], AbstractContextManager[Any]] = getattr(
    torch._C, "_DisableFuncTorch", nullcontext
)


class StreamWeights(Hook):
    """Brings one unit's offloaded weights in before it runs, prefetching the next unit's.

    Args:
        group: the unit's offloaded tensors and the group that runs after it.
        state: the model's dispatch state: its transfer to the execution device, its lock for
            swapped-in weights (accelerator execution), its streamed tensors.
        files: the model's :class:`CheckFiles` (CPU execution), which lets a compiled forward
            skip this hook once it has checked every file.
    """

    def __init__(self, group: Group, state: DispatchState, files: CheckFiles | None = None):
        super().__init__()
        assert state.transfer is not None
        self.group, self.state, self.files = group, state, files
        self.transfer: Transfer = state.transfer
        self.lock: threading.RLock = state.lock
        self.device = torch_device(state.plan.execution_device)
        self._inside = threading.local()  # per thread: swap-ins not yet undone
        self._saving: ExitStack | None = None

    # Hook bodies do I/O (stat, readahead), take locks and swap tensors: work that torch.compile
    # cannot trace. Each body is a function dynamo skips (torch.compiler.disable), so a compiled
    # model breaks its graph at a streamed unit's boundaries, never inside the unit. On CPU
    # execution nothing moves (the parameters are the views): once the model's own hook has
    # checked every file for this forward (CheckFiles), a compiled forward skips the body, and
    # compiles whole.
    def pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if torch.is_grad_enabled() and not torch.compiler.is_compiling():
            self._refuse_new_gradients()
        if self.transfer.swaps:
            self._enter()
        elif not (torch.compiler.is_compiling() and self.files is not None and self.files.checked):
            self._touch()
        return None

    def post(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self.transfer.swaps:
            self._leave(module.training)
        return None

    def _refuse_new_gradients(self) -> None:
        """A weight frozen at dispatch and unfrozen since gets its refusing hook now, before
        a gradient could reach it."""
        for item in self.group.items:
            if item.tensor.requires_grad and id(item.tensor) not in self.state.refusing:
                refuse_gradients(self.state, item.tensor, item.name)

    @skip_when_compiling
    def _touch(self) -> None:
        """CPU execution: the weights are the views the parameters hold; check their files
        and read ahead."""
        if not self.state.undone:  # a forward racing undispatch runs on the weights in RAM
            self.transfer.take(self.group.key, [i.name for i in self.group.ahead])
            self._prefetch_next()

    @skip_when_compiling
    def _enter(self) -> None:
        self.lock.acquire()
        try:
            if self.state.undone:
                raise DispatchError(
                    f"the model was undispatched by another thread (automap.undispatch) while this "
                    f"forward ran, before unit {self.group.key!r}; run it again"
                )
            self._swap_in()
        except BaseException:
            self.lock.release()
            raise
        self._inside.depth = getattr(self._inside, "depth", 0) + 1

    @skip_when_compiling
    def _leave(self, training: bool) -> None:
        if not getattr(self._inside, "depth", 0):
            return  # this thread's pre never ran (an earlier hook raised)
        self._inside.depth -= 1
        try:
            self._swap_out(training)
        finally:
            self.lock.release()

    def _prefetch_next(self) -> None:
        units = following(self.group.next, self.group, self.transfer.lookahead)
        if units:
            self.transfer.prefetch(*units[0])  # the next unit; a guess that missed is dropped
            self.transfer.prefetch_after(units[1:])  # and those after it, as far as the transfer reads ahead

    def _swap_in(self) -> None:
        # Weights swapped in under inference_mode would become inference tensors, which a
        # normal Parameter cannot hold; swapping outside it keeps the parameter usable. Copies
        # made inside torch.func's transforms would be their wrappers, which must not outlive
        # the transform (torch crashes): the copies are automap's, made outside them.
        with torch.inference_mode(False), outside_transforms():
            needed = [i for i in self.group.dense if i.users == 0 and follow(i, self.state.streamed)]
            if any(i.streams and i.tensor._version != i.version for i in needed):
                # Written in place since the unit last ran (load_state_dict, p.mul_() between
                # forwards): a copy prefetched before the write (the last unit of the previous
                # forward prefetches the first) holds the old values.
                self.transfer.discard(self.group.key)
            got = self.transfer.take(self.group.key, [i.name for i in needed if i.streams])
            for item in needed:
                # What torch's API put in the tensor since dispatch (adopted by follow) is
                # copied in as the source's tensors are; it stays what the model holds.
                item.tensor.data = got[item.name] if item.streams else item.home.to(self.device)
                item.version = item.tensor._version
        for item in self.group.dense:
            item.users += 1
        if torch.is_grad_enabled() and self._saving is None:
            self._saving = ExitStack()
            try:
                self._saving.enter_context(torch.autograd.graph.saved_tensors_hooks(*save_by_name(self)))
            except RuntimeError:
                # Saved-tensor hooks are off here (torch.func.grad, vjp, jacrev): autograd keeps
                # the copies themselves, which give the same values, for as long as its graph lives.
                log.debug("saved-tensor hooks are disabled; %s keeps its copies for backward", self.group.key)
                self._saving = None
        self._prefetch_next()

    def _swap_out(self, training: bool) -> None:
        if self._saving is not None:
            self._saving.close()
            self._saving = None
        with torch.inference_mode(False), torch.no_grad(), outside_transforms():
            for item in self.group.dense:
                item.users -= 1
                if item.users:
                    continue
                if item.tensor._version != item.version or (item.is_buffer and training):
                    item.home.copy_(item.tensor.data)  # what the unit changed stays changed
                item.tensor.data = item.home
                item.version = item.tensor._version  # the home holds what the tensor holds


class CheckFiles(Hook):
    """On the model itself: counts the forward in (the model's :class:`Gate`, which
    :func:`automap.undispatch` waits on) and, when units stream on CPU execution, checks every
    file behind the offloaded weights before it (one ``fstat`` each) and reads the first streamed
    units ahead (:attr:`~automap.offload.Transfer.lookahead` of them); ``checked`` stays True
    until the forward returns (or raises). A compiled forward then skips the units' own hooks (dynamo guards on ``checked``), so it compiles without a
    graph break. A forward that did not come through the model's hooks (``model.forward(...)``,
    ``torch.compile(model.forward)``) finds ``checked`` False and checks unit by unit, as in
    eager mode, where the units check their own files anyway.

    Args:
        gate: the model's gate.
        model: the model's class name, for messages.
        groups, transfer: the streamed groups and the transfer, when files are checked here.
    """

    def __init__(
        self, gate: Gate, model: str, groups: list[Group] | None = None, transfer: Transfer | None = None
    ):
        super().__init__()
        self.gate, self.model, self.transfer = gate, model, transfer
        self.first = groups[0] if groups else None
        self.names = [n for group in (groups or []) for n in group.names]
        self.checked = False

    def pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self._check()
        return None

    def post(self, module: nn.Module, args: tuple, output: Any) -> None:
        self.checked = False
        self._leave()
        return None

    @skip_when_compiling
    def _check(self) -> None:
        self.checked = False
        self.gate.enter(self.model)
        if self.transfer is not None and self.first is not None:
            self.transfer.source.check_unchanged(self.names)
            # The first streamed units are read while the resident units before them compute.
            self.transfer.prefetch_after(following(self.first, None, self.transfer.lookahead))
        self.checked = True

    @skip_when_compiling
    def _leave(self) -> None:
        self.gate.leave()


def following(start: Group | None, stop: Group | None, count: int) -> list[tuple[str, list[str]]]:
    """Up to ``count`` groups from ``start`` on in run order, before coming back to ``stop``
    (or to a group already listed): ``(key, names)`` of each, the weights not already in use
    (its dense part: routed experts are read when the routing is known, unless ``whole``)."""
    found: list[tuple[str, list[str]]] = []
    seen = {id(stop)} if stop is not None else set()
    while start is not None and id(start) not in seen and len(found) < count:
        seen.add(id(start))
        found.append((start.key, [i.name for i in start.ahead if i.users == 0]))
        start = start.next
    return found


@dataclass(frozen=True)
class SavedWeight:
    """What autograd keeps of an offloaded weight a unit used on an accelerator: its name and
    the view's layout, not its data (which leaves when the unit ends). Backward reads it again."""

    name: str
    shape: torch.Size
    stride: tuple[int, ...]


def save_by_name(hook: StreamWeights) -> tuple[Callable, Callable]:
    loaded = {ptr: i for i in hook.group.dense if (ptr := data_ptr(i.tensor))}

    def pack(tensor: torch.Tensor) -> Any:
        item = loaded.get(data_ptr(tensor))
        return tensor if item is None else SavedWeight(item.name, tensor.shape, tensor.stride())

    def unpack(saved: Any) -> torch.Tensor:
        if not isinstance(saved, SavedWeight):
            return saved
        item = next(i for i in hook.group.items if i.name == saved.name)
        if item.streams:
            source = hook.transfer.take(f"{saved.name}@backward", [saved.name])[saved.name]
        else:  # adopted: what the model holds now
            source = item.home.to(hook.device)
        return source.as_strided(saved.shape, saved.stride, source.storage_offset())

    return pack, unpack
