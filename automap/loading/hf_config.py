"""A Hugging Face folder's config: read locally (never downloaded) with ``from_pretrained``'s
arguments applied (:func:`configured`), and the folder's own model code (``auto_map``) refused
unless ``trust_remote_code`` (:func:`remote_code_refused`), else imported from the folder
(:func:`remote_class`). transformers is always told ``trust_remote_code``'s value, so it never
asks on a terminal.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

from automap.errors import ArgumentError, CheckpointError, DependencyError
from automap.loading.configs import check_config_fields, config_from_fields, wrapped
from automap.loading.pretrained_args import FolderOptions
from automap.loading.quantized import CONFIG_NAME
from automap.userfiles import read_json_file

# Heads to try when a config names no architecture, most useful first: a family is built as
# what people run it as.
AUTO_CLASSES = (
    "AutoModelForCausalLM",
    "AutoModelForSeq2SeqLM",
    "AutoModelForImageClassification",
    "AutoModel",
)


def is_model_folder(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a folder with a ``config.json`` (a Hugging Face model folder)."""
    return (Path(path) / CONFIG_NAME).is_file()


def import_transformers(purpose: str = "building a model from a Hugging Face folder's config.json") -> Any:
    """The ``transformers`` module.

    Args:
        purpose: what needs it, for the error message.

    Raises:
        DependencyError: transformers is not installed.
    """
    try:
        import transformers
    except ImportError as exc:
        raise DependencyError(
            f"{purpose} needs transformers, which is not installed ({exc}); install it with "
            'pip install "automap[hf]" (or pip install transformers), or build the model yourself under '
            "automap.empty_model() and call automap.load(model, folder)"
        ) from exc
    return transformers


def read_config(folder: str | os.PathLike[str], trust_remote_code: bool = False) -> Any:
    """The transformers config in ``folder/config.json`` (read locally, never downloaded).
    ``trust_remote_code`` is always passed on as given (never None), so transformers never
    asks on the terminal whether to run a folder's own code.

    Raises:
        CheckpointError: no config.json there, or one transformers cannot read; its config
            class is the folder's own code and ``trust_remote_code`` is off.
        DependencyError: transformers is not installed.
    """
    root = Path(folder)
    if not os.path.lexists(root):
        hub = (
            ""
            if os.path.isabs(str(folder)) or str(folder).count("/") != 1
            else (
                f"; if {str(folder)!r} is a hub id: automap never downloads; download it with "
                f"hf download {folder} --local-dir ./{root.name} and pass ./{root.name}"
            )
        )
        raise CheckpointError(
            f"{root} does not exist; automap.load(path) takes a Hugging Face model folder "
            f"(config.json and its weights){hub}"
        )
    if not root.is_dir():
        raise CheckpointError(
            f"{root} is a file, not a folder; automap.load(path) takes a Hugging Face model "
            "folder (config.json and its weights). For a single checkpoint file, build the "
            "model and call automap.load(model, path)"
        )
    if not is_model_folder(root):
        raise CheckpointError(
            f"{root} has no {CONFIG_NAME}, so automap cannot tell which model to build; build it "
            "yourself under automap.empty_model() and call automap.load(model, folder)"
        )
    transformers = import_transformers()
    path = root / CONFIG_NAME
    data = read_json_file(
        path,
        "config file",
        error=CheckpointError,
        hint="save it again with save_pretrained, or build the model yourself",
    )
    where = repr(str(path))
    check_config_fields(data, where, CheckpointError)
    auto_map = data.get("auto_map") if isinstance(data.get("auto_map"), dict) else {}
    if auto_map and not trust_remote_code and data.get("model_type") not in transformers.CONFIG_MAPPING:
        raise remote_code_refused(root, auto_map)  # the config class is the folder's own code
    if "model_type" in data and not (auto_map and trust_remote_code):
        return config_from_fields(data, where, CheckpointError)
    # The folder's own config class (trusted), or an old config without model_type: transformers
    # guesses the family from the folder's name.
    return wrapped(
        lambda: transformers.AutoConfig.from_pretrained(
            str(root), local_files_only=True, trust_remote_code=trust_remote_code
        ),
        where,
        CheckpointError,
    )


def _auto_map(root: Path) -> dict[str, Any]:
    """config.json's ``auto_map`` (the folder's own code per Auto class), without running anything."""
    try:
        found = read_json_file(root / CONFIG_NAME, "config file", hint="", error=CheckpointError).get(
            "auto_map"
        )
    except (CheckpointError, AttributeError):
        return {}
    return found if isinstance(found, dict) else {}


def remote_code_refused(folder: str | os.PathLike[str], auto_map: dict[str, Any]) -> CheckpointError:
    """The error for a folder whose model is its own code, which automap runs only when asked."""
    listed = ", ".join(f"{k}: {v}" for k, v in list(auto_map.items())[:3])
    return CheckpointError(
        f"{Path(folder) / CONFIG_NAME} maps the model to code of its own in the folder (auto_map: {listed}); "
        "automap runs it only when asked, never by a prompt: read that code, then pass "
        "automap.load(folder, trust_remote_code=True)"
    )


def remote_class(config: Any, folder: str | os.PathLike[str]) -> type | None:
    """The model class ``config``'s ``auto_map`` names in ``folder``'s own code (the one of its
    ``architectures``, else the first of :data:`AUTO_CLASSES` it maps), imported from there."""
    auto_map = getattr(config, "auto_map", None) or {}
    wanted = list(getattr(config, "architectures", None) or ())
    refs = [ref for key, ref in auto_map.items() if key != "AutoConfig" and isinstance(ref, str)]
    chosen = next((r for r in refs if r.rpartition(".")[2] in wanted), None) or next(
        (auto_map[k] for k in AUTO_CLASSES if isinstance(auto_map.get(k), str)), None
    )
    if chosen is None:
        return None
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    return get_class_from_dynamic_module(chosen, str(folder), local_files_only=True)


def configured(folder: str | os.PathLike[str], options: FolderOptions) -> Any:
    """The config to build ``folder``'s model from: the folder's (or the one given as
    ``config=``), with the implementations asked for and each config attribute given set,
    as ``from_pretrained`` sets them.

    Raises:
        ArgumentError: a keyword is neither one of ``from_pretrained``'s arguments nor an
            attribute of the config.
    """
    given = options.config
    if given is None or isinstance(given, (str, os.PathLike)):
        config = read_config(folder if given is None else given, options.trust_remote_code)
    else:
        config = copy.deepcopy(given)
    if options.use_safetensors and not any(Path(folder).glob("*.safetensors")):
        raise CheckpointError(f"use_safetensors=True, but {folder} has no .safetensors file")
    for name, value in options.overrides.items():
        if not hasattr(config, name):
            raise ArgumentError(
                f"automap.load(folder, {name}=...): neither an argument of from_pretrained automap "
                f"takes nor an attribute of {type(config).__name__}; see docs/loading.md for the "
                "arguments, or set it on the model after loading"
            )
        setattr(config, name, value)
    if options.attn_implementation is not None:
        config._attn_implementation = options.attn_implementation
    if options.experts_implementation is not None:
        if not hasattr(config, "_experts_implementation"):
            raise ArgumentError(
                f"experts_implementation={options.experts_implementation!r}: this transformers' "
                f"{type(config).__name__} has no experts implementations to choose from"
            )
        config._experts_implementation = options.experts_implementation
    return config
