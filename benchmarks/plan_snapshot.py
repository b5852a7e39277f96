"""Plans of a few models under many budgets, written as JSON, and two such snapshots compared.

    PYTHONPATH=/path/to/before python benchmarks/plan_snapshot.py write before.json
    PYTHONPATH=/path/to/after  python benchmarks/plan_snapshot.py write after.json
    python benchmarks/plan_snapshot.py compare before.json after.json

(run as a file, so that ``PYTHONPATH`` picks the ``automap`` a snapshot plans with)

For refactors of the planner that must not change a plan: every case (a tiny Llama with and
without a generation cache, tied, a tiny GPT-2, ResNet-50 on meta; 14 ``max_memory`` budgets as
fractions of the model's bytes, hypothetical GPUs 0-2, CPU and disk; the three strategies) maps
to ``plan.to_json()`` or the ``AutomapError`` it raised. The disk tier's capacity, the free space
when ``max_memory`` names no disk, is fixed at 20 GiB so that runs at different times compare.
``compare`` exits 1 and lists the cases that differ.
"""

from __future__ import annotations

import argparse
import collections
import json
import shutil
import sys
from typing import Any, Callable

import torch

_Usage = collections.namedtuple("_Usage", "total used free")

FRACTIONS: list[dict[Any, float]] = [
    {0: 2, 1: 2},
    {0: 0.6, 1: 0.6},
    {0: 0.4, 1: 0.4, 2: 0.4},
    {0: 0.3, 1: 0.3, "cpu": 2},
    {0: 0.3, "cpu": 0.2, "disk": 10},
    {0: 0.5, "disk": 10},
    {0: 1.2, "disk": 10},
    {"cpu": 2},
    {"cpu": 0.3, "disk": 10},
    {0: 0.05, 1: 0.1, "cpu": 0.5, "disk": 10},
    {0: 0.15, 1: 0.3, "cpu": 0.1, "disk": 10},
    {0: 0.02, "cpu": 0.05},
    {0: 0.7, 1: 0.2, "cpu": 1.0},
    {0: 0.9, 1: 0.2},
]


def tiny_llama(layers: int, tie: bool = False) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(
        LlamaConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=256,
            max_position_embeddings=128,
            tie_word_embeddings=tie,
        )
    ).eval()


def tiny_gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(
        GPT2Config(
            n_embd=64, n_layer=4, n_head=4, vocab_size=256, n_positions=128, bos_token_id=0, eos_token_id=0
        )
    ).eval()


def resnet50() -> torch.nn.Module:
    import torchvision

    with torch.device("meta"):
        return torchvision.models.resnet50()


def models() -> dict[str, tuple[Callable[[], torch.nn.Module], dict[str, Any]]]:
    ids = lambda batch: {"input_ids": torch.zeros(batch, 8, dtype=torch.long)}  # noqa: E731
    return {
        "llama_kv": (lambda: tiny_llama(4), dict(example_inputs=ids(8), max_length=64)),
        "llama_tied_kv": (lambda: tiny_llama(6, tie=True), dict(batch=4, max_length=96)),
        "llama_plain": (lambda: tiny_llama(4), dict(example_inputs=ids(2))),
        "gpt2_kv": (tiny_gpt2, dict(example_inputs=ids(2), max_length=48)),
        "gpt2": (tiny_gpt2, dict()),
        "resnet50": (resnet50, dict(example_inputs=(torch.zeros(2, 3, 64, 64, device="meta"),))),
    }


def snapshot() -> dict[str, str]:
    """``{case: plan JSON or "ERROR ..."}`` for every model, budget and strategy."""
    import automap

    shutil.disk_usage = lambda path: _Usage(100 << 30, 50 << 30, 20 << 30)  # type: ignore[assignment]
    out = {}
    for name, (build, kwargs) in models().items():
        model = build()
        total = sum(p.numel() * p.element_size() for p in model.parameters())
        for fractions in FRACTIONS:
            budget = {k: int(v * total) for k, v in fractions.items()}
            for strategy in ("auto", "balanced_low_0", "sequential"):
                key = f"{name} {strategy} {fractions}"
                try:
                    out[key] = automap.plan(model, device_map=strategy, max_memory=budget, **kwargs).to_json()
                except automap.AutomapError as exc:
                    out[key] = f"ERROR {type(exc).__name__}: {exc}"
    return out


def compare(before: dict[str, str], after: dict[str, str]) -> list[str]:
    """The cases missing from one snapshot or planned differently."""
    return sorted(k for k in {*before, *after} if before.get(k) != after.get(k))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("write").add_argument("out")
    both = sub.add_parser("compare")
    both.add_argument("before")
    both.add_argument("after")
    args = parser.parse_args()
    if args.command == "write":
        found = snapshot()
        with open(args.out, "w") as f:
            json.dump(found, f, indent=0, sort_keys=True)
        print(json.dumps({"cases": len(found), "errors": sum(v.startswith("ERROR") for v in found.values())}))
        return
    with open(args.before) as f, open(args.after) as g:
        before, after = json.load(f), json.load(g)
    differ = compare(before, after)
    print(json.dumps({"cases": len(before), "identical": len(before) - len(differ), "differ": differ}))
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
