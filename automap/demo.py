"""``automap demo`` / ``make demo``: the main job on an embedded default.

Builds torchvision's ResNet-50 and a small Llama-style model (random weights, nothing is
downloaded), prints their plans for this machine and for a hypothetical 2-GPU + CPU + disk
machine, then dispatches each under a RAM budget that forces part of it onto disk, runs it,
and checks that the outputs equal the plain model's. Without transformers (installed by
``pip install "automap[hf]"``) the Llama half is skipped with a line that says so.
"""
from __future__ import annotations

import importlib.util
import tempfile
import time
from typing import Any, Callable

import torch
from torch import nn

from automap.api import dispatch, plan
from automap.runtime import undispatch
from automap.report import placement
from automap.sizes import format_bytes, format_number, format_seconds


def _resnet50() -> tuple[nn.Module, tuple[Any, ...]]:
    import torchvision

    return torchvision.models.resnet50().eval(), (torch.randn(2, 3, 128, 128),)


def _llama() -> tuple[nn.Module, tuple[Any, ...]]:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                         num_key_value_heads=4, vocab_size=8000, max_position_embeddings=512)
    return LlamaForCausalLM(config).eval(), (torch.randint(0, 8000, (1, 48)),)


def _logits(output: Any) -> torch.Tensor:
    return output.logits if hasattr(output, "logits") else output


def _show(title: str, text: str, say: Callable[[str], None]) -> None:
    say(f"\n== {title}\n{text}")


def run_demo(say: Callable[[str], None] = print) -> bool:
    """Run the demo; return True when every dispatched output equals the plain one."""
    torch.manual_seed(0)
    ok = True
    models = [("ResNet-50 (torchvision)", _resnet50)]
    if importlib.util.find_spec("transformers") is not None:
        models.append(("Llama-style LM (transformers config)", _llama))
    for label, build in models:
        model, inputs = build()
        size = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        say(f"\n######## {label}: {format_bytes(size)} of fp32 weights")
        _show("plan for this machine", plan(model, example_inputs=inputs).report(), say)
        hypothetical: dict[int | str, int | str] = {0: int(size * 0.3), 1: int(size * 0.3),
                                                    "cpu": int(size * 0.25), "disk": "1TB"}
        _show("plan for a hypothetical 2 GPU + CPU + disk machine (GPUs hold 30% each)",
              plan(model, max_memory=hypothetical, example_inputs=inputs).report(), say)
        with torch.no_grad():
            expected = _logits(model(*inputs))
        budget = int(size * 0.4)
        with tempfile.TemporaryDirectory(prefix="automap-demo-") as offload_dir:
            chosen = plan(model, max_memory={"cpu": budget}, example_inputs=inputs, offload_dir=offload_dir)
            dispatch(model, chosen, offload_dir=offload_dir)
            _show(f"dispatched with a RAM budget of {format_bytes(budget)}; where each tensor really is",
                  placement(model).report(), say)
            start = time.perf_counter()
            with torch.no_grad():
                got = _logits(model(*inputs))
            seconds = time.perf_counter() - start
            undispatch(model)
        diff = (got - expected).abs().max().item()
        same = diff <= 1e-6
        ok &= same
        say(f"\nforward, part of the weights on disk: {format_seconds(seconds)}; max |dispatched - plain| {format_number(diff)} "
            f"-> {'IDENTICAL' if same else 'DIFFERENT'}")
    if len(models) == 1:
        say('\nskipped the Llama half: it needs transformers, which is not installed; pip install "automap[hf]"')
    say("\ndemo " + ("passed: dispatched outputs equal the plain model's" if ok else "FAILED"))
    return ok
