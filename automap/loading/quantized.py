"""Quantized checkpoints, refused before anything is read: a folder that declares a
``quantization_config``, or a floating-point parameter filled from an integer or float8 tensor,
would otherwise give silently wrong weights.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from automap.errors import CheckpointError, FormatError
from automap.offload import load_json, read_regular

CONFIG_NAME = "config.json"  # the config of a Hugging Face model folder
# A config.json is a few kB; a larger file is not one worth reading for this check.
MAX_CONFIG_BYTES = 16 << 20
# The fields that say most about a quantization, named in messages after its method.
_DETAILS = ("bits", "load_in_4bit", "load_in_8bit", "format", "fmt")
FIX = (
    "load it with transformers' from_pretrained, which builds quantized layers for it (automap can plan them: "
    "from_pretrained(folder, device_map=automap.plan(skeleton, max_memory=...).device_map)), or load a copy "
    "saved without quantization"
)


def describe(quantization: Any) -> str:
    """A ``quantization_config`` in a few words: ``'gptq' (bits=4)``."""
    if not isinstance(quantization, Mapping):
        to_dict = getattr(quantization, "to_dict", None)
        quantization = to_dict() if callable(to_dict) else {}
    method = quantization.get("quant_method", "a method it does not name")
    details = ", ".join(
        f"{k}={quantization[k]}" for k in _DETAILS if quantization.get(k) not in (None, False)
    )
    return f"{method!r}" + (f" ({details})" if details else "")


def refuse_declared(folder: str | os.PathLike[str], config: Any) -> None:
    """Refuse to build the model of ``folder`` when its config declares a quantization.

    Raises:
        CheckpointError: ``config`` has a ``quantization_config``.
    """
    quantization = getattr(config, "quantization_config", None)
    if quantization:
        raise CheckpointError(
            f"{Path(folder) / CONFIG_NAME} declares quantized weights (quantization_config: {describe(quantization)}); "
            f"automap builds and loads plain floating-point weights and does not quantize or dequantize, so it "
            f"cannot build this model as from_pretrained does; {FIX}"
        )


def declared(checkpoint: str | os.PathLike[str]) -> str | None:
    """The quantization the ``config.json`` beside ``checkpoint`` (a folder, or a file in one)
    declares, in a few words; None when there is no such config or it declares none. Read as
    plain JSON: transformers is not needed."""
    path = Path(checkpoint)
    config = (path if path.is_dir() else path.parent) / CONFIG_NAME
    try:
        data = load_json(read_regular(config, MAX_CONFIG_BYTES), f"{config} is not JSON", "")
    except (OSError, FormatError):
        return None  # no config, or not one this check can read: the load goes on as for any checkpoint
    quantization = data.get("quantization_config") if isinstance(data, dict) else None
    return describe(quantization) if quantization else None


def declared_note(checkpoint: str | os.PathLike[str]) -> str:
    """What to add to a key mismatch's message when the checkpoint's folder declares a
    quantization (its keys are then ``qweight``, ``scales``, ``absmax``...): empty otherwise."""
    method = declared(checkpoint)
    if method is None:
        return ""
    return (
        f". Its {CONFIG_NAME} declares quantized weights (quantization_config: {method}), which automap does "
        f"not load into plain layers; {FIX}"
    )


def check_no_dequantizing_cast(model: nn.Module, stored: Mapping[str, torch.dtype], checkpoint: Path) -> None:
    """Refuse a load that would fill a floating-point parameter of ``model`` by casting a
    quantized tensor: one stored as an integer, or as ``float8`` in a checkpoint whose folder
    declares a quantization. ``stored`` maps parameter names to the dtype of the checkpoint
    tensor that fills them.

    Raises:
        CheckpointError: such a parameter, named with the two dtypes and the fix.
    """
    quantization = declared(checkpoint)
    params = dict(model.named_parameters(remove_duplicate=False))
    cast = [
        (name, dtype)
        for name, dtype in stored.items()
        if name in params
        and params[name].is_floating_point()
        and dtype != params[name].dtype
        and (_integer(dtype) or (quantization is not None and dtype.itemsize == 1))
    ]
    if not cast:
        return
    name, dtype = cast[0]
    origin = (
        f"its {CONFIG_NAME} declares quantization_config: {quantization}"
        if quantization
        else ("quantized weights are stored so")
    )
    raise CheckpointError(
        f"{checkpoint} stores {len(cast)} of the model's floating-point parameters as {str(dtype).removeprefix('torch.')} "
        f"(first {name!r}, a {str(params[name].dtype).removeprefix('torch.')} parameter; {origin}): casting would "
        f"not dequantize them and would give wrong weights; {FIX}"
    )


def _integer(dtype: torch.dtype) -> bool:
    return not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool
