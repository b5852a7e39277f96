"""Mixture-of-experts from disk: bytes read and time of a cold one-token forward.

Builds small transformers MoE models (random weights, fp32): a Mixtral shape (8 experts, top-2)
and a Qwen2-MoE shape (16 experts, top-4, a shared expert). Every decoder layer is placed on
disk (an offload store), the rest stays in RAM. Before each forward the store's pages are
dropped from the page cache, and a one-token forward runs (the decode step of a model bigger
than RAM, without a cache). Each (model, batch) runs in a fresh interpreter, which reports:

- ``read_bytes``: bytes of the store brought into memory by the forward (pages resident after
  it, by ``mincore``; they were evicted before), median over the runs;
- ``need_bytes``: what the routing needs: each layer's dense part (attention, norms, router,
  shared expert) and its routed experts (the union over the batch's tokens), from the
  routing the plain model takes;
- ``cold_seconds``: the forward's time, median;
- ``max_abs_diff`` against the plain model's logits (0.0 expected: the same kernels).

With ``--baseline DIR`` the same runs are made with the automap package of another checkout
(e.g. a ``git worktree`` of an earlier commit) and the speed-up is printed.

    python -m benchmarks.moe --runs 5 --baseline /tmp/automap-main
"""
from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import statistics
import sys
import tempfile
import time
from typing import Any

from benchmarks.memwatch import run_fresh

PAGE = mmap.PAGESIZE
LIBC = ctypes.CDLL(None, use_errno=True)
LIBC.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)


# ------------------------------------------------------------------ models


def build(kind: str, layers: int) -> Any:
    import torch
    import transformers

    common = dict(vocab_size=1024, hidden_size=512, num_hidden_layers=layers, num_attention_heads=8,
                  num_key_value_heads=4, max_position_embeddings=128)
    if kind == "mixtral":
        config = transformers.MixtralConfig(**common, intermediate_size=1536, num_local_experts=8, num_experts_per_tok=2)
        model_class = transformers.MixtralForCausalLM
    elif kind == "qwen2_moe":
        config = transformers.Qwen2MoeConfig(**common, intermediate_size=1536, num_experts=16, num_experts_per_tok=4,
                                             moe_intermediate_size=768, shared_expert_intermediate_size=2048)
        model_class = transformers.Qwen2MoeForCausalLM
    else:
        raise SystemExit(f"unknown model {kind!r}: mixtral or qwen2_moe")
    torch.manual_seed(0)
    return model_class(config).eval()


def expert_modules(model: Any) -> list[Any]:
    """Each layer's experts (a module stacking them, or a ``ModuleList`` in older transformers)."""
    return [m for layer in model.model.layers for n, m in layer.named_modules() if n.endswith("experts")]


def per_expert_bytes(experts: Any) -> int:
    if hasattr(experts, "__len__"):  # a ModuleList of experts
        return sum(t.nbytes for t in experts[0].state_dict().values())
    return sum(p.nbytes // p.shape[0] for p in experts.parameters(recurse=False))


def need_bytes(model: Any, routed: list[set[int]]) -> int:
    """Bytes the forward needs of the layers: all but the experts, plus the routed experts."""
    total = 0
    for layer, experts, used in zip(model.model.layers, expert_modules(model), routed):
        layer_bytes = sum(t.nbytes for t in layer.state_dict().values())
        all_experts = sum(t.nbytes for t in experts.state_dict().values())
        total += layer_bytes - all_experts + per_expert_bytes(experts) * len(used)
    return total


def routing(model: Any, ids: Any) -> tuple[Any, list[set[int]]]:
    """The plain model's logits and, per layer, the experts its tokens went to."""
    import torch

    routed: list[set[int]] = [set() for _ in expert_modules(model)]
    handles = []
    for index, experts in enumerate(expert_modules(model)):
        if hasattr(experts, "__len__"):  # listed: an expert is used when it is called
            for number, expert in enumerate(experts):
                def called(module: Any, args: tuple, index: int = index, number: int = number) -> None:
                    routed[index].add(number)
                handles.append(expert.register_forward_pre_hook(called))
            continue

        def record(module: Any, args: tuple, index: int = index) -> None:
            routed[index].update(int(i) for i in args[1].flatten().tolist() if 0 <= int(i) < module.num_experts)
        handles.append(experts.register_forward_pre_hook(record))
    with torch.no_grad():
        logits = model(ids, use_cache=False).logits
    for handle in handles:
        handle.remove()
    return logits, routed


# ------------------------------------------------------------------ one measured process


def resident_bytes(files: list[Any]) -> int:
    """Bytes of the mapped store files in memory now."""
    total = 0
    for mapped in files:
        size = len(mapped._map)
        vector = ctypes.create_string_buffer((size + PAGE - 1) // PAGE)
        LIBC.mincore(mapped.address, size, vector)
        total += sum(b & 1 for b in vector.raw) * PAGE
    return total


def worker(kind: str, batch: int, runs: int, layers: int, automap_from: str | None) -> dict[str, Any]:
    if automap_from:
        sys.path.insert(0, automap_from)
    import torch

    import automap
    from automap.runtime.state import state_of

    torch.set_num_threads(2)
    model = build(kind, layers)
    ids = torch.randint(0, 1024, (batch, 1), generator=torch.Generator().manual_seed(1))
    expected, routed = routing(model, ids)
    needed = need_bytes(model, routed)
    device_map: dict[str, Any] = {"model.embed_tokens": "cpu", "model.norm": "cpu", "lm_head": "cpu",
                                  "model.rotary_emb": "cpu"}
    device_map.update({f"model.layers.{i}": "disk" for i in range(layers)})
    with tempfile.TemporaryDirectory(prefix="automap-moe-") as folder:
        automap.dispatch(model, device_map=device_map, offload_dir=folder)
        source = state_of(model).source
        files = list(source.files.values())
        seconds, read, diff = [], [], 0.0
        for _ in range(runs):
            os.sync()
            source.evict()
            before = resident_bytes(files)
            start = time.perf_counter()
            with torch.no_grad():
                logits = model(ids, use_cache=False).logits
            seconds.append(time.perf_counter() - start)
            read.append(resident_bytes(files) - before)
            diff = max(diff, (logits - expected).abs().max().item())
        automap.undispatch(model)
    return {"model": kind, "batch": batch, "cold_seconds": statistics.median(seconds), "all_seconds": seconds,
            "read_bytes": statistics.median(read), "need_bytes": needed,
            "routed_experts": [sorted(r) for r in routed], "max_abs_diff": diff,
            "automap": automap_from or "this checkout"}


# ------------------------------------------------------------------ the comparison


def measure(kind: str, batch: int, args: argparse.Namespace, automap_from: str | None) -> dict[str, Any]:
    extra = ["--automap-from", automap_from] if automap_from else []
    return run_fresh("benchmarks.moe", "--worker", kind, "--batch", str(batch), "--runs", str(args.runs),
                     "--layers", str(args.layers), *extra)


def compare(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for kind in args.models.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            ours = measure(kind, batch, args, None)
            row: dict[str, Any] = {"model": kind, "batch": batch, "automap": ours,
                                   "read_vs_need": ours["read_bytes"] / ours["need_bytes"]}
            if args.baseline:
                base = measure(kind, batch, args, args.baseline)
                row["baseline"] = base
                row["speedup_vs_baseline"] = base["cold_seconds"] / ours["cold_seconds"]
                row["baseline_read_vs_need"] = base["read_bytes"] / base["need_bytes"]
            rows.append(row)
            print(line(row), flush=True)
    return rows


def line(row: dict[str, Any]) -> str:
    ours = row["automap"]
    text = (f"{row['model']:>9} batch {row['batch']}: read {ours['read_bytes'] / 2**20:.1f} MiB, router needs "
            f"{ours['need_bytes'] / 2**20:.1f} MiB ({row['read_vs_need']:.2f}x), cold forward "
            f"{ours['cold_seconds'] * 1e3:.0f} ms, max abs diff {ours['max_abs_diff']}")
    if "baseline" in row:
        base = row["baseline"]
        text += (f"; baseline read {base['read_bytes'] / 2**20:.1f} MiB ({row['baseline_read_vs_need']:.2f}x), "
                 f"{base['cold_seconds'] * 1e3:.0f} ms: {row['speedup_vs_baseline']:.2f}x faster")
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mixtral,qwen2_moe")
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--baseline", help="a checkout whose automap package to compare against")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--automap-from", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.batch, args.runs, args.layers, args.automap_from)))
        return
    rows = compare(args)
    print(json.dumps(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
