"""Example inputs: derived for common model families, and moved to the meta device.

Derived inputs are a guess, and a guess can be wrong: the profiler then plans from what is
known without running the forward (``profiling/fallback.py``). Two things make the guess right
more often for models nobody here wrote. The input is shaped for the first layer the forward
actually *calls*, found by a probe that runs the forward on meta until it reaches a layer
(a ``head`` declared before the ``body`` that runs first does not mislead it). And a forward
with more required positional arguments than the guess fills (``forward(self, x, mask)``) gets
``None`` for the rest, which forwards that treat the argument as optional accept.
"""

from __future__ import annotations

import copy
import inspect
import logging
from typing import Any, Callable, Mapping

import torch
from torch import nn
from torch.utils._pytree import tree_map

from automap.interrupts import deferred
from automap.profiling.fallback import eval_mode
from automap.profiling.units import all_named_tensors, call_with

log = logging.getLogger(__name__)

ExampleInputs = tuple[Any, ...] | Mapping[str, Any]


def default_example_inputs(
    model: nn.Module, seq_len: int = 128, batch: int = 1
) -> tuple[ExampleInputs | None, str]:
    """Derive example inputs for common model families, and say which were used.

    transformers text models get ``input_ids`` of ``seq_len`` tokens (plus
    ``decoder_input_ids`` for encoder-decoders); transformers vision
    models ``pixel_values`` at the config's image size (else 224), speech models a second of
    ``input_values`` or Whisper's ``input_features`` of its encoder's window; other models a ``batch x C x H x W``
    image from their first conv (H = the model's ``image_size`` or 224), or a vector for their
    first linear layer (the first such layer the forward calls, found by running it on meta
    until it calls one, else the first one defined), with ``None`` for any further required
    positional argument. Every tensor is on the meta device, floating-point ones at the dtype
    of most of the model's floating-point parameters (a model built at bfloat16 takes bfloat16
    features or pixels, not float32 ones its first convolution refuses).

    Args:
        model: the model.
        seq_len: tokens per sequence for text models (capped at ``max_position_embeddings``).
        batch: batch size.

    Returns:
        ``(inputs, description)``, or ``(None, "")`` when nothing sensible can be derived.

    Example:
        >>> default_example_inputs(torchvision.models.resnet50())[1]
        'image 1x3x224x224 (first conv)'
    """
    config = getattr(model, "config", None)
    found = _transformers_inputs(model, config, seq_len, batch) if config is not None else (None, "")
    if found[0] is None:
        found = _generic_inputs(model, batch)
    dtype = _float_dtype(model)
    if found[0] is None or dtype in (None, torch.get_default_dtype()):
        return found
    return to_meta(found[0], dtype), found[1]


def _float_dtype(model: nn.Module) -> torch.dtype | None:
    """The dtype of most of ``model``'s floating-point parameters (by elements); None if none."""
    counts: dict[torch.dtype, int] = {}
    for p in model.parameters():
        if p.is_floating_point():
            counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
    return max(counts, key=counts.__getitem__) if counts else None


def _transformers_inputs(
    model: nn.Module, config: Any, seq_len: int, batch: int
) -> tuple[ExampleInputs | None, str]:
    main = getattr(model, "main_input_name", None)
    inputs: dict[str, Any]
    if main == "input_ids":
        text = getattr(config, "text_config", None)
        limit = getattr(config, "max_position_embeddings", None) or getattr(
            text, "max_position_embeddings", None
        )
        if isinstance(limit, int) and limit > 0:  # XLNet's -1: no limit
            seq_len = min(seq_len, limit)
        ids = torch.zeros(batch, seq_len, dtype=torch.long, device="meta")
        inputs, how = {"input_ids": ids}, f"input_ids {batch}x{seq_len}"
        if getattr(config, "is_encoder_decoder", False):
            inputs["decoder_input_ids"] = ids
            how += " (+ decoder_input_ids)"
        vision = getattr(config, "vision_config", None)
        if hasattr(vision, "image_size") and not _image_tokens(
            config
        ):  # CLIP-like: text and image side by side
            size, channels = _pair(vision.image_size), getattr(vision, "num_channels", 3)
            inputs["pixel_values"] = torch.zeros(batch, channels, *size, device="meta")
            how += f" (+ pixel_values {batch}x{channels}x{size[0]}x{size[1]})"
    elif main == "pixel_values":  # ResNet's and ConvNeXt's configs name no image size: ImageNet's
        size, channels = _pair(getattr(config, "image_size", 224)), getattr(config, "num_channels", 3)
        inputs = {"pixel_values": torch.zeros(batch, channels, *size, device="meta")}
        how = f"pixel_values {batch}x{channels}x{size[0]}x{size[1]}"
    elif main == "input_values":  # wav2vec2-like speech models: raw audio, one second at 16 kHz
        inputs, how = (
            {"input_values": torch.zeros(batch, 16000, device="meta")},
            f"input_values {batch}x16000 (audio)",
        )
    elif (
        main == "input_features"
        and hasattr(config, "num_mel_bins")
        and hasattr(config, "max_source_positions")
    ):
        inputs, how = _features(config, seq_len, batch)
    else:
        try:
            dummies = dict(getattr(model, "dummy_inputs"))
        except Exception:  # noqa: BLE001 - a model without usable dummies falls through
            return None, ""
        if main not in dummies:  # transformers 5 gives every model input_ids: not this model's input
            return None, ""
        return {k: to_meta(v) for k, v in dummies.items()}, "transformers dummy_inputs"
    return inputs, how


def _features(config: Any, seq_len: int, batch: int) -> tuple[dict[str, Any], str]:
    """Whisper-like speech models: log-mel features of the encoder's whole window (two frames
    a position), and decoder ids."""
    frames = 2 * config.max_source_positions
    inputs = {"input_features": torch.zeros(batch, config.num_mel_bins, frames, device="meta")}
    how = f"input_features {batch}x{config.num_mel_bins}x{frames}"
    if getattr(config, "is_encoder_decoder", False):
        length = min(seq_len, getattr(config, "max_target_positions", seq_len))
        inputs["decoder_input_ids"] = torch.zeros(batch, length, dtype=torch.long, device="meta")
        how += f" (+ decoder_input_ids {batch}x{length})"
    return inputs, how


def _image_tokens(config: Any) -> bool:
    """Whether images enter the model as tokens of its text (LLaVA-like: the ids must hold one
    per image patch, so a text-only example is the one that runs)."""
    return any(hasattr(config, name) for name in ("image_token_id", "image_token_index", "image_token_ids"))


def _generic_inputs(model: nn.Module, batch: int) -> tuple[ExampleInputs | None, str]:
    def takes(module: nn.Module) -> bool:
        return _input_for(module, model, batch) is not None

    first = next((m for m in model.modules() if takes(m)), None)
    if first is None:
        return None, ""
    args, how = _with_required(model, first, model, batch)
    called = first_called(model, args, takes)
    if called is None or called is first:
        return args, how
    args, how = _with_required(model, called, model, batch)
    return args, how.replace("(first ", "(first called ")


def _input_for(module: nn.Module, model: nn.Module, batch: int) -> tuple[torch.Tensor, str] | None:
    """An input ``module`` takes, and its description; None for a module of another kind."""
    if isinstance(module, nn.Conv2d):
        h, w = _pair(getattr(model, "image_size", 224))
        return torch.zeros(
            batch, module.in_channels, h, w, device="meta"
        ), f"image {batch}x{module.in_channels}x{h}x{w} (first conv)"
    if isinstance(module, nn.Conv1d):
        return torch.zeros(
            batch, module.in_channels, 1024, device="meta"
        ), f"signal {batch}x{module.in_channels}x1024 (first conv)"
    if isinstance(module, nn.Embedding):
        return torch.zeros(
            batch, 128, dtype=torch.long, device="meta"
        ), f"token ids {batch}x128 (first embedding)"
    if isinstance(module, nn.Linear):
        return torch.zeros(
            batch, module.in_features, device="meta"
        ), f"vector {batch}x{module.in_features} (first linear)"
    return None


def _with_required(
    model: nn.Module, layer: nn.Module, root: nn.Module, batch: int
) -> tuple[tuple[Any, ...], str]:
    """An input for ``layer``, padded with ``None`` up to ``model``'s required positional arguments."""
    found = _input_for(layer, root, batch)
    assert found is not None, type(layer).__name__  # only layers _input_for takes are asked about
    first, how = found
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):  # a builtin or C forward: nothing to read
        return (first,), how
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    required = [p.name for p in params if p.kind in kinds and p.default is inspect.Parameter.empty]
    if len(required) <= 1:
        return (first,), how
    return (first, *[None] * (len(required) - 1)), f"{how} + None for {', '.join(required[1:])}"


class _Reached(BaseException):
    """Raised by the probe's hook: the forward called ``module`` (a ``BaseException``, so that a
    forward's own ``except Exception`` does not swallow it)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__(type(module).__name__)
        self.module = module


def first_called(
    model: nn.Module, args: tuple[Any, ...], wanted: Callable[[nn.Module], bool]
) -> nn.Module | None:
    """The first module for which ``wanted`` holds that ``model``'s forward calls on ``args``
    (meta tensors), or None when the forward fails or ends before calling one. The forward
    runs on meta copies of the weights and stops at that call; the model is not changed."""

    def stop(module: nn.Module, _args: Any) -> None:
        raise _Reached(module)

    state = {name: to_meta(t) for name, t in all_named_tensors(model)}
    # All of it under deferred (a forward on meta, stopped at the first call: short): an interrupt
    # on the way into the cleanup (at the call of it) would skip it and leave the hooks.
    with deferred():
        handles = []
        try:
            for module in model.modules():
                if module is not model and wanted(module):
                    handles.append(module.register_forward_pre_hook(stop))
            with torch.no_grad(), eval_mode(model):
                call_with(model, state, args)
        except _Reached as reached:
            return reached.module
        except Exception as exc:  # noqa: BLE001 - the probe only learns where a forward starts
            log.debug("probing where the forward of %s starts failed: %s", type(model).__name__, exc)
        finally:
            for handle in handles:
                handle.remove()
    return None


def _pair(value: Any) -> tuple[int, int]:
    if isinstance(value, (tuple, list)):
        return int(value[0]), int(value[1])
    return int(value), int(value)


# Values a forward cannot change in place: passed to a probe as they are.
_IMMUTABLE = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size)


def to_meta(value: Any, dtype: torch.dtype | None = None) -> Any:
    """``value`` with every tensor replaced by an empty meta tensor (floats at ``dtype`` if given).

    Any other object in it (a transformers cache of keys and values from an earlier call) is
    copied with its tensors replaced so: a probe's forward writes into its copy, never into the
    user's object (a cache grown by a meta step would give the next real step other outputs)."""

    def meta(x: torch.Tensor) -> torch.Tensor:
        target = dtype if dtype is not None and x.is_floating_point() else x.dtype
        return torch.empty_strided(x.shape, x.stride(), device="meta", dtype=target)

    def convert(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return meta(x)
        if isinstance(x, _IMMUTABLE) or callable(x):
            return x
        try:
            return copy.deepcopy(
                x, {id(t): meta(t) for t in _tensors_in(x)}
            )  # the tensors themselves not copied
        except TypeError:  # holds what cannot be copied (a lock, a file): the probe gets it as it is
            return x

    return tree_map(convert, value)


def _tensors_in(value: Any, seen: set[int] | None = None) -> list[torch.Tensor]:
    """The tensors reachable from ``value`` through containers and object attributes."""
    seen = set() if seen is None else seen
    if id(value) in seen or isinstance(value, _IMMUTABLE):
        return []
    seen.add(id(value))
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, Mapping):
        children: Any = [*value.keys(), *value.values()]
    elif isinstance(value, (list, tuple, set, frozenset)):
        children = value
    else:
        children = list(getattr(value, "__dict__", {}).values())
        children += [
            getattr(value, slot) for slot in getattr(type(value), "__slots__", ()) if hasattr(value, slot)
        ]
    return [tensor for child in children for tensor in _tensors_in(child, seen)]


def split_inputs(inputs: ExampleInputs) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` for ``forward`` from a tuple of args or a mapping of kwargs."""
    if isinstance(inputs, Mapping):
        return (), dict(inputs)
    if isinstance(inputs, torch.Tensor):
        return (inputs,), {}
    return tuple(inputs), {}
