"""Breadth beyond causal LMs: every family of transformers' registry for three more tasks —
sequence-to-sequence LMs (greedy ``generate``: encoder, decoder and cache), image classification
(``pixel_values``) and masked LMs (encoders) — built from small configs with random weights
(tests/tiny_configs.py), dispatched by ``device_map="auto"`` with a CPU budget that sends part
of each to disk. Each gives the plain model's outputs exactly. A family whose plain model cannot
build or run from the small config is skipped with what it said."""

from __future__ import annotations

import warnings
from typing import Callable

import pytest
import torch

import automap
from tiny_configs import part_on_disk, run_dispatched, tiny


def _families(mapping: str) -> list[str]:
    import transformers.models.auto.modeling_auto as auto

    return sorted(getattr(auto, mapping))


def _build(family: str, auto: str) -> torch.nn.Module:
    try:
        return tiny(family, auto)
    except pytest.skip.Exception:
        raise
    except Exception as exc:  # noqa: BLE001 - the family's own config or model refused the small sizes
        pytest.skip(f"{family} does not build from a small config: {type(exc).__name__}: {str(exc)[:200]}")


def _same_on_disk(model: torch.nn.Module, call: Callable[[torch.nn.Module], torch.Tensor], tmp_path) -> None:
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            expected = call(model)
    except Exception as exc:  # noqa: BLE001 - the plain model itself does not run so
        pytest.skip(
            f"the plain model does not run from a small config: {type(exc).__name__}: {str(exc)[:200]}"
        )
    automap.dispatch(model, device_map="auto", max_memory=part_on_disk(model), offload_dir=tmp_path)
    assert torch.equal(run_dispatched(model, call), expected)


def _ids(length: int) -> torch.Tensor:
    return torch.randint(3, 100, (2, length), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("family", _families("MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES"))
def test_each_seq2seq_family_generates_the_plain_tokens_with_part_on_disk(family, tmp_path):
    model, ids = _build(family, "AutoModelForSeq2SeqLM"), _ids(6)
    options = dict(max_new_tokens=3, do_sample=False, attention_mask=torch.ones_like(ids), pad_token_id=0)
    _same_on_disk(model, lambda m: m.generate(ids, **options), tmp_path)


@pytest.mark.parametrize("family", _families("MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES"))
def test_each_image_classification_family_gives_the_plain_logits_with_part_on_disk(family, tmp_path):
    model = _build(family, "AutoModelForImageClassification")
    size = getattr(model.config, "image_size", 224)
    size = size if isinstance(size, int) else size[0]
    image = torch.randn(
        1, getattr(model.config, "num_channels", 3), size, size, generator=torch.Generator().manual_seed(0)
    )
    _same_on_disk(model, lambda m: m(pixel_values=image).logits, tmp_path)


@pytest.mark.parametrize("family", _families("MODEL_FOR_MASKED_LM_MAPPING_NAMES"))
def test_each_masked_lm_family_gives_the_plain_logits_with_part_on_disk(family, tmp_path):
    model, ids = _build(family, "AutoModelForMaskedLM"), _ids(8)
    _same_on_disk(model, lambda m: m(input_ids=ids).logits, tmp_path)
