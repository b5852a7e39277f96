"""Plan a model named by a SPEC (``automap plan SPEC``): build it on meta (:mod:`automap.specs`),
guess or take its example inputs, profile and plan it. Nothing is downloaded and no weights
are allocated."""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch import nn

from automap.errors import ProfileError, SpecError
from automap.sizes import format_bytes
from automap.specs import BuiltModel, build_model

log = logging.getLogger(__name__)


def example_inputs_for(model: nn.Module, batch: int, seq_len: int) -> tuple[Any, str]:
    """Meta example inputs for ``model`` at ``batch`` x ``seq_len`` and a description of them.

    transformers vision models get ``pixel_values`` at their config's image size; everything
    else gets :func:`automap.profiling.default_example_inputs`.
    """
    from automap.profiling import default_example_inputs

    config = getattr(model, "config", None)
    if config is not None and getattr(model, "main_input_name", None) == "pixel_values":
        size = getattr(config, "image_size", 224)
        side = int(size[0] if isinstance(size, (list, tuple)) else size.get("height", 224)
                   if isinstance(size, dict) else size)
        channels = int(getattr(config, "num_channels", 3))
        image = torch.zeros(batch, channels, side, side, device="meta")
        return {"pixel_values": image}, f"pixel_values {batch}x{channels}x{side}x{side}"
    return default_example_inputs(model, seq_len=seq_len, batch=batch)


@dataclass(frozen=True)
class SpecPlan:
    """What ``automap plan SPEC`` produced."""

    built: BuiltModel
    plan: Any
    dtype: torch.dtype | None
    note: str = ""  # what was changed from what was asked (a capped --seq-len)

    def headline(self, seconds: float) -> str:
        """``'LlamaForCausalLM (hf:llama): 68.98B parameters, 128.48 GiB at bfloat16; planned ...'``."""
        dtype = self.dtype or next((p.dtype for p in self.built.model.parameters() if p.is_floating_point()),
                                   torch.float32)
        weights = sum(u.weight_bytes for u in self.plan.units)
        source = f" ({self.built.source})" if self.built.source else ""
        note = f"; {self.note}" if self.note else ""
        return (f"{self.built.label}: {_count(self.built.parameters)} parameters, {format_bytes(weights)} at "
                f"{str(dtype).removeprefix('torch.')}{source}; planned on meta in {seconds:.1f} s{note}")


def _as_inputs(value: Any) -> Any:
    """A forward's inputs as profile takes them: one tensor becomes a 1-tuple."""
    return (value,) if isinstance(value, torch.Tensor) else value


def _count(n: int) -> str:
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.2f}{suffix}"
    return str(n)


def plan_spec(spec: str, overrides: Mapping[str, Any] | None = None, *,
              max_memory: Mapping[int | str, Any] | None = None, strategy: str = "auto",
              batch: int = 1, seq_len: int = 128, dtype: torch.dtype | None = None,
              max_length: int | None = None, example_inputs: Any = None) -> SpecPlan:
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
    from automap.devices import detect_devices, parse_max_memory
    from automap.planning import make_plan
    from automap.profiling import profile
    from automap.profiling.kvcache import profile_generation
    from automap.profiling.refine import Splitter

    if batch < 1 or seq_len < 1:
        raise SpecError(f"--batch and --seq-len must be >= 1, got batch={batch}, seq_len={seq_len}")
    if max_memory is not None:
        parse_max_memory(max_memory)  # a bad size fails now, before the model is built
    built = build_model(spec, overrides)
    chosen_dtype = dtype or built.dtype
    note = ""
    if example_inputs is None:
        seq_len, note = capped_seq_len(built.model, seq_len)
        if note:
            log.info("%s", note)
        inputs, how = example_inputs_for(built.model, batch, seq_len)
    else:
        inputs, how = _as_inputs(example_inputs), "given"
    # Plans are for inference: tracing a backward pass too would double the time for nothing.
    try:
        prof = profile(built.model, inputs, dtype=chosen_dtype, backward=False,
                       guessed="" if example_inputs is not None else how)
    except ProfileError as exc:
        if example_inputs is not None:
            raise
        raise ProfileError(f"{exc}. automap guessed these inputs ({how}); give the model's own: "
                           "--input-shape 1x3x16x112x112 (one tensor; several separated by commas) or "
                           "--example-inputs module:function on the command line, example_inputs=(...) "
                           "in Python") from exc
    prof = dataclasses.replace(prof, example=how if inputs is not None else "")
    if max_length is not None:
        prof = profile_generation(built.model, prof, inputs, batch=batch, max_length=max_length, dtype=chosen_dtype)
    splitter = Splitter(built.model, example_inputs=inputs, dtype=chosen_dtype)  # units that do not fit split
    return SpecPlan(built, make_plan(prof, detect_devices(max_memory), strategy, refine=splitter), chosen_dtype, note)


def capped_seq_len(model: nn.Module, seq_len: int) -> tuple[int, str]:
    """``seq_len``, or the model's ``max_position_embeddings`` when that is smaller (its
    position table has no rows beyond), with a sentence saying so ("" when not capped)."""
    config = getattr(model, "config", None)
    limit = getattr(config, "max_position_embeddings", None) if config is not None else None
    if isinstance(limit, int) and 0 < limit < seq_len and getattr(model, "main_input_name", "") == "input_ids":
        return limit, (f"--seq-len {seq_len} capped at {limit}, the model's max_position_embeddings: "
                       f"planned for {limit} tokens")
    return seq_len, ""
