"""One plan, every engine: a :class:`~automap.planning.Plan` in the form another engine takes
(accelerate's ``device_map``, torch pipelining's ``split_spec``, torchtitan's
``module_fqns_per_model_part``, vLLM's ``VLLM_PP_LAYER_PARTITION``, llama.cpp's ``-ngl``/``-ot``
flags for the GGUF tensor names). Pipeline engines refuse a plan that offloads.
See docs/export.md.
"""

from __future__ import annotations

import json
import re
import shlex
from collections import Counter
from typing import Any, Sequence

from automap.errors import DependencyError, PlanError
from automap.kinds import kind_of
from automap.pipelining.ranks import rank_stages, split_spec
from automap.planning.model import Plan, register_exporter

# llama.cpp's converter names families as gguf's MODEL_ARCH_NAMES do; a few transformers
# model_types it converts as another architecture.
GGUF_ALIASES = {"mistral": "llama", "mixtral": "llama", "gpt_neox": "gptneox", "gpt_oss": "gpt-oss"}
_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")
_EXPERTS = re.compile(r"_exps(\.|$)")  # a layer's routed experts, stacked: ffn_gate_exps.weight


def accelerate_map(plan: Plan) -> dict[str, int | str]:
    """``plan.device_map``: accelerate's and ``from_pretrained``'s ``device_map``."""
    return dict(plan.device_map)


def split_points(plan: Plan) -> dict[str, Any]:
    """``torch.distributed.pipelining.pipeline``'s ``split_spec`` (see :func:`automap.distributed.split_spec`)."""
    return split_spec(plan)


def _stages(plan: Plan) -> Sequence[Any]:
    return rank_stages(plan)


def torchtitan_parts(plan: Plan) -> list[list[str]]:
    """torchtitan's ``module_fqns_per_model_part``: each pipeline stage's modules, in order."""
    return [list(stage.units) for stage in _stages(plan)]


def vllm_partition(plan: Plan) -> str:
    """``VLLM_PP_LAYER_PARTITION``: how many decoder layers each pipeline stage runs
    (``"10,12,10"``); the embedding goes with the first stage and the head with the last, as
    vLLM places them.

    Raises:
        PlanError: the model has no numbered layers, or a stage splits one.
    """
    prefix, _ = decoder_layers(plan)
    owner: dict[int, int] = {}
    for index, stage in enumerate(_stages(plan)):
        for unit in stage.units:
            layer = layer_index(unit, prefix)
            if layer is not None and owner.setdefault(layer, index) != index:
                raise PlanError(
                    f"layer {prefix}.{layer} computes in stages {owner[layer]} and {index}; vLLM runs a "
                    "layer whole on one stage: plan with no_split set to the layer's class"
                )
    counts = Counter(owner.values())
    return ",".join(str(counts.get(i, 0)) for i in range(len(_stages(plan))))


def decoder_layers(plan: Plan) -> tuple[str, int]:
    """The plan's repeated layers (the numbered modules of its largest list): their prefix and
    count.

    Raises:
        PlanError: none.
    """
    indices: dict[str, set[int]] = {}
    for unit in plan.units:
        for name in (unit.name, *unit.tensors):
            parts = name.split(".")
            for i in range(1, len(parts)):
                if parts[i].isdigit():
                    key = ".".join(parts[:i])
                    indices.setdefault(key, set()).add(int(parts[i]))
                    break
    if not indices:
        raise PlanError("the model has no numbered layers (a ModuleList of blocks) to count per stage")
    prefix = max(indices, key=lambda k: (len(indices[k]), -len(k)))
    return prefix, max(indices[prefix]) + 1


def layer_index(name: str, prefix: str) -> int | None:
    """The layer number of module or tensor ``name`` under ``prefix`` (None: outside the layers)."""
    if not name.startswith(prefix + "."):
        return None
    head = name[len(prefix) + 1 :].split(".", 1)[0]
    return int(head) if head.isdigit() else None


# ------------------------------------------------------------------ llama.cpp


def gguf_arch(arch: str) -> Any:
    """gguf's ``MODEL_ARCH`` for a transformers ``model_type`` (or a GGUF architecture name).

    Raises:
        DependencyError: the ``gguf`` package (llama.cpp's own) is not installed.
        PlanError: an architecture llama.cpp does not name.
    """
    try:
        import gguf
    except ImportError as exc:
        raise DependencyError(
            f"exporting to llama.cpp needs the gguf package for its tensor names ({exc}); pip install gguf"
        ) from exc
    by_name = {name: arch_ for arch_, name in gguf.MODEL_ARCH_NAMES.items()}
    for candidate in (arch, GGUF_ALIASES.get(arch, ""), arch.replace("_", ""), arch.replace("_", "-")):
        if candidate in by_name:
            return by_name[candidate]
    raise PlanError(
        f"llama.cpp names no architecture {arch!r}; give arch= as llama.cpp's GGUF names it "
        f"(general.architecture, e.g. {', '.join(sorted(by_name)[:6])}, ...)"
    )


def gguf_names(name_map: Any, tensor: str) -> list[str]:
    """The GGUF tensors llama.cpp's converter makes of transformers tensor ``tensor`` (a fused
    gate-up projection becomes two), or [] when it has none."""
    parts = (
        [tensor.replace("gate_up_proj", "gate_proj"), tensor.replace("gate_up_proj", "up_proj")]
        if "gate_up_proj" in tensor
        else [tensor]
    )
    found = []
    for part in parts:
        name = name_map.get_name(part, try_suffixes=(".weight", ".bias"))
        if name is not None:
            found.append(name if name.endswith((".weight", ".bias")) else name + ".weight")
    return found


def backend(plan: Plan, device: str) -> str:
    """llama.cpp's name of the buffer a plan device's weights go to: ``CUDA0``, ``CPU`` (CPU
    RAM and disk: llama.cpp maps the file and reads it as CPU memory)."""
    spec = plan.device(device)
    if not spec.is_accelerator:
        return "CPU"
    return f"{kind_of(spec).name.upper()}{spec.index or 0}"


def gguf_placement(plan: Plan, arch: str) -> dict[str, str]:
    """Each GGUF tensor of the model -> llama.cpp's buffer for it, as ``plan`` places it."""
    import gguf

    _, blocks = decoder_layers(plan)
    name_map = gguf.get_tensor_name_map(gguf_arch(arch), blocks)
    placed = {}
    for unit, placement in zip(plan.units, plan.placements):
        for tensor in unit.tensors:
            for name in gguf_names(name_map, tensor):
                placed[name] = backend(plan, placement.home)
    if not placed:
        raise PlanError(
            f"none of the plan's tensors has a GGUF name for architecture {arch!r}; is it the model's?"
        )
    return placed


def llama_cpp_args(plan: Plan, arch: str) -> list[str]:
    """``-ngl`` and ``-ot`` arguments that put each tensor of the model's GGUF file where
    ``plan`` puts it: every layer offloaded (``-ngl 999``) to the first GPU, and an override
    (first match wins, as llama.cpp applies them) for what goes elsewhere: whole layers where
    all their tensors go together, a layer's routed experts (``ffn_*_exps``) apart, single
    tensors otherwise. ``token_embd`` is left to llama.cpp (it keeps the input embedding in
    CPU memory). No GPU in the plan: ``-ngl 0``."""
    placed = gguf_placement(plan, arch)
    gpus = sorted({backend(plan, d.name) for d in plan.devices if d.is_accelerator} & set(placed.values()))
    if not gpus:
        return ["-ngl", "0"]
    default = gpus[0]
    overrides: dict[tuple[str, str], list[int]] = {}
    singles = []
    for block, tensors in _by_block(placed).items():
        devices = set(tensors.values())
        if devices == {default}:
            continue
        if len(devices) == 1:
            overrides.setdefault(("", devices.pop()), []).append(block)
            continue
        experts = {d for n, d in tensors.items() if _EXPERTS.search(n)}
        if len(experts) == 1 and next(iter(experts)) != default:
            overrides.setdefault((r"ffn_.*_exps\.", next(iter(experts))), []).append(block)
        singles += [
            (f"blk.{block}.{n}", d)
            for n, d in tensors.items()
            if d != default and not (_EXPERTS.search(n) and len(experts) == 1)
        ]
    singles += [
        (n, d)
        for n, d in placed.items()
        if not _BLOCK.match(n) and d != default and not n.startswith("token_embd")
    ]
    args = ["-ngl", "999"]
    for (rest, device), blocks in overrides.items():
        args += ["-ot", f"blk\\.({'|'.join(map(str, blocks))})\\.{rest}={device}"]
    for name, device in singles:
        args += ["-ot", f"^{re.escape(name)}$={device}"]
    return args


def _by_block(placed: dict[str, str]) -> dict[int, dict[str, str]]:
    """The GGUF tensors of each block, without their ``blk.N.`` and ``.weight``/``.bias``."""
    found: dict[int, dict[str, str]] = {}
    for name, device in placed.items():
        match = _BLOCK.match(name)
        if match:
            found.setdefault(int(match.group(1)), {})[match.group(2)] = device
    return {b: found[b] for b in sorted(found)}


# ------------------------------------------------------------------ as text


def render(plan: Plan, engine: str, **options: Any) -> str:
    """The export for ``engine`` as ``automap plan --emit`` prints it: JSON for the maps and
    stage lists, ``VLLM_PP_LAYER_PARTITION=...`` for vLLM, shell-quoted flags for llama.cpp."""
    value = plan.export(engine, **options)
    return AS_TEXT.get(engine, lambda v: json.dumps(v, indent=2))(value)


# How each engine's export is printed (JSON when not listed).
AS_TEXT = {
    "vllm": lambda value: f"VLLM_PP_LAYER_PARTITION={value}",
    "llama.cpp": shlex.join,
    "split_spec": lambda value: json.dumps({name: point.name for name, point in value.items()}, indent=2),
}


register_exporter("accelerate", accelerate_map)
register_exporter("split_spec", split_points)
register_exporter("torchtitan", torchtitan_parts)
register_exporter("vllm", vllm_partition)
register_exporter("llama.cpp", llama_cpp_args)
