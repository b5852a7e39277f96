"""Planning runs the model's forward on meta tensors (to count FLOPs and activations); a forward
that changes its module's Python state — a rotary cache regrown for a longer input, a step
counter, a tensor cached as a plain attribute, a buffer registered on first call, noise drawn
from the global generator — must find the model as it was once planning ends, so the plain
model, and the dispatched one, give the outputs they gave before."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import automap
from tiny_configs import part_on_disk


class GrownRotary(nn.Module):
    """The rotary embedding of older transformers Llama code: tables regrown when a longer
    sequence comes, their length kept in a plain int."""

    def __init__(self, dim: int = 16, length: int = 16):
        super().__init__()
        self.register_buffer(
            "inv_freq", 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim)), persistent=False
        )
        self._grow(length)

    def _grow(self, length: int) -> None:
        self.max_seq_len_cached = length
        t = torch.arange(length, device=self.inv_freq.device, dtype=self.inv_freq.dtype)
        emb = torch.cat([torch.outer(t, self.inv_freq)] * 2, dim=-1)
        self.register_buffer("cos_cached", emb.cos(), persistent=False)
        self.register_buffer("sin_cached", emb.sin(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        length = x.shape[1]
        if length > self.max_seq_len_cached:
            self._grow(length)
        return x * self.cos_cached[:length] + x.flip(-1) * self.sin_cached[:length]


class Stateful(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.rotary = GrownRotary()
        self.mix = nn.Linear(16, 16)
        self.head = nn.Linear(16, 50)
        self.steps = 0
        self.cached: torch.Tensor | None = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        self.steps += 1
        h = self.rotary(self.embed(ids))
        if self.cached is None or self.cached.shape[0] != h.shape[1]:
            self.cached = torch.ones(h.shape[1], 1)  # a tensor kept as a plain attribute
        if not hasattr(self, "scale"):
            self.register_buffer("scale", torch.full((16,), 0.5), persistent=False)
        return self.head(self.mix(h * self.cached) * self.scale)


def _state(model: nn.Module) -> tuple:
    buffers = {n: (tuple(b.shape), b.device.type) for n, b in model.named_buffers()}
    return model.steps, model.rotary.max_seq_len_cached, model.cached, buffers


@pytest.mark.parametrize("call", ["plan", "infer_auto_device_map", "dispatch"])
def test_planning_leaves_the_models_python_state_as_it_was(call, tmp_path):
    torch.manual_seed(0)
    model = Stateful().eval()
    ids = torch.randint(0, 50, (2, 24), generator=torch.Generator().manual_seed(1))
    before = _state(model)
    reference = copy.deepcopy(model)
    if call == "plan":
        automap.plan(
            model, max_memory={"cpu": "1GB"}, example_inputs=(torch.zeros(1, 128, dtype=torch.long),)
        )
    elif call == "infer_auto_device_map":
        automap.infer_auto_device_map(model, max_memory={"cpu": "1GB"})
    else:
        inputs = (torch.zeros(1, 128, dtype=torch.long),)
        automap.dispatch(
            model,
            device_map="auto",
            max_memory=part_on_disk(model, example_inputs=inputs),
            offload_dir=tmp_path,
            example_inputs=inputs,
        )
        assert "disk" in automap.placement(model).placement
    assert _state(model) == before
    with torch.no_grad():
        assert torch.equal(model(ids), reference(ids))  # length 24: the tables regrow for real, from 16
    if call == "dispatch":
        automap.undispatch(model)


def test_planning_draws_nothing_from_the_global_generator():
    class Noisy(nn.Module):
        def __init__(self):
            super().__init__()
            self.encode, self.decode = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.encode(x)
            return self.decode(h + torch.randn(h.shape))

    model = Noisy()
    torch.manual_seed(7)
    state = torch.random.get_rng_state()
    automap.plan(model, max_memory={"cpu": "1GB"}, example_inputs=(torch.zeros(2, 8),))
    assert torch.equal(torch.random.get_rng_state(), state)
