"""Undoing a dispatch: hooks and overrides removed, every weight back in memory of its own on the
device it had, the sources given up; for a whole model, a part of it kept alone after the model
was dropped, or a failed dispatch (rollback)."""

from __future__ import annotations

import logging
from typing import Callable

import torch
from torch import nn

from automap.errors import DispatchError
from automap.interrupts import deferred, public
from automap.kinds import on_host
from automap.profiling.units import all_named_tensors
from automap.runtime.state import DispatchState, follow, forget, state_of
from automap.runtime.swap import allocation_failed, install, moved_back

log = logging.getLogger(__name__)


def restore(
    model: nn.Module, state: DispatchState, *, rollback: bool = False, done: Callable[[], None] | None = None
) -> None:
    """Undo :func:`apply`, keeping the model as it is now: every tensor that still views the
    weight source (the offloaded ones, and any other the model got from them since) is read
    into memory of its own — first, so that a tensor whose bytes cannot be read raises, naming
    it, before anything changes — while what torch's API put into the model since dispatch
    (new data, new parameters, converted dtypes) is kept as it is. On ``rollback`` (a failed
    dispatch) the sources this dispatch created are removed again. ``done`` runs when all is
    undone, before an interrupt that came meanwhile is delivered."""
    if rollback:
        install(model, state.replaced)
    # Every allocation first (may take long, may fail for lack of memory; changes nothing:
    # interruptible), then only assignments, which cannot fail for memory.
    try:
        views = read_views(model, state)
        back = moved_back(state.original, state.streamed) + views  # dispatch's moves are undone first
    except (MemoryError, RuntimeError) as exc:
        if not allocation_failed(exc):
            raise
        raise DispatchError(
            f"undispatch could not allocate the memory the weights it brings back need ({type(exc).__name__}: "
            f"{str(exc)[:200]}); nothing was changed: the model is still dispatched and works as before. Free "
            "memory (or raise the process's memory or address-space limit) and call automap.undispatch again"
        ) from exc
    with deferred():
        _undo(model, state, back, rollback)
        if done is not None:
            done()


def _undo(
    model: nn.Module, state: DispatchState, back: list[tuple[torch.Tensor, torch.Tensor]], rollback: bool
) -> None:
    if state.guard is not None:
        state.guard.remove()
    for hook in state.hooks:
        hook.detach()
    for handle in state.tensor_hooks:
        handle.remove()
    if state.transfer is not None:
        state.transfer.close()
    for tensor, copied in back:
        tensor.data = copied
    for source in state.owned:
        source.close(discard=rollback)


def read_views(model: nn.Module, state: DispatchState) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each tensor of ``model`` that views the weight source, with its current values (any
    write included) copied into memory of its own on the device it had before dispatch (CPU
    for one that was on meta, or that torch's API put there since).

    Raises:
        OffloadError: the bytes of one of them cannot be read (its file was truncated under
            it, or rewritten with other bytes); nothing has changed.
    """
    for item in state.streamed.values():
        follow(item, state.streamed)
    tensors = [t for _, t in all_named_tensors(model, remove_duplicate=False)]
    for module in state.live():  # the other parts of the model still alive (the model was dropped)
        tensors += [*module._parameters.values(), *module._buffers.values()]
    views = {
        i.view.untyped_storage().data_ptr(): i
        for i in state.streamed.values()
        if i.view is not None and i.view.numel() and on_host(i.view.device)
    }
    devices = {id(tensor): device for tensor, device in state.original.values()}
    holders: dict[int, tuple[torch.Tensor, str]] = {}
    for tensor in tensors:
        if (
            tensor is not None
            and tensor.numel()
            and on_host(tensor.device)
            and tensor.untyped_storage().data_ptr() in views
        ):
            holders.setdefault(id(tensor), (tensor, views[tensor.untyped_storage().data_ptr()].name))
    if state.source is not None and holders:  # one fstat per file, not one per tensor
        state.source.check_unchanged(sorted({name for _, name in holders.values()}))
    return [
        (t, torch.empty_like(t.data, device=devices.get(id(t), t.device)).copy_(t.data))
        for t, _ in holders.values()
    ]


def release_orphans(model: nn.Module) -> None:
    """Undo each earlier dispatch whose model is gone but which still hooks modules of
    ``model`` (a part the user kept: ``backbone = model.backbone; del model``), so that
    ``model`` is dispatched as a model of its own, without a second set of hooks."""
    found: dict[int, nn.Module] = {}
    for module in model.modules():
        state = state_of(module)
        if state is not None and state.model is None and not state.undone:
            found.setdefault(id(state), module)
    for module in found.values():
        log.info("undoing the dispatch %s was left in when its model was dropped", type(module).__name__)
        undispatch(module)


@public
def undispatch(model: nn.Module) -> nn.Module:
    """Remove every automap hook from ``model`` and bring every weight back to the device it
    was on before :func:`dispatch`, the model as it is now: offloaded weights are read back
    from their source into RAM, with any change made to them, and what torch's API put into
    the model since dispatch (``param.data = t``, ``load_state_dict(assign=True)``, ...) is
    kept; tensors that were on meta come back on CPU. Forwards in flight in other threads
    finish first; one starting meanwhile raises DispatchError. The weights are read from the
    maps automap holds, so a checkpoint or store file deleted, replaced or moved since dispatch
    changes nothing. The offload store stays on disk, unlocked, for the next dispatch of the
    same weights. A part of a dispatched model that outlived it (``model =
    peft_model.merge_and_unload()``, ``backbone = model.backbone; del model``) is undispatched
    by itself, with every other part still alive.

    Raises:
        DispatchError: ``model`` was not dispatched by automap, or is a part of a model that
            is dispatched (undispatch that model).
        OffloadError: a tensor's bytes cannot be read (its file was truncated or rewritten
            under it; the message names it); the model stays dispatched.

    Example:
        >>> automap.undispatch(automap.dispatch(model, max_memory={"cpu": "1GB"}, offload_dir="off"))
    """
    state = state_of(model)
    if state is None:
        raise DispatchError(f"{type(model).__name__} is not dispatched by automap; nothing to undo")
    root = state.model
    if root is not None and root is not model:
        raise DispatchError(
            f"{type(model).__name__} is a part of a dispatched {type(root).__name__}, which is dispatched and undone "
            f"as one: call automap.undispatch on that {type(root).__name__} (a part kept alone, once the whole "
            "model is gone, is undone by itself)"
        )
    with state.undoing:
        if state_of(model) is not state:
            raise DispatchError(f"{type(model).__name__} was undispatched by another thread meanwhile")
        state.gate.close()
        try:
            with state.lock:
                restore(model, state, done=lambda: (setattr(state, "undone", True), forget(state)))
        finally:
            state.gate.finish() if state.undone else state.gate.reopen()
    return model
