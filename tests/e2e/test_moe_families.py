"""Breadth for routed experts read from disk: every mixture-of-experts causal LM family of the
installed transformers that builds from a tiny config (random weights, 1-2 decoder layers, 8
experts, top 2), its decoder layers on disk, the page cache dropped first. Each gives the plain
model's logits exactly and the same greedy tokens, and its experts are read as routed (a
:class:`ReadExperts` hook on them): stacked and listed experts, with and without shared
experts, linear-attention and Mamba hybrids, multi-latent attention."""

from __future__ import annotations

import pytest
import torch

import automap
from automap.offload import HostCopyOps, StagedTransfer
from automap.runtime import dispatch_plan
from automap.runtime.experts import ReadExperts
from automap.runtime.state import state_of
from tiny_configs import tiny

FAMILIES = [
    "afmoe",
    "cohere2_moe",
    "deepseek_v2",
    "deepseek_v3",
    "ernie4_5_moe",
    "exaone_moe",
    "glm4_moe",
    "glm4_moe_lite",
    "gpt_oss",
    "granitemoe",
    "granitemoeshared",
    "hunyuan_v1_moe",
    "jamba",
    "jetmoe",
    "llama4_text",
    "longcat_flash",
    "minicpm5_moe",
    "minimax",
    "mixtral",
    "olmoe",
    "param2moe",
    "phimoe",
    "qwen2_moe",
    "qwen3_moe",
    "qwen3_next",
    "qwen3_5_moe_text",
    "sarvam_moe",
]

# Pages: the CPU computes on views of the store (reads only decide residency). Staged: each call
# copies the routed rows into a tensor of the experts' shape, as on a GPU (HostCopyOps stands in
# for the device), so a row read wrong gives wrong outputs.
PATHS = {"pages": None, "staged": lambda source, *_: StagedTransfer(source, HostCopyOps())}


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("family", FAMILIES)
def test_each_moe_family_with_its_layers_on_disk_gives_the_plain_outputs(family, path, tmp_path):
    model = tiny(family)
    layers = model.model.layers
    ids = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(0))
    generate = dict(attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        expected, tokens = model(ids, use_cache=False).logits, model.generate(ids, **generate)
    device_map = {"": "cpu", **{f"model.layers.{i}": "disk" for i in range(len(layers))}}
    extra = {"transfer": PATHS[path]} if PATHS[path] else {}
    dispatch_plan(model, automap.plan(model, device_map), offload_dir=tmp_path, **extra)
    try:
        state = state_of(model)
        assert any(isinstance(h, ReadExperts) for h in state.hooks), "its experts are read as routed"
        state.source.evict()
        with torch.no_grad():
            got, again = model(ids, use_cache=False).logits, model.generate(ids, **generate)
    finally:
        automap.undispatch(model)
    assert torch.equal(got, expected)
    assert torch.equal(again, tokens)
