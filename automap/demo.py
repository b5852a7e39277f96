"""``automap demo`` / ``make demo``: the main job on an embedded default.

Builds torchvision's ResNet-50 and a small Llama-style model (random weights, nothing is
downloaded), prints their plans for this machine and for a hypothetical 2-GPU + CPU + disk
machine, then dispatches each under a RAM budget that forces part of it onto disk, runs it,
and checks that the outputs equal the plain model's. Without transformers (installed by
``pip install "automap[hf]"``) the Llama half is skipped with a line that says so.

``automap demo --save DIR`` (:func:`save_examples`) instead writes the model folders the docs'
snippets name — small random-weight Hugging Face folders, what ``save_pretrained`` writes — so
that every snippet runs offline from a fresh clone.
"""

from __future__ import annotations

import importlib.util
import os
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

    config = LlamaConfig(
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=8000,
        max_position_embeddings=512,
    )
    return LlamaForCausalLM(config).eval(), (torch.randint(0, 8000, (1, 48)),)


# The docs' example folders (automap demo --save DIR): name -> (config fields, shard size). Small
# shapes of the families the docs use; gptj is sharded like the big checkpoints it stands for.
EXAMPLES: dict[str, tuple[dict[str, Any], str | None]] = {
    "llama": (
        dict(
            model_type="llama",
            hidden_size=256,
            intermediate_size=768,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=4,
            vocab_size=8000,
            max_position_embeddings=512,
        ),
        None,
    ),
    "gptj": (
        dict(
            model_type="gptj",
            n_embd=256,
            n_layer=4,
            n_head=8,
            rotary_dim=16,
            vocab_size=8000,
            n_positions=512,
            bos_token_id=0,
            eos_token_id=0,
        ),
        "4MB",
    ),
}


def save_examples(directory: str | os.PathLike[str]) -> list[str]:
    """Write the docs' example model folders under ``directory`` (``llama``, ``gptj``: config.json
    and safetensors weights, random, seeded) and return one line per folder. A folder that
    exists already is kept as it is (nothing of the user's is overwritten).

    Raises:
        DependencyError: transformers is not installed.
    """
    from automap.loading.hf import import_transformers

    transformers = import_transformers("automap demo --save")
    bars = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()
    try:
        return _save(transformers, directory)
    finally:
        if bars:
            transformers.utils.logging.enable_progress_bar()


def _save(transformers: Any, directory: str | os.PathLike[str]) -> list[str]:
    lines = []
    for name, (fields, shard) in EXAMPLES.items():
        target = os.path.join(directory, name)
        if os.path.lexists(target):
            lines.append(f"kept {target} (it exists already)")
            continue
        torch.manual_seed(0)
        config = transformers.AutoConfig.for_model(**fields)
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
        model.save_pretrained(target, **({"max_shard_size": shard} if shard else {}))
        size = sum(os.path.getsize(os.path.join(target, f)) for f in os.listdir(target))
        lines.append(f"wrote {target} ({type(model).__name__}, random weights, {format_bytes(size)})")
    return lines


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
        hypothetical: dict[int | str, int | str] = {
            0: int(size * 0.3),
            1: int(size * 0.3),
            "cpu": int(size * 0.25),
            "disk": "1TB",
        }
        _show(
            "plan for a hypothetical 2 GPU + CPU + disk machine (GPUs hold 30% each)",
            plan(model, max_memory=hypothetical, example_inputs=inputs).report(),
            say,
        )
        with torch.no_grad():
            expected = _logits(model(*inputs))
        budget = int(size * 0.4)
        with tempfile.TemporaryDirectory(prefix="automap-demo-") as offload_dir:
            chosen = plan(model, max_memory={"cpu": budget}, example_inputs=inputs, offload_dir=offload_dir)
            dispatch(model, chosen, offload_dir=offload_dir)
            _show(
                f"dispatched with a RAM budget of {format_bytes(budget)}; where each tensor really is",
                placement(model).report(),
                say,
            )
            start = time.perf_counter()
            with torch.no_grad():
                got = _logits(model(*inputs))
            seconds = time.perf_counter() - start
            undispatch(model)
        diff = (got - expected).abs().max().item()
        same = diff <= 1e-6
        ok &= same
        say(
            f"\nforward, part of the weights on disk: {format_seconds(seconds)}; max |dispatched - plain| {format_number(diff)} "
            f"-> {'IDENTICAL' if same else 'DIFFERENT'}"
        )
    if len(models) == 1:
        say(
            '\nskipped the Llama half: it needs transformers, which is not installed; pip install "automap[hf]"'
        )
    say("\ndemo " + ("passed: dispatched outputs equal the plain model's" if ok else "FAILED"))
    return ok
