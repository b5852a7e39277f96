"""Plan a model named by a SPEC (``automap plan SPEC``): build it on meta (:mod:`automap.specs`),
then profile and plan it through the composition :func:`automap.plan` uses
(:mod:`automap.compose`), with the command line's tracing (:func:`~automap.compose.spec_tracing`:
inputs guessed at ``--batch`` x ``--seq-len``, no backward). Nothing is downloaded and no
weights are allocated."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from automap.errors import SpecError
from automap.planning import Plan
from automap.sizes import MAX_COUNT, format_bytes, parse_number
from automap.specs import BuiltModel, build_model


@dataclass(frozen=True)
class SpecPlan:
    """What ``automap plan SPEC`` produced."""

    built: BuiltModel
    plan: Plan
    dtype: torch.dtype | None
    note: str = ""  # what was changed from what was asked (a capped --seq-len)

    def headline(self, seconds: float) -> str:
        """``'LlamaForCausalLM (hf:llama): 68.98B parameters, 128.48 GiB at bfloat16; planned ...'``."""
        dtype = self.dtype or next(
            (p.dtype for p in self.built.model.parameters() if p.is_floating_point()), torch.float32
        )
        weights = sum(u.weight_bytes for u in self.plan.units)
        source = f" ({self.built.source})" if self.built.source else ""
        note = f"; {self.note}" if self.note else ""
        return (
            f"{self.built.label}: {_count(self.built.parameters)} parameters, {format_bytes(weights)} at "
            f"{str(dtype).removeprefix('torch.')}{source}; planned on meta in {seconds:.1f} s{note}"
        )


def _count(n: int) -> str:
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.2f}{suffix}"
    return str(n)


def plan_spec(
    spec: str,
    overrides: Mapping[str, Any] | None = None,
    *,
    max_memory: Mapping[int | str, Any] | None = None,
    strategy: str = "auto",
    batch: int = 1,
    seq_len: int = 128,
    dtype: torch.dtype | None = None,
    max_length: int | None = None,
    example_inputs: Any = None,
) -> SpecPlan:
    """Build the model a SPEC names on meta, profile it at ``batch`` x ``seq_len`` and plan it.

    Args:
        spec, overrides: see :func:`build_model`.
        max_memory: budgets in the accelerate form (hypothetical devices welcome); this
            machine's devices when None.
        strategy: ``auto``, ``balanced``, ``balanced_low_0`` or ``sequential``.
        batch, seq_len: size of the example inputs (token models use both, image models batch).
        dtype: the dtype the model will run in; default: the config's, else as built (fp32).
        max_length: plan for ``generate``: ``batch`` sequences whose ``seq_len``-token prompts
            grow to ``max_length`` tokens; each device keeps room for its layers' KV cache.
        example_inputs: the forward's inputs (a tuple, a dict, or one tensor; meta tensors
            welcome) instead of ones guessed from the model at ``batch`` x ``seq_len``.

    Returns:
        A :class:`SpecPlan` with the built model and its :class:`~automap.planning.Plan`.

    Raises:
        SpecError: bad SPEC or overrides. PlanError: the model does not fit, or ``max_length``
            is not longer than the prompt.

    Example:
        >>> plan_spec("torchvision:resnet50", max_memory={0: "60MB", 1: "60MB"}).plan.device_map["fc"]
        1
    """
    from automap.compose import plan_strategy, spec_tracing
    from automap.devices import detect_devices, parse_max_memory

    for flag, value in (("--batch", batch), ("--seq-len", seq_len)):
        parse_number(
            value,
            flag,
            integral=True,
            minimum=1,
            maximum=MAX_COUNT,
            error=SpecError,
            hint=f"--batch and --seq-len must be between 1 and {MAX_COUNT:,}",
        )
    if max_memory is not None:
        parse_max_memory(max_memory)  # a bad size fails now, before the model is built
    built = build_model(spec, overrides)
    chosen_dtype = dtype or built.dtype
    tracing, note = spec_tracing(built.model, example_inputs, batch, seq_len, max_length)
    computes = str(chosen_dtype or torch.float32).removeprefix("torch.")
    made = plan_strategy(
        built.model, detect_devices(max_memory, dtype=computes), strategy, tracing, dtype=chosen_dtype
    )
    return SpecPlan(built, made, chosen_dtype, note)
