"""Small configs for the families of transformers' registry: each family's default config with
the sizes below set wherever it (or a sub-config of it: ``text_config``, an encoder's, a decoder's)
has the attribute, and what the sizes imply for attributes tied to them; a backbone in stages
keeps its widths (but for a width doubled per stage from ``num_filters``) and gets one block per
stage. Used by the registry sweeps (test_moe_families.py, test_causal_lm_registry.py,
test_registry_tasks.py)."""

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
    num_decoder_layers=2,  # T5's (its cache has num_hidden_layers' layers)
    entity_vocab_size=128,  # LUKE's entities
    cross_attention_hidden_size=64,  # T5Gemma's decoder reads its encoder's width
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=96,
    decoder_ffn_dim=96,
    rotary_dim=8,
    vocab_size_per_layer_input=128,
    unpadded_vocab_size=128,
    embedding_dim=64,  # xLSTM's width
    audio_hidden_size=64,  # a head reading an audio encoder of hidden_size (nemo_speechlm's diarization)
    # sparse attention's indexer (DeepSeek V3.2's DSA and its kin)
    index_n_heads=4,
    index_head_dim=16,
    index_topk=8,
    # state-space layers: heads x head size = expand x hidden (64 x 2)
    mamba_n_heads=8,
    mamba_d_head=16,
    n_mamba_heads=8,
    mamba_headdim=16,
    mamba_d_state=16,
    mamba_d_ssm=128,
    state_size=16,
    num_kv_shared_layers=0,  # layers reusing an earlier layer's cache need more layers than 2
    # Reformer: axial positions (shape multiplying to max_position_embeddings), chunked attention,
    # hashing with a fixed seed (its random rotations are then the same in every forward)
    axial_pos_shape=(8, 8),
    local_attn_chunk_length=8,
    lsh_attn_chunk_length=8,
    num_buckets=4,
    hash_seed=0,
)

# Dots 3 Note's attention always has a query LoRA (SMALL's None is DeepSeek's "none"); a head
# is its rotary and plain parts, the rotary a quarter of it (the default's rope parameters, 64 of
# 256); its sliding layers' overrides (64 heads, a key rank of 1024) are full size: the global ones
DOTS3_NOTE_TEXT = dict(
    q_lora_rank=16, head_dim=16, qk_rope_head_dim=4, qk_nope_head_dim=12, per_layer_config={}
)

# What a family needs beyond SMALL, set after it: a constraint between its sizes that the shared
# shrinking does not know, or sizes under names of its own (a dict under a sub-config's name is
# set on that sub-config).
FAMILY_SIZES = {
    # one attention layer and experts in every layer, in two
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=1, expert_layer_offset=0),
    # its embeddings feed its first layer as they are
    "squeezebert": dict(embedding_size=64),
    # its LM head adds hidden_size - embedding_size features to the embeddings'
    "mobilebert": dict(embedding_size=32, intra_bottleneck_size=32, true_hidden_size=32),
    # its keys' norm spans every head: no grouped keys
    "esmc": dict(num_key_value_heads=4),
    # its default config leaves the vocabulary to its checkpoints: no padding token either
    "esm": dict(pad_token_id=1, mask_token_id=2),
    # B0's width, depth and image, not B7's
    "efficientnet": dict(width_coefficient=1.0, depth_coefficient=1.0, hidden_dim=1280, image_size=224),
    # its latents
    "perceiver": dict(d_latents=64, num_latents=32, num_self_attends_per_block=2),
    # its cache has a slot per stack layer and cycle: num_layers_per_stack * H_cycles * (L_cycles + 1)
    "hrm_text": dict(num_layers_per_stack=1, num_hidden_layers=8),
    # its hybrid layers share one attention block, tied from the first to the others: two of them
    "zamba": dict(num_hidden_layers=3, layers_block_type=["linear_attention", "hybrid", "hybrid"]),
    # its vision tower is timm's MobileNetV5 (300M parameters), which the small sizes do not reach:
    # the same network with a hundredth of its channels
    "gemma3n": dict(vision_config=dict(model_args=dict(channel_multiplier=0.01))),
    # its byte n-gram hash tables (500,002 rows each); its local layers read the global width, and
    # the global one projects the encoder's cross_attn_k patches (what its __post_init__ derives)
    "blt": dict(
        encoder_hash_byte_group_vocab=128,
        encoder_config=dict(hidden_size_global=64),
        decoder_config=dict(hidden_size_global=64),
        global_config=dict(encoder_cross_output_size=128),
    ),
    # sizes its config checks when it is saved (save_pretrained validates them; __init__ does not):
    # one head's width is d_model / n_head
    "xlnet": dict(d_head=16),
    # one expert per token
    "zaya": dict(num_experts_per_tok=1),
    # its per-layer attention kinds expand from (kinds, repeats): one of each
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]], attention_layers=["global", "local"]),
    # its input, looped and output layers add up to its layers: one of each
    "dory": dict(
        num_hidden_layers=3,
        n_input_layers=1,
        n_recurrent_layers=1,
        n_output_layers=1,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
    ),
    # its indexer sits in an indexed-attention layer (the second) and has at most the query heads
    # of one key head
    "kolibri1_1": dict(index_layers=[1], index_num_heads=2),
    "dots3_note_text": DOTS3_NOTE_TEXT,
    "dots3_note": dict(text_config=DOTS3_NOTE_TEXT),
    # its image's tokens pool the vision tower's 14 x 14 patches to a square: 2 x 2; its answer
    # reads the "Yes" and "No" tokens' logits, ids of the full vocabulary
    "shieldgemma2": dict(mm_tokens_per_image=4, yes_token_index=1, no_token_index=2),
}

# Attributes that give one entry per layer, cut to the small number of layers.
PER_LAYER = ("layer_type", "block_type", "sparsity_pattern", "_per_layer", "swiglu_limit", "source_layers")
MAX_PARAMETERS = 40_000_000
STAGE_FILTERS = 4
TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "blank_token_id")


def shrink(config, depth: int = 0) -> None:
    """Set :data:`SMALL` on ``config`` and its sub-configs, in place (a backbone in stages gets
    :func:`_shrink_stages` instead)."""
    if isinstance(getattr(config, "depths", None), (list, tuple)):
        _shrink_stages(config)
        return
    config.allow_global_per_layer_attribute_access = True  # configs whose layers may differ (Gemma 4)
    layers = getattr(config, "num_hidden_layers", None)
    wide = {k: getattr(config, k, None) for k in ("hidden_size", "attention_hidden_size")}
    for key, value in SMALL.items():
        try:
            if hasattr(config, key):
                if isinstance(getattr(config, key), list) and not isinstance(value, list):
                    value = [value] * SMALL["num_hidden_layers"]  # given per layer (Gemma 3n's sizes)
                setattr(config, key, value)
        except Exception:  # noqa: BLE001 - derived from the others here, or validated otherwise: keep its own
            pass
    for key in TOKEN_IDS:  # a token id past the small vocabulary (an embedding's padding row)
        value = getattr(config, key, None)
        if isinstance(value, int) and value >= SMALL["vocab_size"]:
            setattr(config, key, 0)
    if getattr(config, "kv_lora_rank", None) and hasattr(config, "qk_rope_head_dim"):
        config.head_dim = SMALL["qk_rope_head_dim"]  # multi-latent attention: head_dim is the rotary part
    if isinstance(wide["attention_hidden_size"], int) and isinstance(wide["hidden_size"], int):
        # Zamba's attention reads the hidden state and the embeddings side by side: same ratio
        config.attention_hidden_size = (
            wide["attention_hidden_size"] * config.hidden_size // wide["hidden_size"]
        )
        if hasattr(config, "attention_head_dim"):
            config.attention_head_dim = config.attention_hidden_size // config.num_attention_heads
    for key, value in list(vars(config).items()):  # one entry per layer: mlp_layer_types, sparsity, ...
        per_layer = any(part in key for part in PER_LAYER) and key != "layer_types"
        if per_layer and isinstance(value, (list, tuple)) and layers and len(value) == layers > 2:
            setattr(config, key, type(value)(_per_layer(value, _layers_left(config, layers, value))))
    kinds_before = list(getattr(config, "layer_types", None) or ())
    if kinds_before and len(kinds_before) != config.num_hidden_layers:
        kinds = list(dict.fromkeys(kinds_before))  # a hybrid: one layer of each kind
        config.layer_types = (kinds * 2)[:2]
    _keep_per_layer_overrides(config, kinds_before)
    _keep_an_attention_layer(config)
    kinds = getattr(config, "layers_block_type", None)
    if isinstance(getattr(config, "hybrid_layer_ids", None), list) and isinstance(kinds, list):
        config.hybrid_layer_ids = [i for i, kind in enumerate(kinds) if kind == "hybrid"]  # Zamba2's
    if hasattr(config, "qk_dim_factor") and hasattr(config, "num_blocks"):
        # xLSTM: its query/key width is rounded up to a multiple of 64 (the cache's is not), and its
        # blocks are counted apart from its layers
        config.qk_dim_factor, config.num_blocks = 1.0, config.num_hidden_layers
    if hasattr(config, "axial_pos_embds_dim"):
        half = config.hidden_size // 2  # the axial embeddings' parts add up to the hidden size
        config.axial_pos_embds_dim = (half, config.hidden_size - half)
    if all(hasattr(config, n) for n in ("expand", "num_heads", "head_dim", "state_size")):
        config.num_heads = config.expand * config.hidden_size // config.head_dim  # Mamba-2's heads
    if getattr(config, "index_n_heads", None) and hasattr(config, "num_key_value_heads"):
        config.num_key_value_heads = config.num_attention_heads  # the indexer's mask is per query head
    if getattr(config, "languages", None) and getattr(config, "default_language", "") is None:
        config.default_language = config.languages[0]  # X-MOD's adapters need one
    if depth < 3:  # a speech LM's diarization model's own audio encoder (nemo_speechlm)
        for name in list(vars(config)):
            sub = getattr(config, name, None)
            if hasattr(sub, "to_dict") and sub is not config:  # text_config, an encoder's, a decoder's
                shrink(sub, depth + 1)


def _shrink_stages(config) -> None:
    """A backbone in stages (ResNet, ConvNeXt, Swin, an audio tokenizer's convolutions): one block
    per stage. Its widths and heads are given per stage and must agree with the number of stages
    (its "layers"), which :data:`SMALL` would cut to two; a width that doubles at each stage from
    ``num_filters`` (32 · 2⁶ at VibeVoice's last stage) starts from :data:`STAGE_FILTERS`."""
    config.depths = [1] * len(config.depths)
    if isinstance(getattr(config, "num_filters", None), int):
        config.num_filters = STAGE_FILTERS


def _layers_left(config, layers: int, values) -> int:
    """How many layers a per-layer list keeps: the small number, or where the config counts its
    layers by that list (Nemotron-H's ``layers_block_type``), one of each kind it names."""
    if config.num_hidden_layers != layers:
        return config.num_hidden_layers
    if all(isinstance(v, str) for v in values):
        return len(set(values))
    return SMALL["num_hidden_layers"]


def _per_layer(values, layers: int) -> list:
    """A per-layer list cut to ``layers``: the first values, or where the list names kinds of
    layer (strings), one layer of each kind in the order they come."""
    if all(isinstance(v, str) for v in values):
        kinds = list(dict.fromkeys(values))
        return (kinds * layers)[:layers]
    return list(values[:layers])


def _keep_per_layer_overrides(config, kinds_before: list[str]) -> None:
    """A config whose layers differ (Gemma 4's ``per_layer_config``, keyed by layer index): each
    layer left takes the overrides of the first layer of its kind before the cut (save_pretrained
    checks the keys against the number of layers)."""
    spec = vars(config).get("_heterogeneity_spec")
    if spec is None:
        return
    overrides = spec.per_layer_overrides
    if kinds_before and getattr(config, "layer_types", None):
        first: dict[str, dict] = {}
        for index, kind in enumerate(kinds_before):
            first.setdefault(kind, overrides.get(index, {}))
        kept = {i: first.get(kind) for i, kind in enumerate(config.layer_types)}
    else:
        kept = {i: overrides.get(i) for i in range(config.num_hidden_layers)}
    config.per_layer_config = {i: values for i, values in kept.items() if values}


def _keep_an_attention_layer(config) -> None:
    """A hybrid of state-space (linear) and attention layers keeps one attention layer in its
    two: transformers' cache for it needs one (Bamba's indices, Recurrent Gemma's block cycle,
    a default of linear layers only)."""
    if hasattr(config, "attn_layer_indices") and not config.attn_layer_indices:
        config.attn_layer_indices = [1]
    blocks = getattr(config, "block_types", None)
    if blocks and "attention" in blocks and "attention" not in blocks[: config.num_hidden_layers]:
        config.num_hidden_layers = blocks.index("attention") + 1
    types = getattr(config, "layer_types", None)
    if types and set(types) == {"linear_attention"} and hasattr(config, "mamba_n_heads"):
        config.layer_types = ["linear_attention", "full_attention"][: config.num_hidden_layers]


def tiny(family: str, auto: str = "AutoModelForCausalLM") -> torch.nn.Module:
    """``family``'s model (a causal LM, or transformers' ``auto`` class's) from its default
    config, shrunk (skipped where transformers lacks the family, or where it stays large:
    sizes under names not shrunk here)."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if family not in CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no {family}")
    config = transformers.AutoConfig.for_model(family)
    # an auto class with several models for a family (DeiT's, with and without a teacher) picks by
    # the config's architectures; the default config has none: the first
    config.architectures = config.architectures or []
    shrink(config)
    if auto == "AutoModelForCausalLM" and hasattr(config, "is_decoder"):
        config.is_decoder = True  # an encoder family's causal LM head (BERT's, RoBERTa's) decodes
    for key, value in FAMILY_SIZES.get(family, {}).items():
        if isinstance(value, dict) and hasattr(getattr(config, key, None), "to_dict"):  # a sub-config's
            for name, size in value.items():
                setattr(getattr(config, key), name, size)
        else:
            setattr(config, key, value)
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
