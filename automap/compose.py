"""The one composition root: a module profiled and planned, for every front door.

:func:`automap.plan` (and so dispatch, load and the drop-ins), ``automap plan SPEC`` and
:func:`automap.distributed.plan_for_ranks` wire profile -> plan here; where the library and the
command line differ, the difference is a field of :class:`Tracing`. A dict device map is parsed
once here (:func:`user_map`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
from torch import nn

from automap.devices import DeviceSpec
from automap.errors import PlanError, ProfileError
from automap.kinds import kind_of
from automap.planning import Plan, make_plan, plan_from_device_map
from automap.planning.usermap import UserMap, loose_homes, parse_device_map
from automap.profiling import ExampleInputs, Profile, default_example_inputs, profile, untraced_profile
from automap.profiling.kvcache import prompt_inputs, profile_generation
from automap.profiling.refine import Splitter
from automap.profiling.units import all_named_tensors
from automap.progress import step
from automap import report  # noqa: F401  (registers how the plans made here are drawn and written)
from automap.runtime.pieces import never_called

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GenerationRequest:
    """A plan for ``generate``: ``batch`` sequences (None: the prompt's) of ``max_length`` tokens."""

    batch: int | None
    max_length: int


@dataclass(frozen=True)
class Tracing:
    """How a model is traced for its plan; each front door says it in full (see the table above).

    Attributes:
        inputs: the forward's inputs (the prompt, for a generation); None: the profiler
            guesses its own.
        guessed: how automap derived ``inputs`` ("" when they are the user's): a forward
            failing on a guess falls back to weights-only figures instead of raising.
        backward: also trace a backward (activations kept for training).
        generation: measure each unit's cache for this generation; None: no generation.
        hint: added to a :class:`ProfileError` from guessed inputs, saying how to give them.
    """

    inputs: ExampleInputs | None
    guessed: str = ""
    backward: bool = True
    generation: GenerationRequest | None = None
    hint: str = ""


def library_tracing(
    model: nn.Module | Profile,
    example_inputs: ExampleInputs | None,
    batch: int | None,
    max_length: int | None,
) -> Tracing:
    """:func:`automap.plan`'s tracing: ``example_inputs`` (guessed at ``batch`` when only that
    is given), backward included; for a generation (``max_length``) the prompt, forward only.

    Raises:
        PlanError: ``batch`` or ``max_length`` out of range for a generation.
    """
    generation = None if max_length is None else GenerationRequest(batch, max_length)
    if isinstance(model, Profile):
        return Tracing(None, generation=generation)  # already profiled: nothing to trace
    if generation is None:
        if example_inputs is None and batch is not None:
            inputs, how = default_example_inputs(model, batch=batch)
            return Tracing(inputs, guessed=how)
        return Tracing(example_inputs)
    inputs, how = prompt_inputs(model, example_inputs, batch or 1, max_length)
    return Tracing(
        inputs, guessed=how if example_inputs is None else "", backward=False, generation=generation
    )


def spec_tracing(
    model: nn.Module, example_inputs: Any, batch: int, seq_len: int, max_length: int | None
) -> tuple[Tracing, str]:
    """``automap plan``'s tracing: ``example_inputs`` (one tensor welcome) or inputs guessed at
    ``batch`` x ``seq_len``, forward only (its plans are for inference: a backward would double
    the time for nothing); for a generation those inputs are the prompt. Also the sentence
    saying ``seq_len`` was capped ("" when not)."""
    if example_inputs is not None:
        inputs = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else example_inputs
        guessed, note = "", ""
    else:
        seq_len, note = capped_seq_len(model, seq_len)
        if note:
            log.info("%s", note)
        inputs, guessed = example_inputs_for(model, batch, seq_len)
    generation = None if max_length is None else GenerationRequest(batch, max_length)
    return Tracing(inputs, guessed=guessed, backward=False, generation=generation, hint=_CLI_HINT), note


_CLI_HINT = (
    "give the model's own: --input-shape 1x3x16x112x112 (one tensor; several separated by commas) or "
    "--example-inputs module:function on the command line, example_inputs=(...) in Python"
)


def example_inputs_for(model: nn.Module, batch: int, seq_len: int) -> tuple[Any, str]:
    """Meta example inputs for ``model`` at ``batch`` x ``seq_len`` and a description of them.

    transformers vision models get ``pixel_values`` at their config's image size; everything
    else gets :func:`automap.profiling.default_example_inputs`.
    """
    config = getattr(model, "config", None)
    if config is not None and getattr(model, "main_input_name", None) == "pixel_values":
        size = getattr(config, "image_size", 224)
        side = int(
            size[0]
            if isinstance(size, (list, tuple))
            else size.get("height", 224)
            if isinstance(size, dict)
            else size
        )
        channels = int(getattr(config, "num_channels", 3))
        image = torch.zeros(batch, channels, side, side, device="meta")
        return {"pixel_values": image}, f"pixel_values {batch}x{channels}x{side}x{side}"
    return default_example_inputs(model, seq_len=seq_len, batch=batch)


def capped_seq_len(model: nn.Module, seq_len: int) -> tuple[int, str]:
    """``seq_len``, or the model's ``max_position_embeddings`` when that is smaller (its
    position table has no rows beyond), with a sentence saying so ("" when not capped)."""
    config = getattr(model, "config", None)
    limit = getattr(config, "max_position_embeddings", None) if config is not None else None
    if (
        isinstance(limit, int)
        and 0 < limit < seq_len
        and getattr(model, "main_input_name", "") == "input_ids"
    ):
        return limit, (
            f"--seq-len {seq_len} capped at {limit}, the model's max_position_embeddings: "
            f"planned for {limit} tokens"
        )
    return seq_len, ""


def traced_profile(
    model: nn.Module,
    tracing: Tracing,
    *,
    no_split: Iterable[str | type] | None = None,
    dtype: torch.dtype | None = None,
    units: list[str] | None = None,
) -> Profile:
    """``model``'s profile as ``tracing`` says, with each unit's cache for a generation.

    Raises:
        ProfileError: the forward failed on the user's inputs (or on guessed ones, with
            ``tracing.hint``); ``no_split`` or ``units`` name what the model lacks.
        PlanError: a generation's ``batch`` or ``max_length`` out of range.
    """
    try:
        prof = profile(
            model,
            tracing.inputs,
            no_split=no_split,
            dtype=dtype,
            units=units,
            backward=tracing.backward,
            guessed=tracing.guessed,
        )
    except ProfileError as exc:
        if not (tracing.hint and tracing.guessed):
            raise
        raise ProfileError(
            f"{exc}. automap guessed these inputs ({tracing.guessed}); {tracing.hint}"
        ) from exc
    if tracing.generation is None:
        return prof
    return profile_generation(
        model,
        prof,
        tracing.inputs,
        batch=tracing.generation.batch,
        max_length=tracing.generation.max_length,
        dtype=dtype,
    )


def plan_strategy(
    model: nn.Module | Profile,
    devices: tuple[DeviceSpec, ...],
    strategy: str,
    tracing: Tracing,
    *,
    no_split: Iterable[str | type] | None = None,
    dtype: torch.dtype | None = None,
    reserve: Mapping[str, int] | None = None,
    accept: Callable[[Plan], bool] | None = None,
) -> Plan:
    """Profile ``model`` as ``tracing`` says and place it with ``strategy`` on ``devices``,
    splitting a unit that does not fit (traced again on the same inputs). A :class:`Profile`
    is planned as it is (nothing to trace again, so nothing split).

    Raises:
        PlanError: the model does not fit; a generation asked of a profile without its cache.
        ProfileError, MapFormatError: see :func:`traced_profile`, :func:`automap.planning.make_plan`.
    """
    if isinstance(model, Profile):
        if tracing.generation is not None and model.generation is None:
            raise PlanError(
                "max_length needs the model to measure its cache, not a Profile; pass the model, "
                "or a Profile from automap.profiling.kvcache.profile_generation"
            )
        prof, refine = model, None
    else:
        prof = traced_profile(model, tracing, no_split=no_split, dtype=dtype)
        refine = Splitter(model, example_inputs=tracing.inputs, no_split=no_split, dtype=dtype)
    with step("automap: planning"):
        return make_plan(prof, devices, strategy, reserve=reserve, refine=refine, accept=accept)


def user_map(model: nn.Module, device_map: Mapping[object, object]) -> UserMap:
    """``device_map`` parsed against ``model`` (:func:`~automap.planning.usermap.parse_device_map`):
    the one place a dict device map is read, called once by every public entry that takes one.

    Raises:
        DeviceMapError: a key or a value the map cannot mean.
    """
    tensors = dict.fromkeys(n for n, _ in all_named_tensors(model, remove_duplicate=False))
    return parse_device_map(device_map, model.named_modules(remove_duplicate=False), tensors)


def tensor_holders(model: nn.Module, parsed: UserMap, units: Sequence[str]) -> list[str]:
    """Modules a map places tensor by tensor (``{"fc.weight": "disk", "fc.bias": "disk"}``, as
    accelerate's maps may), each a unit of its own when the map names every tensor it holds
    itself and no unit lies inside or around it: what the map keeps together stays together
    (tensors of one such module put on two devices are refused by name)."""
    found: list[str] = []
    for key in parsed.devices:
        holder = key.rpartition(".")[0]
        if (
            not holder
            or holder in found
            or any(u == holder or u.startswith(holder + ".") or holder.startswith(u + ".") for u in units)
        ):
            continue
        try:
            module = model.get_submodule(holder)
        except AttributeError:
            continue
        own = [
            f"{holder}.{n}"
            for n, t in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
            if t is not None
        ]
        if own and all(n in parsed.devices for n in own):
            found.append(holder)
    return found


def plan_user_map(
    model: nn.Module,
    parsed: UserMap,
    devices: tuple[DeviceSpec, ...],
    example_inputs: ExampleInputs | None,
    dtype: torch.dtype | None,
    batch: int | None,
    max_length: int | None,
) -> Plan:
    """A parsed dict device map as a plan: its module keys that hold tensors are the units (what
    it keeps together stays together). Traced only with ``example_inputs`` or for a generation
    (:func:`library_tracing`); otherwise the map alone says where everything goes.

    Raises:
        DeviceMapError: the map leaves tensors without a device or splits a unit.
    """
    tensors = parsed.tensors
    holders = {""} | {t.rsplit(".", depth)[0] for t in tensors for depth in range(1, t.count(".") + 1)}
    named = [k for k in parsed.devices if k in parsed.modules and k in holders]
    units = called_units(model, named, holders, parsed.devices)
    units = (units + tensor_holders(model, parsed, units)) or [""]
    if example_inputs is None and max_length is None:
        prof = untraced_profile(
            model, _MAP_PLACES_ALL, units=units, dtype=dtype, loose_homes=loose_homes(parsed, units)
        )
    else:
        prof = traced_profile(
            model, library_tracing(model, example_inputs, batch, max_length), dtype=dtype, units=units
        )
    return plan_from_device_map(prof, devices, parsed)


def called_units(
    model: nn.Module, units: Sequence[str], holders: set[str], where: Mapping[str, str]
) -> list[str]:
    """The map's units as modules that run: a container the map stores whole (on a kind of
    device that only stores), which is never called and so could not be streamed in
    (accelerate's ``infer_auto_device_map`` keeps a ``ModuleList`` together:
    ``'model.encoder.layers': 'disk'``), gives way to its children that hold tensors, found the
    same way, each streamed in when it runs; the map still places them by its prefix.
    ``where``: the parsed map's canonical devices."""
    found: list[str] = []
    for name in units:
        module = model.get_submodule(name)
        stored = name in where and kind_of(where[name]).stores_only
        if not (stored and never_called(module)):
            found.append(name)
            continue
        children = [f"{name}.{child}" for child, _ in module.named_children()]
        children = [
            c for c in children if c in holders and c not in units
        ]  # a child the map names is a unit already
        found += called_units(model, children, holders, {**where, **{c: where[name] for c in children}})
    return found


_MAP_PLACES_ALL = "the device map places every tensor; pass example_inputs to count FLOPs and cut bytes"
