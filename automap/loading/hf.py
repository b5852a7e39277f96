"""Hugging Face model folders: the model a folder's ``config.json`` names, built on meta with
transformers' own classes (local files only: nothing is downloaded). transformers is imported
here only, when a folder is built.
"""

from __future__ import annotations

import logging
import os
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from automap.errors import ArgumentError, CheckpointError
from automap.loading.checkpoint import Checkpoint, open_checkpoint
from automap.kinds import available_ram_bytes
from automap.loading.configs import check_generation_fields, measure_on_meta, wrapped
from automap.loading.empty import empty_model
from automap.loading.hf_config import (
    AUTO_CLASSES,
    configured,
    import_transformers,
    remote_class,
    remote_code_refused,
)
from automap.loading.keys import Match, match_keys
from automap.loading.pretrained_args import FolderOptions
from automap.loading.quantized import CONFIG_NAME, refuse_declared
from automap.runtime.swap import install
from automap.sizes import format_bytes
from automap.userfiles import read_json_file

log = logging.getLogger(__name__)

GENERATION_CONFIG_NAME = "generation_config.json"
# torch.set_default_dtype takes only these.
_DEFAULT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def config_dtype(config: Any) -> torch.dtype | None:
    """The dtype a config says its weights are in (``"dtype"``, formerly ``"torch_dtype"``)."""
    # transformers 5 keeps "dtype" and warns on every read of "torch_dtype"; older ones have only the latter.
    dtype = (
        getattr(config, "dtype", None) if hasattr(config, "dtype") else getattr(config, "torch_dtype", None)
    )
    if isinstance(dtype, str):  # a config.json stores "bfloat16"
        dtype = getattr(torch, dtype.removeprefix("torch."), None)
    return dtype if isinstance(dtype, torch.dtype) else None


def instantiate(config: Any, *, guess: bool = False) -> nn.Module | None:
    """Construct the model ``config`` describes (in the caller's device/dtype context): the
    class its ``architectures`` entry names, else the first of :data:`AUTO_CLASSES` the family
    has. None when transformers has no class for it. A config naming classes transformers lacks
    (a model with remote code) gives None too, unless ``guess``: then the family's heads are
    tried (good enough to plan a config; weights would need the real class)."""
    transformers = import_transformers()
    for arch in getattr(config, "architectures", None) or ():
        cls = getattr(transformers, arch, None)
        if cls is not None:
            return cls(config)
    if getattr(config, "architectures", None) and not guess:
        return None
    for auto_name in AUTO_CLASSES:
        try:
            return getattr(transformers, auto_name).from_config(config)
        except ValueError:  # this head does not exist for the family: try the next
            continue
    return None


def folder_model(
    config: Any, folder: str | os.PathLike[str], trust_remote_code: bool = False
) -> nn.Module | None:
    """The model ``folder``'s config names (None: transformers lacks its class), or, when it
    names none, the head its checkpoint fits (:func:`fitting_head`), built on the current
    default device: what :func:`build_from_folder` loads and ``automap plan FOLDER`` plans.
    With ``trust_remote_code``, a class of the folder's own code (``auto_map``) when
    transformers has none.

    Raises:
        CheckpointError: the config declares a quantization (:func:`refuse_declared`), or
            maps the model to the folder's own code while ``trust_remote_code`` is off.
    """
    refuse_declared(folder, config)
    model = instantiate(config) if getattr(config, "architectures", None) else fitting_head(config, folder)
    if model is None and getattr(config, "auto_map", None):
        if not trust_remote_code:
            raise remote_code_refused(folder, config.auto_map)
        cls = remote_class(config, folder)
        model = cls(config) if cls is not None else None
    return model


def fitting_head(config: Any, folder: str | os.PathLike[str]) -> nn.Module | None:
    """For a config that names no architecture: the first of its family's heads (the
    :data:`AUTO_CLASSES` first, then every other head transformers maps the family to, the bare
    model last) whose tensors the checkpoint in ``folder`` fills exactly, keys converted as for
    the load. A sequence classifier's folder without ``architectures`` then builds the
    classifier, not a causal LM that lacks its ``classifier`` and has a head it lacks. None of
    them fitting, the first head there is (:func:`instantiate`), for the load to say what does
    not match. Only headers are read."""
    with open_checkpoint(folder) as ckpt:
        for cls in _family_heads(config):
            model = cls(config)
            try:
                match_keys(model, ckpt)
            except CheckpointError:
                continue
            log.info(
                "%s names no architecture: built %s, whose tensors its checkpoint holds", folder, cls.__name__
            )
            return model
    return instantiate(config)


def _family_heads(config: Any) -> list[type]:
    """The model classes transformers maps ``config``'s family to, :data:`AUTO_CLASSES`' first."""
    transformers = import_transformers()
    mappings = transformers.models.auto.modeling_auto
    first = (
        "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
        "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
        "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
    )
    others = sorted(n for n in dir(mappings) if n.startswith("MODEL_FOR_") and n.endswith("_MAPPING_NAMES"))
    names = [
        getattr(mappings, n).get(getattr(config, "model_type", None))
        for n in (*first, *others, "MODEL_MAPPING_NAMES")
    ]
    found = [getattr(transformers, n, None) for n in dict.fromkeys(n for n in names if isinstance(n, str))]
    return [cls for cls in found if cls is not None and getattr(cls, "config_class", None) is type(config)]


@contextmanager
def default_dtype(dtype: torch.dtype | None) -> Iterator[None]:
    """Build modules at ``dtype`` (as ``from_pretrained(dtype=...)`` does): their parameters
    are created in it, and buffers computed in an explicit dtype keep theirs."""
    if dtype not in _DEFAULT_DTYPES:
        yield
        return
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def build_from_folder(
    folder: str | os.PathLike[str], dtype: torch.dtype | None = None, options: FolderOptions = FolderOptions()
) -> nn.Module:
    """The model of a Hugging Face folder, as a skeleton: parameters on meta, buffers computed.

    Args:
        folder: a folder with ``config.json`` (written by ``save_pretrained``).
        dtype: build the parameters in this dtype; default: the config's, as
            ``from_pretrained``'s ``dtype="auto"`` does.
        options: ``from_pretrained``'s other arguments that shape the build
            (:mod:`automap.loading.pretrained_args`).

    Returns:
        The model in eval mode, ready for :func:`automap.load` to fill from ``folder``.

    Raises:
        CheckpointError: no or unreadable config.json, an architecture transformers lacks,
            or a quantized checkpoint (``quantization_config``).
        DependencyError: transformers is not installed.

    Example:
        >>> skeleton = build_from_folder("gpt2/")
        >>> type(skeleton).__name__, skeleton.lm_head.weight.device
        ('GPT2LMHeadModel', device(type='meta'))
    """
    config = configured(folder, options)
    dtype = dtype or config_dtype(config)
    if dtype is not None:  # from_pretrained gives the config the dtype it builds at (Apertus' xIELU reads it)
        setattr(config, "dtype" if hasattr(config, "dtype") else "torch_dtype", dtype)
    where = repr(str(Path(folder) / CONFIG_NAME))
    with default_dtype(dtype):
        sizes = measure_on_meta(lambda: _folder_model(config, folder, options), where, CheckpointError)
        check_fits_in_ram(sizes, where)
        with empty_model():
            model = wrapped(lambda: _folder_model(config, folder, options), where, CheckpointError)
    if model is None:
        names = getattr(config, "architectures", None) or [type(config).__name__]
        raise CheckpointError(
            f"{Path(folder) / CONFIG_NAME} names {', '.join(map(str, names))}, which this transformers "
            f"({import_transformers().__version__}) does not have (a model with its own code?); build the model "
            "yourself under automap.empty_model() and call automap.load(model, folder)"
        )
    keep_in_fp32(model, dtype)
    initialise_buffers(model)
    read_generation_config(model, folder)
    if options.generation_config is not None:
        model.generation_config = options.generation_config
    return model.eval()


def _folder_model(config: Any, folder: str | os.PathLike[str], options: FolderOptions) -> nn.Module | None:
    """:func:`folder_model`, an implementation transformers refuses for this model (one asked for
    with ``attn_implementation=`` / ``experts_implementation=``) an :class:`ArgumentError`."""
    try:
        return folder_model(config, folder, options.trust_remote_code)
    except (ValueError, ImportError) as exc:
        if options.attn_implementation is None and options.experts_implementation is None:
            raise
        raise ArgumentError(
            f"{type(config).__name__}: transformers refused the implementation asked for "
            f"({type(exc).__name__}: {exc})"
        ) from exc


def check_fits_in_ram(sizes: tuple[int, int], where: str) -> None:
    """Refuse a config whose model has a tensor larger than this machine's free RAM: a skeleton
    is built with each parameter briefly in RAM before it goes to meta (``sizes``: the largest
    tensor's bytes and all of them, measured on meta), so such a config could never be built
    (a ``vocab_size`` of 10**12 would ask for terabytes)."""
    largest, total = sizes
    room = min(available_ram_bytes(), _address_space_left())
    if largest > room:
        raise CheckpointError(
            f"{where} describes a model whose largest tensor needs {format_bytes(largest)} "
            f"({format_bytes(total)} in all), more than this process's free memory "
            f"({format_bytes(room)}) in which each tensor of a skeleton is made before "
            "it goes to meta; check the config's sizes (vocab_size, hidden_size, ...)"
        )


def _address_space_left() -> int:
    """Bytes this process may still map under its ``RLIMIT_AS`` (unbounded: a huge number)."""
    import resource

    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    if limit == resource.RLIM_INFINITY:
        return 2**62
    try:
        with open("/proc/self/status") as status:
            used = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))
    except (OSError, StopIteration, ValueError):
        return limit
    return max(0, limit - used)


def read_generation_config(model: nn.Module, folder: str | os.PathLike[str]) -> None:
    """Give a model that generates the folder's ``generation_config.json`` (its stop tokens,
    sampling defaults, Whisper's forced and suppressed tokens), as ``from_pretrained`` does, read
    through the one reader of users' files and checked as a config is (one transformers
    refuses is a :class:`CheckpointError` naming it); without one, the generation settings an older
    ``config.json`` holds (BART's ``num_beams``, ``no_repeat_ngram_size``). The model's own,
    derived from its config at init, would generate other tokens."""
    can_generate = getattr(model, "can_generate", None)
    if can_generate is None or not can_generate():
        return
    generation_config = import_transformers().GenerationConfig
    path = Path(folder) / GENERATION_CONFIG_NAME
    where = repr(str(path))
    given: dict[str, Any] = {}
    if not os.path.lexists(path):  # none: an older config.json's settings, as from_pretrained falls back
        path, given = Path(folder) / CONFIG_NAME, {"_from_model_config": True}
        where = repr(str(path))
    data = read_json_file(
        path,
        "generation settings",
        error=CheckpointError,
        hint="save it again with generation_config.save_pretrained, or remove it",
    )
    if not given:  # config.json's fields were checked as a config's when it was read
        check_generation_fields(data, where, CheckpointError)
    model.generation_config = wrapped(
        lambda: generation_config.from_dict(dict(data), **given), where, CheckpointError
    )


def initialise_buffers(model: nn.Module) -> None:
    """Compute the buffers the checkpoint does not hold again, outside the build's dtype, as
    ``from_pretrained`` does once it has loaded (its ``initialize_weights`` with every loaded
    tensor marked done): CodeGen's and GPT-J's sinusoidal tables are computed in float32 and
    copied into their bfloat16 buffers, not computed in bfloat16. Parameters (on meta) and
    saved buffers are marked, so transformers' initialisers skip them."""
    initialise = getattr(model, "initialize_weights", None)
    if initialise is None:
        return
    saved = {id(t) for t in model.state_dict(keep_vars=True).values()}
    marked = [
        t for t in [*model.parameters(), *model.buffers()] if id(t) in saved or isinstance(t, nn.Parameter)
    ]
    for tensor in marked:
        tensor._is_hf_initialized = True
    for module in model.modules():  # built: each marked done by its own post_init, inside the build's dtype
        module.__dict__.pop("_is_hf_initialized", None)
    initialise()


def compute_declared_missing(model: nn.Module, match: Match) -> list[str]:
    """Compute, with the model's own initialiser as ``from_pretrained`` does, the tensors of a
    transformers model that are on meta, that the checkpoint lacks, and that no checkpoint is
    expected to hold: those the model declares it may lack (``_keys_to_ignore_on_load_missing``:
    Marian's sinusoidal position tables, which it never saves) and its non-persistent buffers
    (rotary ``inv_freq``, BERT's ``position_ids``), which a model built on meta holds on meta.
    Only their modules' initialisers run, and they skip every other tensor (marked done). A
    tensor the initialiser does not fill (still holding its sentinel) goes back on meta, for the
    load to refuse. Returns the names computed."""
    initialise = getattr(model, "initialize_weights", None)
    if initialise is None:
        return []
    patterns = getattr(model, "_keys_to_ignore_on_load_missing", None) or ()
    transient = _non_persistent(model)
    lacking: dict[int, tuple[str, torch.Tensor]] = {}
    for name, tensor in _meta_tensors(model):
        if (
            name not in match.sources
            and name not in match.built
            and _sentinel(tensor.dtype) is not None
            and (name in transient or any(re.search(p, name) for p in patterns))
        ):
            lacking[id(tensor)] = (name, tensor)
    if not lacking:
        return []
    undo = install(
        model, {i: torch.full(t.shape, _sentinel(t.dtype), dtype=t.dtype) for i, (_, t) in lacking.items()}
    )
    _initialise_only(model, set(undo), initialise)
    now = {id(t): t for t in (*model.parameters(), *model.buffers()) if id(t) in undo}
    unfilled = {id(undo[i]) for i, t in now.items() if _unfilled(t)}
    install(model, {i: undo[i] for i, t in now.items() if id(undo[i]) in unfilled})
    computed = [name for i, (name, _) in lacking.items() if i not in unfilled]
    if computed:
        log.info(
            "computed %d tensor(s) the checkpoint does not hold, as the model declares (%s)",
            len(computed),
            ", ".join(computed[:3]),
        )
    return computed


def _initialise_only(model: nn.Module, tensors: set[int], initialise: Any) -> None:
    """Run the model's initialiser on the modules holding ``tensors`` (ids) alone: every other
    module and tensor is marked initialised while it runs, and the marks are put back after."""
    owners = {
        id(m)
        for m in model.modules()
        if any(id(t) in tensors for t in (*m._parameters.values(), *m._buffers.values()) if t is not None)
    }
    flags = {m: m.__dict__.get("_is_hf_initialized") for m in model.modules()}
    done = [t for t in (*model.parameters(), *model.buffers()) if id(t) not in tensors]
    marks = {id(t): t.__dict__.get("_is_hf_initialized") for t in done}
    try:
        for module in flags:
            module._is_hf_initialized = id(module) not in owners
        for tensor in done:
            tensor._is_hf_initialized = True
        initialise()
    finally:
        for module, flag in flags.items():
            _restore(module, flag)
        for tensor in done:
            _restore(tensor, marks[id(tensor)])


def _non_persistent(model: nn.Module) -> set[str]:
    """The names of the model's buffers that ``state_dict()`` leaves out."""
    return {
        f"{prefix}.{name}" if prefix else name
        for prefix, module in model.named_modules()
        for name in module._non_persistent_buffers_set
        if module._buffers.get(name) is not None
    }


def _sentinel(dtype: torch.dtype) -> float | int | None:
    """A value an initialiser never leaves in a tensor of ``dtype``: NaN, or the integers' least
    (positions, counts and ids are not); None for dtypes without one (bool)."""
    if dtype.is_floating_point:
        return float("nan")
    if dtype != torch.bool and not dtype.is_complex:
        return torch.iinfo(dtype).min
    return None


def _unfilled(tensor: torch.Tensor) -> bool:
    sentinel = _sentinel(tensor.dtype)
    return bool(torch.isnan(tensor).any()) if tensor.is_floating_point() else bool((tensor == sentinel).any())


def _restore(owner: Any, flag: Any) -> None:
    if flag is None:
        owner.__dict__.pop("_is_hf_initialized", None)
    else:
        owner._is_hf_initialized = flag


def keep_in_fp32(model: nn.Module, dtype: torch.dtype | None) -> int:
    """Give the parameters ``from_pretrained`` keeps in float32 at ``dtype`` that dtype on
    meta: those whose name holds a pattern of the model's ``_keep_in_fp32_modules`` (at
    float16: T5's ``wo``) or ``_keep_in_fp32_modules_strict`` (at float16 and bfloat16), found
    as transformers finds them (a regular-expression search, ``*`` any text). The load then
    reads each tensor in its skeleton's dtype. Returns the number of tensors changed."""
    patterns = set(getattr(model, "_keep_in_fp32_modules", None) or ()) if dtype == torch.float16 else set()
    if dtype in (torch.float16, torch.bfloat16):
        patterns |= set(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    if not patterns:
        return 0
    search = re.compile("|".join(f"(?:{p.replace('*', '.*')})" for p in sorted(patterns))).search
    changed = 0
    for name, tensor in _meta_tensors(model):
        if tensor.is_floating_point() and tensor.dtype != torch.float32 and search(name):
            _retype(tensor, torch.float32)
            changed += 1
    return changed


def take_stored_dtypes(model: nn.Module, checkpoint: Checkpoint, match: Match) -> int:
    """Give each meta tensor of ``model`` the dtype its checkpoint tensor is stored in (for a
    tensor transformers' conversion builds: the dtype it builds it in), so that a plan counts
    the bytes the checkpoint really holds (a bf16 checkpoint of an fp32 config).
    Only headers are read. Returns the number of tensors changed."""
    changed = 0
    for name, tensor in _meta_tensors(model):
        stored = _stored_dtype(name, checkpoint, match)
        if (
            stored is not None
            and stored != tensor.dtype
            and stored.is_floating_point
            and tensor.is_floating_point()
        ):
            _retype(tensor, stored)
            changed += 1
    return changed


def _stored_dtype(name: str, checkpoint: Checkpoint, match: Match) -> torch.dtype | None:
    if name in match.built:
        recipe, target = match.built[name]
        return recipe.targets[target][1]
    stored = checkpoint.tensors.get(match.sources.get(name, ""))
    return None if stored is None else stored.dtype


def _retype(tensor: torch.Tensor, dtype: torch.dtype) -> None:
    """A meta tensor of the model given ``dtype`` in place (the Parameter object and its ties stay)."""
    tensor.data = torch.empty(tensor.shape, dtype=dtype, device="meta")


def _meta_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    seen: set[int] = set()
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        if tensor.is_meta and id(tensor) not in seen:
            seen.add(id(tensor))
            yield name, tensor
