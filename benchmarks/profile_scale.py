"""Profile a Llama-2-70B-shaped model (hidden 8192, 80 layers, GQA 8, bf16) built on meta.

Target: 2,048 tokens profile in < 5 s and < 1.5 GiB peak RSS, in a fresh process. Settings:
``train`` (the default profile: forward + backward), ``forward`` (``backward=False``) and, for
context, ``flopcounter`` (plain ``FlopCounterMode`` forward + backward, no attribution). Each run is
a fresh interpreter (``memwatch.run_fresh``) so imports and earlier work do not blur the
memory figures; the report gives medians over runs, as JSON on the last stdout line.

    .venv/bin/python -m benchmarks.profile_scale --runs 3 --out benchmarks/results/profile_scale.json
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.memwatch import MemWatch, read_status, run_fresh

log = logging.getLogger(__name__)

GIB = 2**30
SHAPE = {
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
}


def one_run(tokens: int, backward: bool) -> dict[str, Any]:
    """Build the model on meta and profile it once, in this process."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import automap

    start = time.perf_counter()
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**SHAPE))
    build_seconds = time.perf_counter() - start
    ids = torch.zeros(1, tokens, dtype=torch.long, device="meta")
    with MemWatch() as watch:
        start = time.perf_counter()
        prof = automap.profile(model, {"input_ids": ids}, dtype=torch.bfloat16, backward=backward)
        seconds = time.perf_counter() - start
    layer = prof.index("model.layers.40")
    return {
        "profile_seconds": seconds,
        "build_seconds": build_seconds,
        **watch.result(),
        "peak_rss_bytes": watch.peak_anon_bytes + watch.peak_file_bytes,
        "vm_hwm_bytes": read_status()["VmHWM"],
        "units": len(prof.units),
        "weight_bytes": prof.total_bytes,
        "forward_flops": prof.total_flops,
        "train_flops": prof.total_train_flops,
        "cut_bytes_mid": prof.cut_bytes(layer),
        "layer_peak_activation_bytes": prof.units[layer].peak_activation_bytes,
    }


def baseline_run(tokens: int) -> dict[str, Any]:
    """For context: plain ``FlopCounterMode`` forward + backward of the same model on meta."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**SHAPE)).to(torch.bfloat16)
    ids = torch.zeros(1, tokens, dtype=torch.long, device="meta")
    with MemWatch() as watch, FlopCounterMode(display=False) as counter:
        start = time.perf_counter()
        model(input_ids=ids).logits.sum().backward()
        seconds = time.perf_counter() - start
    return {"profile_seconds": seconds, "train_flops": counter.get_total_flops(), **watch.result()}


def median_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {key: statistics.median(r[key] for r in runs) for key in runs[0]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="fresh processes per setting")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON report here")
    parser.add_argument("--child", choices=["train", "forward", "flopcounter"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        if args.child == "flopcounter":
            result = baseline_run(args.tokens)
        else:
            result = one_run(args.tokens, backward=args.child == "train")
        print(json.dumps(result))
        return result
    report: dict[str, Any] = {
        "model": "Llama-2-70B shape " + json.dumps(SHAPE),
        "dtype": "bfloat16",
        "tokens": args.tokens,
        "runs": args.runs,
        "python": sys.version.split()[0],
    }
    for setting in ("train", "forward", "flopcounter"):
        runs = [
            run_fresh("benchmarks.profile_scale", "--child", setting, "--tokens", str(args.tokens))
            for _ in range(args.runs)
        ]
        report[setting] = {
            "median": median_of(runs),
            "profile_seconds_all": [r["profile_seconds"] for r in runs],
        }
    train = report["train"]["median"]
    report["meets_target"] = train["profile_seconds"] < 5 and train["peak_rss_bytes"] < 1.5 * GIB
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    main()
