"""Example inputs: derived for common model families, and moved to the meta device."""
from __future__ import annotations

import logging
from typing import Any, Mapping

import torch
from torch import nn
from torch.utils._pytree import tree_map

log = logging.getLogger(__name__)

ExampleInputs = tuple[Any, ...] | Mapping[str, Any]


def default_example_inputs(model: nn.Module, seq_len: int = 128, batch: int = 1) -> tuple[ExampleInputs | None, str]:
    """Derive example inputs for common model families, and say which were used.

    transformers text models get ``input_ids`` of ``seq_len`` tokens (plus
    ``decoder_input_ids`` for encoder-decoders); transformers vision
    models ``pixel_values`` at the config's image size; other models a ``batch x C x H x W``
    image from their first conv (H = the model's ``image_size`` or 224), or a vector for their
    first linear layer. Every tensor is on the meta device.

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
    if config is not None:
        found = _transformers_inputs(model, config, seq_len, batch)
        if found[0] is not None:
            return found
    return _generic_inputs(model, batch)


def _transformers_inputs(model: nn.Module, config: Any, seq_len: int, batch: int) -> tuple[ExampleInputs | None, str]:
    main = getattr(model, "main_input_name", None)
    inputs: dict[str, Any]
    if main == "input_ids":
        seq_len = min(seq_len, getattr(config, "max_position_embeddings", None) or seq_len)
        ids = torch.zeros(batch, seq_len, dtype=torch.long, device="meta")
        inputs, how = {"input_ids": ids}, f"input_ids {batch}x{seq_len}"
        if getattr(config, "is_encoder_decoder", False):
            inputs["decoder_input_ids"] = ids
            how += " (+ decoder_input_ids)"
    elif main == "pixel_values" and hasattr(config, "image_size"):
        size, channels = _pair(config.image_size), getattr(config, "num_channels", 3)
        inputs = {"pixel_values": torch.zeros(batch, channels, *size, device="meta")}
        how = f"pixel_values {batch}x{channels}x{size[0]}x{size[1]}"
    else:
        try:
            dummies = dict(getattr(model, "dummy_inputs"))
        except Exception:  # noqa: BLE001 - a model without usable dummies falls through
            return None, ""
        return {k: to_meta(v) for k, v in dummies.items()}, "transformers dummy_inputs"
    return inputs, how


def _generic_inputs(model: nn.Module, batch: int) -> tuple[ExampleInputs | None, str]:
    for module in model.modules():
        if isinstance(module, nn.Conv2d):
            h, w = _pair(getattr(model, "image_size", 224))
            image = torch.zeros(batch, module.in_channels, h, w, device="meta")
            return (image,), f"image {batch}x{module.in_channels}x{h}x{w} (first conv)"
        if isinstance(module, nn.Conv1d):
            return (torch.zeros(batch, module.in_channels, 1024, device="meta"),), \
                f"signal {batch}x{module.in_channels}x1024 (first conv)"
        if isinstance(module, nn.Embedding):
            return (torch.zeros(batch, 128, dtype=torch.long, device="meta"),), f"token ids {batch}x128 (first embedding)"
        if isinstance(module, nn.Linear):
            return (torch.zeros(batch, module.in_features, device="meta"),), f"vector {batch}x{module.in_features} (first linear)"
    return None, ""


def _pair(value: Any) -> tuple[int, int]:
    if isinstance(value, (tuple, list)):
        return int(value[0]), int(value[1])
    return int(value), int(value)


def to_meta(value: Any, dtype: torch.dtype | None = None) -> Any:
    """``value`` with every tensor replaced by an empty meta tensor (floats at ``dtype`` if given)."""
    def convert(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        target = dtype if dtype is not None and x.is_floating_point() else x.dtype
        return torch.empty_strided(x.shape, x.stride(), device="meta", dtype=target)
    return tree_map(convert, value)


def split_inputs(inputs: ExampleInputs) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` for ``forward`` from a tuple of args or a mapping of kwargs."""
    if isinstance(inputs, Mapping):
        return (), dict(inputs)
    if isinstance(inputs, torch.Tensor):
        return (inputs,), {}
    return tuple(inputs), {}
