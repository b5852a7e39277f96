"""What a CPU budget bounds on CPU execution: the anonymous memory of a process that runs a model
with ``max_memory={"cpu": share * model bytes}`` and the rest on disk.

Writes a Llama-style fp32 checkpoint (random weights, seeded), then for each share runs, in a
fresh interpreter each:

- ``load``: a meta skeleton loaded with ``automap.load`` (offloaded tensors referenced in the
  checkpoint in place) and one forward;
- ``dispatch``: the model built in RAM with its weights, ``automap.dispatch`` (offloaded tensors
  written to an offload store and released from RAM), then one forward.

Each reports the plan's bytes in CPU RAM and the process's anonymous memory above its
post-import baseline (``RssAnon``, sampled every 2 ms): the peak while loading, the level after
dispatching, and the peak during the forward. Disk units are memory-mapped, so their pages are
page cache (``RssFile``), which the budget does not count.

    python -m benchmarks.budget_memory --root /tmp/automap-budget --json benchmarks/notes/budget_memory.json
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import sys
from pathlib import Path
from typing import Any

from benchmarks.memwatch import MemWatch, read_status, run_fresh

CHECKPOINT = "model.safetensors"
SHARES = (0.3, 0.1, 0.0)
TOKENS = 64


def config(layers: int, hidden: int) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=hidden,
        intermediate_size=int(hidden * 2.6875),
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=16,
        vocab_size=32000,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )


def write_checkpoint(root: Path, layers: int, hidden: int) -> Path:
    import torch
    from safetensors.torch import save_file

    from benchmarks.llama import llama_shapes, random_weights

    path = root / f"llama-{layers}x{hidden}" / CHECKPOINT
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        shapes = llama_shapes(config(layers, hidden))
        save_file(random_weights(shapes, shapes, torch.Generator().manual_seed(0)), str(path))
    return path


def worker(
    mode: str, checkpoint: Path, layers: int, hidden: int, share: float, offload: Path
) -> dict[str, Any]:
    import torch
    from transformers import LlamaForCausalLM

    import automap

    torch.set_num_threads(1)
    ids = torch.randint(0, 32000, (1, TOKENS), generator=torch.Generator().manual_seed(1))
    total = checkpoint.stat().st_size
    budget = int(share * total)
    gc.collect()
    base = read_status()["RssAnon"]
    with MemWatch() as setup:
        if mode == "load":
            with automap.empty_model():
                model = LlamaForCausalLM(config(layers, hidden)).eval()
            automap.load(model, checkpoint, max_memory={"cpu": budget}, offload_dir=offload, quiet=True)
        else:
            from safetensors.torch import load_file

            model = LlamaForCausalLM(config(layers, hidden)).eval()
            model.load_state_dict(load_file(str(checkpoint)))
            automap.dispatch(
                model, max_memory={"cpu": budget}, offload_dir=offload, example_inputs={"input_ids": ids}
            )
    gc.collect()
    after = read_status()["RssAnon"] - base
    plan = automap.placement(model)
    with MemWatch() as forward, torch.no_grad():
        model(ids, use_cache=False)
    return {
        "mode": mode,
        "share": share,
        "budget_bytes": budget,
        "model_bytes": total,
        "plan_cpu_bytes": plan.placements.bytes_on.get("cpu", 0),
        "setup_peak_anon_bytes": setup.peak_anon_bytes - base,
        "after_setup_anon_bytes": after,
        "forward_peak_anon_bytes": forward.peak_anon_bytes - base,
        "forward_peak_file_bytes": forward.peak_file_bytes - forward.base_file_bytes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("role", nargs="?", default="main", choices=["main", "load", "dispatch"])
    parser.add_argument("--root", type=Path, default=Path("/tmp/automap-budget"))
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--share", type=float, default=0.1)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    checkpoint = args.root / f"llama-{args.layers}x{args.hidden}" / CHECKPOINT
    if args.role != "main":
        offload = args.root / f"offload-{args.role}-{args.share}"
        try:
            print(json.dumps(worker(args.role, checkpoint, args.layers, args.hidden, args.share, offload)))
        finally:
            shutil.rmtree(offload, ignore_errors=True)
        return
    write_checkpoint(args.root, args.layers, args.hidden)
    rows = [
        run_fresh(
            "benchmarks.budget_memory",
            mode,
            "--root",
            str(args.root),
            "--layers",
            str(args.layers),
            "--hidden",
            str(args.hidden),
            "--share",
            str(share),
        )
        for share in SHARES
        for mode in ("load", "dispatch")
    ]
    mib = 2**20
    print("| mode | budget | plan: in RAM | peak anon, setup | anon after setup | peak anon, forward |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['mode']} | {r['share']:.0%} = {r['budget_bytes'] / mib:.0f} MiB | {r['plan_cpu_bytes'] / mib:.0f} MiB "
            f"| {r['setup_peak_anon_bytes'] / mib:.0f} MiB | {r['after_setup_anon_bytes'] / mib:.0f} MiB "
            f"| {r['forward_peak_anon_bytes'] / mib:.0f} MiB |"
        )
    if args.json:
        args.json.write_text(
            json.dumps({"model_bytes": rows[0]["model_bytes"], "rows": rows}, indent=2) + "\n"
        )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
