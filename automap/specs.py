"""Models named on the command line (``torchvision:NAME``, ``hf:FAMILY``, ``hf:config.json``, a
model folder, ``module:factory``, a preset such as ``llama-3-70b``), built on the meta device:
nothing downloaded, no weights allocated. A hub id is refused with the command that downloads it.
"""

from __future__ import annotations

import ast
import difflib
import importlib
import importlib.util
import inspect
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import torch
from torch import nn

from automap.errors import AutomapError, CheckpointError, SpecError
from automap.loading.configs import check_config_fields, wrapped
from automap.presets import PRESETS, check_not_hub_id
from automap.loading.hf import config_dtype, folder_model, instantiate
from automap.loading.hf_config import import_transformers, is_model_folder, read_config
from automap.sizes import format_bytes
from automap.userfiles import read_json_file

log = logging.getLogger(__name__)

DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp8": torch.float8_e4m3fn,
    "float8": torch.float8_e4m3fn,
}


@dataclass(frozen=True)
class BuiltModel:
    """A model built from a SPEC: the module (on meta), what to call it, its dtype hint, and
    where its tensor sizes came from when not from the constructor (a folder's checkpoint)."""

    model: nn.Module
    label: str
    parameters: int
    dtype: torch.dtype | None = None
    source: str = ""


def parse_value(text: str) -> Any:
    """``"80"`` -> 80, ``"1e-5"`` -> 1e-05, ``"true"`` -> True, ``"silu"`` -> ``"silu"``."""
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null"):
        return None
    try:
        return ast.literal_eval(text.strip())
    except (ValueError, SyntaxError):
        return text.strip()


def parse_overrides(items: Iterable[str]) -> dict[str, Any]:
    """Parse ``--set`` arguments: ``["a=1,b=silu", "c=true"]`` -> ``{"a": 1, "b": "silu", "c": True}``.
    A dotted key names a field of a nested config: ``text_config.num_hidden_layers=2``.

    Raises:
        SpecError: an item is not ``key=value``.
    """
    result: dict[str, Any] = {}
    for item in items:
        for pair in filter(None, (p.strip() for p in item.split(","))):
            key, sep, value = pair.partition("=")
            if not sep or not key.strip() or not all(part.isidentifier() for part in key.strip().split(".")):
                raise SpecError(
                    f"--set expects key=value pairs separated by commas, got {pair!r}; "
                    "e.g. --set num_hidden_layers=80,hidden_size=8192 (text_config.num_hidden_layers=2 "
                    "for a nested config)"
                )
            result[key.strip()] = parse_value(value)
    return result


def parse_max_memory_arg(text: str) -> dict[int | str, str]:
    """Parse ``--max-memory 0=20GiB,1=20GiB,cpu=64GiB,disk=500GiB`` into the accelerate form.

    Raises:
        SizeError: an item is not ``device=size``, a size is bad, or a device is named twice.
    """
    from automap.devices import parse_max_memory_text

    return parse_max_memory_text(text)


def parse_dtype(text: str) -> torch.dtype:
    """``"bf16"`` -> ``torch.bfloat16``.

    Raises:
        SpecError: unknown name.
    """
    try:
        return DTYPES[text.strip().lower().removeprefix("torch.")]
    except KeyError:
        raise SpecError(f"unknown dtype {text!r}; use one of {', '.join(DTYPES)}") from None


def build_model(spec: str, overrides: Mapping[str, Any] | None = None) -> BuiltModel:
    """Build the model a SPEC names, on the meta device (no weights allocated).

    Args:
        spec: ``torchvision:NAME``, ``hf:FAMILY``, ``hf:PATH/config.json``, a model folder
            or ``module.path:factory``.
        overrides: config fields (hf) or keyword arguments (torchvision, factories).

    Returns:
        A :class:`BuiltModel` whose parameters are all on meta.

    Raises:
        SpecError: the SPEC's form, name, module or overrides are wrong; the message says which.

    Example:
        >>> build_model("hf:llama", {"num_hidden_layers": 80}).label
        'LlamaForCausalLM (hf:llama)'
    """
    if not isinstance(spec, str) or not spec or "\0" in spec:
        raise SpecError(
            f"SPEC {spec!r} is no model name; use torchvision:resnet50, hf:llama, "
            "hf:/path/config.json, "
            "path/to/model-folder or module.path:factory"
        )
    if is_folder(spec):
        return _folder(spec, overrides or {})
    settings = dict(overrides or {})
    if spec in PRESETS:
        model, dtype = _transformers(spec, settings, preset=PRESETS[spec])
        count = sum(p.numel() for p in model.parameters())
        label = (
            f"{type(model).__name__} (preset {spec}: the shape of {PRESETS[spec]['source']}, random weights)"
        )
        return BuiltModel(model, label, count, dtype)
    check_not_hub_id(spec)
    kind, sep, name = spec.partition(":")
    if not sep or not kind or not name:
        _check_path(spec)
        raise SpecError(
            f"SPEC {spec!r} has no 'kind:name' form and is not a folder; use torchvision:resnet50, "
            "hf:llama, hf:/path/config.json, path/to/model-folder, module.path:factory or a "
            "preset (automap plan --list-presets)" + _did_you_mean(spec, PRESETS)
        )
    if kind == "torchvision":
        model, dtype = _torchvision(name, settings), None
    elif kind == "hf":
        model, dtype = _transformers(name, settings)
    else:
        model, dtype = _factory(kind, name, settings), None
    count = sum(p.numel() for p in model.parameters())
    return BuiltModel(model, f"{type(model).__name__} ({spec})", count, dtype)


def is_folder(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` names a folder; False, not an error, for a name the file system cannot
    look up (too long, a loop of links): it then is no folder."""
    try:
        return Path(path).is_dir()
    except (OSError, ValueError):
        return False


def _on_meta(what: str, build: Callable[[], Any]) -> nn.Module:
    """Call ``build`` with meta as the default device; any failure becomes a SpecError."""
    try:
        with torch.device("meta"):
            model = build()
    except AutomapError:
        raise
    except Exception as exc:  # noqa: BLE001 - user code: report it in one line, with its type
        raise SpecError(f"building {what} failed: {type(exc).__name__}: {exc}") from exc
    if not isinstance(model, nn.Module):
        raise SpecError(f"{what} returned {type(model).__name__}, not a torch.nn.Module")
    return model.eval()


def _torchvision(name: str, kwargs: dict[str, Any]) -> nn.Module:
    import torchvision

    known = torchvision.models.list_models()
    if name not in known:
        raise SpecError(
            f"torchvision has no model {name!r}"
            + _did_you_mean(name, known)
            + "; list them with torchvision.models.list_models()"
        )
    # Nothing is downloaded: no weights, and no pretrained backbone for the detection models.
    if "weights_backbone" in inspect.signature(torchvision.models.get_model_builder(name)).parameters:
        kwargs = {"weights_backbone": None, **kwargs}
    return _on_meta(f"torchvision:{name}", lambda: torchvision.models.get_model(name, weights=None, **kwargs))


def _check_path(spec: str) -> None:
    """A SPEC written as a path (``./x``, ``../x``, ``/x``, ``~/x``, ``a/b/c``) that names nothing."""
    path = Path(spec).expanduser()
    if spec.startswith((".", "/", "~")) or os.sep in spec:
        if not os.path.lexists(path):
            raise SpecError(
                f"{spec!r} does not exist; give a Hugging Face model folder (config.json and its "
                "weights), or a SPEC such as torchvision:resnet50, hf:llama or llama-3-8b"
            )
        if not path.is_dir():
            raise SpecError(
                f"{spec!r} is a file, not a model folder; give the folder that holds config.json "
                "(or hf:/path/config.json for a config file alone)"
            )


def _transformers(
    name: str, overrides: dict[str, Any], preset: Mapping[str, Any] | None = None
) -> tuple[nn.Module, torch.dtype | None]:
    transformers = import_transformers(f"planning {'preset ' if preset else 'hf:'}{name}")
    if preset is not None:
        fields = {k: v for k, v in preset.items() if k not in ("source", "model_type")}
        model_type = preset["model_type"]
    else:
        model_type, fields = _hf_config_source(name)
    label = f"preset {name}" if preset is not None else f"hf:{name}"
    given = wrapped(lambda: transformers.AutoConfig.for_model(model_type, **fields), label, SpecError)
    overrides = resolve_config_keys(given, overrides, name)
    check_config_fields({"model_type": model_type, **overrides}, f"--set for {label}", SpecError)
    try:
        # Overrides go through the constructor, so derived fields (layer_types, head_dim) follow them.
        config = transformers.AutoConfig.for_model(model_type, **{**fields, **overrides})
    except (Exception, RecursionError) as exc:  # noqa: BLE001 - a config's own validation, one line
        raise SpecError(f"the {name} config rejects --set {overrides}: {type(exc).__name__}: {exc}") from exc
    model = _on_meta(name if preset else f"hf:{name}", lambda: _hf_model(config))
    return model, config_dtype(config)


def _folder(path: str, overrides: Mapping[str, Any]) -> BuiltModel:
    """A Hugging Face folder: the model its config names, on meta, each tensor in the dtype
    its checkpoint stores it in (the shapes must match). Only headers are read."""
    from automap.loading import match_keys, open_checkpoint
    from automap.loading.hf import take_stored_dtypes

    if overrides:
        raise SpecError(
            f"--set changes the architecture, but {path}'s weights fix it; plan "
            f"hf:{Path(path) / 'config.json'} --set ... to plan a changed config without the weights"
        )
    if not is_model_folder(path):
        raise SpecError(
            f"folder {path!r} has no config.json; a model folder is what save_pretrained writes "
            "(config.json and the weights), or give hf:/path/config.json or module.path:factory"
        )
    try:
        config = read_config(path)
    except CheckpointError as exc:  # a config that cannot be read or is hostile: bad input, as a SPEC's
        raise SpecError(str(exc)) from None
    # What automap.load builds: its weights need the real class (a quantized one is refused).
    model = _on_meta(path, lambda: folder_model(config, path) or _hf_model(config, guess=False))
    with open_checkpoint(path) as checkpoint:
        match = match_keys(model, checkpoint)
        take_stored_dtypes(model, checkpoint, match)
        files = {s.file for s in checkpoint.tensors.values()}
        source = (
            f"sizes and dtypes of {len(checkpoint.tensors)} tensors from {len(files)} checkpoint "
            f"file(s), {format_bytes(checkpoint.total_bytes)}; no weights read"
            + (f"; {match.converted}" if match.converted else "")
        )
    count = sum(p.numel() for p in model.parameters())
    return BuiltModel(model, f"{type(model).__name__} ({path})", count, source=source)


def _hf_config_source(name: str) -> tuple[str, dict[str, Any]]:
    """The model_type and config fields a ``hf:`` SPEC names (a family, or a config file)."""
    import transformers

    path = Path(name)
    check_not_hub_id(name)
    if is_folder(path):
        path = path / "config.json"
    if path.suffix == ".json" or os.sep in name:
        return _hf_config_file(path)
    families = list(transformers.CONFIG_MAPPING.keys())
    if name not in families:
        raise SpecError(
            f"transformers has no model family {name!r}"
            + _did_you_mean(name, families)
            + "; use a model_type such as llama, mistral, qwen2, gpt2, t5, or hf:/path/config.json"
        )
    return name, {}


def _hf_config_file(path: Path) -> tuple[str, dict[str, Any]]:
    import transformers

    data = read_json_file(
        path,
        "config file",
        error=SpecError,
        hint="give hf:/path/to/config.json, a transformers config saved with save_pretrained",
    )
    check_config_fields(data, repr(str(path)), SpecError)
    model_type = data.pop("model_type", None)
    if not isinstance(model_type, str) or model_type not in transformers.CONFIG_MAPPING:
        raise SpecError(
            f"{str(path)!r} has model_type {model_type!r}, which transformers does not know; "
            "a transformers config.json names its family in 'model_type'"
        )
    return model_type, data


def resolve_config_keys(config: Any, overrides: Mapping[str, Any], name: str) -> dict[str, Any]:
    """``overrides`` as ``config``'s constructor takes them: aliases by their field
    (``num_hidden_layers`` -> GPT-2's ``n_layer``, through ``attribute_map``), and dotted keys
    (``text_config.num_hidden_layers``) merged into the nested config's fields.

    Raises:
        SpecError: a key the config (or its nested config) does not have.
    """
    resolved: dict[str, Any] = {}
    for key, value in overrides.items():
        head, dot, rest = key.partition(".")
        field = _config_field(config, head, name)
        if not dot:
            resolved[field] = value
            continue
        nested = getattr(config, field, None)
        if not hasattr(nested, "to_dict"):
            raise SpecError(f"--set {key}: the {name} config's {field!r} is not a nested config")
        inner = resolved.get(field) or {
            k: v for k, v in nested.to_dict().items() if k != "transformers_version"
        }
        resolved[field] = {**inner, **resolve_config_keys(nested, {rest: value}, f"{name} {field}")}
    return resolved


def _config_field(config: Any, key: str, name: str) -> str:
    field = (getattr(config, "attribute_map", None) or {}).get(key, key)
    # Fields and properties (num_labels); a method (to_dict) is no field, whatever dir() says.
    known = set(config.to_dict()) | {
        k for k in dir(config) if not k.startswith("_") and not callable(getattr(type(config), k, None))
    }
    if field not in known:
        aliases = list(getattr(config, "attribute_map", None) or {})
        raise SpecError(
            f"--set names {key!r}, which the {name} config does not have"
            + _did_you_mean(key, sorted(known | set(aliases)))
        )
    return field


def _hf_model(config: Any, guess: bool = True) -> nn.Module:
    model = instantiate(config, guess=guess)
    if model is None:
        names = getattr(config, "architectures", None) or [type(config).__name__]
        raise SpecError(f"transformers has no model class for {', '.join(map(str, names))}")
    return model


def _import_user_module(module_name: str, hint: str) -> Any:
    """Import ``module_name`` as ``python -m`` would find it, the working directory searched
    *last* and only for this import: `automap plan mymodels:build` finds ./mymodels.py, but a
    stray ./matplotlib.py never shadows the real one. A path (``./models/net.py``, with or
    without ``.py``) is imported from that file.

    Raises:
        SpecError: the module cannot be found, or importing it raised (any error: a syntax
            error, an exception at import), with ``hint`` on what to give.
    """
    try:
        if module_name.endswith(".py") or "/" in module_name or os.sep in module_name:
            return _import_file(Path(module_name if module_name.endswith(".py") else module_name + ".py"))
        cwd = os.getcwd()
        added = cwd not in sys.path
        if added:
            sys.path.append(cwd)
        try:
            return importlib.import_module(module_name)
        finally:
            if added and sys.path and sys.path[-1] == cwd:
                sys.path.pop()
    except SpecError:
        raise
    except Exception as exc:  # noqa: BLE001 - user code: any failure to import it is one line
        reason = str(exc) if isinstance(exc, ImportError) else f"{type(exc).__name__}: {exc}"
        raise SpecError(f"cannot import {module_name!r} ({reason}); {hint}") from None


def _import_file(file: Path) -> Any:
    if not file.is_file():
        raise SpecError(f"no file {str(file)!r}; give module.path:function or path/to/file.py:function")
    spec = importlib.util.spec_from_file_location(file.stem, file)
    if spec is None or spec.loader is None:
        raise SpecError(f"cannot import {str(file)!r} as a Python module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _factory(module_name: str, attr: str, kwargs: dict[str, Any]) -> nn.Module:
    module = _import_user_module(
        module_name, "SPEC kinds are torchvision:NAME, hf:FAMILY, hf:/path/config.json or module.path:factory"
    )
    factory = getattr(module, attr, None)
    if not callable(factory):
        names = [n for n in dir(module) if not n.startswith("_")]
        raise SpecError(f"module {module_name!r} has no callable {attr!r}" + _did_you_mean(attr, names))
    return _on_meta(f"{module_name}:{attr}", lambda: factory(**kwargs))


def _did_you_mean(name: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(choices), n=3)
    return f" (did you mean {', '.join(close)}?)" if close else ""


def input_tensors(shapes: Iterable[tuple[int, ...]]) -> tuple[torch.Tensor, ...]:
    """Meta float tensors of ``shapes``: the forward's positional inputs (``--input-shape``)."""
    return tuple(torch.zeros(shape, device="meta") for shape in shapes)


def load_example_inputs(ref: str) -> Any:
    """Call ``module.path:function`` (``--example-inputs``) on the meta device and return the
    inputs it builds: a tuple of positional arguments, a dict of keyword arguments, or a tensor.

    Raises:
        SpecError: the reference is malformed, cannot be imported, the call fails, or it
            returns something else than inputs.
    """
    module_name, sep, attr = ref.partition(":")
    if not sep or not module_name or not attr:
        raise SpecError(f"--example-inputs expects module.path:function, got {ref!r}")
    module = _import_user_module(module_name, "--example-inputs takes module.path:function")
    function = getattr(module, attr, None)
    if not callable(function):
        raise SpecError(
            f"module {module_name!r} has no callable {attr!r}"
            + _did_you_mean(attr, [n for n in dir(module) if not n.startswith("_")])
        )
    try:
        with torch.device("meta"):
            inputs = function()
    except Exception as exc:  # noqa: BLE001 - user code: report it in one line, with its type
        raise SpecError(f"--example-inputs {ref} failed: {type(exc).__name__}: {exc}") from exc
    if not isinstance(inputs, (tuple, list, dict, torch.Tensor)):
        raise SpecError(
            f"--example-inputs {ref} returned a {type(inputs).__name__}; it must return the forward's "
            "inputs: a tuple of positional arguments, a dict of keyword arguments, or one tensor"
        )
    return inputs
