"""Breadth for dense models nobody here wrote: every causal LM family in the installed
transformers' registry (the mixture-of-experts ones are test_moe_families.py's), built from its
default config with small sizes and random weights, dispatched by ``device_map="auto"`` with a
CPU budget that sends part of it to disk. Each gives the plain model's logits exactly and the
same greedy tokens through the KV cache, and the plain logits again after undispatch. Saved by
``save_pretrained`` in small shards, each loads with ``automap.load(folder)`` (part on disk, read
from the shards in place) to exactly what transformers' ``from_pretrained`` of the same folder
computes: both read the shards' bytes where they are (and in bfloat16); the same with accelerate's script
(``init_empty_weights``, ``infer_auto_device_map``, ``load_checkpoint_and_dispatch``) run on
automap's drop-ins, whose map passes accelerate's own ``check_device_map``. (Against the model that was saved, a
weight read from a file offset less aligned than torch's allocator's may round differently in
some kernels, ~1e-7; ``from_pretrained`` shows the same.)

The families that do not build or run small are listed in :data:`UNTESTED`, each with what
transformers said (transformers 5.25.0): a family listed builds again, or one not listed stops
building, and ``test_the_untested_families_are_those_that_do_not_build_small`` says so. Every
other family saves and reloads; those whose bfloat16 model transformers itself cannot run on a
CPU are listed in :data:`UNTESTED_BFLOAT16`, and their bfloat16 test checks that it still fails."""

from __future__ import annotations

import warnings

import pytest
import torch

import automap
from test_moe_families import FAMILIES as MOE_FAMILIES
from tiny_configs import part_on_disk, run_dispatched, tiny


# What transformers raises for each of the 11 families this file cannot test, with the small sizes
# of tiny_configs.py: its own default config is incomplete or invalid (the first nine, through
# gemma4_assistant, whose default fails transformers' own validation; each fails the same at full
# size on the meta device), the model runs only inside its main model (gemma4_unified_assistant),
# or its forward fails whatever the sizes (blt: its cache is built from the top config, which has
# no layers of its own; the full-size default too).
UNTESTED = {
    "cohere_compass_text": "KeyError: 'full_attention' (its default config has no rope parameters per layer type)",
    "dbrx": "AttributeError: 'DbrxAttentionConfig' object has no attribute 'rope_theta'",
    "dots1": "TypeError: unsupported operand type(s) for *: 'int' and 'NoneType' (n_shared_experts is None)",
    "lfm2_moe": "TypeError: 'NoneType' object is not subscriptable (layer_types is None)",
    "qwen4_exp": "TypeError: unsupported operand type(s) for //: 'NoneType' and 'NoneType' (indexer sizes None)",
    "qwen4_exp_text": "TypeError: unsupported operand type(s) for //: 'NoneType' and 'NoneType' (indexer sizes None)",
    "musicgen": "AttributeError: 'MusicgenConfig' object has no attribute 'dropout' (no decoder config)",
    "musicgen_melody": "AttributeError: 'MusicgenMelodyConfig' object has no attribute 'dropout' (no decoder config)",
    "gemma4_assistant": "ValueError: hidden_size_per_layer_input must be 0, got 256",
    "gemma4_unified_assistant": "ValueError: inputs_embeds and shared_kv_states cannot be None (run by its main model)",
    "blt": "AttributeError: 'BltConfig' object has no attribute 'num_hidden_layers' (its forward's cache)",
}

# Saved and reloaded, the families whose bfloat16 model does not run in transformers itself on a
# CPU (from_pretrained(folder, dtype=torch.bfloat16)): a float32 tensor meets the bfloat16 weights.
UNTESTED_BFLOAT16 = {
    "reformer": "RuntimeError: mixed dtype (CPU): expect parameter to have scalar type of Float (its norms)",
    "xlnet": "RuntimeError: expected scalar type Float but found BFloat16 (its float32 relative positions)",
}


def _families() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) - set(MOE_FAMILIES))


def _plain(family: str) -> tuple[torch.nn.Module, torch.Tensor, dict, torch.Tensor, torch.Tensor]:
    if family in UNTESTED:
        pytest.skip(f"{family} does not build or run small: {UNTESTED[family]}")
    return _built(family)


def _built(family: str) -> tuple[torch.nn.Module, torch.Tensor, dict, torch.Tensor, torch.Tensor]:
    model = tiny(family)
    vocab = min(getattr(model.config, "vocab_size", 128) or 128, 128)
    ids = torch.randint(3, vocab, (2, 6), generator=torch.Generator().manual_seed(0))
    generate = dict(attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False, pad_token_id=0)
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return model, ids, generate, model(input_ids=ids).logits, model.generate(ids, **generate)
    except Exception as exc:  # noqa: BLE001 - the plain model itself does not run so
        raise RuntimeError(f"{family}'s plain model does not run small: {type(exc).__name__}: {exc}") from exc


def test_the_untested_families_are_those_that_do_not_build_small():
    """Each family of :data:`UNTESTED` still fails without automap (else test it), and the
    registry still has it; every other family builds and runs (its tests below say so)."""
    import transformers

    families = set(_families())
    building = []
    for family in sorted(UNTESTED):
        if family not in families:
            continue  # transformers dropped it (or it moved to the MoE sweep)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                _built(family)
        except (Exception, pytest.skip.Exception):  # noqa: BLE001 - any failure keeps it listed
            continue
        building.append(family)
    assert not building, (
        f"these build and run small with transformers {transformers.__version__}: test them: {building}"
    )


def _saved(family: str, tmp_path):
    """The small model saved by ``save_pretrained`` in small shards, and what transformers'
    ``from_pretrained`` of that folder computes (logits, greedy tokens). The class saved reads
    it back: a text model inside a multimodal family (Mllama's, Emu3's) saves a config that
    ``AutoModelForCausalLM`` does not map, though its ``architectures`` name the class."""
    model, ids, generate, _, _ = _plain(family)
    folder = tmp_path / "saved"
    model.save_pretrained(folder, max_shard_size="200KB")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = type(model).from_pretrained(folder).eval()
        expected, tokens = reference(input_ids=ids).logits, reference.generate(ids, **generate)
    return model, ids, generate, folder, expected, tokens


@pytest.mark.parametrize("family", _families())
def test_each_causal_lm_family_with_part_on_disk_gives_the_plain_outputs(family, tmp_path):
    model, ids, generate, expected, tokens = _plain(family)
    automap.dispatch(model, device_map="auto", max_memory=part_on_disk(model), offload_dir=tmp_path)
    got, again = run_dispatched(model, lambda m: (m(input_ids=ids).logits, m.generate(ids, **generate)))
    assert torch.equal(got, expected)
    assert torch.equal(again, tokens)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, expected)


@pytest.mark.parametrize("family", _families())
def test_each_family_saved_by_transformers_loads_as_from_pretrained_does(family, tmp_path):
    model, ids, generate, folder, expected, tokens = _saved(family, tmp_path)
    loaded = automap.load(folder, max_memory=part_on_disk(model), offload_dir=tmp_path / "off", quiet=True)
    got, again = run_dispatched(loaded, lambda m: (m(input_ids=ids).logits, m.generate(ids, **generate)))
    assert torch.equal(got, expected)
    assert torch.equal(again, tokens)


@pytest.mark.parametrize("family", _families())
def test_each_family_loads_in_bfloat16_as_from_pretrained_builds_it(family, tmp_path):
    """At ``dtype=bfloat16`` from_pretrained keeps what the model computes at init in the dtype
    it gives it, recomputes the buffers the checkpoint lacks in float32, and gives the config
    the dtype (Apertus' activation reads it): the folder form does the same."""
    model, ids, _, folder, _, _ = _saved(family, tmp_path)

    def expected() -> torch.Tensor:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return type(model).from_pretrained(folder, dtype=torch.bfloat16).eval()(input_ids=ids).logits

    if family in UNTESTED_BFLOAT16:
        with pytest.raises(RuntimeError):
            expected()
        pytest.skip(f"{family} in bfloat16 does not run in transformers itself: {UNTESTED_BFLOAT16[family]}")
    loaded = automap.load(
        folder,
        dtype=torch.bfloat16,
        max_memory=part_on_disk(model, torch.bfloat16),
        offload_dir=tmp_path / "off",
        quiet=True,
    )
    assert torch.equal(run_dispatched(loaded, lambda m: m(input_ids=ids).logits), expected())


@pytest.mark.parametrize("family", _families())
def test_each_family_loads_through_accelerates_script_on_the_drop_ins(family, tmp_path):
    from accelerate.utils import check_device_map

    from automap.accelerate_compat import (
        infer_auto_device_map,
        init_empty_weights,
        load_checkpoint_and_dispatch,
    )

    model, ids, generate, folder, expected, tokens = _saved(family, tmp_path)
    with init_empty_weights():
        empty = type(model)(type(model).config_class.from_pretrained(folder))
    empty.tie_weights()
    no_split = getattr(empty, "_no_split_modules", None)
    device_map = infer_auto_device_map(
        empty, max_memory=part_on_disk(model), no_split_module_classes=no_split
    )
    check_device_map(empty, device_map)  # accelerate's own reading: every name has a device
    loaded = load_checkpoint_and_dispatch(
        empty,
        str(folder),
        device_map=device_map,
        offload_folder=str(tmp_path / "off"),
        no_split_module_classes=no_split,
    )
    got, again = run_dispatched(
        loaded.eval(), lambda m: (m(input_ids=ids).logits, m.generate(ids, **generate))
    )
    assert torch.equal(got, expected)
    assert torch.equal(again, tokens)
