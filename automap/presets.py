"""Presets: the shapes of popular models, planned offline (``automap plan llama-3-70b``), and
the refusal of a hub id (``automap plan meta-llama/Llama-3-8B``) with the command that downloads.

Each preset is the architecture fields of a model's public ``config.json`` (its hub id in
``source``): no weights, no tokenizer, nothing downloaded. :mod:`automap.specs` builds one on
the meta device with transformers; ``--set`` overrides any field. This module imports neither
torch nor transformers, so ``automap plan --list-presets`` and a hub id answer at once.
"""

from __future__ import annotations

import os
import re
from typing import Any

from automap.errors import SpecError

# Popular shapes, planned offline: the architecture fields of each model's public config.json
# (hub id in "source"), nothing else (no weights, no tokenizer). --set overrides any field.
PRESETS: dict[str, dict[str, Any]] = {
    "llama-3-8b": dict(
        source="meta-llama/Meta-Llama-3-8B",
        model_type="llama",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        dtype="bfloat16",
    ),
    "llama-3-70b": dict(
        source="meta-llama/Meta-Llama-3-70B",
        model_type="llama",
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        dtype="bfloat16",
    ),
    "mistral-7b": dict(
        source="mistralai/Mistral-7B-v0.1",
        model_type="mistral",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=32000,
        max_position_embeddings=32768,
        sliding_window=4096,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        dtype="bfloat16",
    ),
    "mixtral-8x7b": dict(
        source="mistralai/Mixtral-8x7B-v0.1",
        model_type="mixtral",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=32000,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        dtype="bfloat16",
    ),
    "qwen3-30b-a3b": dict(
        source="Qwen/Qwen3-30B-A3B",
        model_type="qwen3_moe",
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        decoder_sparse_step=1,
        norm_topk_prob=True,
        vocab_size=151936,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        dtype="bfloat16",
    ),
    "gpt2": dict(
        source="openai-community/gpt2",
        model_type="gpt2",
        n_embd=768,
        n_layer=12,
        n_head=12,
        vocab_size=50257,
        n_positions=1024,
        dtype="float32",
    ),
}


def preset_lines() -> list[str]:
    """One line per preset, for ``automap plan --list-presets``: name, family, shape, source."""
    lines = []
    for name, fields in PRESETS.items():
        layers = fields.get("num_hidden_layers", fields.get("n_layer"))
        width = fields.get("hidden_size", fields.get("n_embd"))
        experts = fields.get("num_local_experts", fields.get("num_experts"))
        routed = f", {experts} experts (top {fields['num_experts_per_tok']})" if experts else ""
        shape = f"{layers} layers, hidden {width}{routed}"
        lines.append(
            f"{name:<15} {fields['model_type']:<10} {shape:<44} {fields['dtype']:<9} "
            f"shape of {fields['source']}"
        )
    return lines


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def check_not_hub_id(spec: str) -> None:
    """Refuse a SPEC that is a hub id (``org/name``, no such path here): automap never
    downloads; the message gives the command that does, and what to pass then.

    Raises:
        SpecError: ``spec`` looks like ``org/name`` and no file or folder has that name.
    """
    if _HUB_ID.match(spec) and not os.path.lexists(spec) and not spec.endswith(".py"):
        folder = "./" + spec.rsplit("/", 1)[1]
        preset = next((n for n, f in PRESETS.items() if f["source"].lower() == spec.lower()), None)
        raise SpecError(
            f"{spec!r} looks like a Hugging Face hub id, and no folder of that name exists here; automap "
            f"never downloads. Download it with the hub's own client: hf download {spec} --local-dir {folder} "
            f"(or huggingface-cli download {spec} --local-dir {folder}), then pass the folder: "
            f"automap plan {folder}"
            + (
                f"; or plan its shape offline: automap plan {preset}"
                if preset
                else "; to plan a shape offline, see automap plan --list-presets"
            )
        )
