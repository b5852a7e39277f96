"""Placement units: which modules stay whole, and which unit owns each tensor.

Every parameter and buffer gets exactly one owning unit: its module's unit, or, for a tensor
held directly by a non-unit module (ViT's ``class_token``, a rotary ``inv_freq`` on a parent),
the unit whose code first uses it. Tied tensors are owned once and reported as a group.
"""

from __future__ import annotations

import copy
import functools
import types
from collections import OrderedDict
from typing import Any, Iterable, Iterator, Mapping, Sequence, TypeVar

import torch
from torch import nn

from automap.interrupts import completed
from automap.errors import ProfileError

_V = TypeVar("_V")


def _has_tensors(module: nn.Module) -> bool:
    return any(True for _ in module.parameters()) or any(True for _ in module.buffers())


def has_forward(module: nn.Module) -> bool:
    """Whether ``module`` has a ``forward`` of its own (a ``ModuleDict`` or ``ModuleList`` has not)."""
    return "forward" in module.__dict__ or type(module).forward is not nn.Module.forward


def no_split_classes(model: nn.Module, no_split: Iterable[str | type] | None) -> set[str]:
    """Class names never to split: ``no_split`` when given, else the model's ``_no_split_modules``.

    Raises:
        ProfileError: ``no_split`` names a class no module of the model has.
    """
    if no_split is None:
        names = getattr(model, "_no_split_modules", None) or []
        return {str(n) for n in names}
    wanted = {c if isinstance(c, str) else c.__name__ for c in no_split}
    present = {type(m).__name__ for m in model.modules()}
    missing = sorted(wanted - present)
    if missing:
        raise ProfileError(
            f"no_split names {missing} but {type(model).__name__} has no module of that class; "
            f"classes present include {sorted(present)[:12]}; check the spelling or drop those names"
        )
    return wanted


def find_units(model: nn.Module, no_split: Iterable[str | type] | None = None) -> list[str]:
    """Names of the placement units of ``model`` in definition order.

    A unit is a module of a ``no_split`` class (default: the model's ``_no_split_modules``),
    a block of a ``Sequential``/``ModuleList`` stack (or of a model with no ``forward`` of its
    own, such as a ``ModuleDict``: its children are called one by one), or a leaf module that
    holds tensors;
    whatever is inside a unit is never split across computing devices (the planner may split a
    unit that does not fit into its children, :mod:`automap.profiling.refine`, but they compute
    on one device). A module reachable under several
    names (a block registered twice) is one unit, under its first name; see :func:`unit_aliases`.

    Args:
        model: the model.
        no_split: class names or classes to keep whole; overrides ``_no_split_modules``.

    Returns:
        Module names, none inside another.

    Raises:
        ProfileError: ``no_split`` names a class the model lacks.
    """
    keep_whole = no_split_classes(model, no_split)
    units: list[str] = []
    seen: set[int] = set()

    def visit(name: str, module: nn.Module, in_stack: bool) -> None:
        if id(module) in seen or not _has_tensors(module):
            return
        seen.add(id(module))
        children = list(module.named_children())
        stack = isinstance(module, (nn.Sequential, nn.ModuleList)) or (not name and not has_forward(module))
        whole = type(module).__name__ in keep_whole or not children
        # Blocks of a stack are units unless they are stacks themselves (Swin's stages).
        if whole or (in_stack and not stack and not keep_whole):
            units.append(name)
            return
        for child_name, child in children:
            visit(f"{name}.{child_name}" if name else child_name, child, stack)

    visit("", model, False)
    return units


def tensor_children(name: str, module: nn.Module) -> list[str]:
    """Names of ``module``'s children that hold tensors, the blocks of a child
    ``ModuleList``/``ModuleDict`` in its place (a container that is never called itself)."""
    found = []
    for child_name, child in module.named_children():
        full = f"{name}.{child_name}" if name else child_name
        if not _has_tensors(child):
            continue
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            found += tensor_children(full, child)
        else:
            found.append(full)
    return found


def check_units(model: nn.Module, units: Sequence[str]) -> list[str]:
    """Validate explicit unit names; a second name of one module object is dropped.

    Raises:
        ProfileError: a name is not a module of ``model``.
    """
    modules = dict(model.named_modules(remove_duplicate=False))
    unknown = [u for u in units if u not in modules]
    if unknown:
        raise ProfileError(
            f"units {unknown[:5]} are not modules of {type(model).__name__}; "
            "use names from model.named_modules()"
        )
    seen: set[int] = set()
    kept = []
    for name in units:
        if id(modules[name]) not in seen:
            seen.add(id(modules[name]))
            kept.append(name)
    return kept


def unit_aliases(model: nn.Module, units: Sequence[str]) -> dict[str, tuple[str, ...]]:
    """Other names under which each unit's module object is reachable."""
    names_of: dict[int, list[str]] = {}
    modules: dict[str, nn.Module] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        names_of.setdefault(id(module), []).append(name)
        modules[name] = module
    return {u: tuple(n for n in names_of[id(modules[u])] if n != u) for u in units}


def all_named_tensors(model: nn.Module, remove_duplicate: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Parameters, then buffers (``None`` buffers skipped)."""
    yield from model.named_parameters(remove_duplicate=remove_duplicate)
    yield from ((n, b) for n, b in model.named_buffers(remove_duplicate=remove_duplicate) if b is not None)


def call_with(
    model: nn.Module,
    state: Mapping[str, torch.Tensor],
    args: tuple,
    kwargs: dict | None = None,
    user_hooks: bool = False,
) -> object:
    """``model(*args, **kwargs)`` with ``state``'s tensors in place of its own (``functional_call``),
    and the model as it was after, also when it raised: every module's parameters and buffers
    (``functional_call`` alone puts back those of a module reached under one name only: a module
    registered under two, ALBERT's shared layer or ``self.b = self.a``, kept a meta stand-in),
    its other attributes (a rotary cache regrown for the probe's length, a counter, a tensor
    cached as a plain attribute, a buffer registered in forward: each would outlive the probe
    as a meta tensor or a stale size) and the CPU's random state (a forward drawing noise).
    Hooks the user registered are not called (:func:`computes_the_model`) unless ``user_hooks``."""
    kept = [_python_state(module) for module in model.modules()]
    try:
        for module, _ in kept if not user_hooks else ():
            leave_out_observers(module)  # the saved tables come back with the rest
        with torch.random.fork_rng(devices=[]):
            return torch.func.functional_call(
                model, dict(state), args, kwargs or {}, tie_weights=True, strict=False
            )
    finally:
        completed(lambda: [_put_back(module, saved) for module, saved in kept])  # none left half put back


# The module tables of forward and backward hooks (by handle id).
HOOK_TABLES = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
_OWN_CODE = ("torch", "automap")


def computes_the_model(hook: Any) -> bool:
    """Whether a hook is torch's or automap's own code, which computes the model (weight_norm,
    spectral_norm and pruning rebuild a weight before each call; quantization observers; the
    trace's and the runtime's hooks). The others are the user's: features or gradients collected
    into a list, a counter, a log line. Planning's meta runs leave those out: they would be
    handed meta tensors, and their side effects would outlive the plan (accelerate's planner
    runs no forward, so its users never see such a call)."""
    while isinstance(hook, functools.partial):
        hook = hook.func
    hook = getattr(hook, "__func__", hook)  # a bound method: its function
    plain = isinstance(hook, (types.FunctionType, types.BuiltinFunctionType))
    home = getattr(hook, "__module__", None) if plain else type(hook).__module__
    return (home or "").split(".")[0] in _OWN_CODE


def has_user_hooks(model: nn.Module) -> bool:
    """Whether a module of ``model`` has a hook the user registered."""
    return any(
        not computes_the_model(hook)
        for module in model.modules()
        for table in HOOK_TABLES
        for hook in module.__dict__.get(table, {}).values()
    )


def leave_out_observers(module: nn.Module) -> None:
    """Replace ``module``'s hook tables by copies without the user's hooks; the caller puts
    the original tables back."""
    for table in HOOK_TABLES:
        hooks = module.__dict__.get(table)
        if hooks and not all(computes_the_model(hook) for hook in hooks.values()):
            module.__dict__[table] = OrderedDict((k, h) for k, h in hooks.items() if computes_the_model(h))


# Every table torch keeps on a module: tensors, children and hooks. A probe's forward may add to
# them in place (transformers installs its output-capturing hooks on a model's first call, marking
# the model in an attribute): its additions go with the attributes it set, or a later call would
# find hooks without their mark, install them twice and get no hidden states (LLaVA's vision tower).
_TABLES = tuple(name for name, value in vars(nn.Module()).items() if isinstance(value, (dict, set)))


def _python_state(module: nn.Module) -> tuple[nn.Module, tuple[dict, list]]:
    """``module``'s attributes and the contents of its tables of tensors and children."""
    return module, (
        dict(module.__dict__),
        [copy.copy(module.__dict__[t]) for t in _TABLES if t in module.__dict__],
    )


def _put_back(module: nn.Module, saved: tuple[dict, list]) -> None:
    attributes, tables = saved
    module.__dict__.clear()
    module.__dict__.update(attributes)
    for name, contents in zip((t for t in _TABLES if t in attributes), tables):
        table = attributes[name]  # the same object, its contents as they were
        table.clear()
        table.update(contents)


def names_by_identity(named: Iterable[tuple[str, torch.Tensor]]) -> list[list[str]]:
    """Names grouped by the tensor object they refer to (tied weights share one group), in
    order of first appearance: the one rule for what "tied" means."""
    by_id: dict[int, list[str]] = {}
    for name, tensor in named:
        by_id.setdefault(id(tensor), []).append(name)
    return list(by_id.values())


def _names_per_tensor(model: nn.Module) -> list[list[str]]:
    """Every name of each distinct parameter or buffer, in definition order."""
    return names_by_identity(all_named_tensors(model, remove_duplicate=False))


def tie_groups(model: nn.Module) -> list[tuple[str, ...]]:
    """Groups of names (parameters and buffers) that refer to the same tensor."""
    return [tuple(names) for names in _names_per_tensor(model) if len(names) > 1]


def tensor_bytes(tensor: torch.Tensor, dtype: torch.dtype | None) -> int:
    """Bytes of ``tensor``, with floating-point tensors counted at ``dtype`` when given."""
    if dtype is not None and tensor.is_floating_point():
        return tensor.numel() * dtype.itemsize
    return tensor.numel() * tensor.element_size()


def assign_tensors(
    model: nn.Module, units: Sequence[str], order: Sequence[str], first_use: Mapping[str, str]
) -> dict[str, tuple[list[str], list[str]]]:
    """Give every tensor exactly one unit; return ``{unit: (owned names, loose names)}``.

    A tensor inside a unit's module (under any of the module's names) belongs to the earliest
    such unit in execution order (GPT-2's tied ``wte``/``lm_head`` weight goes to ``wte``).
    A tensor held directly by a non-unit module is *loose*: it goes to the unit whose code
    first used it in the traced forward (``first_use``), else to the first unit inside its
    holder.

    Args:
        model: the model.
        units: unit names.
        order: units in execution order (called ones).
        first_use: tensor name -> unit that first used it.

    Returns:
        For each unit, its tensor names and the loose subset.
    """
    rank = {n: i for i, n in enumerate(order)}
    defined = {n: i for i, n in enumerate(units)}

    def position(unit: str) -> tuple[int, int]:  # execution order, uncalled units last
        return rank.get(unit, len(rank)), defined[unit]

    ranked = sorted(units, key=position)
    prefixes = {alias: unit for unit, names in unit_aliases(model, units).items() for alias in (unit, *names)}
    owned: dict[str, tuple[list[str], list[str]]] = {n: ([], []) for n in units}
    for names in _names_per_tensor(model):
        held = [(u, n) for u, n in ((_holder(n, prefixes), n) for n in names) if u is not None]
        if held:
            unit, name = min(held, key=lambda h: position(h[0]))
            owned[unit][0].append(name)
            continue
        name = names[0]
        unit = next((first_use[n] for n in names if n in first_use), None) or _first_inside(name, ranked)
        owned[unit][0].append(name)
        owned[unit][1].append(name)
    return owned


def stray_reads(
    model: nn.Module, units: Sequence[str], readers: Mapping[str, Iterable[str | None]], loose: Iterable[str]
) -> list[str]:
    """Tensors read while no unit holding them ran: by a module's own code between units, or by
    a unit whose module does not hold them. Tensors in ``loose`` (held by a non-unit module,
    kept resident where they run) never count.

    Args:
        model: the model.
        units: unit names.
        readers: tensor name (any of its names) -> the units running when it was read (None:
            code between units).
        loose: names of loose tensors.

    Returns:
        The first name of each such tensor, in definition order.
    """
    prefixes = {alias: unit for unit, names in unit_aliases(model, units).items() for alias in (unit, *names)}
    skip = set(loose)
    found = []
    for names in _names_per_tensor(model):
        seen = {r for n in names for r in readers.get(n, ())}
        if not seen or skip.intersection(names):
            continue
        holders = {_holder(n, prefixes) for n in names}
        if any(r is None or r not in holders for r in seen):
            found.append(names[0])
    return found


def longest_prefix(mapping: Mapping[str, _V], name: str) -> _V | None:
    """``mapping``'s value for ``name`` or its longest dotted prefix (``""`` last), as
    transformers and accelerate read device maps; None when nothing matches."""
    probe = name
    while True:
        if probe in mapping:
            return mapping[probe]
        if not probe:
            return None
        probe = probe.rpartition(".")[0]


def _holder(tensor_name: str, prefixes: Mapping[str, str]) -> str | None:
    """The unit whose module (under any name) holds ``tensor_name``."""
    return longest_prefix(prefixes, tensor_name.rpartition(".")[0])


def _first_inside(tensor_name: str, ranked: Sequence[str]) -> str:
    owner = tensor_name.rpartition(".")[0]
    for unit in ranked:
        if owner == "" or unit == owner or unit.startswith(owner + "."):
            return unit
    return ranked[0]
