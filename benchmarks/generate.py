"""Greedy decoding with offloaded weights: automap against accelerate and the model all in RAM.

The checkpoint of ``benchmarks/offload.py`` (a Llama-style fp32 model with random weights,
~3 GB at the defaults) is planned with ``automap.plan(skeleton, max_memory={"cpu": budget},
batch=B, max_length=L)``: the RAM budget (25 % of the checkpoint) keeps the KV cache of the
layers computing in RAM beside their weights, the rest of the weights stay on disk. Then, for
batch 1 and 8, each contender runs in a fresh interpreter, in shuffled rounds:

- ``ram``: the whole checkpoint loaded into RAM (the speed to match);
- ``automap``: ``automap.load(skeleton, checkpoint, device_map=plan)`` (public API only:
  offloaded safetensors tensors are referenced in place, nothing is copied);
- ``accelerate``: ``load_checkpoint_and_dispatch`` with the same ``device_map`` and an offload folder.

Each process warms up (one short generate: page cache, allocator), then times ``--runs``
greedy ``generate(max_length=L)`` calls: a forward hook stamps the end of every forward (wall
clock and the process's CPU time), so the prefill (first forward) and the decode (the rest)
are timed apart, and decode tokens/s is ``B * (forwards - 1) / (end of last - end of first)``.
The tokens of every process are compared with the all-in-RAM model's.

A ``calibrate`` process (three, medians taken) measures this machine's constants in CPU time
of one thread (wall time on a shared machine measures the other jobs), each apart from the
others as ``automap.planning.decode`` adds them up on a CPU: memory bandwidth (a sum over 512
MB in RAM); the "disk" link with a warm page cache (the checkpoint's tensors mmapped, each pass
first asking the kernel to map them, ``MADV_POPULATE_READ``, as an mmap offload store does
before a unit runs, then read); and FLOP/s of the model's MLP matrix product with as many rows
as a decode step has (the batch) and as a prefill has (batch x prompt), the time its weights
take to read from RAM taken out: CPU GEMMs with few rows run far below peak. Each batch is planned with its decode constants, so
its predicted decode tokens/s can be set against the measured tokens per CPU-second.

    .venv/bin/python -m benchmarks.generate --root /tmp/automap-gen --rounds 3
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.memwatch import run_fresh
from benchmarks.offload import CHECKPOINT, build_checkpoint, llama_config

log = logging.getLogger("benchmarks.generate")
KINDS = ("ram", "automap", "accelerate")
PROMPT = 32  # tokens per prompt
VOCAB = 32000


def prompts(batch: int):
    import torch

    return torch.randint(3, VOCAB, (batch, PROMPT), generator=torch.Generator().manual_seed(batch))


# ------------------------------------------------------------------ this machine's constants


def _median_cpu_seconds(fn, repeats: int = 7) -> float:
    """Median CPU time of this process over ``repeats`` calls, after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return statistics.median(times)


def calibrate(root: Path, batches: list[int], hidden: int) -> dict[str, Any]:
    """Memory bandwidth (a read of 512 MB in RAM), warm page-cache bandwidth (the checkpoint's
    tensors mmapped, mapped in and read), FLOP/s of the MLP's matrix product with ``batch`` rows
    (a decode step) and ``batch x PROMPT`` rows (the prefill) beyond the time its weights take
    to read, in CPU seconds."""
    import numpy as np
    import torch

    weights = torch.randn(8192, 16384)  # 512 MB
    memory = weights.numel() * 4 / _median_cpu_seconds(weights.sum)
    del weights
    mlp = torch.randn(int(hidden * 2.6875), hidden)  # the model's up/gate projection
    read = mlp.numel() * 4 / memory
    flops = {}
    for rows in sorted({*batches, *(b * PROMPT for b in batches)}):
        inputs = torch.randn(rows, hidden)
        seconds = _median_cpu_seconds(lambda: torch.nn.functional.linear(inputs, mlp))
        flops[str(rows)] = 2 * rows * mlp.numel() / max(seconds - read, 0.1 * seconds)
    mapped = _mmapped_matrices(root / CHECKPOINT, np)
    nbytes = sum(m.numel() * 4 for m in mapped)

    def read_mapped() -> None:
        for m in mapped:
            _populate(m)
            m.sum()

    page_cache = nbytes / _median_cpu_seconds(read_mapped, repeats=3)
    return {
        "cpu_memory_bytes_per_second": memory,
        "cpu_flops_per_second_by_rows": flops,
        "page_cache_bytes_per_second": page_cache,
        "page_cache_probe_bytes": nbytes,
        "threads": torch.get_num_threads(),
    }


def _populate(tensor: Any) -> None:
    """``madvise(MADV_POPULATE_READ)`` over the tensor's pages (Linux 5.14+; 22 is its value)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    start = tensor.data_ptr() - tensor.data_ptr() % mmap.PAGESIZE
    libc.madvise(
        start,
        tensor.data_ptr() + tensor.numel() * tensor.element_size() - start,
        getattr(mmap, "MADV_POPULATE_READ", 22),
    )


def _mmapped_matrices(path: Path, np: Any, limit: int = 1 << 30) -> list:
    """2-D fp32 tensors of the checkpoint as zero-copy views of a read-only mmap (as an offload
    store reads them), up to ``limit`` bytes."""
    import torch

    import warnings

    with path.open("rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_len))
    whole = np.memmap(path, dtype=np.uint8, mode="r")
    warnings.filterwarnings("ignore", "The given NumPy array is not writable")
    found, total = [], 0
    for name, info in header.items():
        if name == "__metadata__" or len(info["shape"]) != 2 or info["dtype"] != "F32" or "embed" in name:
            continue
        start, end = (8 + header_len + o for o in info["data_offsets"])
        found.append(torch.from_numpy(np.asarray(whole[start:end]).view(np.float32).reshape(info["shape"])))
        total += end - start
        if total >= limit:
            break
    return found


def _median_constants(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per constant, the median over calibration processes (the machine's load varies)."""
    merged: dict[str, Any] = {}
    for key, value in runs[0].items():
        if isinstance(value, dict):
            merged[key] = {k: statistics.median(r[key][k] for r in runs) for k in value}
        else:
            merged[key] = statistics.median(r[key] for r in runs)
    merged["calibrations"] = runs
    return merged


# ------------------------------------------------------------------ the plan (made once per batch)


def skeleton(layers: int, hidden: int):
    from transformers import LlamaForCausalLM

    import automap

    with automap.empty_model():
        return LlamaForCausalLM(llama_config(layers, hidden)).eval()


def make_plan(
    root: Path,
    layers: int,
    hidden: int,
    batch: int,
    max_length: int,
    budget_share: float,
    constants: dict[str, Any] | None,
    folder: Path | None = None,
) -> Path:
    """Plan batch ``batch`` for the budget with this machine's ``constants``; write it to ``folder``
    (default ``root``), where every worker reads it."""
    import automap

    budget = int((root / CHECKPOINT).stat().st_size * budget_share)
    speeds = links = bandwidths = None
    if constants:
        speeds = {"cpu": constants["cpu_flops_per_second_by_rows"][str(batch)]}  # a decode step's rows
        bandwidths = {"cpu": constants["cpu_memory_bytes_per_second"]}
        links = {"disk": constants["page_cache_bytes_per_second"]}  # warm page cache: the "disk" reads
    plan = automap.plan(
        skeleton(layers, hidden),
        max_memory={"cpu": budget},
        batch=batch,
        max_length=max_length,
        example_inputs={"input_ids": prompts(batch)},
        speeds=speeds,
        links=links,
        bandwidths=bandwidths,
    )
    path = (folder or root) / f"plan-b{batch}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(plan.to_json())
    return path


# ------------------------------------------------------------------ the contenders (one per process)


def setup(kind: str, root: Path, layers: int, hidden: int, batch: int):
    import automap

    plan = automap.Plan.from_json((root / f"plan-b{batch}.json").read_text())
    checkpoint = root / CHECKPOINT
    if kind == "ram":
        from safetensors.torch import load_file

        model = skeleton(layers, hidden)
        model.load_state_dict(load_file(str(checkpoint)), strict=False, assign=True)
        return model
    if kind == "automap":
        return automap.load(
            skeleton(layers, hidden),
            checkpoint,
            device_map=plan,
            offload_dir=root / f"automap-offload-{batch}",
            quiet=True,
        )
    from accelerate import init_empty_weights, load_checkpoint_and_dispatch
    from transformers import LlamaForCausalLM

    with init_empty_weights():
        model = LlamaForCausalLM(llama_config(layers, hidden)).eval()
    return load_checkpoint_and_dispatch(
        model, str(checkpoint), device_map=plan.device_map, offload_folder=str(root / "accelerate-offload")
    )


def timed_generate(model, ids, max_length: int) -> dict[str, Any]:
    """One greedy generate to ``max_length``; the end of each forward stamped (wall and CPU)."""
    import torch

    stamps: list[tuple[float, float]] = []
    handle = model.register_forward_hook(lambda *_: stamps.append((time.perf_counter(), time.process_time())))
    try:
        start, cpu = time.perf_counter(), time.process_time()
        with torch.no_grad():
            out = model.generate(
                ids,
                max_length=max_length,
                min_length=max_length,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
    finally:
        handle.remove()
    steps = len(stamps) - 1
    decode_wall = stamps[-1][0] - stamps[0][0]
    decode_cpu = stamps[-1][1] - stamps[0][1]
    return {
        "prefill_seconds": stamps[0][0] - start,
        "prefill_cpu_seconds": stamps[0][1] - cpu,
        "decode_steps": steps,
        "decode_tokens_per_second": ids.shape[0] * steps / decode_wall,
        "decode_tokens_per_cpu_second": ids.shape[0] * steps / decode_cpu,
        "tokens": out.tolist(),
    }


def worker(kind: str, root: Path, layers: int, hidden: int, batch: int, max_length: int, runs: int) -> dict:
    import torch

    start = time.perf_counter()
    model = setup(kind, root, layers, hidden, batch)
    setup_seconds = time.perf_counter() - start
    ids = prompts(batch)
    timed_generate(model, ids, PROMPT + 4)  # warm-up: page cache, allocator, first touches
    results = [timed_generate(model, ids, max_length) for _ in range(runs)]
    tokens = results[0]["tokens"]
    assert all(r["tokens"] == tokens for r in results), "greedy decoding changed between runs"
    return {
        "kind": kind,
        "batch": batch,
        "setup_seconds": setup_seconds,
        "threads": torch.get_num_threads(),
        "tokens": tokens,
        "runs": [{k: v for k, v in r.items() if k != "tokens"} for r in results],
        "decode_tokens_per_second": statistics.median(r["decode_tokens_per_second"] for r in results),
        "decode_tokens_per_cpu_second": statistics.median(r["decode_tokens_per_cpu_second"] for r in results),
        "prefill_seconds": statistics.median(r["prefill_seconds"] for r in results),
        "prefill_cpu_seconds": statistics.median(r["prefill_cpu_seconds"] for r in results),
    }


# ------------------------------------------------------------------ the report


def summarise(
    results: list[dict], plans: dict[int, Path], constants: dict[str, Any] | None
) -> dict[str, Any]:
    import automap
    from automap.planning.decode import predict_decode

    summary: dict[str, Any] = {}
    for batch, path in plans.items():
        plan = automap.Plan.from_json(path.read_text())
        mine = [r for r in results if r["batch"] == batch]
        tps = {
            k: statistics.median(r["decode_tokens_per_second"] for r in mine if r["kind"] == k) for k in KINDS
        }
        cpu_tps = {
            k: statistics.median(r["decode_tokens_per_cpu_second"] for r in mine if r["kind"] == k)
            for k in KINDS
        }
        reference = next(r.get("tokens") for r in mine if r["kind"] == "ram")
        decode = predict_decode(plan)
        assert decode is not None
        offloaded = plan.placements.offloaded_bytes
        in_ram = _predicted_in_ram(plan)
        summary[f"batch_{batch}"] = {
            "processes": {k: sum(1 for r in mine if r["kind"] == k) for k in KINDS},
            "decode_tokens_per_second": tps,
            "decode_tokens_per_cpu_second": cpu_tps,
            "automap_vs_accelerate": tps["automap"] / tps["accelerate"],
            "automap_vs_ram": tps["automap"] / tps["ram"],
            "automap_vs_accelerate_cpu_time": cpu_tps["automap"] / cpu_tps["accelerate"],
            "automap_vs_ram_cpu_time": cpu_tps["automap"] / cpu_tps["ram"],
            "tokens_identical": all(r.get("tokens") == reference for r in mine)
            if reference is not None
            else None,
            "prefill_seconds": {
                k: statistics.median(r["prefill_seconds"] for r in mine if r["kind"] == k) for k in KINDS
            },
            "prefill_cpu_seconds": {
                k: statistics.median(r["prefill_cpu_seconds"] for r in mine if r["kind"] == k) for k in KINDS
            },
            "predicted_decode_tokens_per_second": decode.tokens_per_second,
            "predicted_decode_tokens_per_second_in_ram": in_ram,
            "predicted_vs_measured_cpu_time_automap": decode.tokens_per_second / cpu_tps["automap"],
            "predicted_vs_measured_cpu_time_ram": in_ram / cpu_tps["ram"],
            "predicted_vs_measured_wall_automap": decode.tokens_per_second / tps["automap"],
            "predicted_vs_measured_wall_ram": in_ram / tps["ram"],
            "predicted_prefill_seconds": _prefill_seconds(plan, constants, batch),
            "decode_summary": decode.describe(),
            "decode_hint": decode.hint,
            "offloaded_share": offloaded / sum(u.weight_bytes for u in plan.units),
            "kv_bytes": sum(u.kv_bytes for u in plan.units),
        }
    return summary


def _prefill_seconds(plan, constants: dict[str, Any] | None, batch: int) -> float:
    """The plan's predicted prefill with the CPU's FLOP/s at the prefill's rows (batch x prompt)."""
    import dataclasses

    from automap.planning.predict import forward_seconds

    if not constants:
        return forward_seconds(plan)
    rate = constants["cpu_flops_per_second_by_rows"][str(batch * PROMPT)]
    devices = tuple(
        dataclasses.replace(d, flops_per_second=rate) if d.kind == "cpu" else d for d in plan.devices
    )
    return forward_seconds(dataclasses.replace(plan, devices=devices))


def _predicted_in_ram(plan) -> float:
    """The same plan's prediction with every unit resident in RAM (the all-in-RAM contender)."""
    import dataclasses

    from automap.planning.decode import predict_decode

    resident = dataclasses.replace(plan, placement=tuple("cpu" for _ in plan.placement))
    decode = predict_decode(resident)
    assert decode is not None
    return decode.tokens_per_second


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("role", nargs="?", default="main", choices=["main", "calibrate", *KINDS])
    parser.add_argument("--root", type=Path, default=Path("/tmp/automap-gen"))
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--budget-share", type=float, default=0.25)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--new-tokens", type=int, default=16, help="tokens generated after the prompt")
    parser.add_argument("--rounds", type=int, default=3, help="fresh processes per contender and batch")
    parser.add_argument("--runs", type=int, default=2, help="timed generates per process")
    parser.add_argument("--batch", type=int, default=1, help="(worker) the batch to run")
    parser.add_argument("--no-calibrate", action="store_true", help="predict with automap's default speeds")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads in every process (default 1: on a shared machine two "
        "OpenMP threads spin-wait behind other jobs)",
    )
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--resummarise",
        type=Path,
        default=None,
        metavar="JSON",
        help="recompute the summary of an earlier run (its constants and timings) with this code",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s: %(message)s")
    max_length = PROMPT + args.new_tokens
    if args.role != "main" and args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.role == "calibrate":
        print(json.dumps(calibrate(args.root, args.batches, args.hidden)))
        return
    if args.role != "main":
        print(
            json.dumps(
                worker(args.role, args.root, args.layers, args.hidden, args.batch, max_length, args.runs)
            )
        )
        return
    if args.resummarise:
        resummarise(args.resummarise, args)
        return
    build_checkpoint(args.root, args.layers, args.hidden)
    constants = (
        None
        if args.no_calibrate
        else _median_constants(
            [
                run_fresh(
                    "benchmarks.generate",
                    "calibrate",
                    "--root",
                    str(args.root),
                    "--threads",
                    str(args.threads),
                    "--hidden",
                    str(args.hidden),
                    "--batches",
                    *map(str, args.batches),
                )
                for _ in range(3)
            ]
        )
    )
    log.info("constants: %s", constants)
    plans = {
        b: make_plan(args.root, args.layers, args.hidden, b, max_length, args.budget_share, constants)
        for b in args.batches
    }
    flags = [
        "--root",
        str(args.root),
        "--layers",
        str(args.layers),
        "--hidden",
        str(args.hidden),
        "--new-tokens",
        str(args.new_tokens),
        "--runs",
        str(args.runs),
        "--threads",
        str(args.threads),
    ]
    results = []
    order = [(kind, b) for kind in KINDS for b in args.batches]
    for round_ in range(args.rounds):
        random.Random(round_).shuffle(order)
        for kind, batch in order:
            log.info("round %d: %s at batch %d in a fresh process", round_ + 1, kind, batch)
            results.append(run_fresh("benchmarks.generate", kind, "--batch", str(batch), *flags))
    report = {
        "summary": summarise(results, plans, constants),
        "constants": constants,
        "threads": args.threads,
        "max_length": max_length,
        "prompt_tokens": PROMPT,
        "settings": _settings(args),
        "runs": results,
    }
    (args.out or args.root / "generate.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report["summary"], indent=1))


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "layers": args.layers,
        "hidden": args.hidden,
        "budget_share": args.budget_share,
        "batches": args.batches,
        "new_tokens": args.new_tokens,
        "rounds": args.rounds,
        "runs": args.runs,
        "threads": args.threads,
    }


def resummarise(path: Path, args: argparse.Namespace) -> None:
    """Plan again with the run's stored constants and settings (into ``--root``/resummarised)
    and rewrite its summary: predictions follow this code, timings stay as measured."""
    report = json.loads(path.read_text())
    settings = {**_settings(args), **report.get("settings", {})}
    plans = {
        b: make_plan(
            args.root,
            settings["layers"],
            settings["hidden"],
            b,
            report["max_length"],
            settings["budget_share"],
            report["constants"],
            folder=args.root / "resummarised",
        )
        for b in settings["batches"]
    }
    report["summary"] = summarise(report["runs"], plans, report["constants"])
    path.write_text(json.dumps(report, indent=1))
    print(json.dumps(report["summary"], indent=1))


if __name__ == "__main__":
    main()
