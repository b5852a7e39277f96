"""A transformers ``config.json`` or ``generation_config.json`` a user gave, checked before anything
is built from it: read by the one reader of user files, its names and counting fields checked
(whole, bounded, core sizes >= 1), what transformers' own classes raise wrapped with the file named,
and the model measured on meta, never built on the CPU, to find its size.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from automap.errors import AutomapError
from automap.sizes import MAX_COUNT, parse_number, shown

# Fields that count something: their names, split at "_", hold one of these words, or start so.
_COUNT_WORDS = frozenset(
    (
        "size sizes dim dims layers heads positions embeddings experts channels labels length rank ctx "
        "embd inner layer head ff kv depths groups blocks filters"
    ).split()
)
_COUNT_PREFIXES = ("num_", "n_", "d_")
# The sizes every model of a family has: 1 or more (other counts may be -1, "the last layer").
_SIZES = frozenset(
    (
        "hidden_size num_hidden_layers num_attention_heads intermediate_size vocab_size n_embd n_layer "
        "n_head d_model num_layers num_heads max_position_embeddings n_positions num_key_value_heads "
        "embed_dim d_ff d_kv encoder_layers decoder_layers"
    ).split()
)
# Words that make a field something else, although a count word is in its name.
_NOT_COUNTS = frozenset(
    (
        "id ids ratio factor eps epsilon dropout prob std range scale type types act theta multiplier "
        "bias init norm pdrop rate mode name names fn implementation alpha beta temperature"
    ).split()
)


def is_count_field(name: str) -> bool:
    """Whether a config field ``name`` counts something (a size, a number of layers or heads)."""
    words = set(name.lower().split("_"))
    if words & _NOT_COUNTS:
        return False
    return bool(words & _COUNT_WORDS) or name.lower().startswith(_COUNT_PREFIXES)


def check_config_fields(data: Any, where: str, error: type[AutomapError]) -> dict[str, Any]:
    """``data`` (a parsed ``config.json``) if its shape is a config's.

    Raises:
        ``error``: ``data`` is not an object; ``architectures`` is not a list of names;
            ``model_type`` is not a name; a count field (:func:`is_count_field`, nested configs
            too) is a number that is not whole or beyond :data:`~automap.sizes.MAX_COUNT`, or
            a model's size below 1. The message
            names ``where``, the field and its value.
    """
    if not isinstance(data, dict):
        raise error(
            f"{where} holds a JSON {type(data).__name__}, not a config's object; save it again with "
            "save_pretrained"
        )
    architectures = data.get("architectures")
    if architectures is not None and (
        not isinstance(architectures, list)
        or not all(isinstance(a, str) and a.isidentifier() for a in architectures)
    ):
        raise error(
            f"{where}'s architectures={shown(architectures)} is not a list of class names such as "
            "['LlamaForCausalLM']; fix it or save the config again"
        )
    model_type = data.get("model_type")
    if model_type is not None and not isinstance(model_type, str):
        raise error(f"{where}'s model_type={shown(model_type)} is not a family name such as 'llama'")
    _check_counts(data, where, "", error)
    return data


def _check_counts(data: dict[str, Any], where: str, prefix: str, error: type[AutomapError]) -> None:
    for key, value in data.items():
        field = f"{prefix}{key}"
        if isinstance(value, dict):
            _check_counts(value, where, f"{field}.", error)
        elif is_count_field(str(key)):
            _check_count(value, field, where, error, 1 if key in _SIZES else -MAX_COUNT)


def _check_count(value: Any, field: str, where: str, error: type[AutomapError], minimum: int) -> None:
    """A number in a count field is a whole number in bounds; names and flags (GPT-Neo's
    ``attention_layers``, ``tie_word_embeddings``) are left to transformers' own checks."""
    if isinstance(value, list):
        for i, item in enumerate(value):
            _check_count(item, f"{field}[{i}]", where, error, minimum)
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    if isinstance(value, float) and value.is_integer() and abs(value) <= MAX_COUNT:
        value = int(value)
    parse_number(
        value,
        f"{where}'s {field}",
        integral=True,
        minimum=minimum,
        maximum=MAX_COUNT,
        error=error,
        hint=f"a count or size is a whole number from {minimum:,} to {MAX_COUNT:,}; fix the config",
    )


# A generation config's numbers that are no counts: each a number >= 0 when given.
_GENERATION_NUMBERS = frozenset(
    (
        "temperature top_p top_k min_p typical_p repetition_penalty length_penalty diversity_penalty "
        "epsilon_cutoff eta_cutoff encoder_repetition_penalty"
    ).split()
)
_GENERATION_FLAGS = frozenset(
    ("do_sample use_cache output_scores return_dict_in_generate renormalize_logits").split()
)


def check_generation_fields(data: Any, where: str, error: type[AutomapError]) -> dict[str, Any]:
    """``data`` (a parsed ``generation_config.json``) if its shape is a generation config's:
    its counts (``max_length``, ``num_beams``, ``max_new_tokens``, ...) whole numbers from 0 to
    :data:`~automap.sizes.MAX_COUNT` or None, its sampling settings numbers >= 0, its flags
    booleans. transformers reads such a file without these checks and fails at ``generate``.

    Raises:
        ``error``: which field is wrong, in ``where``.
    """
    if not isinstance(data, dict):
        raise error(f"{where} holds a JSON {type(data).__name__}, not a generation config's object")
    for key, value in data.items():
        if value is None or key.startswith("_"):  # transformers' own bookkeeping (_from_model_config)
            continue
        if is_count_field(key) and not isinstance(value, (list, dict)):
            parse_number(
                value,
                f"{where}'s {key}",
                integral=True,
                maximum=MAX_COUNT,
                error=error,
                hint=f"a count is a whole number from 0 to {MAX_COUNT:,}; fix the file or remove it",
            )
        elif key in _GENERATION_NUMBERS:
            parse_number(
                value,
                f"{where}'s {key}",
                maximum=MAX_COUNT,
                error=error,
                hint="a sampling setting is a number >= 0; fix the file or remove it",
            )
        elif key in _GENERATION_FLAGS and not isinstance(value, bool):
            raise error(f"{where}'s {key}={shown(value)} is not true or false; fix the file or remove it")
    return data


def config_from_fields(data: dict[str, Any], where: str, error: type[AutomapError]) -> Any:
    """The transformers config ``data`` (checked by :func:`check_config_fields`) describes, built
    by its own config class (``from_dict``, as ``from_pretrained`` does), whose checks (strict
    field types, a ``rope_scaling`` type it knows) raise ``error`` naming ``where``."""
    import transformers

    model_type = data.get("model_type")
    if model_type not in transformers.CONFIG_MAPPING:
        raise error(
            f"{where} has model_type {shown(model_type)}, which this transformers "
            f"({transformers.__version__}) does not know; a transformers config.json names its family in "
            "'model_type'"
        )
    config_class = transformers.CONFIG_MAPPING[model_type]
    # transformers writes floats JSON lacks as {"__float__": "Infinity"} and reads them back so
    # (Falcon-H1's time_step_limit): decoded by its own method, as from_pretrained does.
    decode = getattr(config_class, "_decode_special_floats", lambda value: value)
    return wrapped(lambda: config_class.from_dict(decode(dict(data))), where, error)


def wrapped(make: Callable[[], Any], where: str, error: type[AutomapError]) -> Any:
    """``make()``, any exception a library raises from a hostile config wrapped into ``error``."""
    try:
        return make()
    except AutomapError:
        raise
    except (Exception, RecursionError) as exc:  # noqa: BLE001 - a library's validation, one line
        reason = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
        raise error(
            f"{where} is not a config transformers accepts ({reason}); fix it or save it again with "
            "save_pretrained"
        ) from None


def measure_on_meta(
    build: Callable[[], nn.Module | None], where: str, error: type[AutomapError]
) -> tuple[int, int]:
    """``(largest tensor's bytes, all tensors' bytes)`` of the model ``build`` makes, built under
    the meta device (nothing allocated, whatever sizes the config gives); a failure of the build
    (a negative size, an unknown ``rope_scaling`` type) is ``error`` naming ``where``."""

    def measured() -> tuple[int, int]:
        with torch.device("meta"):
            model = build()
        if model is None:
            return 0, 0
        sizes = [t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers())]
        return max(sizes, default=0), sum(sizes)

    result: tuple[int, int] = wrapped(measured, where, error)
    return result
