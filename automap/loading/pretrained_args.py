"""``from_pretrained``'s keyword arguments, as ``automap.load(folder, ...)`` takes them: each one
in :data:`ARGUMENTS` is honoured with the same meaning, a no-op as in ``from_pretrained``, or
refused unless at its default, with why; any other keyword names a config attribute.
``trust_remote_code`` is off by default and never asked for on the terminal.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from automap.errors import ArgumentError

HONOURED = "honoured"
NO_OP = "no-op"
REFUSED = "refused"

_LOCAL = (
    "automap.load reads a local folder and downloads nothing; fetch the model first "
    "(huggingface_hub.snapshot_download(repo_id, {name}=...)) and pass its path"
)
_SINGLE = "automap places a model on the devices of one machine; "


@dataclass(frozen=True)
class Argument:
    """What :func:`automap.load` does with one of ``from_pretrained``'s keyword arguments:
    ``how`` is :data:`HONOURED`, :data:`NO_OP` or :data:`REFUSED` (unless the value is
    ``default``, which changes nothing); ``why`` says it."""

    how: str
    why: str
    default: Any = None


ARGUMENTS: dict[str, Argument] = {
    # honoured
    "attn_implementation": Argument(HONOURED, "the model is built with this attention implementation"),
    "experts_implementation": Argument(HONOURED, "the model is built with this experts implementation"),
    "trust_remote_code": Argument(
        HONOURED,
        "runs the folder's own model code (auto_map); off by default, never asked on the terminal",
        False,
    ),
    "config": Argument(HONOURED, "the model is built from this config instead of the folder's config.json"),
    "generation_config": Argument(HONOURED, "set as the model's generation_config"),
    "subfolder": Argument(HONOURED, "the model folder is this subfolder of the path given", ""),
    "use_safetensors": Argument(
        HONOURED,
        "True: the folder's safetensors files are required and read; automap reads safetensors first anyway",
    ),
    "local_files_only": Argument(NO_OP, "automap.load only ever reads local files", False),
    "weights_only": Argument(
        HONOURED,
        "automap unpickles .bin checkpoints with weights_only=True only; "
        "False (arbitrary code in the pickle) is refused",
        True,
    ),
    "offload_buffers": Argument(NO_OP, "the buffers of units on disk are offloaded with them", False),
    # no-ops, as in from_pretrained
    "low_cpu_mem_usage": Argument(NO_OP, "automap always loads tensor by tensor, never the whole state dict"),
    "_fast_init": Argument(NO_OP, "ignored by from_pretrained too"),
    "mirror": Argument(NO_OP, "ignored by from_pretrained too"),
    "offload_state_dict": Argument(
        NO_OP, "ignored by from_pretrained too; automap never holds a whole state dict"
    ),
    "_from_auto": Argument(NO_OP, "transformers' own bookkeeping"),
    "_from_pipeline": Argument(NO_OP, "transformers' own bookkeeping"),
    "_commit_hash": Argument(NO_OP, "transformers' own bookkeeping"),
    # refused unless at the default
    "revision": Argument(REFUSED, _LOCAL.format(name="revision"), "main"),
    "token": Argument(REFUSED, _LOCAL.format(name="token")),
    "cache_dir": Argument(REFUSED, _LOCAL.format(name="cache_dir")),
    "force_download": Argument(REFUSED, _LOCAL.format(name="force_download"), False),
    "proxies": Argument(REFUSED, _LOCAL.format(name="proxies")),
    "from_tf": Argument(
        REFUSED, "automap reads PyTorch checkpoints (safetensors, .bin), not TensorFlow ones", False
    ),
    "from_flax": Argument(
        REFUSED, "automap reads PyTorch checkpoints (safetensors, .bin), not Flax ones", False
    ),
    "variant": Argument(
        REFUSED,
        "automap reads the folder's default weight files; point it at a folder holding "
        "the variant's files under the default names",
    ),
    "gguf_file": Argument(
        REFUSED,
        "automap reads safetensors and PyTorch checkpoints, not GGUF; convert it with "
        "from_pretrained(folder, gguf_file=...).save_pretrained(new_folder)",
    ),
    "state_dict": Argument(
        REFUSED,
        "automap.load(folder) reads the folder's weights; for weights in memory build "
        "the model and call automap.dispatch",
    ),
    "ignore_mismatched_sizes": Argument(
        REFUSED,
        "automap refuses a tensor whose shape differs from the model's; fix the config or the checkpoint",
        False,
    ),
    "output_loading_info": Argument(
        REFUSED, "automap.load returns the model; keys skipped are logged as warnings", False
    ),
    "quantization_config": Argument(
        REFUSED,
        "automap does not quantize; quantize with transformers and its "
        "quantizers, or load an unquantized checkpoint",
    ),
    "key_mapping": Argument(
        REFUSED,
        "rename the checkpoint's keys with save_pretrained after "
        "from_pretrained(folder, key_mapping=...) once, then load that folder",
    ),
    "device_mesh": Argument(
        REFUSED, _SINGLE + "for tensor parallelism across processes use from_pretrained's own"
    ),
    "distributed_config": Argument(
        REFUSED, _SINGLE + "for parallelism across processes use from_pretrained's own"
    ),
    "tp_plan": Argument(
        REFUSED, _SINGLE + "for tensor parallelism across processes use from_pretrained's own"
    ),
    "tp_size": Argument(
        REFUSED, _SINGLE + "for tensor parallelism across processes use from_pretrained's own"
    ),
    "use_kernels": Argument(
        REFUSED,
        "hub kernels are downloaded code; automap builds the model from transformers' "
        "own modules (call model.kernelize() yourself after loading)",
        False,
    ),
    "kernel_config": Argument(REFUSED, "hub kernels are downloaded code; see use_kernels"),
    "kernels_mode": Argument(REFUSED, "hub kernels are downloaded code; see use_kernels"),
    "allow_all_kernels": Argument(REFUSED, "hub kernels are downloaded code; see use_kernels", False),
    "adapter_name": Argument(
        REFUSED,
        "load adapters with peft after automap.load (PeftModel.from_pretrained(model, adapter_folder))",
        "default",
    ),
    "adapter_kwargs": Argument(
        REFUSED,
        "load adapters with peft after automap.load (PeftModel.from_pretrained(model, adapter_folder))",
    ),
    "fusion_config": Argument(
        REFUSED, "fusions change the model's outputs; automap loads the model as saved"
    ),
    "disable_mmap": Argument(
        REFUSED, "automap reads checkpoints through maps: that is how weights stay on disk until used", False
    ),
    "tqdm_class": Argument(
        REFUSED, "automap shows its own progress bar, on a terminal only; quiet=True hides it"
    ),
}


@dataclass(frozen=True)
class FolderOptions:
    """The ``from_pretrained`` arguments that shape how a folder's model is built."""

    attn_implementation: str | None = None
    experts_implementation: str | None = None
    trust_remote_code: bool = False
    config: Any = None
    generation_config: Any = None
    subfolder: str = ""
    use_safetensors: bool | None = None
    overrides: Mapping[str, Any] = field(default_factory=dict)  # config attributes set before the build


def folder_options(given: Mapping[str, Any]) -> FolderOptions:
    """Check ``given`` (the keywords of ``automap.load(folder, ...)`` beyond its own) against
    :data:`ARGUMENTS`; the rest are config attributes (checked when the config is read).

    Raises:
        ArgumentError: one is refused (its name, its value and why), ``trust_remote_code``
            is not a bool, or ``weights_only=False``.
    """
    known, overrides = {}, {}
    for name, value in given.items():
        argument = ARGUMENTS.get(name)
        if argument is None:
            overrides[name] = value
        elif argument.how == REFUSED and not _is_default(value, argument.default):
            raise ArgumentError(f"automap.load(folder, {name}={value!r}): {argument.why}")
        elif argument.how == HONOURED:
            known[name] = value
    if not isinstance(known.get("trust_remote_code", False), bool):
        raise ArgumentError(
            f"trust_remote_code={known['trust_remote_code']!r}: give True or False (False: the "
            "folder's own code is never run)"
        )
    if known.pop("weights_only", True) is False:
        raise ArgumentError(f"automap.load(folder, weights_only=False): {ARGUMENTS['weights_only'].why}")
    if known.get("use_safetensors") is False:
        raise ArgumentError(
            "automap.load(folder, use_safetensors=False): automap reads a folder's safetensors "
            "files when it has them, as from_pretrained does by default; move them out to read "
            "the .bin files"
        )
    return FolderOptions(**{k: v for k, v in known.items() if v is not None}, overrides=overrides)


def load_options(built: object, given: Mapping[str, Any]) -> FolderOptions:
    """``from_pretrained``'s arguments given to :func:`automap.load`: checked for a folder
    (``built`` None); for the ``load(model, checkpoint)`` form (``built``: the model) only
    those that change nothing (``low_cpu_mem_usage``) are taken.

    Raises:
        ArgumentError: as :func:`folder_options`; any other argument with a built model.
    """
    if built is None:
        return folder_options(given)
    taken = [n for n in given if n not in ARGUMENTS or ARGUMENTS[n].how != NO_OP]
    if taken:
        raise ArgumentError(
            f"automap.load({type(built).__name__}, checkpoint, {taken[0]}=...): from_pretrained's "
            "arguments apply to a folder (automap.load('path/to/folder', ...)), which is built from "
            "its config; this model is already built"
        )
    return FolderOptions()


def _is_default(value: Any, default: Any) -> bool:
    return value is default or (
        value is not None and default is not None and type(value) is type(default) and value == default
    )
