"""Checkpoints transformers converts when it loads them: saved by ``save_pretrained`` one expert
per tensor (and under older key names), built fused in memory. ``automap.load(folder)`` and the
drop-in ``load_checkpoint_and_dispatch``, with part of the model on disk, give the greedy
``generate`` tokens of ``from_pretrained(folder)`` — for Mixtral and Qwen2-MoE in every save
format, and for every mixture-of-experts family of transformers' conversion registry that builds
on a CPU from a tiny config; a Llava saved under its old key layout and a BERT with
``LayerNorm.gamma`` keys load like ``from_pretrained`` too; planning such a folder reads no weights; a checkpoint the
conversion cannot build fails with a CheckpointError before anything is loaded."""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import automap
from automap.accelerate_compat import init_empty_weights, load_checkpoint_and_dispatch
from automap.cli import main
from automap.errors import CheckpointError
from conftest import store_dirs, weight_bytes
from test_hf_folder import measure_plan_rss, save
from tiny_configs import beside_the_run, part_on_disk

transformers = pytest.importorskip("transformers")
conversion_mapping = pytest.importorskip("transformers.conversion_mapping")
core_model_loading = pytest.importorskip("transformers.core_model_loading")

# A tiny config for any family: each family takes the fields it has (2 layers, 4 experts, 2 per token).
TINY = dict(
    hidden_size=32,
    intermediate_size=64,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    head_dim=8,
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    vocab_size=128,
    max_position_embeddings=64,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
    kv_lora_rank=16,
    q_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=8,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)

# Mixture-of-experts families of the registry that do not build as a tiny causal LM on a CPU, and why
# (found by building each; a family that starts to build fails test_every_moe_family_is_tested).
_NO_CAUSAL_LM = (
    "transformers has no AutoModelForCausalLM class for this config (a multimodal model or a sub-config)"
)
NOT_BUILT = {
    **dict.fromkeys(
        [
            "deepseek_ocr2",
            "glm4v_moe",
            "glm5_next",
            "kimi_k25",
            "minimax_m3_vl",
            "mistral_large4_text",
            "qwen3_omni_moe",
            "qwen3_omni_moe_text",
            "qwen3_omni_moe_thinker",
        ],
        _NO_CAUSAL_LM,
    ),
    "dots1": "its config fails to build from the tiny fields (TypeError in its constructor)",
    "lfm2_moe": "its config fails to build from the tiny fields (TypeError in its constructor)",
    "dots3_note_vision_encoder": "its config keeps experts per layer (AmbiguousGlobalPerLayerAttributeError)",
    "glm5_next_text": "its config validator rejects the tiny architecture",
    "kolibri1_1": "its config validator rejects the tiny architecture",
    "mimo_v2_flash": "the plain tiny model's own forward fails (a head size of 0)",
}
# Families whose tiny config needs more layers: with 2, every layer is linear attention and generate fails.
CHANGES = {"qwen3_5_moe_text": {"num_hidden_layers": 4}, "qwen3_next": {"num_hidden_layers": 4}}
# Hybrid families whose plain tiny model cannot generate (a cache of linear-attention layers only): their
# greedy tokens are the argmax of one forward, and their configs say use_cache=False (so that planning's
# forward builds no such cache either).
ONE_STEP = {"bailing_hybrid", "jamba", "kimi_linear", "qwen4_exp_text"}


def moe_families() -> list[str]:
    """The model types whose conversion in transformers' registry merges per-expert tensors."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    merges = core_model_loading.MergeModulelist
    found = []
    for model_type in sorted(CONFIG_MAPPING_NAMES):
        transforms = conversion_mapping.get_checkpoint_conversion_mapping(model_type) or []
        if any(isinstance(op, merges) for t in transforms for op in getattr(t, "operations", ())):
            found.append(model_type)
    return found


def tiny(model_type: str) -> torch.nn.Module:
    default = transformers.AutoConfig.for_model(model_type)
    fields = {k: v for k, v in {**TINY, **CHANGES.get(model_type, {})}.items() if hasattr(default, k)}
    if model_type in ONE_STEP:
        fields["use_cache"] = False
    config = transformers.AutoConfig.for_model(model_type, **fields)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoModelForCausalLM.from_config(config).eval()


def greedy(model: torch.nn.Module, new: int = 4) -> list[list[int]]:
    ids = torch.randint(3, 128, (2, 6), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        if model.config.model_type in ONE_STEP:
            return model(ids, use_cache=False).logits.argmax(-1).tolist()
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False, pad_token_id=0
        )
    return out.tolist()


def reference(folder: Path) -> list[list[int]]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    return greedy(model)


def converted_keys(folder: Path, model: torch.nn.Module) -> bool:
    """Whether the saved keys differ from the model's names (transformers converts at load)."""
    saved = set()
    for file in folder.glob("*.safetensors"):
        saved |= set(load_file(file))
    for file in folder.glob("*.bin"):
        saved |= set(torch.load(file, weights_only=True))
    return saved != set(model.state_dict())


def load_both_ways(real: torch.nn.Module, folder: Path, tmp_path: Path) -> tuple[list, list]:
    """automap.load(folder) and the drop-in, each with part of the weights on disk."""
    budget = part_on_disk(real)
    model = automap.load(folder, max_memory=budget, offload_dir=tmp_path / "off", quiet=True)
    assert "disk" in automap.placement(model).placement
    by_load = greedy(model)
    automap.undispatch(model)
    with init_empty_weights():
        skeleton = type(real)(real.config)
    dropped = load_checkpoint_and_dispatch(
        skeleton.eval(), folder, device_map="auto", max_memory=budget, offload_folder=tmp_path / "off2"
    )
    assert "disk" in dropped.hf_device_map.values()
    by_dropin = greedy(dropped)
    automap.undispatch(dropped)
    return by_load, by_dropin


# ------------------------------------------------------------------ Mixtral and Qwen2-MoE, every format


@pytest.mark.parametrize("fmt", ["single", "sharded", "bin"])
@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe"])
def test_moe_folder_loads_like_from_pretrained(model_type, fmt, tmp_path, caplog):
    real = tiny(model_type)
    folder = save(real, tmp_path / "model", fmt)
    assert converted_keys(folder, real), "transformers saves experts one by one: the case this test is for"
    expected = reference(folder)
    with caplog.at_level(logging.INFO, logger="automap"):
        model = automap.load(folder, max_memory=part_on_disk(real), offload_dir=tmp_path / "off", quiet=True)
    assert greedy(model) == expected
    line = f"(transformers' conversion for {model_type})"
    assert any(line in c for c in automap.placement(model).choices), automap.placement(model).choices
    assert any(line in r.getMessage() for r in caplog.records)
    # merged experts of units on disk are written once, into a store of automap's own
    assert store_dirs(tmp_path / "off")
    automap.undispatch(model)
    _, by_dropin = load_both_ways(real, folder, tmp_path)
    assert by_dropin == expected


def test_resident_merges_are_built_and_equal_the_fused_weights(tmp_path):
    real = tiny("mixtral")
    folder = save(real, tmp_path / "model", "sharded")
    model = automap.load(folder, max_memory={"cpu": "1GB"}, quiet=True)  # all in RAM: no offload_dir needed
    for name, tensor in real.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name
    plan = automap.placement(model)
    assert set(plan.placement) == {"cpu"}
    line = next(c for c in plan.choices if "converted at load" in c)
    # 2 layers: gate_up_proj and down_proj, from 4 experts x (w1, w3) and 4 x w2; the routers are renamed
    assert "4 tensors built from 24 checkpoint tensors" in line and "2 keys renamed" in line, line


# ------------------------------------------------------------------ every MoE family of the registry


def test_every_moe_family_is_tested():
    families = moe_families()
    assert {"mixtral", "qwen2_moe"} <= set(families)
    assert set(NOT_BUILT) <= set(families), "a family left out is no longer in transformers' registry"
    assert len(families) - len(NOT_BUILT) >= 20


@pytest.mark.parametrize("model_type", [f for f in moe_families() if f not in NOT_BUILT])
def test_moe_family_loads_like_from_pretrained(model_type, tmp_path):
    real = tiny(model_type)
    fmt = "sharded" if sum(map(ord, model_type)) % 2 else "single"  # both forms, spread over the families
    folder = save(real, tmp_path / "model", fmt)
    expected = reference(folder)
    by_load, by_dropin = load_both_ways(real, folder, tmp_path)
    assert by_load == expected and by_dropin == expected


# ------------------------------------------------------------------ planning reads no weights


def test_plan_folder_reports_the_conversion_and_counts_the_built_tensors(capsys, tmp_path):
    real = tiny("qwen2_moe").to(torch.bfloat16)
    folder = save(real, tmp_path / "model", "sharded")
    cpu = beside_the_run(real, 50_000)  # part on disk
    budget = f"cpu={cpu},disk=1GB"
    code = main(["plan", str(folder), "--max-memory", budget, "--json", str(tmp_path / "p.json")])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "no weights read" in out and "converted at load:" in out and "conversion for qwen2_moe" in out, out
    plan = json.loads((tmp_path / "p.json").read_text())
    assert plan["devices"]
    from automap.spec_plan import plan_spec

    result = plan_spec(str(folder), max_memory={"cpu": "1GB"})
    assert sum(u.param_bytes for u in result.plan.units) == weight_bytes(real)  # bf16 as built, fused


@pytest.mark.slow
def test_plan_moe_folder_reads_no_weights_peak_rss_in_a_subprocess(tmp_path):
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        num_local_experts=8,
        num_experts_per_tok=2,
        vocab_size=4096,
    )
    folder = tmp_path / "mixtral"
    MixtralForCausalLM(config).save_pretrained(folder, max_shard_size="40MB")
    size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    assert size > 100e6
    tiny = tmp_path / "tiny"
    MixtralForCausalLM(
        MixtralConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            vocab_size=128,
        )
    ).save_pretrained(tiny)
    measured = measure_plan_rss(folder, "transformers.models.mixtral.modeling_mixtral", warm=tiny)
    assert "converted at load" in measured["report"]
    assert measured["read"] > 0.9 * size, f"the control must see the weights read: {measured}"
    assert measured["plan"] < size / 5, (
        f"planning grew RSS by {measured['plan']:,} bytes for a {size:,}-byte checkpoint"
    )


# ------------------------------------------------------------------ what cannot be built


def _rewrite(folder: Path, change) -> None:
    file = folder / "model.safetensors"
    tensors = load_file(file)
    change(tensors)
    file.unlink()
    save_file(tensors, file, metadata={"format": "pt"})


def test_missing_or_misshapen_expert_fails_before_loading(tmp_path):
    real = tiny("mixtral")
    folder = save(real, tmp_path / "model", "single")
    key = "model.layers.1.block_sparse_moe.experts.2.w1.weight"
    _rewrite(folder, lambda t: t.pop(key))
    with pytest.raises(CheckpointError, match=r"built from 11 checkpoint tensors|transformers' conversion"):
        automap.load(folder, max_memory={"cpu": "1GB"}, offload_dir=tmp_path / "off", quiet=True)
    folder = save(real, tmp_path / "model2", "single")
    _rewrite(folder, lambda t: t.update({key: torch.zeros(3, 32)}))
    with pytest.raises(CheckpointError, match="transformers' conversion .*failed building"):
        automap.load(folder, max_memory={"cpu": "1GB"}, offload_dir=tmp_path / "off", quiet=True)
    assert not store_dirs(tmp_path / "off")
    assert main(["plan", str(folder)]) == 1  # the plan reads the same headers and refuses too


def test_merged_tensors_on_disk_need_an_offload_dir(tmp_path):
    real = tiny("mixtral")
    folder = save(real, tmp_path / "model", "single")
    with pytest.raises(CheckpointError, match="merged by transformers' checkpoint conversion.*offload_dir"):
        automap.load(folder, max_memory=part_on_disk(real), quiet=True)


# ------------------------------------------------------------------ transformers' legacy renames


def test_legacy_gamma_beta_keys_load_like_from_pretrained(tmp_path):
    """A BERT checkpoint of the old layout (``LayerNorm.gamma``/``.beta``): transformers' "legacy"
    renames, which apply to every model, map them; automap reads them renamed, in place."""
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        vocab_size=128,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    real = BertForMaskedLM(config).eval()
    folder = save(real, tmp_path / "model", "single")
    old = {
        k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
        for k, v in load_file(folder / "model.safetensors").items()
    }
    assert sum("gamma" in k for k in old) >= 5
    _rewrite(folder, lambda t: (t.clear(), t.update(old)))
    ids = torch.randint(3, 128, (2, 8), generator=torch.Generator().manual_seed(2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = transformers.AutoModelForMaskedLM.from_pretrained(folder).eval()(ids).logits
    model = automap.load(folder, max_memory=part_on_disk(real), offload_dir=tmp_path / "off", quiet=True)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, expected.detach())
    assert any(
        "keys renamed (transformers' conversion for bert)" in c for c in automap.placement(model).choices
    )
    automap.undispatch(model)


def test_llava_saved_in_its_old_layout_loads_like_from_pretrained(tmp_path):
    """A non-MoE family of the registry: transformers saves Llava under its old key layout
    (``language_model.model.*``) and renames at load; so does automap."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    vision = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=16,
        patch_size=8,
    )
    text = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=128,
    )
    config = LlavaConfig(vision_config=vision.to_dict(), text_config=text.to_dict(), image_token_id=127)
    torch.manual_seed(0)
    real = LlavaForConditionalGeneration(config).eval()
    folder = save(real, tmp_path / "model", "single")
    assert converted_keys(folder, real)
    ids = torch.randint(0, 120, (2, 6), generator=torch.Generator().manual_seed(4))
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        expected = LlavaForConditionalGeneration.from_pretrained(folder).eval()(input_ids=ids).logits
    model = automap.load(folder, max_memory=part_on_disk(real), offload_dir=tmp_path / "off", quiet=True)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, expected)
    assert any(
        "keys renamed (transformers' conversion for llava)" in c for c in automap.placement(model).choices
    )
    automap.undispatch(model)
