"""What torch's own API may do to a dispatched model, decided at the call: conversions that would
move or convert offloaded weights are refused before anything changes; copies and pickles are
plain models; no read of a truncated file.
"""

from __future__ import annotations

import copy
import logging
import sys
import threading
import weakref
from collections import OrderedDict
from typing import Any, Callable

import torch
from torch import nn

from automap.devices import available_ram_bytes
from automap.errors import ConversionError, DispatchError
from automap.runtime.state import DispatchState, holds
from automap.sizes import format_bytes

log = logging.getLogger(__name__)

# The module tables torch keeps hooks in (by handle id): automap's entries are left out of copies.
HOOK_TABLES = (
    "_forward_pre_hooks",
    "_forward_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_state_dict_pre_hooks",
)
OVERRIDES = ("_apply", "__getstate__", "__deepcopy__")
_CHECKED = "automap: memory checked"  # a key of deepcopy's memo (whose own keys are ints)
# Offloaded bytes a dtype conversion made by the model's own forward may bring into RAM,
# converted, as the model's own from then on: a router's classifier the forward casts to float32
# at each call (Switch Transformers: `self.classifier = self.classifier.to(torch.float32)`), as
# the plain model keeps it. Anything larger, or a conversion from outside a forward, would read
# the plan's offloaded weights into RAM behind its back.
SMALL_CONVERSION_BYTES = 16 << 20
_CALLS = {nn.Module._call_impl.__code__, nn.Module._wrapped_call_impl.__code__}  # a module's __call__


class Guard:
    """Installs the per-module overrides on a dispatched model and removes them.

    Args:
        model: the dispatched model.
        state: its dispatch state (hooks attached, tensors placed and streamed).
    """

    def __init__(self, model: nn.Module, state: DispatchState):
        # Weak references: the state (which holds this guard) must not keep the model alive, and
        # a part of the model the user keeps alone is guarded as the whole model was.
        self._model, self.state = weakref.ref(model), state
        self.name = type(model).__name__
        self.names: dict[int, str] = {}  # id of each tensor the dispatch placed or offloaded -> its name
        self._converting = threading.local()
        self._installed: list[tuple[weakref.ref[nn.Module], dict[str, Any]]] = []
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self.hook_ids: set[int] = set()

    def install(self) -> Guard:
        model = self._model()
        assert model is not None, "installed while dispatching: the caller holds the model"
        self.names = {
            id(t): n
            for n, t in [
                *model.named_parameters(remove_duplicate=False),
                *model.named_buffers(remove_duplicate=False),
            ]
        }
        for module in model.modules():
            prior = {k: module.__dict__[k] for k in OVERRIDES if k in module.__dict__}
            self._installed.append((weakref.ref(module), prior))
            module._apply = self._apply_of(module)
            module.__getstate__ = self._getstate_of(module)
            module.__deepcopy__ = self._deepcopy_of(module)
            if self.offloaded(module, recurse=False):
                self._handles.append(module.register_state_dict_pre_hook(self._before_state_dict))
        self.hook_ids = {h.id for hook in self.state.hooks for h in hook.handles} | {
            h.id for h in self._handles
        }
        return self

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        for ref, prior in self._installed:
            module = ref()
            if module is not None:
                for key in OVERRIDES:
                    module.__dict__.pop(key, None)
                module.__dict__.update(prior)
        self._installed.clear()

    def modules(self) -> list[nn.Module]:
        """The guarded modules still alive (the model, or the parts of it a user kept)."""
        return [m for m in (ref() for ref, _ in self._installed) if m is not None]

    # -------------------------------------------------------------- what is offloaded

    def offloaded(self, module: nn.Module, recurse: bool = True) -> dict[int, str]:
        """The tensors of ``module`` that are views of the weight source now: id -> name."""
        by_id = {id(i.tensor): i for i in self.state.streamed.values()}
        found = {}
        for tensor in [*module.parameters(recurse=recurse), *module.buffers(recurse=recurse)]:
            item = by_id.get(id(tensor))
            if item is not None and item.streams and holds(tensor, item.home):
                found[id(tensor)] = item.name
        return found

    def check_readable(self, module: nn.Module, recurse: bool = True) -> None:
        """Raise OffloadError naming offloaded tensors of ``module`` whose file was truncated
        under them (without a lease, reading them would kill the process with SIGBUS), or whose store file was
        rewritten with other bytes."""
        names = list(self.offloaded(module, recurse).values())
        if names and self.state.source is not None:
            self.state.source.check_unchanged(names)

    def _before_state_dict(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        self.check_readable(module, recurse=False)

    # -------------------------------------------------------------- conversions

    def _apply_of(self, module: nn.Module) -> Callable[..., nn.Module]:
        original = type(module)._apply.__get__(module)

        def _apply(fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> nn.Module:
            if getattr(self._converting, "active", False):
                return original(fn, recurse)  # the outermost call checked the whole subtree
            self.check_conversion(module, fn, recurse)
            self._converting.active = True
            try:
                return original(fn, recurse)
            finally:
                self._converting.active = False

        return _apply

    def check_conversion(
        self, module: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool
    ) -> None:
        """Refuse ``fn`` (what ``Module._apply`` would apply) if it would move a tensor
        automap placed to another device, change an offloaded tensor's dtype or move it into
        shared memory."""
        offloaded = self.offloaded(module, recurse)
        named = {**self.names, **offloaded}
        seen: dict[tuple[torch.dtype, torch.device], tuple[torch.dtype, torch.device, bool]] = {}
        for tensor in [*module.parameters(recurse=recurse), *module.buffers(recurse=recurse)]:
            placed = id(tensor) in self.state.original
            if not (placed or id(tensor) in offloaded):
                continue  # the model's own since dispatch
            key = (tensor.dtype, tensor.device)
            if key not in seen:
                seen[key] = probe(fn, tensor, named[id(tensor)], self.refusal)
            dtype, device, shared = seen[key]
            if device != tensor.device:
                raise ConversionError(
                    self.refusal(
                        f"would move tensor {named[id(tensor)]!r} from {tensor.device} to "
                        f"{device}; automap placed every unit of the model, and moving it by "
                        "hand would break that placement"
                    )
                )
            if id(tensor) in offloaded and shared:
                raise ConversionError(
                    self.refusal(
                        f"would copy offloaded tensor {named[id(tensor)]!r} into shared memory (share_memory), reading "
                        f"the offloaded weights ({format_bytes(self.offloaded_bytes(module, recurse))}) off disk into RAM "
                        "behind the plan's back; to share the model between processes, keep its units in memory (map "
                        "them to 'cpu')"
                    )
                )
            if id(tensor) in offloaded and dtype != tensor.dtype:
                total = self.offloaded_bytes(module, recurse)
                if total <= SMALL_CONVERSION_BYTES and self.in_forward():  # the model's own code: as plain
                    log.info(
                        "%s: offloaded %r converted to %s, kept in RAM from now on (%s)",
                        self.name,
                        named[id(tensor)],
                        dtype,
                        format_bytes(total),
                    )
                    continue
                raise ConversionError(
                    self.refusal(
                        f"would turn offloaded tensor {named[id(tensor)]!r} from {tensor.dtype} into {dtype}, reading the "
                        f"offloaded weights ({format_bytes(total)}) off disk into RAM "
                        f"behind the plan's back; to run it in {dtype}, load or dispatch it in that dtype "
                        "(automap.load(..., dtype=...))"
                    )
                )

    def offloaded_bytes(self, module: nn.Module, recurse: bool) -> int:
        offloaded = self.offloaded(module, recurse)
        return sum(
            t.numel() * t.element_size() for t in module.parameters(recurse=recurse) if id(t) in offloaded
        )

    def in_forward(self) -> bool:
        """Whether this thread is inside the forward of one of the model's modules (the call
        comes from the model's own code, which the plain model runs too)."""
        ours = {id(m) for m in self.modules()}
        frame = sys._getframe(1)
        while frame is not None:
            if frame.f_code in _CALLS and id(frame.f_locals.get("self")) in ours:
                return True
            frame = frame.f_back
        return False

    def refusal(self, what: str) -> str:
        return (
            f"this conversion of dispatched {self.name} {what}. Call automap.undispatch(model) first (the model "
            "then holds every weight in memory, with any change made to it), convert it, and dispatch it again"
        )

    # -------------------------------------------------------------- copies and pickles

    def _getstate_of(self, module: nn.Module) -> Callable[[], dict[str, Any]]:
        def __getstate__() -> dict[str, Any]:
            self.check_readable(module)
            return self.plain_state(module)

        return __getstate__

    def plain_state(self, module: nn.Module) -> dict[str, Any]:
        """``module``'s state as torch pickles it, without automap's hooks and overrides."""
        state = nn.Module.__getstate__(module)
        for key in OVERRIDES:
            state.pop(key, None)
        for table in HOOK_TABLES:
            hooks = state.get(table)
            if hooks and not self.hook_ids.isdisjoint(hooks):
                state[table] = OrderedDict((k, v) for k, v in hooks.items() if k not in self.hook_ids)
        return state

    def _deepcopy_of(self, module: nn.Module) -> Callable[[dict[Any, Any]], nn.Module]:
        def __deepcopy__(memo: dict[Any, Any]) -> nn.Module:
            if _CHECKED not in memo:
                self.check_memory(module)
                memo[_CHECKED] = True
            self.check_readable(module)
            twin = type(module).__new__(type(module))
            memo[id(module)] = twin
            twin.__setstate__(copy.deepcopy(self.plain_state(module), memo))
            return twin

        return __deepcopy__

    def check_memory(self, module: nn.Module) -> None:
        """Refuse a deep copy whose offloaded weights would not fit in available memory."""
        offloaded = self.offloaded(module)
        needed = sum(
            t.numel() * t.element_size()
            for t in [*module.parameters(), *module.buffers()]
            if id(t) in offloaded
        )
        free = available_ram_bytes()
        if needed > free:
            raise DispatchError(
                f"copy.deepcopy of dispatched {self.name} would read its {len(offloaded)} offloaded tensors "
                f"({format_bytes(needed)}) into RAM, but only {format_bytes(free)} is available. Save it instead "
                "(model.save_pretrained, torch.save(model.state_dict()): they read the weights from disk as they "
                "write), or call automap.undispatch(model) first on a machine with more memory"
            )


def probe(
    fn: Callable[[torch.Tensor], torch.Tensor], tensor: torch.Tensor, name: str, refusal: Callable[[str], str]
) -> tuple[torch.dtype, torch.device, bool]:
    """What ``fn`` makes of a tensor like ``tensor`` (dtype, device, and whether it moved it
    into shared memory, as ``share_memory`` does in place), tried on one element."""
    sample = torch.empty(1, dtype=tensor.dtype, device=tensor.device)
    was_shared = sample.is_shared()
    try:
        with torch.no_grad():
            out = fn(sample)
    except Exception as exc:  # noqa: BLE001 - the conversion's own failure, reported with the refusal
        raise ConversionError(
            refusal(
                f"cannot be checked on tensor {name!r} ({type(exc).__name__}: {exc}); a "
                "conversion that moves a placed tensor is refused"
            )
        ) from exc
    if not isinstance(out, torch.Tensor):
        raise ConversionError(refusal(f"does not give a tensor for {name!r}"))
    return out.dtype, out.device, out.is_shared() and not was_shared
