"""transformers' checkpoint conversions (renames, experts merged into fused tensors) as
:class:`Recipe` objects: which checkpoint tensors, through which of transformers' own operations,
build each tensor of the model. No rule here is written for a family.
"""

from __future__ import annotations

import copy
import logging
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
from torch import nn

from automap.errors import CheckpointError
from automap.loading.checkpoint import Stored

log = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class Recipe:
    """One group of model tensors that a transformers converter builds from checkpoint tensors.

    Attributes:
        targets: the model tensors it builds, by name, with their shape and dtype (learned by
            running it on meta tensors shaped like the checkpoint's).
        sources: the checkpoint keys it reads, each with the source pattern it matched, in the
            order transformers collects them (experts 0, 1, 2, ...).
        converter: transformers' ``WeightConverter`` for the group, used as a template.
        first: the name transformers keys the group by (the first source's renamed key).
        model: the model it builds for (an operation may read its config).
    """

    targets: dict[str, tuple[tuple[int, ...], torch.dtype]]
    sources: tuple[tuple[str, str], ...]
    converter: Any = field(repr=False)
    first: str = ""
    model: nn.Module | None = field(default=None, repr=False)

    def build(self, read: Callable[[str], torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every target, from the source tensors ``read`` gives (one call per source key).

        Raises:
            CheckpointError: transformers' operation failed on these tensors.
        """
        converter = copy.deepcopy(self.converter)
        for key, pattern in self.sources:
            converter.add_tensor(self.first, key, pattern, read(key))
        try:
            built = converter.convert(
                self.first, model=self.model, config=getattr(self.model, "config", None)
            )
        except Exception as exc:  # noqa: BLE001 - any failure of a third-party op means the same here
            raise CheckpointError(
                f"transformers' conversion {_ops(self.converter)} failed building {self.first!r} from "
                f"{len(self.sources)} checkpoint tensor(s), first {[k for k, _ in self.sources[:3]]} "
                f"({type(exc).__name__}: {exc}); the checkpoint was saved by another transformers version or "
                "for another config: load it with the transformers that saved it and save_pretrained it again"
            ) from exc
        return {name: value[0] if isinstance(value, list) else value for name, value in built.items()}


@dataclass(frozen=True)
class Conversion:
    """What transformers' conversion mapping does to one checkpoint for one model.

    Attributes:
        family: whose mapping it is (the model's ``model_type``), for messages.
        renames: checkpoint key -> model name, for keys only renamed.
        recipes: the merges; each checkpoint key is read by at most one of them.
    """

    family: str
    renames: dict[str, str]
    recipes: tuple[Recipe, ...]

    @property
    def consumed(self) -> set[str]:
        """The checkpoint keys that recipes read."""
        return {key for recipe in self.recipes for key, _ in recipe.sources}

    def summary(self) -> str | None:
        """One line for reports: what was converted, and by whom. None when nothing was."""
        renamed = sum(key != name for key, name in self.renames.items())
        if not self.recipes and not renamed:
            return None
        built = sum(len(r.targets) for r in self.recipes)
        parts = (
            [f"{built} tensors built from {len(self.consumed)} checkpoint tensors"] if self.recipes else []
        )
        parts += [f"{renamed} keys renamed"] if renamed else []
        return f"converted at load: {', '.join(parts)} (transformers' conversion for {self.family})"


def conversion_for(model: nn.Module, stored: Mapping[str, Stored]) -> Conversion | None:
    """transformers' conversion of the checkpoint tensors ``stored`` into ``model``'s names.

    None when ``model`` is not a transformers model, or this transformers has no conversion
    machinery. Reads no weight: recipes are sized by running them on meta tensors.

    Raises:
        CheckpointError: transformers could not give the model's conversion mapping.
    """
    api = _machinery()
    if api is None or not isinstance(model, api["PreTrainedModel"]):
        return None
    try:
        transforms = api["get_model_conversion_mapping"](model)
    except Exception as exc:  # noqa: BLE001 - transformers' own validation, reported in one line
        raise CheckpointError(
            f"transformers could not give the checkpoint conversion of {type(model).__name__} "
            f"({type(exc).__name__}: {exc}); build the model with the transformers version that "
            "saved the checkpoint"
        ) from exc
    renames, groups = _pair_keys(model, stored, transforms, api)
    family = str(getattr(getattr(model, "config", None), "model_type", None) or type(model).__name__)
    recipes = tuple(
        _recipe(model, first, converter, sources, stored) for first, (converter, sources) in groups.items()
    )
    return Conversion(family, renames, recipes)


def _machinery() -> dict[str, Any] | None:
    """transformers' conversion API, if transformers is imported (a transformers model exists)
    and is a release that has it; automap never imports transformers for a model of its own."""
    if "transformers" not in sys.modules:
        return None
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, dot_natural_key, rename_source_key
    except ImportError:  # transformers 4: checkpoints load as saved
        return None
    return {
        "PreTrainedModel": PreTrainedModel,
        "get_model_conversion_mapping": get_model_conversion_mapping,
        "WeightConverter": WeightConverter,
        "dot_natural_key": dot_natural_key,
        "rename_source_key": rename_source_key,
    }


Groups = dict[str, tuple[Any, list[tuple[str, str]]]]


def _pair_keys(
    model: nn.Module, stored: Mapping[str, Stored], transforms: list[Any], api: dict[str, Any]
) -> tuple[dict[str, str], Groups]:
    """Each checkpoint key renamed as ``from_pretrained`` renames it (transformers' function,
    same order, same fallbacks); keys a converter matched are grouped by their first target."""
    converters = [t for t in transforms if isinstance(t, api["WeightConverter"])]
    renamings = [t for t in transforms if not isinstance(t, api["WeightConverter"])]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    names = model.state_dict()  # on meta: names only
    prefix, rename = getattr(model, "base_model_prefix", ""), api["rename_source_key"]
    renames: dict[str, str] = {}
    groups: Groups = {}
    for key in sorted(stored, key=api["dot_natural_key"]):
        renamed, pattern = rename(key, renamings, converters, prefix, names)
        if renamed not in names and key in names:
            renamed, pattern = rename(key, [], [], base_model_prefix=prefix, meta_state_dict=names)
        if renamed not in names:
            continue  # not the model's: automap's key matching reports it
        if pattern is None:
            renames[key] = renamed
        else:
            groups.setdefault(renamed, (by_pattern[pattern], []))[1].append((key, pattern))
    return renames, groups


def _recipe(
    model: nn.Module, first: str, converter: Any, sources: list[tuple[str, str]], stored: Mapping[str, Stored]
) -> Recipe:
    """A recipe, with the shape and dtype of each target learned from a run on meta tensors
    (transformers' operations stack, concatenate, split and transpose: all run on meta).

    Raises:
        CheckpointError: the operation fails on tensors of these shapes (an expert of another
            shape, a missing half of a pair), before anything is read.
    """
    recipe = Recipe({}, tuple(sources), converter, first, model)
    built = recipe.build(lambda key: torch.empty(stored[key].shape, dtype=stored[key].dtype, device="meta"))
    targets = {name: (tuple(t.shape), t.dtype) for name, t in built.items()}
    return Recipe(targets, tuple(sources), converter, first, model)


def _ops(converter: Any) -> str:
    return (
        "+".join(type(op).__name__ for op in getattr(converter, "operations", ())) or type(converter).__name__
    )
