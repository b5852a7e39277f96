"""torch.compile on dispatched models: eager vs compiled forward, with and without offload, CPU.

One Llama-style model (random weights) is run six ways on the same input:

- ``plain``: the model in RAM, no hooks;
- ``automap``: ``automap.dispatch`` with half its weights on disk (units streamed from a store
  of copy-on-write views);
- ``accelerate``: ``accelerate.dispatch_model`` with the same device map and an offload folder;

each eager and under ``torch.compile`` (inductor). Forwards are timed in interleaved rounds
(shuffled order, ``torch.no_grad``) and the median per forward is reported; the first compiled
call (compile time) is timed apart. ``torch._dynamo.explain`` counts the graphs and graph breaks
of each compiled variant, and every compiled output is compared with the plain model's.

One intra-op thread by default (see ``overhead.py``: on a shared 2-core machine a second
OpenMP thread only adds noise). Warm page cache: the offloaded weights were just written.

    python -m benchmarks.compile [--layers 6] [--hidden 512] [--tokens 128] [--rounds 15] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn


def build(layers: int, hidden: int) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=8,
        vocab_size=8192,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def half_on_disk(model: nn.Module) -> dict[str, int | str]:
    """automap's map for a CPU budget of half the weights: the rest goes to disk."""
    import automap

    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    return automap.plan(model, max_memory={"cpu": weights // 2}).device_map


def variants(plain: nn.Module, device_map: dict[str, int | str], folder: Path) -> dict[str, nn.Module]:
    import accelerate

    import automap

    ours = automap.dispatch(copy.deepcopy(plain), device_map, offload_dir=folder / "automap")
    theirs = accelerate.dispatch_model(
        copy.deepcopy(plain), device_map, offload_dir=str(folder / "accelerate")
    )
    return {"plain": plain, "automap": ours, "accelerate": theirs}


def logits(model: Callable[..., Any], ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def graphs_of(model: nn.Module, ids: torch.Tensor) -> dict[str, Any]:
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            explained = torch._dynamo.explain(model)(ids)
    except Exception as exc:  # noqa: BLE001 - a variant that does not trace is a result, not a crash
        return {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    finally:
        torch._dynamo.reset()
    return {
        "graphs": explained.graph_count,
        "graph_breaks": explained.graph_break_count,
        "reasons": sorted({r.reason.splitlines()[0][:120] for r in explained.break_reasons}),
    }


def compiled(models: dict[str, nn.Module], ids: torch.Tensor, expected: torch.Tensor) -> dict[str, Any]:
    """Compile each model; the first call's seconds (dynamo reset before each: the variants share
    code objects; inductor's on-disk cache may be warm) and how far its outputs are from eager.
    The compiled functions recompile once more in the timing warm-up, after the last reset."""
    result: dict[str, Any] = {}
    for name, model in models.items():
        torch._dynamo.reset()
        fn = torch.compile(model)
        start = time.perf_counter()
        try:
            out = logits(fn, ids)
        except Exception as exc:  # noqa: BLE001 - recorded: accelerate's hooks may not compile
            result[name] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
            continue
        result[name] = {
            "fn": fn,
            "compile_seconds": time.perf_counter() - start,
            "max_abs_diff": float((out - expected).abs().max()),
        }
    return result


def timed(calls: dict[str, Callable[[], Any]], rounds: int, warmup: int) -> dict[str, float]:
    samples: dict[str, list[float]] = {name: [] for name in calls}
    order = list(calls)
    for round_ in range(warmup + rounds):
        random.shuffle(order)
        for name in order:
            start = time.perf_counter()
            calls[name]()
            if round_ >= warmup:
                samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(s) * 1e3 for name, s in samples.items()}


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    plain = build(args.layers, args.hidden)
    ids = torch.randint(0, 8192, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    expected = logits(plain, ids)
    device_map = half_on_disk(plain)
    with tempfile.TemporaryDirectory() as tmp:
        models = variants(plain, device_map, Path(tmp))
        for name, model in models.items():
            assert torch.equal(logits(model, ids), expected), f"{name} eager differs from the plain model"
        graphs = {name: graphs_of(model, ids) for name, model in models.items()}
        compiled_ = compiled(models, ids, expected)
        calls: dict[str, Callable[[], Any]] = {
            f"{n} eager": (lambda m=m: logits(m, ids)) for n, m in models.items()
        }
        calls.update(
            {f"{n} compiled": (lambda f=c["fn"]: logits(f, ids)) for n, c in compiled_.items() if "fn" in c}
        )
        medians = timed(calls, args.rounds, args.warmup)
    weights = sum(t.numel() * t.element_size() for t in plain.state_dict().values())
    rows = {}
    for name in models:
        info = {k: v for k, v in compiled_[name].items() if k != "fn"}
        rows[name] = {
            "eager_ms": medians[f"{name} eager"],
            "compiled_ms": medians.get(f"{name} compiled"),
            **info,
            **{f"explain_{k}": v for k, v in graphs[name].items()},
        }
    return {
        "model": f"Llama {args.layers} layers, hidden {args.hidden}, vocab 8192",
        "weight_bytes": weights,
        "tokens": args.tokens,
        "threads": args.threads,
        "rounds": args.rounds,
        "on_disk_units": sum(1 for v in device_map.values() if v == "disk"),
        "units": len(device_map),
        "torch": torch.__version__,
        "rows": rows,
    }


def table(result: dict[str, Any]) -> str:
    lines = [
        f"{result['model']}, {result['weight_bytes'] / 1e6:.0f} MB fp32, 1 x {result['tokens']} tokens, "
        f"{result['on_disk_units']} of {result['units']} units on disk; median of {result['rounds']} rounds",
        f"{'variant':<11} {'eager ms':>9} {'compiled ms':>12} {'speed-up':>9} {'compile s':>10} "
        f"{'graphs':>7} {'breaks':>7} {'max |diff|':>11}",
    ]
    for name, row in result["rows"].items():
        if row.get("compiled_ms") is None:
            lines.append(f"{name:<11} {row['eager_ms']:>9.1f}   compile failed: {row.get('error', '?')}")
            continue
        lines.append(
            f"{name:<11} {row['eager_ms']:>9.1f} {row['compiled_ms']:>12.1f} "
            f"{row['eager_ms'] / row['compiled_ms']:>8.2f}x {row['compile_seconds']:>10.1f} "
            f"{row.get('explain_graphs', '-'):>7} {row.get('explain_graph_breaks', '-'):>7} "
            f"{row['max_abs_diff']:>11.2e}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    result = run(args)
    print(table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
