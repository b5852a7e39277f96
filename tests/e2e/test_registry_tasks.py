"""Breadth beyond causal LMs: every family of transformers' registry for three more tasks —
sequence-to-sequence LMs (greedy ``generate``: encoder, decoder and cache), image classification
and masked LMs (encoders) — built from small configs with random weights (tests/tiny_configs.py),
dispatched by ``device_map="auto"`` with a CPU budget that sends part of each to disk. Each gives
the plain model's outputs exactly.

The families that do not build or run small are listed per task in :data:`UNTESTED_SEQ2SEQ`,
:data:`UNTESTED_IMAGE` and :data:`UNTESTED_MASKED`, each with what transformers said
(transformers 5.25.0): a family listed builds and runs again, or leaves the registry, and
``test_the_untested_families_are_those_that_do_not_build_small`` says so."""

from __future__ import annotations

import warnings
from typing import Callable

import pytest
import torch

import automap
from tiny_configs import part_on_disk, run_dispatched, tiny

# All 38 families tested (Voxtral Realtime's generate reads audio features beside its prompt).
UNTESTED_SEQ2SEQ: dict[str, str] = {}

# All 42 families tested (DiNAT where natten before 0.20 is; ShieldGemma 2 reads a prompt beside
# its image).
UNTESTED_IMAGE: dict[str, str] = {}

# All 51 families tested (ESM's default config leaves its vocabulary and padding token to its
# checkpoints: tiny_configs.py gives it both).
UNTESTED_MASKED: dict[str, str] = {}

# Families that need a package transformers does not require, as the module and the name
# transformers imports from it: skipped without them. DiNAT's kernels are natten's before 0.20
# (0.20 dropped natten2dav: PyPI's 0.21 installs but lacks it; 0.17.5 is source only, and its
# C++17 build fails on torch 2.14's headers, which need C++20).
NEEDS = {"dinat": ("natten.functional", "natten2dav")}

SEQ2SEQ = ("MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "AutoModelForSeq2SeqLM")
IMAGE = ("MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES", "AutoModelForImageClassification")
MASKED = ("MODEL_FOR_MASKED_LM_MAPPING_NAMES", "AutoModelForMaskedLM")


def _registry(mapping: str) -> list[str]:
    import transformers.models.auto.modeling_auto as auto

    return sorted(getattr(auto, mapping))


def _tested(task: tuple[str, str], untested: dict[str, str]) -> list[str]:
    return [family for family in _registry(task[0]) if family not in untested]


def _seed() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def _ids(length: int) -> torch.Tensor:
    return torch.randint(3, 100, (2, length), generator=_seed())


def _audio(config, tokens: int) -> dict[str, torch.Tensor]:
    """Voxtral Realtime streams its audio beside the tokens: log-mel frames, two per encoder
    position (its second convolution's stride), ``downsample_factor`` positions per token, for
    the prompt and each token generated."""
    frames = 2 * config.downsample_factor * tokens
    mels = config.audio_config.num_mel_bins
    return {"input_features": torch.randn(2, mels, frames, generator=_seed())}


SEQ2SEQ_INPUTS = {"voxtral_realtime": _audio}


def _generate(model: torch.nn.Module) -> Callable[[torch.nn.Module], torch.Tensor]:
    ids = _ids(6)
    options = dict(max_new_tokens=3, do_sample=False, attention_mask=torch.ones_like(ids), pad_token_id=0)
    if model.config.model_type in SEQ2SEQ_INPUTS:
        options |= SEQ2SEQ_INPUTS[model.config.model_type](
            model.config, ids.shape[1] + options["max_new_tokens"]
        )
    start = model.generation_config
    if start.decoder_start_token_id is None and start.bos_token_id is None:
        # T5's default config (and BERT2BERT's) leaves the decoder's first token to its
        # checkpoints; T5's start from the pad token
        options["decoder_start_token_id"] = 0
    return lambda m: m.generate(ids, **options)


def _pixels(config) -> dict[str, torch.Tensor]:
    size = getattr(config, "image_size", 224)
    size = size if isinstance(size, int) else size[0]
    return {"pixel_values": torch.randn(1, getattr(config, "num_channels", 3), size, size, generator=_seed())}


def _colour_clusters(config) -> dict[str, torch.Tensor]:
    """ImageGPT reads an image as the ids of its pixels' colour clusters (the last id starts it)."""
    return {"input_ids": torch.randint(0, config.vocab_size - 1, (1, 16), generator=_seed())}


def _patches(config) -> dict[str, torch.Tensor]:
    """SigLIP 2 (NaFlex) reads an image as flattened patches, a mask over them and their grid."""
    vision = config.vision_config
    side = int(vision.num_patches**0.5)
    width = vision.num_channels * vision.patch_size**2
    return {
        "pixel_values": torch.randn(1, side * side, width, generator=_seed()),
        "pixel_attention_mask": torch.ones(1, side * side, dtype=torch.long),
        "spatial_shapes": torch.tensor([[side, side]]),
    }


def _prompt_and_image(config) -> dict[str, torch.Tensor]:
    """ShieldGemma 2 answers a prompt about the image: the image's placeholder tokens (one per
    pooled patch, where the vision tower's features go) and the prompt's."""
    image = torch.full((1, config.mm_tokens_per_image), config.image_token_index)
    prompt = torch.randint(3, 100, (1, 4), generator=_seed())
    return {"input_ids": torch.cat([image, prompt], dim=1)} | _pixels(config.vision_config)


IMAGE_INPUTS = {"imagegpt": _colour_clusters, "siglip2": _patches, "shieldgemma2": _prompt_and_image}


def _classify(model: torch.nn.Module) -> Callable[[torch.nn.Module], torch.Tensor]:
    inputs = IMAGE_INPUTS.get(model.config.model_type, _pixels)(model.config)
    return lambda m: m(**inputs)[0]  # the scores: logits (PP-LCNet calls them last_hidden_state)


def _fill(model: torch.nn.Module) -> Callable[[torch.nn.Module], torch.Tensor]:
    ids = _ids(8)
    return lambda m: m(input_ids=ids).logits


def _plain(family: str, task: tuple[str, str], call) -> tuple[torch.nn.Module, Callable, torch.Tensor]:
    """The small model, its call and the plain model's outputs."""
    if family in NEEDS:
        module, name = NEEDS[family]
        if not hasattr(pytest.importorskip(module, reason=f"{family} needs {module}"), name):
            pytest.skip(f"{family} needs {module}.{name} (natten before 0.20)")
    model = tiny(family, task[1])
    run = call(model)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model, run, run(model)


def _same_on_disk(family: str, task: tuple[str, str], call, tmp_path) -> None:
    try:
        model, run, expected = _plain(family, task, call)
    except pytest.skip.Exception as exc:
        if family in NEEDS:
            raise
        pytest.fail(f"{family} no longer builds small: {exc.msg}")
    automap.dispatch(model, device_map="auto", max_memory=part_on_disk(model), offload_dir=tmp_path)
    assert torch.equal(run_dispatched(model, run), expected)


@pytest.mark.parametrize(
    "task,untested,call",
    [
        (SEQ2SEQ, UNTESTED_SEQ2SEQ, _generate),
        (IMAGE, UNTESTED_IMAGE, _classify),
        (MASKED, UNTESTED_MASKED, _fill),
    ],
    ids=["seq2seq", "image", "masked"],
)
def test_the_untested_families_are_those_that_do_not_build_small(task, untested, call):
    """Each listed family is still in the task's registry and still fails without automap (else
    test it); every other family builds and runs (its test below says so)."""
    import transformers

    gone = sorted(set(untested) - set(_registry(task[0])))
    assert not gone, f"transformers {transformers.__version__} dropped these: take them off the list: {gone}"
    building = []
    for family in sorted(untested):
        try:
            _plain(family, task, call)
        except (Exception, pytest.skip.Exception):  # noqa: BLE001 - any failure keeps it listed
            continue
        building.append(family)
    assert not building, (
        f"these build and run small with transformers {transformers.__version__}: test them: {building}"
    )


@pytest.mark.parametrize("family", _tested(SEQ2SEQ, UNTESTED_SEQ2SEQ))
def test_each_seq2seq_family_generates_the_plain_tokens_with_part_on_disk(family, tmp_path):
    _same_on_disk(family, SEQ2SEQ, _generate, tmp_path)


@pytest.mark.parametrize("family", _tested(IMAGE, UNTESTED_IMAGE))
def test_each_image_classification_family_gives_the_plain_logits_with_part_on_disk(family, tmp_path):
    _same_on_disk(family, IMAGE, _classify, tmp_path)


@pytest.mark.parametrize("family", _tested(MASKED, UNTESTED_MASKED))
def test_each_masked_lm_family_gives_the_plain_logits_with_part_on_disk(family, tmp_path):
    _same_on_disk(family, MASKED, _fill, tmp_path)
