"""The transformer block :func:`automap.machine_probes.op_seconds` times: a Llama-like decoder
layer on one token, written as transformers writes its layers (modules called with keyword
arguments, rotary embeddings and key/value repetition in helper functions, a cache object
whose ``update`` grows each layer's keys and values, the attention function looked up by
name), so the Python around each op costs what it costs in the models ``generate`` runs.
64 wide: its ops' work is nothing beside their dispatch."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

HIDDEN, HEADS, KV_HEADS, CACHED = 64, 4, 2, 32


class _Norm(nn.Module):
    """RMS norm computed in float32 and cast back."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + 1e-6)
        return self.weight * hidden_states.to(dtype)


class _Cache:
    """Each layer's keys and values, grown by ``cat`` at every step."""

    def __init__(self, layers: int) -> None:
        shape = (1, KV_HEADS, CACHED, HIDDEN // HEADS)
        self.layers = [{"keys": torch.ones(shape), "values": torch.ones(shape)} for _ in range(layers)]

    def update(
        self, keys: torch.Tensor, values: torch.Tensor, layer: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        entry = self.layers[layer]
        entry["keys"] = torch.cat([entry["keys"], keys], dim=-2)
        entry["values"] = torch.cat([entry["values"], values], dim=-2)
        return entry["keys"], entry["values"]

    def trim(self) -> None:
        """Back to :data:`CACHED` tokens: every run of the probe sees the same cache."""
        for entry in self.layers:
            entry["keys"], entry["values"] = entry["keys"][:, :, :CACHED], entry["values"][:, :, :CACHED]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[Any, Any]:
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _repeat_kv(states: torch.Tensor, times: int) -> torch.Tensor:
    batch, heads, tokens, size = states.shape
    if times == 1:
        return states
    states = states[:, :, None, :, :].expand(batch, heads, times, tokens, size)
    return states.reshape(batch, heads * times, tokens, size)


def _sdpa(module: nn.Module, query: Any, key: Any, value: Any, **kwargs: Any) -> torch.Tensor:
    key, value = _repeat_kv(key, module.groups), _repeat_kv(value, module.groups)
    out = F.scaled_dot_product_attention(query, key, value, is_causal=False, scale=module.scaling)
    return out.transpose(1, 2).contiguous()


_ATTENTION = {"sdpa": _sdpa}


class _Attention(nn.Module):
    def __init__(self, layer: int) -> None:
        super().__init__()
        self.layer, self.size = layer, HIDDEN // HEADS
        self.groups, self.scaling = HEADS // KV_HEADS, self.size**-0.5
        self.q_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.k_proj = nn.Linear(HIDDEN, KV_HEADS * self.size, bias=False)
        self.v_proj = nn.Linear(HIDDEN, KV_HEADS * self.size, bias=False)
        self.o_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)

    def forward(self, hidden_states: Any, position_embeddings: Any, cache: _Cache, **kwargs: Any) -> Any:
        shape = (*hidden_states.shape[:-1], -1, self.size)
        query = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        key = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        value = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        query, key = _rotary(query, key, *position_embeddings)
        key, value = cache.update(key, value, self.layer)
        out = _ATTENTION[kwargs.get("attention", "sdpa")](self, query, key, value, **kwargs)
        return self.o_proj(out.reshape(*hidden_states.shape[:-1], -1).contiguous())


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(HIDDEN, 4 * HIDDEN, bias=False)
        self.up_proj = nn.Linear(HIDDEN, 4 * HIDDEN, bias=False)
        self.down_proj = nn.Linear(4 * HIDDEN, HIDDEN, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """The layer, with its cache and rotary angles: ``block(x)`` runs one decode step of it."""

    hidden = HIDDEN

    def __init__(self) -> None:
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = _Norm(HIDDEN), _Norm(HIDDEN)
        self.self_attn, self.mlp = _Attention(0), _MLP()
        self.cache = _Cache(1)
        angles = torch.ones(1, 1, HIDDEN // HEADS)
        self.position_embeddings = (angles.cos(), angles.sin())

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states = self.self_attn(
            hidden_states=hidden_states, position_embeddings=self.position_embeddings, cache=self.cache
        )
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.mlp(self.post_attention_layernorm(hidden_states))
        self.cache.trim()
        return residual + hidden_states
