"""The checkpoint's keys matched to a model before a load reads anything: what is skipped (with
``strict=False``, or in the folder form as ``from_pretrained`` skips), ties the checkpoint does
not keep undone, tensors the model declares it computes computed, and a tensor with no value
anywhere refused, with one warning for what was skipped."""

from __future__ import annotations

import warnings

import torch
from torch import nn

from automap.errors import CheckpointError, user_stacklevel
from automap.loading.checkpoint import Checkpoint
from automap.loading.hf import compute_declared_missing
from automap.loading.keys import Match, extra_state_keys, match_keys, untie
from automap.loading.materialise import missing_value_message
from automap.loading.quantized import check_no_dequantizing_cast, declared_note
from automap.profiling.units import all_named_tensors


def matched(model: nn.Module, ckpt: Checkpoint, strict: bool, folder_form: bool = False) -> Match:
    """How ``ckpt`` fills ``model``, with the model made ready for it: tied weights the
    checkpoint holds apart untied (with a warning, as ``from_pretrained`` does), tensors the
    model declares it computes computed (:func:`compute_declared_missing`).

    Raises:
        CheckpointError: keys that do not match (unless skipped), a model tensor on meta
            that no key fills, or a quantized or complex tensor a real parameter would be cast
            from (before anything is read).
    """
    try:
        match, skipped = _keys(model, ckpt, strict, folder_form)
    except CheckpointError as exc:
        note = declared_note(
            ckpt.path
        )  # a quantized checkpoint's keys (qweight, absmax) say little by themselves
        if not note:
            raise
        raise CheckpointError(f"{exc}{note}") from exc
    stored = {n: ckpt.tensors[k].dtype for n, k in match.sources.items()}
    check_no_dequantizing_cast(model, stored, ckpt.path)
    _check_no_complex_to_real(model, stored, ckpt)
    if match.untied:
        untie(model, match.untied)
        tied = ", ".join(" = ".join(g) for g in match.untied[:3])
        warnings.warn(
            f"the checkpoint holds other values for {tied} than for the tensor the model ties them to: "
            "loaded untied, each from its own key, as from_pretrained does (a config saying "
            "tie_word_embeddings=False describes this checkpoint)",
            stacklevel=user_stacklevel(),
        )
    compute_declared_missing(model, match)
    _check_valued(model, match)
    if skipped:
        warnings.warn(skipped, stacklevel=user_stacklevel())
    return match


def _check_no_complex_to_real(model: nn.Module, stored: dict[str, torch.dtype], ckpt: Checkpoint) -> None:
    """Refuse filling a real tensor of ``model`` from a complex one: the cast keeps the real
    part and drops the rest of the values without a word."""
    tensors = dict(all_named_tensors(model, remove_duplicate=False))
    cast = [
        name
        for name, dtype in stored.items()
        if dtype.is_complex and name in tensors and not tensors[name].dtype.is_complex
    ]
    if cast:
        name = cast[0]
        raise CheckpointError(
            f"{ckpt.path} stores {len(cast)} of the model's real tensors as complex numbers (first {name!r}: "
            f"{str(stored[name]).removeprefix('torch.')} in the checkpoint, {str(tensors[name].dtype).removeprefix('torch.')} "
            "in the model); casting would drop their imaginary parts. Build the model the checkpoint was saved "
            "from, or convert the checkpoint (tensor.real, or torch.view_as_real) and save it again"
        )


def _keys(model: nn.Module, ckpt: Checkpoint, strict: bool, folder_form: bool) -> tuple[Match, str]:
    """:func:`match_keys`, and what was skipped to match (empty: nothing). Not ``strict``:
    keys only one side has are skipped, as accelerate loads them (shapes that differ still
    raise). A folder (the ``from_pretrained`` form) skips checkpoint keys the model lacks, as
    ``from_pretrained`` does (buffers older versions saved: Llama's ``rotary_emb.inv_freq``,
    GPT-2's ``attn.masked_bias``). The caller warns of what was skipped once the load can go on."""
    try:
        return match_keys(model, ckpt), ""
    except CheckpointError as exc:
        if strict and not folder_form:
            raise
        first = exc
    skipped = _IGNORE_ATTRIBUTES if not strict else ("_keys_to_ignore_on_load_unexpected",)
    saved = {name: model.__dict__.get(name) for name in skipped}
    try:
        for name in skipped:  # what transformers' models declare for keys to skip
            setattr(model, name, [".*"])
        match = match_keys(model, ckpt)
    except CheckpointError:
        raise first from None
    finally:
        for name, value in saved.items():
            if value is None:
                model.__dict__.pop(name, None)
            else:
                setattr(model, name, value)
    if strict:
        return match, f"loading anyway, skipping what the model lacks as from_pretrained does: {first}"
    return match, f"strict=False: loading anyway, {first}"


def _check_valued(model: nn.Module, match: Match) -> None:
    """Refuse, before anything is read, model tensors on meta that the checkpoint does not
    hold: nothing could give them a value."""
    lacking = [
        (n, t)
        for n, t in all_named_tensors(model)
        if t.is_meta and n not in match.sources and n not in match.built
    ]
    if lacking:
        parameter = any(isinstance(t, nn.Parameter) for _, t in lacking)
        names = [n for n, t in lacking if isinstance(t, nn.Parameter) == parameter]
        raise CheckpointError(missing_value_message(names, parameter))


_IGNORE_ATTRIBUTES = ("_keys_to_ignore_on_load_missing", "_keys_to_ignore_on_load_unexpected")


def set_extra_states(model: nn.Module, ckpt: Checkpoint, match: Match) -> None:
    """Hand each module the extra state the checkpoint saved for it (what its
    ``get_extra_state`` returned), as ``load_state_dict`` does."""
    modules = extra_state_keys(model)
    for key, stored in match.extra.items():
        modules[key].set_extra_state(ckpt.extra_state(stored))
