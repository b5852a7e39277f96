"""Splitting placement units into their children, kept only when a fresh trace shows the pieces
can run as units (each called, each tensor read only by its own piece, in a row, all traced).
Deterministic: the same model and names give the same pieces.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Iterable, Iterator, Mapping, Sequence

import torch
from torch import nn

from automap.errors import ProfileError
from automap.profiling import ExampleInputs, Profile, profile
from automap.profiling.kvcache import profile_generation
from automap.profiling.units import longest_prefix, no_split_classes, tensor_children


@dataclass(frozen=True)
class Refinement:
    """What a split request gave.

    Attributes:
        profile: the model profiled with the split units replaced by their pieces (the
            profile asked about when nothing split).
        pieces: each split unit and the units that replace it, in execution order.
        refused: each unit that stays whole and why (``"a leaf module (Conv2d)"``).
    """

    profile: Profile
    pieces: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    refused: Mapping[str, str] = field(default_factory=dict)


class Splitter:
    """Re-profiles ``model`` with some units split into their children; what
    :func:`automap.planning.make_plan` calls (``refine=``) when a unit does not fit.

    Args:
        model: the model the profiles describe (real or on meta; it is not changed).
        example_inputs, dtype: as given to :func:`automap.profile` for the first profile.
        no_split: classes (or class names) never to split; default: the model's
            ``_no_split_modules``.

    Example:
        >>> splitter = Splitter(model, example_inputs=(x,))
        >>> splitter(prof, ["layer4.0"]).pieces["layer4.0"][:2]
        ('layer4.0.conv1', 'layer4.0.bn1')
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        example_inputs: ExampleInputs | None = None,
        no_split: Iterable[str | type] | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.model, self.example_inputs, self.dtype = model, example_inputs, dtype
        self.keep_whole = no_split_classes(model, no_split)
        self.asked_whole = self.keep_whole if no_split is not None else set()
        self.modules = dict(model.named_modules())

    def __call__(self, base: Profile, names: Sequence[str]) -> Refinement:
        """Split each unit of ``base`` named in ``names`` that can be split."""
        called = {u.name for u in base.units if u.calls > 0}
        untraced = {u.name: u.untraced for u in base.units if u.untraced}
        pieces: dict[str, tuple[str, ...]] = {}
        refused: dict[str, str] = {}
        units = {u.name for u in base.units}
        for asked in names:
            name, (found, why) = (
                (asked, self.pieces_of(asked)) if asked in units else self.isolating(asked, units)
            )
            if not why and not base.example:
                why = "no traced forward to check a split against (profiled without example inputs)"
            if not why and name in untraced:
                why = f"not traced ({untraced[name]})"
            if not why and name not in called:
                why = "never called in the traced forward"
            if why:
                refused[name] = why
            else:
                pieces[name] = found
        while pieces:
            finer, bad = self._retrace(base, pieces)
            refused.update(bad)
            if not bad:
                assert finer is not None
                return Refinement(finer, pieces, refused)
            pieces = {k: v for k, v in pieces.items() if k not in bad}
        return Refinement(base, {}, refused)

    def pieces_of(self, name: str) -> tuple[tuple[str, ...], str]:
        """The units ``name`` would split into, or ``()`` and why it cannot split."""
        module = self.modules[name]
        while True:
            kind = type(module).__name__
            if kind in self.keep_whole:
                return (), f"its class {kind} is in no_split"
            children = tensor_children(name, module)
            if not children:
                return (), f"leaf {kind}"
            if (
                len(children) > 1
                or any(True for _ in module.parameters(recurse=False))
                or any(True for _ in module.buffers(recurse=False))
            ):
                return tuple(children), ""
            name, module = children[0], self.modules[children[0]]

    def isolating(self, target: str, units: Iterable[str]) -> tuple[str, tuple[tuple[str, ...], str]]:
        """The unit holding module ``target`` and the pieces it splits into so that ``target``
        is one of them (or ``()`` and why it cannot)."""
        unit = longest_prefix({u: u for u in units if u}, target)
        if unit is None or target not in self.modules:
            return target, ((), f"{target!r} is no module inside a unit")
        return unit, self._path_pieces(unit, target)

    def _path_pieces(self, name: str, target: str) -> tuple[tuple[str, ...], str]:
        if name == target or not target.startswith(name + "."):
            return (name,), ""
        module = self.modules[name]
        kind = type(module).__name__
        if kind in self.asked_whole:
            return (), f"its class {kind} is in no_split"
        if any(True for _ in module.parameters(recurse=False)) or any(
            True for _ in module.buffers(recurse=False)
        ):
            return (), f"{name!r} holds tensors of its own beside {target!r}"
        pieces: list[str] = []
        for child in tensor_children(name, module):
            found, why = self._path_pieces(child, target)
            if why:
                return (), why
            pieces += found
        return tuple(pieces), ""

    def _retrace(
        self, base: Profile, pieces: Mapping[str, tuple[str, ...]]
    ) -> tuple[Profile | None, dict[str, str]]:
        units = [n for u in base.units for n in pieces.get(u.name, (u.name,))]
        try:
            with _quiet(logging.getLogger("automap.profiling")):
                finer = profile(
                    self.model,
                    self.example_inputs,
                    dtype=self.dtype,
                    units=units,
                    backward=base.total_train_flops > 0,
                    guessed="" if base.example == "given" else base.example,
                )
        except ProfileError as exc:
            return None, {name: f"tracing with its pieces failed ({exc})" for name in pieces}
        bad = {name: why for name, parts in pieces.items() if (why := _unrunnable(finer, parts))}
        if bad:
            return None, bad
        return self._with_generation(base, _marked(base, finer, pieces)), {}

    def _with_generation(self, base: Profile, finer: Profile) -> Profile:
        """``finer`` planned for the same generation as ``base``: the cache measured again, per
        piece, since each piece's cache stays on the piece's device."""
        generation = base.generation
        if generation is None:
            return finer
        if not generation.cache:  # nothing to measure: the same note
            return replace(finer, generation=generation)
        return profile_generation(
            self.model,
            finer,
            self.example_inputs,
            batch=generation.batch,
            max_length=generation.max_length,
            dtype=self.dtype,
        )


@contextmanager
def _quiet(logger: logging.Logger) -> Iterator[None]:
    """Drop ``logger``'s warnings for a while: a rejected split's uncalled pieces are expected
    there, and the reason goes into the plan's choices instead."""

    def drop(record: logging.LogRecord) -> bool:
        return record.levelno > logging.WARNING

    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


def _unrunnable(finer: Profile, parts: Sequence[str]) -> str:
    """Why ``parts`` cannot run as units, from the trace with them as units ("" when they can)."""
    uncalled = [p for p in parts if p in set(finer.uncalled)]
    if uncalled:
        return f"its forward never calls {uncalled[0]!r}"
    untraced = next((u for u in finer.units if u.name in parts and u.untraced), None)
    if untraced is not None:
        return f"{untraced.name!r} cannot be traced ({untraced.untraced})"
    strays = set(finer.strays)
    position = {u.name: i for i, u in enumerate(finer.units)}
    for unit in finer.units:
        if unit.name in parts:
            read = next((t for t in unit.tensors if t in strays), None)
            if read is not None:
                return f"its forward reads {read!r} outside {unit.name!r}"
    spots = sorted(position[p] for p in parts if p in position)
    if spots and spots[-1] - spots[0] + 1 != len(spots):
        return "other units run between its pieces"
    return ""


def _marked(base: Profile, finer: Profile, pieces: Mapping[str, tuple[str, ...]]) -> Profile:
    """``finer`` with every piece's ``split_from`` set to the outermost unit it came from."""
    origin = {}
    for unit in base.units:
        for part in pieces.get(unit.name, ()):
            origin[part] = unit.split_from or unit.name
    kept = {u.name: u.split_from for u in base.units if u.split_from}
    units = tuple(replace(u, split_from=origin.get(u.name) or kept.get(u.name, "")) for u in finer.units)
    return replace(finer, units=units, example=base.example)  # the same inputs, however they were described
