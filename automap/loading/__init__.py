"""Loading checkpoints larger than memory: the parts :func:`automap.load` puts together.

Readers per format (:mod:`~automap.loading.checkpoint`), key matching
(:mod:`~automap.loading.keys`) with transformers' own checkpoint conversions
(:mod:`~automap.loading.convert`), skeletons on meta (:mod:`~automap.loading.empty`), models built
from a Hugging Face folder's config (:mod:`~automap.loading.hf`) and streaming every tensor to
its place (:mod:`~automap.loading.materialise`).
"""

from automap.loading.checkpoint import (
    READERS,
    Checkpoint,
    PickleReader,
    Reader,
    SafetensorsReader,
    Stored,
    open_checkpoint,
)
from automap.loading.empty import empty_model
from automap.loading.hf import build_from_folder
from automap.loading.hf_config import is_model_folder
from automap.loading.keys import Match, match_keys
from automap.loading.convert import Conversion, Recipe, conversion_for
from automap.loading.materialise import (
    Loaded,
    Task,
    log_summary,
    materialise,
    noted,
    offloaded_names,
    plan_tasks,
    verify_loaded,
)

__all__ = [
    "READERS",
    "Checkpoint",
    "Conversion",
    "Loaded",
    "Match",
    "PickleReader",
    "Reader",
    "Recipe",
    "SafetensorsReader",
    "Stored",
    "Task",
    "build_from_folder",
    "conversion_for",
    "empty_model",
    "is_model_folder",
    "log_summary",
    "match_keys",
    "materialise",
    "noted",
    "offloaded_names",
    "open_checkpoint",
    "plan_tasks",
    "verify_loaded",
]
