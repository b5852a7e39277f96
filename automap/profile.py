"""The profiler: what the planner knows about a model.

A :class:`Profile` lists the model's *placement units* (modules whose weights must stay on one
device) in execution order, with their parameter and buffer bytes, FLOPs and activation
sizes, the groups of tied tensors, and the dataflow graph between units. It is measured on the
meta device, so a model of any size profiles without allocating its weights, and the caller's
model is never changed.
"""
from __future__ import annotations

import logging
import warnings
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Mapping, Sequence

import networkx as nx
import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import FlopCounterMode

from automap.errors import ProfileError

log = logging.getLogger(__name__)

ExampleInputs = tuple[Any, ...] | Mapping[str, Any]


@dataclass(frozen=True)
class Unit:
    """A module whose weights live on one device.

    Attributes:
        name: the module's dotted name in the model (``"model.layers.3"``).
        tensors: fully qualified names of the parameters and buffers it owns (a tied tensor
            is owned once, by the first unit that reaches it).
        loose: the subset of ``tensors`` owned directly by a non-unit ancestor (ViT's
            ``class_token``) and attached to this unit; device maps list them by name.
        param_bytes, buffer_bytes: bytes of those tensors (at the profile's dtype).
        flops: forward FLOPs at the example inputs; ``train_flops`` forward + backward.
        output_bytes: bytes of the tensors the unit returns.
        peak_activation_bytes: the largest set of tensors alive inside the unit at once
            (approximated by its output plus its largest input).
        calls: how many times the traced forward called it (0: never).
    """

    name: str
    tensors: tuple[str, ...]
    loose: tuple[str, ...] = ()
    param_bytes: int = 0
    buffer_bytes: int = 0
    flops: int = 0
    train_flops: int = 0
    output_bytes: int = 0
    peak_activation_bytes: int = 0
    calls: int = 0

    @property
    def weight_bytes(self) -> int:
        return self.param_bytes + self.buffer_bytes


@dataclass(frozen=True)
class Profile:
    """Everything the planner needs to know about one model at one input size.

    Attributes:
        model_name: the model's class name.
        units: placement units in execution order.
        tie_groups: names that refer to one tensor (GPT-2's ``lm_head.weight`` and
            ``transformer.wte.weight``); the planner keeps each group on one device.
        graph: ``networkx.DiGraph`` over unit names plus ``"<input>"``; edge ``bytes`` is the
            size of the tensors flowing from one unit to another.
        example: how the example inputs were obtained ("" when bytes only).
        uncalled: units the traced forward never called.
    """

    model_name: str
    units: tuple[Unit, ...]
    tie_groups: tuple[tuple[str, ...], ...] = ()
    graph: nx.DiGraph = field(default_factory=nx.DiGraph, compare=False)
    example: str = ""
    uncalled: tuple[str, ...] = ()

    @property
    def total_flops(self) -> int:
        return sum(u.flops for u in self.units)

    @property
    def total_bytes(self) -> int:
        return sum(u.weight_bytes for u in self.units)

    @property
    def has_compute(self) -> bool:
        return self.total_flops > 0

    def index(self, name: str) -> int:
        for i, unit in enumerate(self.units):
            if unit.name == name:
                return i
        raise KeyError(name)

    def cut_bytes(self, position: int) -> int:
        """Bytes of every tensor live across the cut before unit ``position``."""
        order = {u.name: i for i, u in enumerate(self.units)}
        order["<input>"] = -1
        total = 0
        for src, dst, data in self.graph.edges(data=True):
            if order.get(src, -1) < position <= order.get(dst, -1):
                total += int(data.get("bytes", 0))
        return total


# ----------------------------------------------------------------------------- units


def _direct_tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from module.named_parameters(recurse=False)
    yield from ((n, b) for n, b in module.named_buffers(recurse=False) if b is not None)


def _has_tensors(module: nn.Module) -> bool:
    return any(True for _ in module.parameters()) or any(True for _ in module.buffers())


def _no_split_classes(model: nn.Module, no_split: Iterable[str | type] | None) -> set[str]:
    if no_split is None:
        names = getattr(model, "_no_split_modules", None) or []
        return {str(n) for n in names}
    wanted = {c if isinstance(c, str) else c.__name__ for c in no_split}
    present = {type(m).__name__ for m in model.modules()}
    missing = sorted(wanted - present)
    if missing:
        raise ProfileError(
            f"no_split names {missing} but the model has no module of that class; "
            f"classes present include {sorted(present)[:12]}"
        )
    return wanted


def find_units(model: nn.Module, no_split: Iterable[str | type] | None = None) -> list[str]:
    """Names of the placement units of ``model`` in definition order.

    A unit is a module of a ``no_split`` class (default: the model's ``_no_split_modules``),
    a child of a ``Sequential``/``ModuleList`` stack, or a leaf module that holds tensors;
    whatever is inside a unit is never split across devices.
    """
    keep_whole = _no_split_classes(model, no_split)
    units: list[str] = []

    def visit(name: str, module: nn.Module, in_stack: bool) -> None:
        if not _has_tensors(module):
            return
        children = list(module.named_children())
        stack = isinstance(module, (nn.Sequential, nn.ModuleList))
        whole = type(module).__name__ in keep_whole or not children
        # Blocks of a stack are units unless they are stacks themselves (Swin's stages).
        if whole or (in_stack and not stack and not keep_whole):
            units.append(name)
            return
        for child_name, child in children:
            visit(f"{name}.{child_name}" if name else child_name, child, stack)

    visit("", model, False)
    return units


def _check_units(model: nn.Module, units: Sequence[str]) -> list[str]:
    modules = {name for name, _ in model.named_modules()}
    unknown = [u for u in units if u not in modules]
    if unknown:
        raise ProfileError(f"units {unknown[:5]} are not modules of {type(model).__name__}")
    return list(units)


def tie_groups(model: nn.Module) -> list[tuple[str, ...]]:
    """Groups of names (parameters and buffers) that refer to the same tensor."""
    by_id: dict[int, list[str]] = {}
    for name, tensor in _all_named_tensors(model, remove_duplicate=False):
        by_id.setdefault(id(tensor), []).append(name)
    return [tuple(names) for names in by_id.values() if len(names) > 1]


def _all_named_tensors(model: nn.Module, remove_duplicate: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    yield from model.named_parameters(remove_duplicate=remove_duplicate)
    yield from model.named_buffers(remove_duplicate=remove_duplicate)


def _tensor_bytes(tensor: torch.Tensor, dtype: torch.dtype | None) -> int:
    if dtype is not None and tensor.is_floating_point():
        return tensor.numel() * dtype.itemsize
    return tensor.numel() * tensor.element_size()


# ------------------------------------------------------------------------ tracing


@dataclass
class _Trace:
    order: list[str] = field(default_factory=list)
    calls: dict[str, int] = field(default_factory=dict)
    flops: dict[str, int] = field(default_factory=dict)
    output_bytes: dict[str, int] = field(default_factory=dict)
    input_bytes: dict[str, int] = field(default_factory=dict)
    producer: dict[int, str] = field(default_factory=dict)
    edges: dict[tuple[str, str], int] = field(default_factory=dict)


def _tensors_in(tree: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(tree)
    return [x for x in leaves if isinstance(x, torch.Tensor)]


def _nbytes(tensors: Sequence[torch.Tensor]) -> int:
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def _install_trace_hooks(model: nn.Module, unit_names: Sequence[str], trace: _Trace,
                         counter: FlopCounterMode, stack: ExitStack) -> None:
    modules = dict(model.named_modules())
    start: dict[str, int] = {}

    def pre(name: str):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if name not in trace.calls:
                trace.order.append(name)
            trace.calls[name] = trace.calls.get(name, 0) + 1
            inputs = _tensors_in((args, kwargs))
            trace.input_bytes[name] = max(trace.input_bytes.get(name, 0), _nbytes(inputs))
            for t in inputs:
                src = trace.producer.get(id(t), "<input>")
                if src != name:
                    trace.edges[(src, name)] = max(trace.edges.get((src, name), 0), _nbytes([t]))
            start[name] = counter.get_total_flops()
        return hook

    def post(name: str):
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            trace.flops[name] = trace.flops.get(name, 0) + counter.get_total_flops() - start.pop(name, 0)
            outputs = _tensors_in(output)
            trace.output_bytes[name] = max(trace.output_bytes.get(name, 0), _nbytes(outputs))
            for t in outputs:
                trace.producer[id(t)] = name
        return hook

    for name in unit_names:
        module = modules[name]
        stack.callback(module.register_forward_pre_hook(pre(name), with_kwargs=True).remove)
        stack.callback(module.register_forward_hook(post(name), with_kwargs=True).remove)


def _to_meta(value: Any, dtype: torch.dtype | None) -> Any:
    def convert(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        target = dtype if dtype is not None and x.is_floating_point() else x.dtype
        return torch.empty_like(x, device="meta", dtype=target)
    return tree_map(convert, value)


def _meta_state(model: nn.Module, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    return {name: _to_meta(t, dtype) for name, t in _all_named_tensors(model)}


def default_example_inputs(model: nn.Module, seq_len: int = 128, batch: int = 1) -> tuple[ExampleInputs | None, str]:
    """Derive example inputs for common model families, and say which were used.

    transformers models get ``input_ids`` of ``seq_len`` tokens (and ``decoder_input_ids``
    for encoder-decoders); image models a ``batch x C x 224 x 224`` image from their first conv.
    """
    config = getattr(model, "config", None)
    if config is not None and hasattr(model, "main_input_name") and model.main_input_name == "input_ids":
        ids = torch.zeros(batch, seq_len, dtype=torch.long, device="meta")
        inputs: dict[str, Any] = {"input_ids": ids}
        if getattr(config, "is_encoder_decoder", False):
            inputs["decoder_input_ids"] = ids
        return inputs, f"input_ids {batch}x{seq_len}"
    if config is not None and hasattr(model, "dummy_inputs"):
        try:
            return dict(model.dummy_inputs), "transformers dummy_inputs"
        except Exception:  # noqa: BLE001 - a model without usable dummies falls through
            pass
    for module in model.modules():
        if isinstance(module, nn.Conv2d):
            size = 224
            image = torch.zeros(batch, module.in_channels, size, size, device="meta")
            return (image,), f"image {batch}x{module.in_channels}x{size}x{size}"
        if isinstance(module, nn.Linear):
            return (torch.zeros(batch, module.in_features, device="meta"),), f"vector {batch}x{module.in_features}"
    return None, ""


def profile(model: nn.Module, example_inputs: ExampleInputs | None = None, *,
            no_split: Iterable[str | type] | None = None, dtype: torch.dtype | None = None,
            units: Sequence[str] | None = None) -> Profile:
    """Profile ``model`` on the meta device.

    Args:
        model: any ``nn.Module``, with real weights or on meta. It is not changed.
        example_inputs: positional args (tuple) or keyword args (dict) for ``forward``; tensors
            may be on any device. Derived for common families when None.
        no_split: module classes (or class names) never to split; default: the model's
            ``_no_split_modules`` when it has them.
        dtype: count floating-point tensors at this dtype (the dtype the model will run in).
        units: explicit unit names (module names), overriding ``no_split`` (used for user
            device maps, whose keys are the units).

    Returns:
        A :class:`Profile` with units in execution order.

    Raises:
        ProfileError: ``no_split`` names a class the model lacks, or the forward failed
            (the message names the unit where it failed).

    Example:
        >>> prof = automap.profile(torchvision.models.resnet50())
        >>> prof.units[0].name
        'conv1'
    """
    unit_names = find_units(model, no_split) if units is None else _check_units(model, units)
    how = ""
    if example_inputs is None:
        example_inputs, how = default_example_inputs(model)
    else:
        how = "given"
    trace = _Trace()
    if example_inputs is not None:
        _trace_forward(model, unit_names, example_inputs, dtype, trace)
    else:
        warnings.warn(
            f"no example inputs for {type(model).__name__}: profiling bytes only, so plans balance "
            "memory, not compute; pass example_inputs=(...) for FLOP-aware plans",
            stacklevel=2,
        )
    return _assemble(model, unit_names, trace, dtype, how)


def _trace_forward(model: nn.Module, unit_names: Sequence[str], example_inputs: ExampleInputs,
                   dtype: torch.dtype | None, trace: _Trace) -> None:
    state = _meta_state(model, dtype)
    inputs = _to_meta(example_inputs, None)
    args, kwargs = (inputs, {}) if isinstance(inputs, tuple) else ((), dict(inputs))
    counter = FlopCounterMode(display=False)
    current: list[str] = []
    with ExitStack() as stack:
        _install_trace_hooks(model, unit_names, trace, counter, stack)
        stack.enter_context(counter)
        stack.enter_context(torch.no_grad())
        try:
            torch.func.functional_call(model, state, args, kwargs, tie_weights=True, strict=False)
        except Exception as exc:  # noqa: BLE001 - re-raised with the unit where it happened
            where = trace.order[-1] if trace.order else "(before the first unit)"
            raise ProfileError(
                f"the forward of {type(model).__name__} failed on the example inputs near unit "
                f"{where!r}: {type(exc).__name__}: {exc}"
            ) from exc
    del current


def _assemble(model: nn.Module, unit_names: Sequence[str], trace: _Trace,
              dtype: torch.dtype | None, how: str) -> Profile:
    owned = _assign_tensors(model, unit_names, trace.order)
    ordered = list(trace.order) + [n for n in unit_names if n not in trace.calls]
    uncalled = tuple(n for n in unit_names if n not in trace.calls) if trace.order else ()
    tensors = dict(_all_named_tensors(model, remove_duplicate=False))
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    units = []
    for name in ordered:
        names, loose = owned[name]
        units.append(Unit(
            name=name,
            tensors=tuple(names),
            loose=tuple(loose),
            param_bytes=sum(_tensor_bytes(tensors[n], dtype) for n in names if n in params),
            buffer_bytes=sum(_tensor_bytes(tensors[n], dtype) for n in names if n not in params),
            flops=trace.flops.get(name, 0),
            train_flops=3 * trace.flops.get(name, 0),
            output_bytes=trace.output_bytes.get(name, 0),
            peak_activation_bytes=trace.output_bytes.get(name, 0) + trace.input_bytes.get(name, 0),
            calls=trace.calls.get(name, 0),
        ))
    graph = nx.DiGraph()
    graph.add_nodes_from(["<input>", *ordered])
    for (src, dst), nbytes in trace.edges.items():
        graph.add_edge(src, dst, bytes=nbytes)
    return Profile(
        model_name=type(model).__name__,
        units=tuple(units),
        tie_groups=tuple(tie_groups(model)),
        graph=graph,
        example=how,
        uncalled=uncalled,
    )


def _assign_tensors(model: nn.Module, unit_names: Sequence[str],
                    order: Sequence[str]) -> dict[str, tuple[list[str], list[str]]]:
    """Give every tensor exactly one unit: its own module's, or for a tensor held directly
    by a non-unit module, the first unit (in execution order) inside that module."""
    rank = {n: i for i, n in enumerate(order)}
    units_sorted = sorted(unit_names, key=lambda n: (rank.get(n, len(rank)), unit_names.index(n)))
    owned: dict[str, tuple[list[str], list[str]]] = {n: ([], []) for n in unit_names}
    seen: set[int] = set()

    def unit_of(tensor_name: str) -> tuple[str, bool]:
        holders = [u for u in unit_names if u == "" or tensor_name.startswith(u + ".")]
        if holders:
            return max(holders, key=len), False
        owner = tensor_name.rpartition(".")[0]
        for unit in units_sorted:
            if owner == "" or unit == owner or unit.startswith(owner + "."):
                return unit, True
        return units_sorted[0], True

    names_of: dict[int, list[str]] = {}
    for name, tensor in _all_named_tensors(model, remove_duplicate=False):
        names_of.setdefault(id(tensor), []).append(name)
    for names in names_of.values():
        # A tied tensor belongs to the first unit that runs with it (GPT-2's wte, not lm_head).
        candidates = [(unit_of(n), n) for n in names]
        (unit, is_loose), name = min(candidates, key=lambda c: rank.get(c[0][0], len(rank)))
        owned[unit][0].append(name)
        if is_loose:
            owned[unit][1].append(name)
    return owned
