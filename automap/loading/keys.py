"""Which checkpoint key fills which tensor of the model, and what does not fit: a leading
component more or less (the rename matching most names wins), transformers' own conversions,
then the model's own load path (each module's load-state-dict pre-hooks run on stand-ins: legacy
``weight_g``/``weight_v`` keys are accepted as ``load_state_dict`` takes them); then every tensor
must be filled, every key used, every shape equal.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Sequence

import torch
from torch import nn

from automap.errors import CheckpointError
from automap.loading.checkpoint import Checkpoint, Stored
from automap.loading.pickles import EXTRA_STATE
from automap.loading.convert import Conversion, Recipe, conversion_for
from automap.profiling.units import all_named_tensors, names_by_identity

log = logging.getLogger(__name__)

Rename = tuple[str, Callable[[str], str]]


@dataclass(frozen=True)
class Match:
    """How a checkpoint fills a model.

    Attributes:
        sources: every model tensor name (tied aliases included) -> its checkpoint key.
        how: the rename applied to the checkpoint's keys, for messages.
        built: model tensor names (tied aliases included) that a transformers conversion
            builds from several checkpoint tensors -> the recipe and the name it builds them as.
        converted: what transformers' conversion did, in one line for reports (None: nothing).
        untied: names the model ties to others (one tensor) for which the checkpoint holds
            other values under their own keys: each list gets a tensor of its own, as
            ``from_pretrained`` unties them (:func:`untie`).
    """

    sources: dict[str, str]
    how: str
    built: dict[str, tuple[Recipe, str]] = field(default_factory=dict)
    converted: str | None = None
    untied: list[list[str]] = field(default_factory=list)
    extra: dict[str, str] = field(default_factory=dict)  # a module's extra state key -> its checkpoint key


def extra_state_keys(model: nn.Module) -> dict[str, nn.Module]:
    """The ``state_dict`` keys under which modules save their extra state (a module defining
    ``get_extra_state``): no tensor to place, but a value to hand back to ``set_extra_state``."""
    return {
        f"{name}.{EXTRA_STATE}" if name else EXTRA_STATE: module
        for name, module in model.named_modules()
        if type(module).get_extra_state is not nn.Module.get_extra_state
    }


def match_keys(model: nn.Module, checkpoint: Checkpoint) -> Match:
    """Pair the model's parameters and persistent buffers with the checkpoint's keys (or, for
    tensors transformers builds at load, with the recipe that builds them).

    Raises:
        CheckpointError: tensors missing from the checkpoint, keys the model lacks, or
            shapes that differ (counts and the first names of each).
    """
    extra = extra_state_keys(model)
    expected = {k: v for k, v in model.state_dict(keep_vars=True).items() if k not in extra}
    known = {n for n, _ in all_named_tensors(model, remove_duplicate=False)}
    conversion = conversion_for(model, checkpoint.tensors)
    consumed = conversion.consumed if conversion is not None else set()
    keys = {k: s for k, s in checkpoint.tensors.items() if k not in consumed and not k.endswith(EXTRA_STATE)}
    how, rename = _best_rename(expected, keys, conversion)
    renamed, how = _through_hooks(model, {rename(k): k for k in keys}, keys, how)
    saved = {rename(k): k for k in [*checkpoint.extras, *checkpoint.tensors] if k.endswith(EXTRA_STATE)}
    made = {t: r for r in conversion.recipes for t in r.targets} if conversion is not None else {}
    sources: dict[str, str] = {}
    built: dict[str, tuple[Recipe, str]] = {}
    missing, untied = [], []
    for names in names_by_identity(expected.items()):
        key = next((renamed[n] for n in names if n in renamed), None)
        target = next((n for n in names if n in made), None)
        apart = _apart(names, renamed, checkpoint) if key is not None else []
        if len(apart) > 1:
            untied.extend(apart[1:])
            for group in apart:
                sources.update(dict.fromkeys(group, renamed[next(n for n in group if n in renamed)]))
        elif key is not None:
            sources.update(dict.fromkeys(names, key))
        elif target is not None:
            built.update(dict.fromkeys(names, (made[target], target)))
        else:
            missing.append(names[0])
    missing += [k for k in extra if k not in saved]
    missing = [
        n
        for n in _drop(missing, getattr(model, "_keys_to_ignore_on_load_missing", None))
        if not _filled_by_torch(model, n)
    ]
    unexpected = _drop(
        [k for n, k in renamed.items() if n not in known]
        + [t for t in made if t not in known]
        + [k for n, k in saved.items() if n not in extra],
        getattr(model, "_keys_to_ignore_on_load_unexpected", None),
    )
    shapes = _shape_mismatches(expected, sources, checkpoint) + _built_mismatches(expected, built)
    converted = conversion.summary() if conversion is not None else None
    if missing or unexpected or shapes:
        raise CheckpointError(
            _mismatch_message(model, checkpoint, how, missing, unexpected, shapes, converted)
        )
    return Match(sources, how, built, converted, untied, {k: saved[k] for k in extra if k in saved})


def _through_hooks(
    model: nn.Module, renamed: dict[str, str], keys: Mapping[str, Stored], how: str
) -> tuple[dict[str, str], str]:
    """``renamed`` (model name -> checkpoint key) after the model's own load hooks moved names."""
    hooked = hook_renames(model, {n: keys[k] for n, k in renamed.items()})
    if not hooked:
        return renamed, how
    example = next(iter(hooked.items()))
    return (
        {hooked.get(n, n): k for n, k in renamed.items()},
        f"{how}, then the model's own load hooks ({len(hooked)} keys renamed, e.g. {example})",
    )


def hook_renames(model: nn.Module, keys: Mapping[str, Stored]) -> dict[str, str]:
    """The keys (named as the model names its tensors) that the model's own load-state-dict
    pre-hooks move to another key, as ``load_state_dict`` runs them (each module's, with its
    prefix, parents first): key -> the key it ends under. The hooks see meta stand-ins of the
    stored shapes and dtypes; what one builds anew, or a hook that fails on a stand-in, is left
    to the key matching (which names what then does not fit)."""
    hooked = [(name, module) for name, module in model.named_modules() if module._load_state_dict_pre_hooks]
    if not hooked or not keys:
        return {}
    state = {k: torch.empty(s.shape, dtype=s.dtype, device="meta") for k, s in keys.items()}
    origin = {id(t): k for k, t in state.items()}
    for name, module in hooked:
        prefix = f"{name}." if name else ""
        if not any(k.startswith(prefix) for k in state):
            continue
        for hook in list(module._load_state_dict_pre_hooks.values()):
            try:
                hook(state, prefix, {}, True, [], [], [])
            except Exception as exc:  # noqa: BLE001 - a hook that needs real values: keys as they are
                log.debug("load hook of %r skipped on stand-ins: %s", name, exc)
    moved = {origin[id(t)]: k for k, t in state.items() if id(t) in origin and origin[id(t)] != k}
    return moved


def _filled_by_torch(model: nn.Module, name: str) -> bool:
    """Whether ``name`` is a BatchNorm's ``num_batches_tracked``, which torch's own
    ``load_state_dict`` lets a checkpoint lack (files saved before it existed, as old model-zoo
    ``.pth`` files are): the model keeps its own count (0 when built)."""
    owner, _, leaf = name.rpartition(".")
    if leaf != "num_batches_tracked":
        return False
    try:
        module = model.get_submodule(owner)
    except AttributeError:
        return False
    return isinstance(module, nn.modules.batchnorm._NormBase)


def _renames(model_names: Iterable[str], keys: Iterable[str]) -> list[Rename]:
    def first(names: Iterable[str]) -> set[str]:
        found = {n.split(".", 1)[0] for n in names if "." in n}
        # Wrappers nest (DDP around torch.compile: 'module._orig_mod.'): two names every key shares.
        shared = {".".join(n.split(".", 2)[:2]) if n.count(".") >= 2 else n for n in names}
        return found | shared if len(shared) == 1 and len(found) == 1 else found

    def strip(p: str) -> Callable[[str], str]:
        return lambda k: k[len(p) + 1 :] if k.startswith(p + ".") else k

    def add(p: str) -> Callable[[str], str]:
        return lambda k: f"{p}.{k}"

    options: list[Rename] = [("as saved", lambda k: k)]
    options += [(f"without the prefix '{p}.'", strip(p)) for p in sorted(first(keys))]
    options += [(f"with the prefix '{p}.'", add(p)) for p in sorted(first(model_names))]
    return options


def _best_rename(
    expected: Mapping[str, torch.Tensor], keys: Mapping[str, Stored], conversion: Conversion | None
) -> Rename:
    names = set(expected)
    options = _renames(names, keys)
    if conversion is not None and any(k != n for k, n in conversion.renames.items()):
        table = (
            conversion.renames
        )  # transformers' renames come second: they win over "as saved" if they match more
        options.insert(1, (f"with transformers' renames for {conversion.family}", lambda k: table.get(k, k)))
    scored = [
        (sum(rename(k) in names for k in keys), -i, (how, rename)) for i, (how, rename) in enumerate(options)
    ]
    return max(scored, key=lambda s: (s[0], s[1]))[2]


def _drop(names: list[str], patterns: Sequence[str] | None) -> list[str]:
    if not patterns:
        return names
    return [n for n in names if not any(re.search(p, n) for p in patterns)]


def _shape_mismatches(
    expected: Mapping[str, torch.Tensor], sources: Mapping[str, str], checkpoint: Checkpoint
) -> list[str]:
    found: list[str] = []
    for name, key in sources.items():
        stored, model_shape = checkpoint.tensors[key].shape, tuple(expected[name].shape)
        if stored != model_shape and all(not f.startswith(f"'{key}'") for f in found):
            found.append(f"'{key}' is {list(stored)} in the checkpoint, {list(model_shape)} in the model")
    return found


def _built_mismatches(
    expected: Mapping[str, torch.Tensor], built: Mapping[str, tuple[Recipe, str]]
) -> list[str]:
    found: list[str] = []
    for name, (recipe, target) in built.items():
        made, model_shape = recipe.targets[target][0], tuple(expected[name].shape)
        if made != model_shape and name == target:
            found.append(
                f"'{target}' is {list(made)} as transformers' conversion builds it from "
                f"{len(recipe.sources)} checkpoint tensors, {list(model_shape)} in the model"
            )
    return found


def _mismatch_message(
    model: nn.Module,
    checkpoint: Checkpoint,
    how: str,
    missing: list[str],
    unexpected: list[str],
    shapes: list[str],
    converted: str | None = None,
) -> str:
    parts = []
    if missing:
        parts.append(f"{len(missing)} tensor(s) of the model are missing from it, first {missing[:3]}")
    if unexpected:
        parts.append(f"{len(unexpected)} key(s) in it are not in the model, first {unexpected[:3]}")
    if shapes:
        parts.append(f"{len(shapes)} tensor(s) have another shape, first {'; '.join(shapes[:3])}")
    how = f"{how}; {converted}" if converted else how
    if missing and SHARD.search(checkpoint.path.name):
        fix = (
            f"{checkpoint.path.name} is one shard of a sharded checkpoint: pass its folder "
            f"({checkpoint.path.parent}) or its *.index.json"
        )
    elif missing or shapes:
        fix = "Build the model from the config the checkpoint was saved with, or load a checkpoint of this architecture"
    else:
        fix = "strict=False skips keys the model lacks (as accelerate does)"
    return (
        f"checkpoint {checkpoint.path} does not match {type(model).__name__} (keys read {how}): "
        + "; ".join(parts)
        + f". {fix}"
    )


SHARD = re.compile(r"-\d{5}-of-\d{5}\.")  # model-00001-of-00004.safetensors: one of several


def _apart(names: Sequence[str], renamed: Mapping[str, str], checkpoint: Checkpoint) -> list[list[str]]:
    """Tied ``names`` grouped by the values the checkpoint holds for them (a head trained apart
    from the embedding while the config still ties them): one group per distinct value, the
    names without a key of their own in the first."""
    groups: list[tuple[str, list[str]]] = []  # a key with its value, and the names holding it
    for name in names:
        key = renamed.get(name)
        if key is None:
            continue
        group = next((g for k, g in groups if k == key or checkpoint.same_values(k, key)), None)
        if group is None:
            groups.append((key, [name]))
        else:
            group.append(name)
    if len(groups) > 1:
        groups[0][1].extend(n for n in names if n not in renamed)
    return [g for _, g in groups]


def untie(model: nn.Module, groups: Sequence[Sequence[str]]) -> None:
    """Give each group of names a tensor of its own (on meta, as a skeleton's), which they
    share, so that it is filled from its own key."""
    for names in groups:
        fresh: torch.Tensor | None = None
        for name in names:
            owner_name, _, leaf = name.rpartition(".")
            owner = model.get_submodule(owner_name)
            table = owner._parameters if owner._parameters.get(leaf) is not None else owner._buffers
            old = table[leaf]
            if fresh is None:
                fresh = torch.empty_like(old, device="meta")
                fresh = nn.Parameter(fresh, old.requires_grad) if isinstance(old, nn.Parameter) else fresh
            table[leaf] = fresh
