"""The generation cache, measured on meta: the bytes each unit keeps between decode steps (as
``generate`` runs the model: a prefill, then one decode step), and what one decode step costs.
Nothing is derived from a config's field names.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass, field, replace
from typing import Any, Iterator, Mapping, Sequence

import torch
from torch import nn

from automap.errors import PlanError, ProfileError
from automap.profiling.fallback import eval_mode
from automap.profiling.inputs import ExampleInputs, default_example_inputs, to_meta
from automap.profiling.result import Generation, Profile
from automap.profiling.result import TraceResult
from automap.profiling.traced_run import run_trace
from automap.profiling.units import all_named_tensors
from automap.sizes import MAX_COUNT, format_bytes, parse_number

log = logging.getLogger(__name__)

_ATOMS = (str, bytes, int, float, bool, type(None), torch.dtype, torch.device, type)


@dataclass
class _Step:
    """What one prefill-and-step run measured, per unit."""

    cache: str
    held: dict[str, int] = field(default_factory=dict)  # storage bytes of the cache after the step
    read: dict[str, int] = field(default_factory=dict)  # bytes of the cache tensors (views) after it
    flops: dict[str, int] = field(default_factory=dict)  # FLOPs of the step
    ops: dict[str, int] = field(default_factory=dict)  # aten ops of the step
    weights: dict[str, int] = field(default_factory=dict)  # bytes of each weight (by name) the step read
    unattributed: int = 0


@dataclass(frozen=True)
class _Prompt:
    """The input of a generation: the argument it goes in, its batch and length, and for an
    encoder-decoder the encoder's input (tokens, or Whisper's audio features) as a meta
    template: the encoder runs on it once, the decoder starts from one token."""

    name: str
    batch: int
    length: int
    encoder: bool
    encoder_input: torch.Tensor | None = None


def held_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor reachable from ``obj`` through containers and object attributes (a
    transformers ``Cache`` keeps them in layer objects), each once; modules are not entered."""
    stack, seen = [obj], set()
    while stack:
        value = stack.pop()
        if id(value) in seen or isinstance(value, (_ATOMS, nn.Module)):
            continue
        seen.add(id(value))
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, Mapping):
            stack.extend(value.values())
        elif isinstance(value, (list, tuple, set, frozenset)):
            stack.extend(value)
        elif hasattr(value, "__dict__"):
            stack.extend(vars(value).values())


def find_cache(output: Any, forward_params: Sequence[str]) -> tuple[str, Any] | None:
    """``(argument name, cache)``: the value of ``output`` that ``forward`` takes back under
    the same name (what ``generate`` feeds the next step), or None when there is none."""
    if not isinstance(output, Mapping):
        return None
    for key, value in output.items():
        if key in forward_params and value is not None and not isinstance(value, torch.Tensor):
            return str(key), value
    return None


def cache_bytes(
    cache: Any, producers: Sequence[Mapping[int, str]]
) -> tuple[dict[str, int], dict[str, int], int]:
    """Bytes of ``cache``'s tensors per producing unit: ``(storage bytes, tensor bytes,
    bytes no unit produced)``. ``producers`` are looked up in turn (latest run first)."""
    held: dict[str, int] = {}
    read: dict[str, int] = {}
    storages: set[int] = set()
    views: set[tuple] = set()
    unattributed = 0
    for t in held_tensors(cache):
        st = t.untyped_storage()
        unit = next((p[id(st)] for p in producers if id(st) in p), None)
        view = (id(st), t.storage_offset(), tuple(t.shape), t.stride())
        if unit is None:
            if id(st) not in storages:
                unattributed += st.nbytes()
        else:
            if id(st) not in storages:
                held[unit] = held.get(unit, 0) + st.nbytes()
            if view not in views:
                read[unit] = read.get(unit, 0) + t.numel() * t.element_size()
        storages.add(id(st))
        views.add(view)
    return held, read, unattributed


def prompt_of(
    model: nn.Module, example_inputs: ExampleInputs | None, dtype: torch.dtype | None = None
) -> _Prompt | None:
    """The input of a generation, from the example inputs: the tensor under the model's
    ``main_input_name`` (``input_ids`` in a dict without it; the first positional argument).
    A decoder's is a ``batch x tokens`` token tensor; an encoder-decoder's is whatever its
    encoder takes (token ids for T5 and BART, ``input_features`` for Whisper), cast to
    ``dtype`` when it holds floats. None when there is no such input."""
    main = getattr(model, "main_input_name", "input_ids")
    if isinstance(example_inputs, Mapping):
        name = main if main in example_inputs else "input_ids"
        value = example_inputs.get(name)
    else:
        name = next(iter(inspect.signature(model.forward).parameters), main)
        value = (
            example_inputs[0]
            if isinstance(example_inputs, (tuple, list)) and example_inputs
            else example_inputs
        )
    if not isinstance(value, torch.Tensor) or value.dim() < 2:
        return None
    if bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False)):
        template = to_meta(value, dtype)
        length = int(value.shape[-1] if value.is_floating_point() else value.shape[1])
        return _Prompt(name, int(value.shape[0]), length, True, template)
    if value.dim() != 2 or value.is_floating_point():
        return None
    return _Prompt(name, int(value.shape[0]), int(value.shape[1]), False)


# Tokens of a derived prompt (when no example inputs are given): a chat turn's worth, at most
# half of max_length so that the decode, not the prefill, is what gets planned.
DEFAULT_PROMPT_TOKENS = 128


def prompt_inputs(
    model: nn.Module, example_inputs: ExampleInputs | None, batch: int, max_length: int
) -> tuple[ExampleInputs | None, str]:
    """The prompt a generation starts from, and how it was chosen: ``example_inputs`` when
    given, else (transformers token models) ``batch`` sequences of ``DEFAULT_PROMPT_TOKENS``
    tokens (at most half of ``max_length``), an encoder-decoder's decoder starting from one
    token, as ``generate`` starts it.

    Raises:
        PlanError: ``batch`` or ``max_length`` out of range.
    """
    check_generation(0, batch, max_length, True)
    if example_inputs is not None:
        return example_inputs, "given"
    encoder = bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))
    tokens = DEFAULT_PROMPT_TOKENS if encoder else max(1, min(DEFAULT_PROMPT_TOKENS, max_length // 2))
    inputs, how = default_example_inputs(model, seq_len=tokens, batch=batch)
    if encoder and isinstance(inputs, dict) and "decoder_input_ids" in inputs:
        inputs = {**inputs, "decoder_input_ids": inputs["decoder_input_ids"][:, :1]}
        how = how.replace("(+ decoder_input_ids)", "(+ 1 decoder token)")
    return inputs, how


def _token_kwargs(prompt: _Prompt, batch: int, tokens: int) -> dict[str, Any]:
    ids = torch.zeros(batch, tokens, dtype=torch.long, device="meta")
    if not prompt.encoder:
        return {prompt.name: ids}
    return {prompt.name: prompt.encoder_input, "decoder_input_ids": ids}


def _step_kwargs(prompt: _Prompt, batch: int, prefill: TraceResult, cache: tuple[str, Any]) -> dict[str, Any]:
    """The next step's arguments: one token per sequence, the cache, and for an
    encoder-decoder the encoder's states (the encoder runs once)."""
    ids = torch.zeros(batch, 1, dtype=torch.long, device="meta")
    if not prompt.encoder:
        return {prompt.name: ids, cache[0]: cache[1]}
    states = prefill.output["encoder_last_hidden_state"]
    return {"decoder_input_ids": ids, "encoder_outputs": (states,), cache[0]: cache[1]}


def _run(
    model: nn.Module,
    state: Mapping[str, torch.Tensor],
    units: Sequence[str],
    kwargs: dict[str, Any],
    params: Sequence[str],
) -> TraceResult:
    if "use_cache" in params:
        kwargs = {**kwargs, "use_cache": True}
    return run_trace(model, state, (), kwargs, units, backward=False, record_inputs=False, keep_output=True)


def _prefill_and_step(
    model: nn.Module,
    state: Mapping[str, torch.Tensor],
    units: Sequence[str],
    prompt: _Prompt,
    batch: int,
    tokens: int,
) -> _Step | None:
    params = list(inspect.signature(model.forward).parameters)
    prefill = _run(model, state, units, _token_kwargs(prompt, batch, tokens), params)
    cache = find_cache(prefill.output, params)
    if cache is None:
        return None
    step = _run(model, state, units, _step_kwargs(prompt, batch, prefill, cache), params)
    after = find_cache(step.output, params) or cache
    held, read, unattributed = cache_bytes(after[1], [step.producers, prefill.producers])
    return _Step(
        type(after[1]).__name__,
        held,
        read,
        dict(step.flops),
        dict(step.ops),
        dict(step.weight_reads),
        unattributed,
    )


def check_batch(batch: int) -> None:
    """Raise :class:`PlanError` unless ``batch`` is a whole number of sequences, 1 or more."""
    parse_number(
        batch,
        "batch",
        integral=True,
        minimum=1,
        maximum=MAX_COUNT,
        error=PlanError,
        hint=f"plan for 1 or more sequences (or images), at most {MAX_COUNT:,}, e.g. batch=1",
    )


def check_generation(prompt_length: int, batch: int, max_length: int, encoder: bool) -> None:
    """Raise :class:`PlanError` unless ``batch`` sequences can grow to ``max_length`` tokens."""
    check_batch(batch)
    parse_number(
        max_length,
        "max_length",
        integral=True,
        minimum=2,
        maximum=MAX_COUNT,
        error=PlanError,
        hint=f"a generation needs at least 2 tokens, at most {MAX_COUNT:,} (max_length counts "
        "the prompt and the new tokens, as generate(max_length=...) does)",
    )
    if not encoder and max_length <= prompt_length:
        raise PlanError(
            f"max_length={max_length} is not longer than the prompt ({prompt_length} tokens), so "
            f"nothing would be generated; give max_length > {prompt_length} (prompt + new tokens) "
            "or a shorter prompt in example_inputs"
        )


def profile_generation(
    model: nn.Module,
    prof: Profile,
    example_inputs: ExampleInputs | None,
    *,
    batch: int | None,
    max_length: int,
    dtype: torch.dtype | None = None,
) -> Profile:
    """``prof`` with each unit's cache bytes and decode cost for ``batch`` sequences grown to
    ``max_length`` tokens (see the module docstring).

    Args:
        model: the profiled model (real or on meta); it is not changed.
        prof: its profile at the prompt (``example_inputs``), from :func:`automap.profile`.
        example_inputs: the prompt; its token tensor gives the prompt's batch and length.
        batch: sequences decoded together (default: the prompt's batch).
        max_length: tokens per sequence at the end, prompt included.
        dtype: the dtype the model runs in (the cache's dtype follows it).

    Returns:
        A new :class:`Profile` whose units carry ``kv_bytes``, ``kv_read_bytes`` and
        ``decode_flops`` and whose ``generation`` says what was planned (with a note when the
        model keeps no cache: then nothing is reserved).

    Raises:
        PlanError: ``batch`` < 1 or not the prompt's, ``max_length`` < 2, or ``max_length`` not
            longer than the prompt.
        ProfileError: the model's forward failed on meta.

    Example:
        >>> prof = profile_generation(model, automap.profile(model), None, batch=8, max_length=2048)
        >>> format_bytes(prof.total_kv_bytes)
    """
    prompt = prompt_of(model, example_inputs, dtype)
    if prompt is None:
        batch = 1 if batch is None else batch
        check_generation(0, batch, max_length, True)
        main = getattr(model, "main_input_name", "input_ids")
        note = (
            f"{type(model).__name__} takes no batch x tokens input in the example inputs, so no cache "
            f"was planned; pass example_inputs={{'{main}': ...}} (the prompt's token ids) to plan one"
        )
        return replace(prof, generation=Generation(batch, max_length, 0, notes=(note,)))
    if batch is not None and batch != prompt.batch:
        raise PlanError(
            f"batch={batch} but the example inputs hold {prompt.batch} prompt(s); give one prompt per "
            "sequence decoded together, or leave batch out"
        )
    batch = prompt.batch
    check_generation(prompt.length, batch, max_length, prompt.encoder)
    start = 1 if prompt.encoder else prompt.length  # the decoder's tokens before the first step
    encoder_length = prompt.length if prompt.encoder else 0
    units = [u.name for u in prof.units]
    state = {name: to_meta(t, dtype) for name, t in all_named_tensors(model)}
    with eval_mode(model), torch.no_grad():
        try:
            first = _prefill_and_step(model, state, units, prompt, batch, start)
        except ProfileError:
            if _generates(model):
                raise
            note = (
                f"{type(model).__name__} does not generate (transformers' can_generate() is False) and its "
                "forward does not run on tokens alone (CLIP's needs its images), so no cache was planned"
            )
            return replace(
                prof, generation=Generation(batch, max_length, start, encoder_length, notes=(note,))
            )
        last = (
            _prefill_and_step(model, state, units, prompt, batch, max(max_length - 2, 1)) if first else None
        )
    if first is None or last is None:
        note = (
            f"{type(model).__name__} returns no cache from its forward, so nothing is reserved for one; "
            "each decode step recomputes the whole sequence"
        )
        return replace(prof, generation=Generation(batch, max_length, start, encoder_length, notes=(note,)))
    return _with_cache(
        prof, state, first, last, Generation(batch, max_length, start, encoder_length, last.cache)
    )


def _weights_read(
    tensors: Sequence[str],
    reads: Mapping[str, int],
    tie_groups: Sequence[Sequence[str]],
    state: Mapping[str, torch.Tensor],
) -> tuple[int, int]:
    """Bytes and rows of ``tensors`` one decode step read: of each, the most any op read of
    it under any of its tied names (GPT-2's embedding is read whole by its ``lm_head``); a
    row is a tensor's last dimension (a vector is one row)."""
    names = {n: group for group in tie_groups for n in group}
    nbytes = rows = 0
    for t in tensors:
        group = names.get(t, (t,))
        read = max(reads.get(n, 0) for n in group)
        tensor = next((state[n] for n in group if n in state), None)
        if read and tensor is not None:
            nbytes += read
            rows += read // (max(tensor.shape[-1] if tensor.dim() else 1, 1) * tensor.element_size())
    return nbytes, rows


def _generates(model: nn.Module) -> bool:
    """Whether ``model`` may generate: False only for a transformers model that says it does
    not (``can_generate()``: CLIP, a classifier); any other model is taken at its forward."""
    can_generate = getattr(model, "can_generate", None)
    return not callable(can_generate) or bool(can_generate())


def _with_cache(
    prof: Profile, state: Mapping[str, torch.Tensor], first: _Step, last: _Step, generation: Generation
) -> Profile:
    units = []
    for u in prof.units:
        weight_bytes, weight_rows = _weights_read(u.tensors, last.weights, prof.tie_groups, state)
        units.append(
            replace(
                u,
                kv_bytes=last.held.get(u.name, 0),
                kv_read_bytes=_mean(first.read, last.read, u.name),
                decode_flops=_mean(first.flops, last.flops, u.name),
                decode_weight_bytes=weight_bytes,
                decode_weight_rows=weight_rows,
                decode_ops=_mean(first.ops, last.ops, u.name),
            )
        )
    notes = []
    if last.unattributed:
        notes.append(
            f"{format_bytes(last.unattributed)} of the cache was made outside every unit and is not "
            "reserved on a device"
        )
    if not any(u.kv_bytes for u in units):
        notes.append(f"the {last.cache} the model returns holds no tensors: nothing reserved for it")
    log.info(
        "generation cache of %s for %d x %d tokens: %s (%s)",
        prof.model_name,
        generation.batch,
        generation.max_length,
        format_bytes(sum(u.kv_bytes for u in units)),
        last.cache,
    )
    return replace(prof, units=tuple(units), generation=replace(generation, notes=tuple(notes)))


def _mean(first: Mapping[str, int], last: Mapping[str, int], name: str) -> int:
    return (first.get(name, 0) + last.get(name, 0)) // 2
