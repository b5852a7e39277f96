"""The Llama-style checkpoints the load and offload benchmarks read: seeded random fp32 weights."""

from __future__ import annotations

from typing import Any, Iterable, Mapping


def llama_shapes(config: Any) -> dict[str, tuple[int, ...]]:
    """Every state-dict tensor of ``LlamaForCausalLM(config)`` and its shape, built on meta."""
    from transformers import LlamaForCausalLM

    import automap

    with automap.empty_model():
        model = LlamaForCausalLM(config)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def random_weights(
    shapes: Mapping[str, tuple[int, ...]], names: Iterable[str], generator: Any
) -> dict[str, Any]:
    """fp32 tensors for ``names``: norms at one, the rest N(0, 0.02), so the logits stay finite.
    Pass one ``generator`` through every shard to get the same weights however they are sharded."""
    import torch

    return {
        n: torch.ones(shapes[n]) if "norm" in n else torch.randn(shapes[n], generator=generator) * 0.02
        for n in names
    }
