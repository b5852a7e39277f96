"""The front doors: :func:`plan`, :func:`dispatch` and :func:`load` connect profile -> plan ->
dispatch, and checkpoint -> plan -> dispatch (``load`` also builds the model of a Hugging Face
folder itself). Profile -> plan is wired once, in :mod:`automap.compose`, which the command
line shares; this module checks the arguments and chooses the library's tracing."""

from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterable, Mapping, overload

import torch
from torch import nn
from torch.nn.parameter import UninitializedTensorMixin

from automap.devices import MaxMemory, Reserve, canonical_name, detect_devices, parse_reserve
from automap.runtime import check_not_dispatched, claimed, dispatch_plan, release_orphans, state_of
from automap.runtime.trim import trim_host_memory
from automap.errors import CheckpointError, DeviceError, DeviceMapError, PlanError
from automap.interrupts import public
from automap.progress import silenced, step
from automap.loading.matching import matched
from automap.loading.commit import load_and_dispatch
from automap.loading.materialise import store_bytes
from automap.loading.peak import load_plan
from automap.offload import check_offload_dir
from automap.userfiles import as_path
from automap.offload.folder import recorded_folder, store_folder
from automap.loading.pretrained_args import FolderOptions, load_options
from automap.loading import build_from_folder, log_summary, open_checkpoint
from automap.compose import library_tracing, plan_strategy, plan_user_map, user_map
from automap.planning import STRATEGIES, Plan, get_strategy
from automap.planning.usermap import expressible
from automap.profiling import ExampleInputs, Profile
from automap.profiling.kvcache import check_batch
from automap.profiling.units import all_named_tensors

DeviceMap = str | Mapping[str, int | str] | Plan


@public
def plan(
    model: nn.Module | Profile,
    device_map: DeviceMap = "auto",
    max_memory: MaxMemory | None = None,
    *,
    no_split: Iterable[str | type] | None = None,
    example_inputs: ExampleInputs | None = None,
    dtype: DtypeLike = None,
    offload_dir: str | Path | None = None,
    reserve: Reserve = None,
    batch: int | None = None,
    max_length: int | None = None,
    speeds: Mapping[str, float] | None = None,
    links: Mapping[str, float] | None = None,
    bandwidths: Mapping[str, float] | None = None,
    map_only: bool = False,
) -> Plan:
    """Decide where each placement unit of ``model`` goes.

    ``"auto"``/``"balanced"`` keep everything on the accelerators when they can hold it
    (weights, activations of the planned batch, ``reserve``) and split it there so the slowest
    stage (compute plus incoming transfers) is as fast as possible; otherwise the accelerators
    hold as much as they can, then CPU RAM, then disk. ``"balanced_low_0"`` keeps GPU 0 light;
    ``"sequential"`` fills GPU 0, 1, ..., then CPU, then disk.

    With ``max_length``, the plan is for ``generate``: each device also keeps room for the KV
    cache (or other generation state) of the units that compute on it, for ``batch`` sequences
    of ``max_length`` tokens, measured by running a prefill and a decode step on meta; the
    example inputs are the prompt, so activations are the prefill's. ``plan.report()`` then
    shows a KV column and the predicted prefill time and decode tokens/s, with what limits them.

    A dict ``device_map`` is planned without running the model unless ``example_inputs`` are
    given (then FLOPs and cut bytes are counted for the report).

    Args:
        model: a module (real or on meta) or a :class:`~automap.profiling.Profile` of one.
        device_map: a strategy (``"auto"``, ``"balanced"``, ``"balanced_low_0"``,
            ``"sequential"``), a dict in the Hugging Face form, a :class:`Plan`, or one device
            for the whole model as transformers takes it (``"cpu"``, ``"cuda:0"``, ``0``,
            ``torch.device("cuda", 1)``, ``"disk"``): ``{"": device}``.
        max_memory: per-device budgets, e.g. ``{0: "20GiB", "cpu": "64GiB"}``; devices this
            machine lacks are fine for planning. Detected when None.
        no_split, example_inputs, dtype: passed to :func:`automap.profile`; ``dtype`` may be
            a ``torch.dtype`` or its name (``"bfloat16"``, ``"torch.float16"``). A unit that does
            not fit where it must go is split into its children (the model traced again)
            unless its class is in ``no_split``; ``plan.choices`` says what was split and why.
        offload_dir: where disk offload would go: its free space bounds "disk" (unless
            ``max_memory`` sets it), and the plan records it (``plan.offload_dir``, absolute) as
            the folder dispatch and load use when given none.
        reserve: bytes to keep free for KV cache or optimizer state: one size for every
            computing device (``"2GiB"``) or per device (``{0: "4GiB", 1: "1GiB"}``).
        batch: profile at this batch size (default example inputs only) so that activations
            are reserved for the batch you will run; with ``max_length``, the sequences
            generated together (default: the example inputs' batch, else 1).
        max_length: plan for ``generate(max_length=...)``: tokens per sequence at the end,
            prompt included (the decoder's tokens for an encoder-decoder).
        speeds, links, bandwidths: FLOP/s, link bytes/s and memory bytes/s per device name or
            kind, replacing defaults (e.g. ``speeds={"cuda": 300e12}, links={"cuda": 300e9}``
            for NVLink H100s; ``bandwidths`` set decode predictions).
        map_only: only a plan that ``plan.device_map`` alone says fully, as accelerate's
            ``dispatch_model`` and ``from_pretrained`` read a map (units on ``"cpu"``/``"disk"``
            compute on the first accelerator the map names, else the CPU): what
            ``infer_auto_device_map`` returns. Raises :class:`~automap.errors.MapFormatError`
            when no plan that fits is such.

    Returns:
        A :class:`Plan`; ``plan.device_map`` is the Hugging Face / accelerate form.

    Raises:
        PlanError: unknown strategy, the model cannot fit, ``batch`` < 1, or ``max_length``
            not longer than the prompt.
        DeviceMapError: a dict map names unknown modules or leaves tensors without a device.

    Example:
        >>> p = automap.plan(torchvision.models.resnet50(), max_memory={0: "60MB", 1: "60MB"})
        >>> print(p.report())
    """
    if isinstance(device_map, Plan):
        return device_map
    check_argument_types(
        model,
        offload_dir=offload_dir,
        no_split=no_split,
        example_inputs=example_inputs,
        speeds=speeds,
        links=links,
        bandwidths=bandwidths,
    )
    device_map, dtype = one_device_map(device_map), as_dtype(dtype)
    if isinstance(model, nn.Module) and state_of(model) is not None:
        raise PlanError(
            f"{type(model).__name__} is dispatched, so its weights are spread out and hooked; see where "
            "they are with automap.placement(model), or call automap.undispatch(model) before planning again"
        )
    if offload_dir:
        check_offload_dir(offload_dir)  # a dangling link or /proc: say so, not "the model does not fit"
    devices = detect_devices(
        max_memory,
        offload_dir=str(offload_dir) if offload_dir else None,
        speeds=speeds,
        links=links,
        bandwidths=bandwidths,
        dtype=compute_dtype(model, dtype),
    )
    if batch is not None:
        check_batch(batch)  # fails before any profiling
    if isinstance(device_map, str):
        get_strategy(device_map)  # an unknown name fails before any profiling
        tracing = library_tracing(model, example_inputs, batch, max_length)
        made = plan_strategy(
            model,
            devices,
            device_map,
            tracing,
            no_split=no_split,
            dtype=dtype,
            reserve=parse_reserve(reserve, devices),
            accept=expressible if map_only else None,
        )
        return replace(made, inputs=replace(made.inputs, offload_dir=recorded_folder(offload_dir)))
    if isinstance(device_map, Mapping):
        if isinstance(model, Profile):
            raise DeviceMapError(
                "a dict device_map needs the model itself, not a Profile, to check its names"
            )
        made = plan_user_map(
            model, user_map(model, device_map), devices, example_inputs, dtype, batch, max_length
        )
        return replace(made, inputs=replace(made.inputs, offload_dir=recorded_folder(offload_dir)))
    raise PlanError(f"device_map must be a strategy name, a dict or a Plan, not {type(device_map).__name__}")


def check_argument_types(
    model: object, *, offload_dir: object, no_split: object, example_inputs: object, **mappings: object
) -> None:
    """Refuse arguments of the wrong kind before anything reads them, naming what each takes.

    Raises:
        PlanError: ``model`` is not a module (or Profile), holds a lazy module's
            uninitialized tensor or a TorchScript module, ``offload_dir`` not a path (or an
            empty one, or one with a NUL),
            ``no_split`` not names and classes, ``example_inputs`` not a tuple, dict or tensor,
            or a speeds/links/bandwidths argument not a dict.
    """
    if example_inputs is not None and not isinstance(example_inputs, (tuple, list, Mapping, torch.Tensor)):
        raise PlanError(
            f"example_inputs={example_inputs!r}: give the forward's arguments as a tuple, e.g. "
            "(torch.randn(1, 3, 224, 224),), or its keyword arguments as a dict"
        )
    if not isinstance(model, (nn.Module, Profile)):
        raise PlanError(
            f"automap plans an nn.Module (or a Profile), not {type(model).__name__}; pass the model"
        )
    named = all_named_tensors(model) if isinstance(model, nn.Module) else ()
    lazy = next((n for n, t in named if isinstance(t, UninitializedTensorMixin)), None)
    if lazy is not None:
        raise PlanError(
            f"{lazy!r} is a lazy module's uninitialized tensor (nn.LazyLinear and the like): its shape is "
            "not known until the model has run once; run one forward on an example input first"
        )
    scripted = (
        next(
            (n or "the model" for n, m in model.named_modules() if isinstance(m, torch.jit.ScriptModule)),
            None,
        )
        if isinstance(model, nn.Module)
        else None
    )
    if scripted is not None:
        raise PlanError(
            f"{scripted!r} is a TorchScript module (torch.jit.script or trace), which takes no hooks: "
            "automap can neither measure nor move it; dispatch the eager model, and script it after "
            "if you need to"
        )
    if offload_dir is not None:
        as_path(offload_dir, "offload_dir", PlanError)
    items = [no_split] if isinstance(no_split, (str, type)) else no_split
    if items is not None and (
        not isinstance(items, Iterable) or not all(isinstance(n, (str, type)) for n in items)
    ):  # type: ignore[union-attr]
        raise PlanError(
            f"no_split={no_split!r}: give module class names or classes, e.g. no_split=['LlamaDecoderLayer']"
        )
    for name, value in mappings.items():
        if value is not None and not isinstance(value, Mapping):
            raise PlanError(
                f"{name}={value!r}: give a dict keyed by device kind, e.g. {name}={{'cpu': 20e9}}"
            )


DtypeLike = torch.dtype | str | None


def compute_dtype(model: nn.Module | Profile, dtype: torch.dtype | None) -> str | None:
    """The name of the dtype ``model`` computes in (``"bfloat16"``): ``dtype`` when given, else
    the one most of its floating-point weights have; which measured matmul rate a device gets."""
    if dtype is not None:
        return str(dtype).removeprefix("torch.")
    if not isinstance(model, nn.Module):
        return None
    counts: dict[torch.dtype, int] = {}
    for _, t in all_named_tensors(model):
        if t.is_floating_point():
            counts[t.dtype] = counts.get(t.dtype, 0) + t.numel()
    return str(max(counts, key=counts.__getitem__)).removeprefix("torch.") if counts else None


def as_dtype(dtype: DtypeLike) -> torch.dtype | None:
    """A ``torch.dtype`` from the forms transformers and accelerate take: the dtype itself or
    its name (``"bfloat16"``, ``"torch.float16"``, ``"fp16"``).

    Raises:
        PlanError: not a floating-point dtype or its name (``"auto"`` is for :func:`load`).
    """
    if dtype is None or isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        return dtype
    name = str(dtype).strip().lower().removeprefix("torch.") if isinstance(dtype, str) else None
    found = getattr(torch, _DTYPE_SHORT.get(name, name), None) if name else None
    if isinstance(found, torch.dtype) and found.is_floating_point:
        return found
    hint = " ('auto' takes the checkpoint's dtype, in automap.load)" if name == "auto" else ""
    raise PlanError(
        f"dtype={dtype!r} is not a floating-point dtype{hint}; give a torch.dtype or its name, "
        "e.g. torch.bfloat16, 'bfloat16', 'float16' or 'float32'"
    )


_DTYPE_SHORT = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "fp32": "float32",
    "float": "float32",
}


def one_device_map(device_map: DeviceMap | int | torch.device) -> DeviceMap:
    """``device_map`` with transformers' one-device forms (``"cpu"``, ``"cuda:0"``, ``0``,
    ``torch.device``, ``"disk"``) as the dict ``{"": device}``; strategies, dicts and plans
    as they are.

    Raises:
        PlanError: neither a strategy, a device, a dict nor a Plan.
    """
    if isinstance(device_map, (Plan, Mapping)) or (isinstance(device_map, str) and device_map in STRATEGIES):
        return device_map
    if isinstance(device_map, (str, int, torch.device)) and not isinstance(device_map, bool):
        try:
            return {
                "": canonical_name(str(device_map) if isinstance(device_map, torch.device) else device_map)
            }
        except DeviceError as exc:
            raise PlanError(
                f"device_map={device_map!r} is neither a strategy ({', '.join(STRATEGIES)}) nor a "
                f"device ({exc}); or give a dict or a Plan"
            ) from None
    raise PlanError(
        f"device_map must be a strategy name, a device, a dict or a Plan, not {type(device_map).__name__}"
    )


@public
def dispatch(
    model: nn.Module,
    device_map: DeviceMap = "auto",
    max_memory: MaxMemory | None = None,
    *,
    offload_dir: str | Path | None = None,
    no_split: Iterable[str | type] | None = None,
    example_inputs: ExampleInputs | None = None,
    output_device: str | torch.device | None = None,
    batch: int | None = None,
    max_length: int | None = None,
) -> nn.Module:
    """Place ``model`` across devices and hook it so that it runs there transparently.

    Offloaded units compute on the execution device (the fastest accelerator in the plan, else
    the CPU) with weights brought in just before they run, the next one prefetched meanwhile:
    units on ``"disk"`` are read from a store directory automap creates inside ``offload_dir``
    (copy-on-write views through mmap: between forwards every parameter is a real tensor), units
    on ``"cpu"`` while a GPU executes are copied from pinned RAM on a side stream. Training works
    through resident units; a gradient reaching an offloaded weight raises
    :class:`~automap.errors.DispatchError` at backward (freeze it or keep it resident). See
    ``docs/offload-safety.md`` for what is written where, locks, crashes and threads.

    Args:
        model: the model to place; returned hooked (the same object).
        device_map, max_memory, no_split, example_inputs: as for :func:`plan`.
        offload_dir: directory for disk-offloaded weights (automap writes only inside an
            ``automap-store-*`` folder of its own there); required when anything goes to disk.
        output_device: move the model's outputs here (default: where they were produced).
        batch, max_length: plan for ``generate`` (see :func:`plan`): each device keeps room
            for the KV cache of its layers, and ``generate`` keeps each layer's cache there.

    Returns:
        ``model``, placed and hooked. :func:`undispatch` undoes it.

    Raises:
        AutomapError: bad map, missing device, unwritable offload_dir; the model is unchanged.

    Example:
        >>> model = automap.dispatch(model, max_memory={"cpu": "200MB"}, offload_dir="offload")
        >>> model(x)  # same outputs as before
    """
    release_orphans(model)  # a part kept from a dropped dispatched model is dispatched as its own
    check_not_dispatched(model)
    chosen = plan(
        model,
        device_map,
        max_memory,
        no_split=no_split,
        example_inputs=example_inputs,
        offload_dir=offload_dir,
        batch=batch,
        max_length=max_length,
    )
    dispatched = dispatch_plan(model, chosen, offload_dir=offload_dir, output_device=output_device)
    trim_host_memory()  # what writing the store freed goes back to the system (runtime/trim.py)
    return dispatched


PathLike = str | os.PathLike[str]


@overload
def load(
    folder: PathLike,
    /,
    *,
    device_map: DeviceMap = "auto",
    max_memory: MaxMemory | None = None,
    offload_dir: PathLike | None = None,
    dtype: DtypeLike = None,
    no_split: Iterable[str | type] | None = None,
    example_inputs: ExampleInputs | None = None,
    quiet: bool = False,
    batch: int | None = None,
    max_length: int | None = None,
    strict: bool = True,
    torch_dtype: DtypeLike = None,
    offload_folder: PathLike | None = None,
    **from_pretrained: Any,
) -> nn.Module: ...


@overload
def load(
    model: nn.Module,
    checkpoint: PathLike,
    device_map: DeviceMap = "auto",
    max_memory: MaxMemory | None = None,
    *,
    offload_dir: PathLike | None = None,
    dtype: DtypeLike = None,
    no_split: Iterable[str | type] | None = None,
    example_inputs: ExampleInputs | None = None,
    quiet: bool = False,
    batch: int | None = None,
    max_length: int | None = None,
    strict: bool = True,
    torch_dtype: DtypeLike = None,
    offload_folder: PathLike | None = None,
    **from_pretrained: Any,
) -> nn.Module: ...


@public
def load(
    model: nn.Module | PathLike,
    checkpoint: PathLike | None = None,
    device_map: DeviceMap = "auto",
    max_memory: MaxMemory | None = None,
    *,
    offload_dir: PathLike | None = None,
    dtype: DtypeLike = None,
    no_split: Iterable[str | type] | None = None,
    example_inputs: ExampleInputs | None = None,
    quiet: bool = False,
    batch: int | None = None,
    max_length: int | None = None,
    strict: bool = True,
    torch_dtype: DtypeLike = None,
    offload_folder: PathLike | None = None,
    **from_pretrained: Any,
) -> nn.Module:
    """Load ``checkpoint`` into ``model``, each tensor straight to its planned device or store.

    Two forms:

    - ``load(model, checkpoint, ...)``: a skeleton you built (under :func:`empty_model`) and
      the checkpoint to fill it from;
    - ``load(folder, ...)``: a Hugging Face model folder (``config.json`` beside its weights,
      as ``save_pretrained`` writes it). The model is built from the config's
      ``architectures`` entry on meta (needs transformers), at ``dtype`` or else the config's
      dtype, then loaded from the same folder. The other arguments are keywords.

    The model is planned on meta first; then every tensor is read on its own (never a whole
    shard) to its GPU or to CPU RAM, or kept in the offload store. Offloaded tensors of a
    safetensors checkpoint already in the target dtype are referenced in place: nothing is
    copied or written. Tied weights stay tied; buffers missing from the checkpoint keep the
    values computed at init (build the model in :func:`empty_model`).

    Args:
        model: a skeleton from :func:`empty_model` (or any model; its weights are replaced),
            or the path of a Hugging Face model folder.
        checkpoint: a ``.safetensors`` file, a ``.bin``/``.pt``/``.pth`` file, or a folder of
            shards (with or without ``model.safetensors.index.json``). Not given with a folder.
        device_map, max_memory, no_split, example_inputs, batch, max_length: as for
            :func:`automap.plan` (one device, ``"cpu"`` or ``0``, puts the whole model there);
            pass a :class:`~automap.Plan` as ``device_map`` to use the planner's other options.
        offload_dir: where offloaded tensors that need writing go (converted dtype, a pickled
            source, buffers computed at init in a unit on disk). Not needed when every offloaded
            tensor comes from a safetensors checkpoint already in the target dtype.
        dtype: convert floating-point weights (parameters and what the checkpoint holds) to
            this dtype on the way, as accelerate's ``load_checkpoint_and_dispatch`` does; buffers
            the model computes keep theirs (Llama's rotary ``inv_freq`` stays float32): a
            ``torch.dtype`` or its name (``"bfloat16"``), or
            ``"auto"`` for the checkpoint's own (a folder: its config's dtype). A folder's model
            is built at it as ``from_pretrained`` builds it (buffers computed at init keep their
            dtype; modules the model keeps in float32, T5's ``wo`` at float16, stay there), and
            each tensor is read in its dtype. ``torch_dtype`` is the same argument under
            transformers' former name.
        offload_folder: ``offload_dir`` under transformers' and accelerate's name.
        strict: True: checkpoint keys the model lacks, or model tensors the checkpoint lacks,
            raise; a folder (``from_pretrained``'s form) skips keys the model lacks with a
            warning, as ``from_pretrained`` does (buffers older versions saved). False (accelerate's default in ``load_checkpoint_and_dispatch``): skip the
            former, keep the model's own values of the latter (a tensor on meta still
            raises), and say which in a warning.
        quiet: no progress bar (it only appears for loads longer than a second).
        from_pretrained: the folder form takes ``from_pretrained``'s other keyword arguments
            with the same meaning (``attn_implementation="eager"``, ``trust_remote_code=True``,
            ``low_cpu_mem_usage=True``, config attributes such as ``output_attentions=True``)
            or refuses one with why (``revision``, ``token``: a local folder has neither); see
            :mod:`automap.loading.pretrained_args` and ``docs/loading.md``.

    Returns:
        ``model`` (or the model built from ``folder``), loaded and dispatched;
        :func:`automap.undispatch` brings it back to CPU.

    Raises:
        CheckpointError: missing, corrupt, truncated or unsafe checkpoint; missing, unexpected
            or mis-shaped keys; a folder without config.json. Nothing is left half-written in
            ``offload_dir``.
        DependencyError: a folder was given and transformers is not installed.
        ArgumentError: a ``from_pretrained`` argument automap refuses (named, with why), or
            one given to the ``load(model, checkpoint)`` form.
        PlanError, DispatchError: as for :func:`automap.dispatch`.

    Example:
        >>> model = automap.load(model, "gpt2/model.safetensors", max_memory={"cpu": "200MB"})
        >>> model = automap.load("path/to/llama", max_memory={"cpu": "8GiB"}, offload_dir="offload")
    """
    dtype = _one_of("dtype", dtype, "torch_dtype", torch_dtype)
    offload_dir = _one_of("offload_dir", offload_dir, "offload_folder", offload_folder)
    if offload_dir is not None:
        as_path(offload_dir, "offload_dir", PlanError)
    folder_form = not isinstance(model, nn.Module)
    options = load_options(model if not folder_form else None, from_pretrained)
    model = Path(model) / options.subfolder if options.subfolder and folder_form else model
    if dtype == "auto":
        dtype = (
            None if folder_form else _stored_dtype(checkpoint)
        )  # a folder's model is built in its config's
    dtype = as_dtype(dtype)
    model, checkpoint = _model_and_checkpoint(model, checkpoint, dtype, quiet, options)
    if folder_form:
        dtype = None  # built as from_pretrained builds it: each tensor is read in its skeleton's dtype
    start = time.perf_counter()
    # Claimed from here: the tensors installed below are this call's until its dispatch ends.
    with claimed(model), silenced(quiet), open_checkpoint(checkpoint) as ckpt:
        match = matched(model, ckpt, strict, folder_form)
        chosen, tasks = load_plan(
            model,
            match,
            dtype,
            lambda reserve: plan(
                model,
                device_map,
                max_memory,
                no_split=no_split,
                example_inputs=example_inputs,
                dtype=dtype,
                offload_dir=None if offload_dir is None else Path(offload_dir),
                batch=batch,
                max_length=max_length,
                reserve=reserve,
            ),
        )
        folder = store_folder(chosen, offload_dir, store_bytes(tasks, ckpt))  # room checked before any read
        loaded = load_and_dispatch(model, chosen, tasks, ckpt, folder, match, quiet)
    log_summary(model, tasks, loaded, match, time.perf_counter() - start)
    trim_host_memory()  # what reading and converting freed goes back to the system (runtime/trim.py)
    return model


def _one_of(name: str, value: object, alias: str, aliased: object) -> Any:
    """``value``, or ``aliased`` given under its other name (transformers' and accelerate's)."""
    if aliased is None:
        return value
    if value is not None:
        raise PlanError(f"{name}= and {alias}= are the same argument; give one")
    return aliased


def _stored_dtype(checkpoint: PathLike | None) -> torch.dtype | None:
    """The dtype of the checkpoint's first floating-point tensor (transformers' ``"auto"``)."""
    if checkpoint is None:
        return None  # _model_and_checkpoint says what is missing
    with open_checkpoint(checkpoint) as ckpt:
        return next((s.dtype for s in ckpt.tensors.values() if s.dtype.is_floating_point), None)


def _check_named(path: PathLike, call: str) -> None:
    """Refuse an empty path: ``Path("")`` is the working directory, which the caller did not name."""
    if not os.fspath(path):
        raise CheckpointError(
            f"{call}: the path is empty, which would read the working directory; name the "
            "checkpoint file or folder, e.g. '.' for the working directory"
        )


def _model_and_checkpoint(
    model: nn.Module | PathLike,
    checkpoint: PathLike | None,
    dtype: torch.dtype | None,
    quiet: bool = False,
    options: FolderOptions = FolderOptions(),
) -> tuple[nn.Module, PathLike]:
    """Which form of :func:`load` was called: (skeleton, checkpoint), or a folder to build from."""
    if isinstance(model, nn.Module):
        if checkpoint is None:
            raise CheckpointError(
                f"automap.load({type(model).__name__}) needs the checkpoint to read: "
                "automap.load(model, 'path/to/checkpoint'), or give only a Hugging Face folder: "
                "automap.load('path/to/folder')"
            )
        if not isinstance(checkpoint, (str, os.PathLike)):
            raise CheckpointError(
                f"automap.load(model, {checkpoint!r}): the checkpoint is a path (a str or "
                f"pathlib.Path) to a file or folder of shards, not a {type(checkpoint).__name__}"
            )
        _check_named(checkpoint, f"automap.load({type(model).__name__}, {checkpoint!r})")
        release_orphans(model)  # a part kept from a dropped dispatched model is loaded as its own
        return model, checkpoint
    if not isinstance(model, (str, os.PathLike)):
        raise CheckpointError(
            f"automap.load takes a model (an nn.Module) or a Hugging Face folder's path first, "
            f"not a {type(model).__name__}"
        )
    _check_named(model, f"automap.load({model!r})")
    if checkpoint is not None:
        raise CheckpointError(
            f"automap.load({str(model)!r}, {str(checkpoint)!r}): a folder is both the model and "
            "its checkpoint, so it takes no second path; pass device_map= and max_memory= by name, "
            "or build the model yourself and call automap.load(model, checkpoint)"
        )
    with step(f"automap: building the model in {model}", quiet=quiet):
        return build_from_folder(model, dtype, options), model
