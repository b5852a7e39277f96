"""Loading a checkpoint larger than the RAM budget: automap.load against accelerate's
load_checkpoint_and_dispatch, each in a fresh process, same checkpoint, same budget.

    .venv/bin/python -m benchmarks.load --dir /tmp/automap-bench-load --repeats 3

Builds (once) a Llama-style fp32 checkpoint of 2.2 GB (16 layers, hidden 1536) in 400 MB safetensors shards with an
index, random weights. Each run evicts the checkpoint's pages from the page cache first
(posix_fadvise, these files only), so both tools read from disk. Per run: load time, peak
anonymous and file-backed RSS above the baseline (benchmarks/memwatch.py), bytes written to the
offload folder, bytes the process wrote (/proc/self/io). Both models then compute the logits
of one prompt; the two must agree exactly. The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.memwatch import MemWatch, evict, read_io, run_fresh

SHAPE = dict(
    hidden_size=1536,
    intermediate_size=4096,
    num_hidden_layers=16,
    num_attention_heads=16,
    num_key_value_heads=16,
    vocab_size=32000,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)
INDEX = "model.safetensors.index.json"
MB = 1_000_000


def _config():
    from transformers import LlamaConfig

    return LlamaConfig(**SHAPE)


# ------------------------------------------------------------------ the checkpoint


def _shards(shapes: dict[str, tuple[int, ...]], shard_bytes: int) -> list[list[str]]:
    """Consecutive names grouped into shards of at most ``shard_bytes`` (a bigger tensor alone)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = 4 * math.prod(shape)
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def make_checkpoint(folder: Path, shard_bytes: int) -> dict[str, Any]:
    """Write the checkpoint unless ``folder`` already holds this one; return its facts."""
    import torch
    from safetensors.torch import save_file

    from benchmarks.llama import llama_shapes, random_weights

    marker = folder / "bench-config.json"
    wanted = {"shape": SHAPE, "shard_bytes": shard_bytes}
    shapes = llama_shapes(_config())
    facts = {
        "total_bytes": sum(4 * math.prod(s) for s in shapes.values()),
        "largest_tensor_bytes": max(4 * math.prod(s) for s in shapes.values()),
        "tensors": len(shapes),
    }
    if marker.exists() and json.loads(marker.read_text()) == wanted:
        return {**facts, "shards": len(list(folder.glob("*.safetensors")))}
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    shards = _shards(shapes, shard_bytes)
    generator = torch.Generator().manual_seed(0)
    weight_map = {}
    for i, names in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = random_weights(shapes, names, generator)
        save_file(tensors, str(folder / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file))
        del tensors
    (folder / INDEX).write_text(
        json.dumps({"metadata": {"total_size": facts["total_bytes"]}, "weight_map": weight_map})
    )
    marker.write_text(json.dumps(wanted))
    return {**facts, "shards": len(shards)}


# ------------------------------------------------------------------ one load, fresh process


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.exists() else 0


def worker(tool: str, checkpoint: str, budget: int, offload: str, logits_path: str) -> dict[str, Any]:
    import torch
    from transformers import LlamaForCausalLM

    import automap
    from accelerate import init_empty_weights, load_checkpoint_and_dispatch

    config = _config()
    before = read_io()
    with MemWatch() as watch:
        start = time.perf_counter()
        if tool == "automap":
            with automap.empty_model():
                model = LlamaForCausalLM(config).eval()
            automap.load(model, checkpoint, max_memory={"cpu": budget}, offload_dir=offload, quiet=True)
        else:
            with init_empty_weights():
                model = LlamaForCausalLM(config).eval()
            model = load_checkpoint_and_dispatch(
                model,
                checkpoint,
                device_map="auto",
                max_memory={"cpu": budget},
                offload_folder=offload,
                no_split_module_classes=["LlamaDecoderLayer"],
            )
        seconds = time.perf_counter() - start
    after = read_io()
    from automap.offload import backing_file

    # Weights in anonymous RAM: automap's offloaded tensors are real but file-backed views.
    resident = sum(
        t.numel() * t.element_size()
        for t in model.state_dict().values()
        if t.device.type == "cpu" and backing_file(t) is None
    )
    with torch.no_grad():
        logits = model(torch.arange(16).unsqueeze(0)).logits
    torch.save(logits, logits_path)
    return {
        "tool": tool,
        "load_seconds": seconds,
        **watch.result(),
        "offload_dir_bytes": _folder_bytes(Path(offload)),
        "process_write_bytes": after["write_bytes"] - before["write_bytes"],
        "process_read_bytes": after["read_bytes"] - before["read_bytes"],
        "cpu_resident_weight_bytes": resident,
    }


def run_one(tool: str, checkpoint: Path, budget: int, scratch: Path, cold: bool) -> dict[str, Any]:
    offload = scratch / f"offload-{tool}"
    shutil.rmtree(offload, ignore_errors=True)
    if cold:
        evict(checkpoint.glob("*.safetensors"))
    logits = scratch / f"logits-{tool}.pt"
    result = run_fresh(
        "benchmarks.load",
        "--worker",
        tool,
        "--dir",
        str(checkpoint),
        "--budget",
        str(budget),
        "--offload",
        str(offload),
        "--logits",
        str(logits),
    )
    shutil.rmtree(offload, ignore_errors=True)
    return result


# ------------------------------------------------------------------ summary


def summarise(runs: list[dict[str, Any]], facts: dict[str, Any], budget: int) -> dict[str, Any]:
    tools: dict[str, Any] = {}
    for tool in ("automap", "accelerate"):
        mine = [r for r in runs if r["tool"] == tool]
        tools[tool] = {
            "load_seconds_median": statistics.median(r["load_seconds"] for r in mine),
            "load_seconds": [round(r["load_seconds"], 3) for r in mine],
            "peak_anon_above_base_bytes_max": max(r["peak_anon_above_base_bytes"] for r in mine),
            "peak_file_above_base_bytes_max": max(r["peak_file_above_base_bytes"] for r in mine),
            "offload_dir_bytes_max": max(r["offload_dir_bytes"] for r in mine),
            "process_write_bytes_max": max(r["process_write_bytes"] for r in mine),
            "cpu_resident_weight_bytes": mine[0]["cpu_resident_weight_bytes"],
        }
    ratio = tools["automap"]["load_seconds_median"] / tools["accelerate"]["load_seconds_median"]
    anon_limit = budget + facts["largest_tensor_bytes"] + 300 * MB
    return {
        "checkpoint": facts,
        "budget_bytes": budget,
        "tools": tools,
        "time_ratio_automap_over_accelerate": ratio,
        "targets": {
            "anon_limit_bytes": anon_limit,
            "anon_within_limit": tools["automap"]["peak_anon_above_base_bytes_max"] <= anon_limit,
            "zero_bytes_written": tools["automap"]["offload_dir_bytes_max"] == 0,
            "time_ratio_at_most_half": ratio <= 0.5,
        },
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "automap-bench-load"))
    parser.add_argument("--shard-mb", type=int, default=400)
    parser.add_argument("--budget-fraction", type=float, default=0.25)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warm", action="store_true", help="leave the checkpoint in the page cache")
    parser.add_argument("--out", help="also write the JSON here")
    parser.add_argument("--worker", choices=("automap", "accelerate"), help=argparse.SUPPRESS)
    parser.add_argument("--budget", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--offload", help=argparse.SUPPRESS)
    parser.add_argument("--logits", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, args.dir, args.budget, args.offload, args.logits)))
        return
    folder = Path(args.dir)
    facts = make_checkpoint(folder / "checkpoint", args.shard_mb * MB)
    budget = int(facts["total_bytes"] * args.budget_fraction)
    runs = []
    for _ in range(args.repeats):
        for tool in ("accelerate", "automap"):
            runs.append(run_one(tool, folder / "checkpoint", budget, folder, cold=not args.warm))
            print(
                f"{tool}: {runs[-1]['load_seconds']:.2f} s, anon +{runs[-1]['peak_anon_above_base_bytes'] / MB:.0f} MB, "
                f"file +{runs[-1]['peak_file_above_base_bytes'] / MB:.0f} MB, "
                f"wrote {runs[-1]['offload_dir_bytes'] / MB:.0f} MB",
                file=sys.stderr,
            )
    summary = summarise(runs, facts, budget)
    import torch

    a, b = (torch.load(folder / f"logits-{t}.pt") for t in ("automap", "accelerate"))
    summary["logits_max_abs_diff"] = (a - b).abs().max().item()
    summary["cache"] = "warm" if args.warm else "cold (checkpoint pages evicted before each run)"
    summary["runs"] = runs
    text = json.dumps(summary)
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1))
    print(text)


if __name__ == "__main__":
    main()
