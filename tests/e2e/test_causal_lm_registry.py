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

A family whose own plain model cannot build or run from the small config (sizes that must
agree with others the shrinking does not know, required inputs beyond ``input_ids``) is skipped
with what it said: only automap's part can fail here."""

from __future__ import annotations

import warnings

import pytest
import torch

import automap
from test_moe_families import FAMILIES as MOE_FAMILIES
from tiny_configs import part_on_disk, run_dispatched, tiny


def _families() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) - set(MOE_FAMILIES))


def _plain(family: str) -> tuple[torch.nn.Module, torch.Tensor, dict, torch.Tensor, torch.Tensor]:
    try:
        model = tiny(family)
    except pytest.skip.Exception:
        raise
    except Exception as exc:  # noqa: BLE001 - the family's own config or model refused the small sizes
        pytest.skip(f"{family} does not build from a small config: {type(exc).__name__}: {str(exc)[:200]}")
    vocab = min(getattr(model.config, "vocab_size", 128) or 128, 128)
    ids = torch.randint(3, vocab, (2, 6), generator=torch.Generator().manual_seed(0))
    generate = dict(attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False, pad_token_id=0)
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return model, ids, generate, model(input_ids=ids).logits, model.generate(ids, **generate)
    except Exception as exc:  # noqa: BLE001 - the plain model itself does not run so
        pytest.skip(
            f"{family}'s plain model does not run from a small config: {type(exc).__name__}: {str(exc)[:200]}"
        )


def _saved(family: str, tmp_path):
    """The small model saved by ``save_pretrained`` in small shards, and what transformers'
    ``from_pretrained`` of that folder computes (logits, greedy tokens)."""
    import transformers

    model, ids, generate, _, _ = _plain(family)
    folder = tmp_path / "saved"
    try:
        model.save_pretrained(folder, max_shard_size="200KB")
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            reference = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
            expected, tokens = reference(input_ids=ids).logits, reference.generate(ids, **generate)
    except Exception as exc:  # noqa: BLE001 - transformers itself cannot save or reload this small config
        pytest.skip(
            f"transformers does not save and reload {family} from a small config: {type(exc).__name__}: "
            f"{str(exc)[:200]}"
        )
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
    import transformers

    model, ids, _, folder, _, _ = _saved(family, tmp_path)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = (
            transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
            .eval()(input_ids=ids)
            .logits
        )
    loaded = automap.load(
        folder,
        dtype=torch.bfloat16,
        max_memory=part_on_disk(model, torch.bfloat16),
        offload_dir=tmp_path / "off",
        quiet=True,
    )
    assert torch.equal(run_dispatched(loaded, lambda m: m(input_ids=ids).logits), expected)


@pytest.mark.parametrize("family", _families())
def test_each_family_loads_through_accelerates_script_on_the_drop_ins(family, tmp_path):
    import transformers
    from accelerate.utils import check_device_map

    from automap.accelerate_compat import (
        infer_auto_device_map,
        init_empty_weights,
        load_checkpoint_and_dispatch,
    )

    model, ids, generate, folder, expected, tokens = _saved(family, tmp_path)
    with init_empty_weights():
        empty = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(folder))
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
