"""Routed experts placed apart from their layer: the one cost model that picks how they run
(computed on the CPU where they live, or streamed to the GPU), and the plan's per-layer record.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Mapping

from automap.devices import DeviceSpec
from automap.planning.cost import flop_seconds, read_seconds, transfer_seconds
from automap.profiling import Unit

# The largest token count :func:`stream_from` looks at: beyond it every layer's experts are
# all touched, so the crossing, if any, lies below.
MAX_TOKENS = 1 << 20


class ExpertsMode(str, enum.Enum):
    """How a layer's routed experts run in one phase. A ``str`` enum: JSON writes the value."""

    RESIDENT = "resident"  # on the GPU with the rest of their layer
    CPU_COMPUTES = "cpu computes"  # the CPU runs them; activations cross the link
    STREAMED = "streamed"  # their weights cross the link to the GPU each call


def touched_fraction(unit: Unit, tokens: float) -> float:
    """The expected share of ``unit``'s experts that ``tokens`` tokens are routed to (1 for a
    unit that holds no routed experts)."""
    if not unit.experts or not unit.experts_per_token:
        return 1.0
    missed = 1.0 - min(unit.experts_per_token / unit.experts, 1.0)
    return 1.0 - missed ** max(tokens, 0.0)


def touched_bytes(unit: Unit, tokens: float) -> float:
    """Bytes of ``unit``'s weights that ``tokens`` tokens use: for routed experts only the
    experts they are routed to, else all of them."""
    return unit.weight_bytes * touched_fraction(unit, tokens)


@dataclass(frozen=True)
class ExpertsCost:
    """What one layer's routed experts need per token, from the profile: FLOPs (``k`` experts'
    three matmuls) and the bytes of hidden state that cross to the CPU and back."""

    unit: Unit
    flops_per_token: float
    activation_per_token: float

    @classmethod
    def of(cls, unit: Unit, tokens: int) -> ExpertsCost:
        """From ``unit`` as profiled on ``tokens`` tokens: its input and its output are the
        tokens' hidden states, of one size, so twice its output crosses per call."""
        tokens = max(tokens, 1)
        return cls(unit, unit.flops / tokens, 2 * unit.output_bytes / tokens)


def mode_seconds(cost: ExpertsCost, tokens: float, home: DeviceSpec, cpu: DeviceSpec,
                 gpu: DeviceSpec) -> dict[ExpertsMode, float]:
    """Predicted seconds of one call of the experts on ``tokens`` tokens, per mode (see the
    module docstring): the one cost model both the choice and the report use."""
    touched = touched_bytes(cost.unit, tokens)
    on_cpu = (flop_seconds(cost.flops_per_token * tokens, cpu.flops_per_second) + read_seconds(touched, home)
              + transfer_seconds(cost.activation_per_token * tokens, cpu, gpu))
    return {ExpertsMode.CPU_COMPUTES: on_cpu, ExpertsMode.STREAMED: transfer_seconds(touched, home, gpu)}


def best_mode(cost: ExpertsCost, tokens: float, home: DeviceSpec, cpu: DeviceSpec, gpu: DeviceSpec) -> ExpertsMode:
    """The faster mode at ``tokens`` tokens; a tie computes on the CPU (no weights move)."""
    seconds = mode_seconds(cost, tokens, home, cpu, gpu)
    return min(seconds, key=lambda mode: (seconds[mode], mode is ExpertsMode.STREAMED))


def stream_from(cost: ExpertsCost, home: DeviceSpec, cpu: DeviceSpec, gpu: DeviceSpec) -> int:
    """The fewest tokens at which streaming costs less than computing on the CPU; 0 when it
    never does up to :data:`MAX_TOKENS`. CPU work grows with the tokens while the streamed bytes
    stop growing, so the modes cross once: a bisection finds it."""
    def streams(tokens: int) -> bool:
        return best_mode(cost, tokens, home, cpu, gpu) is ExpertsMode.STREAMED

    if not streams(MAX_TOKENS):
        return 0
    low, high = 0, MAX_TOKENS  # streams(high); not streams(low) by convention
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if streams(middle) else (middle, high)
    return high


@dataclass(frozen=True)
class ExpertsLayer:
    """One layer's routed experts in a plan.

    Attributes:
        layer: the unit they were split out of (``"model.layers.3"``).
        unit: the experts' own unit (``"model.layers.3.mlp.experts"``).
        home: where their weights live (``"cuda:0"``, ``"cpu"``, ``"disk"``).
        decode, prefill: how they run at the planned decode step and at the prompt's prefill.
        stream_from: from how many tokens per call they are streamed to the accelerator (1:
            at every call; 0: never, resident experts or the CPU computing them at every call).
    """

    layer: str
    unit: str
    home: str
    decode: ExpertsMode
    prefill: ExpertsMode
    stream_from: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {"layer": self.layer, "unit": self.unit, "home": self.home, "decode": self.decode.value,
                "prefill": self.prefill.value, "stream_from_tokens": self.stream_from}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ExpertsLayer:
        return cls(str(data["layer"]), str(data["unit"]), str(data["home"]), ExpertsMode(data["decode"]),
                   ExpertsMode(data["prefill"]), int(data.get("stream_from_tokens", 0)))


@dataclass(frozen=True)
class ExpertsPlan:
    """A plan's routed experts apart from their layers, and the decode rate it is predicted
    to reach against the best plan that keeps each layer whole.

    Attributes:
        layers: one record per layer, in execution order.
        decode_tokens: tokens per decode step (the batch); prefill_tokens: the prompt's tokens.
        tokens_per_second: this plan's predicted decode rate.
        whole_layer_tokens_per_second: the best whole-layer plan's predicted decode rate.
    """

    layers: tuple[ExpertsLayer, ...]
    decode_tokens: int
    prefill_tokens: int
    tokens_per_second: float
    whole_layer_tokens_per_second: float

    def as_dict(self) -> dict[str, Any]:
        """The JSON form (``docs/plan-schema.md``)."""
        return {"decode_tokens": self.decode_tokens, "prefill_tokens": self.prefill_tokens,
                "tokens_per_second": self.tokens_per_second,
                "whole_layer_tokens_per_second": self.whole_layer_tokens_per_second,
                "layers": [layer.as_dict() for layer in self.layers]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> ExpertsPlan | None:
        """The record :meth:`as_dict` wrote; None for plan JSON without one."""
        if not data:
            return None
        return cls(tuple(ExpertsLayer.from_dict(d) for d in data["layers"]), int(data["decode_tokens"]),
                   int(data["prefill_tokens"]), float(data["tokens_per_second"]),
                   float(data["whole_layer_tokens_per_second"]))
