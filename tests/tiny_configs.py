"""Small configs for the families of transformers' registry: each family's default config with
the sizes below set wherever it (or a sub-config of it: ``text_config``, a decoder's) has the
attribute, and what the sizes imply for attributes tied to them. Used by the registry sweeps
(test_moe_families.py, test_causal_lm_registry.py)."""

from __future__ import annotations

import warnings

import pytest
import torch

import automap

# Set where a config has the attribute: the names differ from family to family.
SMALL = dict(
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=128,
    num_local_experts=8,
    num_experts=8,
    n_routed_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=64,
    shared_expert_intermediate_size=48,
    first_k_dense_replace=0,
    q_lora_rank=None,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=16,
    qk_head_dim=16,
    n_group=1,
    topk_group=1,
    mlp_only_layers=[],
    decoder_sparse_step=1,
    # encoder-decoder families (BART, Marian, Pegasus, ...) and GPT-J's rotary part
    d_model=64,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=96,
    decoder_ffn_dim=96,
    rotary_dim=8,
    attention_hidden_size=64,
    vocab_size_per_layer_input=128,
)

MAX_PARAMETERS = 40_000_000
TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id")


def shrink(config, depth: int = 0) -> None:
    """Set :data:`SMALL` on ``config`` and its sub-configs, in place."""
    config.allow_global_per_layer_attribute_access = True  # configs whose layers may differ (Gemma 4)
    for key, value in SMALL.items():
        try:
            if hasattr(config, key):
                setattr(config, key, value)
        except Exception:  # noqa: BLE001 - derived from the others here, or validated otherwise: keep its own
            pass
    for key in TOKEN_IDS:  # a token id past the small vocabulary (an embedding's padding row)
        value = getattr(config, key, None)
        if isinstance(value, int) and value >= SMALL["vocab_size"]:
            setattr(config, key, 0)
    if getattr(config, "kv_lora_rank", None) and hasattr(config, "qk_rope_head_dim"):
        config.head_dim = SMALL["qk_rope_head_dim"]  # multi-latent attention: head_dim is the rotary part
    if getattr(config, "layer_types", None) and len(config.layer_types) != config.num_hidden_layers:
        kinds = list(dict.fromkeys(config.layer_types))  # a hybrid: one layer of each kind
        config.layer_types = (kinds * 2)[:2]
    if depth < 2:
        for name in list(vars(config)):
            sub = getattr(config, name, None)
            if name.endswith("_config") and hasattr(sub, "to_dict") and sub is not config:
                shrink(sub, depth + 1)


def tiny(family: str, auto: str = "AutoModelForCausalLM") -> torch.nn.Module:
    """``family``'s model (a causal LM, or transformers' ``auto`` class's) from its default
    config, shrunk (skipped where transformers lacks the family, or where it stays large:
    sizes under names not shrunk here)."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if family not in CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no {family}")
    config = transformers.AutoConfig.for_model(family)
    shrink(config)
    if family == "jamba":
        config.attn_layer_period, config.attn_layer_offset = 2, 1
        config.expert_layer_period, config.expert_layer_offset = 1, 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.device("meta"):
            size = sum(p.numel() for p in getattr(transformers, auto).from_config(config).parameters())
        if size > MAX_PARAMETERS:
            pytest.skip(
                f"{family} keeps {size / 1e6:.0f}M parameters with the small settings (sizes set elsewhere)"
            )
        torch.manual_seed(0)
        return getattr(transformers, auto).from_config(config).eval()


def beside_the_run(
    model: torch.nn.Module | automap.Profile,
    nbytes: int,
    dtype: torch.dtype | None = None,
    example_inputs=None,
) -> int:
    """A CPU budget that holds ``nbytes`` of weights beside the run of ``model`` on the CPU (its
    activations at automap's guessed inputs, or at ``example_inputs``, or those of ``model``'s
    profile, and the runtime's overhead), by the planner's own figures (planning/layout_plans.py,
    planning/memory.py)."""
    from automap.planning.layout_plans import cpu_activations
    from automap.planning.memory import runtime_bytes

    prof = (
        model
        if isinstance(model, automap.Profile)
        else automap.profile(model, dtype=dtype, example_inputs=example_inputs)
    )
    activations = cpu_activations(prof, ())
    return nbytes + runtime_bytes(
        "cpu", activations, min(activations, prof.forward_peak_bytes or activations)
    )


def part_on_disk(
    model: torch.nn.Module, dtype: torch.dtype | None = None, example_inputs=None
) -> dict[str, int]:
    """A CPU budget of 40 % of ``model``'s bytes (its floating-point tensors counted at ``dtype``
    when given) beside the run (at ``example_inputs`` when given): the rest goes to disk."""
    return {"cpu": beside_the_run(model, _two_fifths(model, dtype), dtype, example_inputs)}


def accelerates_part_on_disk(model: torch.nn.Module) -> dict[str, int]:
    """The budget of :func:`part_on_disk` for accelerate's own planner, which counts weights
    only: 40 % of ``model``'s bytes."""
    return {"cpu": _two_fifths(model)}


def _two_fifths(model: torch.nn.Module, dtype: torch.dtype | None = None) -> int:
    size = sum(
        t.numel() * (dtype.itemsize if dtype is not None and t.is_floating_point() else t.element_size())
        for t in model.state_dict().values()
    )
    return int(size * 0.4)


def run_dispatched(model: torch.nn.Module, call):
    """``call(model)`` without grad or warnings, ``model`` (dispatched with part of it on
    disk) undispatched after, whatever happens."""
    try:
        assert "disk" in automap.placement(model).device_map.values(), "part of it is on disk"
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return call(model)
    finally:
        automap.undispatch(model)
