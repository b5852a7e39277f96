"""Pickled checkpoints (``.bin``/``.pt``/``.pth``): read with ``torch.load(weights_only=True,
mmap=True)`` (whose tensors stay on disk until touched), pickles that would run code refused, a
training checkpoint's one state dict unwrapped, and every tensor checked by :func:`tensor_kind`
to be a dense tensor of values before anything is installed."""

from __future__ import annotations

import logging
import pickle
from pathlib import Path
from typing import Any

import torch

from automap.errors import CheckpointError
from automap.kinds import on_host

log = logging.getLogger(__name__)

# The key suffix under which state_dict() saves what a module's get_extra_state returns.
EXTRA_STATE = "_extra_state"  # torch's nn.modules.module._EXTRA_STATE_KEY_SUFFIX


def load_pickle(file: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The tensors of a pickled state dict, and the entries that are modules' extra state."""
    try:
        data = _torch_load(file)
    except pickle.UnpicklingError as exc:
        reason = [line for line in str(exc).splitlines() if "GLOBAL" in line]
        if not reason:
            raise CheckpointError(
                f"{file} is truncated or not a PyTorch checkpoint ({str(exc)[:200]}); save or copy it again"
            ) from exc
        raise CheckpointError(
            f"refused to load {file}: its pickle calls code that torch.load(weights_only=True) will not run "
            f"({reason[0].strip()}); loading it could execute arbitrary code. If you trust its source, convert "
            "it to safetensors yourself and load that"
        ) from exc
    except Exception as exc:  # noqa: BLE001 - any failure to parse the file means the same to the user
        raise CheckpointError(
            f"{file} is truncated or not a PyTorch checkpoint ({type(exc).__name__}: "
            f"{str(exc)[:300]}); save or copy it again"
        ) from exc
    data = _unwrapped(file, data)
    for key, value in data.items():
        if isinstance(value, torch.Tensor):
            _check_kind(file, str(key), value)
    extras = {
        str(k): v for k, v in data.items() if not isinstance(v, torch.Tensor) and str(k).endswith(EXTRA_STATE)
    }
    skipped = [k for k, v in data.items() if not isinstance(v, torch.Tensor) and k not in extras]
    if skipped:
        log.info("%s: ignoring %d non-tensor entries (%s)", file, len(skipped), skipped[:3])
    return {str(k): v for k, v in data.items() if isinstance(v, torch.Tensor)}, extras


def tensor_kind(tensor: torch.Tensor) -> str | None:
    """What makes ``tensor`` other than a plain dense tensor with values in memory (``"sparse
    (sparse_coo)"``, ``"meta"``, ``"quantized (torch.qint8)"``, ``"nested"``, a subclass' name),
    or None for a plain one: the one test every checkpoint tensor passes before anything is
    installed."""
    if tensor.is_nested:
        return "nested"
    if tensor.layout != torch.strided:
        return f"sparse ({str(tensor.layout).replace('torch.', '')})"
    if tensor.is_quantized:
        return f"quantized ({tensor.dtype}) without a quantization config"
    if tensor.device.type == "meta":
        return "meta (it holds no values)"
    if not on_host(tensor.device):
        return f"on {tensor.device.type}"
    if type(tensor) not in (torch.Tensor, torch.nn.Parameter):
        return f"a {type(tensor).__name__} (a tensor subclass)"
    return None


def _check_kind(file: Path, key: str, tensor: torch.Tensor) -> None:
    kind = tensor_kind(tensor)
    if kind is not None:
        raise CheckpointError(
            f"tensor {key!r} in {file} is {kind}, not a dense tensor of values; automap loads only dense "
            "tensors (a model's weights). Save it dense (tensor.to_dense(), or the dequantized weights, or a "
            "quantized model with its quantization config), or load this checkpoint with torch.load yourself"
        )


def _unwrapped(file: Path, data: Any) -> dict:
    """The state dict in ``data``: itself when it holds tensors at its top level, else the dict
    of tensors it wraps: under ``state_dict`` (Lightning), else the only one (``model``,
    ``model_state_dict``, DeepSpeed's ``module``: whatever a training loop named it).

    Raises:
        CheckpointError: ``data`` is no dict, wraps none, or wraps several (which is meant is
            the user's choice).
    """
    if not isinstance(data, dict):
        raise CheckpointError(f"{file} holds a {type(data).__name__}, not a state dict of name -> tensor")
    if any(isinstance(v, torch.Tensor) for v in data.values()):
        return data
    inner = {
        k: v
        for k, v in data.items()
        if isinstance(v, dict) and any(isinstance(t, torch.Tensor) for t in v.values())
    }
    if "state_dict" in inner or len(inner) == 1:
        key = "state_dict" if "state_dict" in inner else next(iter(inner))
        log.info(
            "%s: reading the state dict under %r (beside %s)",
            file,
            key,
            sorted(map(str, set(data) - {key}))[:5],
        )
        return inner[key]
    listed = ", ".join(repr(k) for k in list(data)[:8])
    if not inner:
        raise CheckpointError(
            f"{file} holds no tensors: its top-level entries are {listed}; pass a checkpoint of the "
            "model's weights (a state dict of name -> tensor)"
        )
    raise CheckpointError(
        f"{file} wraps several state dicts ({', '.join(repr(k) for k in inner)}) and it is not clear which holds the "
        f"model's weights; save the one you mean on its own, e.g. safetensors.torch.save_file(torch.load(path)"
        f"[{next(iter(inner))!r}], 'model.safetensors'), and load that"
    )


def _torch_load(file: Path) -> Any:
    try:
        return torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError as exc:
        if "mmap" not in str(exc):
            raise
    # Files from torch.save(_use_new_zipfile_serialization=False) cannot be memory-mapped.
    data = torch.load(file, map_location="cpu", weights_only=True)
    log.warning("%s uses the legacy torch.save format, which cannot be memory-mapped: read whole", file)
    return data
