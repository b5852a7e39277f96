"""Offloaded inference: automap against accelerate and against the model all in RAM.

Builds a Llama-style fp32 checkpoint (random weights, ~3 GB at the defaults), plans it with a
RAM budget of ~25% of its size (the rest on disk), then runs, each in a fresh interpreter:

- ``ram``: the whole model loaded into RAM (the speed to match);
- ``automap``: a meta skeleton, resident weights read from the checkpoint, offloaded ones
  referenced in place (nothing written), dispatched with ``dispatch_plan(..., store=)``;
- ``accelerate``: ``load_checkpoint_and_dispatch`` with the same device map and an offload folder.

Each of those processes reports its forward latency (median of ``--runs`` after one warm-up)
with a warm page cache, peak anonymous and file-backed RSS above the post-import baseline
(sampled from /proc/self/status), bytes read and written, and cold-cache forwards (offloaded
files evicted with ``posix_fadvise(DONTNEED)`` before each), set against bytes read / measured
disk bandwidth, and against the disk's bound (:mod:`benchmarks.diskbound`: offloaded bytes / the
better of one reader and four in flight, measured before and after the contenders, the faster
kept): ``automap_cold_vs_disk_bound`` and ``automap_cold_vs_accelerate_cold``. A fourth process, ``timing``, sets up all three and times their warm forwards
in interleaved, shuffled rounds: on a machine shared with other work this is the comparison
that holds (the load hits all three alike); CPU time of the process is reported beside wall time.
With ``--cold-runs``, two more: ``automap_direct``, automap reading its offloaded units past the
page cache (``AUTOMAP_COLD_READS=direct``: ``O_DIRECT`` into its own buffers, the path it takes when
they do not fit in the page cache), and ``cold``, which sets up automap both ways and accelerate
in one process and times one cold forward of each and the disk's bound in shuffled rounds
(``interleaved_cold``: ``automap_direct_cold_vs_disk_bound``, ``..._vs_accelerate_cold``).

    python -m benchmarks.offload --root /tmp/automap-bench            # CPU execution
    python -m benchmarks.offload --root /tmp/automap-bench --device cuda

With ``--device cuda`` the budget goes to cuda:0 and CPU RAM holds another share: offloaded
units stream to the GPU, and the achieved host-to-device bandwidth is set against a pinned copy
measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

from benchmarks.diskbound import disk_bound
from benchmarks.memwatch import MemWatch, evict, read_io, run_fresh

log = logging.getLogger("benchmarks.offload")
CHECKPOINT = "model.safetensors"
TOKENS = 64  # the forward's tokens; --tokens sets it (few: a forward bound by its reads, as a decode step is)


# ------------------------------------------------------------------ the model and its checkpoint


def llama_config(layers: int, hidden: int):
    from transformers import LlamaConfig

    # 16 full KV heads and a 2.7x MLP: ~50M parameters a layer at hidden 2048, like a 1B Llama.
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


def build_checkpoint(root: Path, layers: int, hidden: int, dtype: str = "float32") -> Path:
    """Write random weights (seeded) for the config in ``dtype``, unless already there. Every
    contender's model takes the checkpoint's dtype (:func:`checkpoint_dtype`)."""
    import torch
    from safetensors.torch import save_file

    from benchmarks.llama import llama_shapes, random_weights

    path = root / CHECKPOINT
    if path.exists():
        return path
    root.mkdir(parents=True, exist_ok=True)
    shapes = llama_shapes(llama_config(layers, hidden))
    weights = random_weights(shapes, shapes, torch.Generator().manual_seed(0))
    save_file(
        {n: t.to(getattr(torch, dtype)) for n, t in weights.items()},
        str(root / f".{CHECKPOINT}.tmp"),
        metadata={"format": "pt"},
    )
    os.replace(root / f".{CHECKPOINT}.tmp", path)
    return path


def checkpoint_dtype(root: Path):
    """The dtype of the checkpoint's weights (a norm's, so any tensor would do)."""
    from automap.offload import DTYPES, read_header

    return DTYPES[read_header(root / CHECKPOINT).tensors["model.norm.weight"].dtype]


def in_dtype(model, dtype):
    """``model`` with its parameters (not its buffers, as transformers loads them) in ``dtype``."""
    for param in model.parameters():
        param.data = param.data.to(dtype)
    return model


def make_plan(
    root: Path,
    layers: int,
    hidden: int,
    budget_share: float,
    device: str,
    max_memory: dict[Any, int] | None = None,
) -> Path:
    """Plan the skeleton for the budget (``max_memory`` instead, when given); every worker reads
    this one plan."""
    import torch
    from transformers import LlamaForCausalLM

    import automap

    with torch.device("meta"):
        skeleton = in_dtype(LlamaForCausalLM(llama_config(layers, hidden)), checkpoint_dtype(root))
    size = (root / CHECKPOINT).stat().st_size
    budget = int(size * budget_share)
    if max_memory is None:
        max_memory = {"cpu": budget} if device == "cpu" else {0: budget, "cpu": int(size * 0.3)}
    plan = automap.plan(
        skeleton,
        max_memory=max_memory,
        example_inputs={"input_ids": torch.zeros(1, TOKENS, dtype=torch.long)},
    )
    path = root / f"plan-{device}.json"
    path.write_text(plan.to_json())
    return path


# ------------------------------------------------------------------ measuring


def disk_bandwidth(path: Path, limit: int = 1 << 30) -> float:
    """Sequential cold read of up to ``limit`` bytes of ``path``, in bytes per second."""
    evict([path])
    buffer = bytearray(16 << 20)
    done, start = 0, time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while done < limit:
            n = f.readinto(buffer)
            if not n:
                break
            done += n
    return done / (time.perf_counter() - start)


def offloaded_ranges(root: Path, plan_path: Path) -> list[tuple[int, int]]:
    """``(offset, length)`` in the checkpoint of every tensor the plan offloads."""
    import automap
    from automap.offload import read_header

    plan = automap.Plan.from_json(plan_path.read_text())
    stored = read_header(root / CHECKPOINT).tensors
    names = {n for u, p in zip(plan.units, plan.placements) if p.offloaded for n in u.tensors}
    return [(stored[n].begin, stored[n].nbytes) for n in sorted(names) if n in stored and stored[n].nbytes]


def best_disk_bound(root: Path, plan_path: Path, before: dict) -> dict:
    """The disk bound measured again after the contenders ran, and the better (faster disk,
    stricter bound) of the two kept: the load of a shared machine changes from minute to minute."""
    after = disk_bound(root / CHECKPOINT, offloaded_ranges(root, plan_path))
    best = min((before, after), key=lambda b: b["bound_seconds"])
    return {**best, "measured": [before, after]}


def time_forwards(
    model, device: str, runs: int, before: Callable[[], None] | None = None
) -> list[tuple[float, float]]:
    """``(wall seconds, process CPU seconds)`` of each of ``runs`` forwards over TOKENS tokens.
    CPU time (all threads of this process) is what stays comparable when other processes
    share the cores; wall time is what a user waits."""
    import torch

    ids = torch.randint(0, 32000, (1, TOKENS), generator=torch.Generator().manual_seed(1))
    ids = ids.to("cuda:0") if device == "cuda" else ids  # the embedding is resident on the GPU in every plan
    seconds = []
    for _ in range(runs):
        if before is not None:
            before()
        start, cpu = time.perf_counter(), time.process_time()
        with torch.no_grad():
            model(ids, use_cache=False)
        if device == "cuda":
            torch.cuda.synchronize()
        seconds.append((time.perf_counter() - start, time.process_time() - cpu))
    return seconds


def measure(
    setup: Callable[[], tuple[Any, Callable[[], None]]], device: str, runs: int, cold_runs: int
) -> dict:
    """Set up, then warm forwards, then cold forwards; memory and I/O around all of it."""
    io0 = read_io()
    with MemWatch() as watch:
        start = time.perf_counter()
        model, evict_offloaded = setup()
        setup_s = time.perf_counter() - start
        io1 = read_io()
        os.sync()  # what setup wrote (accelerate's offload folder) is written back before timing
        time_forwards(model, device, 1)  # warm-up: first touches, allocator, page cache
        warm = time_forwards(model, device, runs)
        io2 = read_io()
    cold = time_forwards(model, device, cold_runs, before=evict_offloaded) if cold_runs else []
    io3 = read_io()
    return {
        **watch.result(),
        "setup_seconds": setup_s,
        "forward_seconds": [w for w, _ in warm],
        "forward_median_seconds": statistics.median(w for w, _ in warm),
        "forward_cpu_seconds": [c for _, c in warm],
        "forward_median_cpu_seconds": statistics.median(c for _, c in warm),
        "setup_read_bytes": io1["read_bytes"] - io0["read_bytes"],
        "setup_write_bytes": io1["write_bytes"] - io0["write_bytes"],
        "warm_read_bytes_per_forward": (io2["read_bytes"] - io1["read_bytes"]) / (runs + 1),
        "cold_forward_seconds": [w for w, _ in cold],
        "cold_forward_median_seconds": statistics.median(w for w, _ in cold) if cold else None,
        "cold_read_bytes_per_forward": (io3["read_bytes"] - io2["read_bytes"]) / max(cold_runs, 1),
    }


# ------------------------------------------------------------------ the three contenders (one per process)


def _skeleton(root: Path, layers: int, hidden: int):
    import automap

    from transformers import LlamaForCausalLM

    with automap.empty_model():
        return in_dtype(LlamaForCausalLM(llama_config(layers, hidden)).eval(), checkpoint_dtype(root))


def setup_ram(root: Path, layers: int, hidden: int, device: str):
    from safetensors.torch import load_file

    model = _skeleton(root, layers, hidden)
    model.load_state_dict(
        load_file(str(root / CHECKPOINT), device="cuda:0" if device == "cuda" else "cpu"),
        strict=False,
        assign=True,
    )
    model.to("cuda:0" if device == "cuda" else "cpu")
    return model, lambda: None


def setup_automap(root: Path, layers: int, hidden: int, device: str, transfer: Callable | None = None):
    """``transfer``: the runtime's transfer factory (default: staged copies to a GPU, pages on
    CPU); the GPU check's dry run passes ``StagedTransfer`` with ``HostCopyOps``."""
    from safetensors import safe_open
    from torch import nn

    import automap
    from automap.offload import CheckpointSource, read_header
    from automap.runtime import dispatch_plan, state_of

    plan = automap.Plan.from_json((root / f"plan-{device}.json").read_text())
    model = _skeleton(root, layers, hidden)
    placement = {n: d for u, d in zip(plan.units, plan.placement) for n in u.tensors}
    checkpoint = root / CHECKPOINT
    stored = read_header(checkpoint).tensors
    on_disk = {n for n, d in placement.items() if d == "disk" and n in stored}
    with safe_open(str(checkpoint), "pt") as f:  # resident weights (and RAM-offloaded ones) are read
        for name, param in list(model.named_parameters()):
            if name not in on_disk:
                owner, _, key = name.rpartition(".")
                placed = plan.placements.by_home[placement[name]]
                where = "cpu" if placed.offloaded else placed.compute
                model.get_submodule(owner)._parameters[key] = nn.Parameter(f.get_tensor(name).to(where))
    source = CheckpointSource({n: (checkpoint, n) for n in on_disk})  # read in place: nothing written
    # ... but for buffers computed at init (rotary frequencies) on disk: they go to a store.
    dispatch_plan(
        model,
        plan,
        source=source,
        offload_dir=root / "automap-offload",
        **({"transfer": transfer} if transfer else {}),
    )
    return model, lambda: state_of(model).source.evict()


def setup_automap_direct(root: Path, layers: int, hidden: int, device: str):
    """automap with its offloaded units read past the page cache (``AUTOMAP_COLD_READS=direct``),
    as it reads a model whose offloaded bytes do not fit in the page cache."""
    before = os.environ.get("AUTOMAP_COLD_READS")
    os.environ["AUTOMAP_COLD_READS"] = "direct"
    try:
        return setup_automap(root, layers, hidden, device)
    finally:
        os.environ.pop("AUTOMAP_COLD_READS")
        if before is not None:
            os.environ["AUTOMAP_COLD_READS"] = before


def setup_accelerate(root: Path, layers: int, hidden: int, device: str):
    from accelerate import init_empty_weights, load_checkpoint_and_dispatch
    from transformers import LlamaForCausalLM

    import automap

    plan = automap.Plan.from_json((root / f"plan-{device}.json").read_text())
    with init_empty_weights():
        model = in_dtype(LlamaForCausalLM(llama_config(layers, hidden)).eval(), checkpoint_dtype(root))
    folder = root / "accelerate-offload"
    model = load_checkpoint_and_dispatch(
        model, str(root / CHECKPOINT), device_map=plan.device_map, offload_folder=str(folder)
    )
    files = [root / CHECKPOINT] + sorted(folder.glob("*.dat"))
    return model, lambda: evict(files)


SETUPS = {"ram": setup_ram, "automap": setup_automap, "accelerate": setup_accelerate}
# Run beside them with --cold-runs: automap's reads past the page cache (the path it takes when the
# offloaded bytes do not fit in the page cache), not part of the interleaved warm rounds.
COLD_SETUPS = {"automap_direct": setup_automap_direct}


def preload() -> None:
    """Import everything a contender uses before the baseline is taken."""
    import accelerate  # noqa: F401
    import safetensors.torch  # noqa: F401
    import torch  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401

    import automap.runtime  # noqa: F401


def interleaved(
    root: Path, layers: int, hidden: int, device: str, runs: int, setups: dict[str, Callable] | None = None
) -> dict:
    """All three set up in this one process, then timed in shuffled rounds, one forward each."""
    import random
    import resource

    models = {kind: setup(root, layers, hidden, device)[0] for kind, setup in (setups or SETUPS).items()}
    os.sync()  # the 3 GB accelerate's setup wrote would otherwise be written back during the rounds
    samples: dict[str, list[tuple[float, float]]] = {kind: [] for kind in models}
    for kind, model in models.items():
        time_forwards(model, device, 1)
    order = list(models)
    faults: dict[str, list[int]] = {kind: [] for kind in models}
    for _ in range(runs):
        random.shuffle(order)
        for kind in order:
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            samples[kind] += time_forwards(models[kind], device, 1)
            faults[kind].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    wall = {k: statistics.median(w for w, _ in v) for k, v in samples.items()}
    cpu = {k: statistics.median(c for _, c in v) for k, v in samples.items()}
    return {
        "kind": "timing",
        "rounds": runs,
        "median_forward_seconds": wall,
        "median_forward_cpu_seconds": cpu,
        "forward_seconds": {k: [w for w, _ in v] for k, v in samples.items()},
        # Page faults a forward takes (fresh memory being mapped in): what makes accelerate's
        # forward vary from one run to the next (it copies every offloaded weight anew).
        "median_minor_faults_per_forward": {k: statistics.median(v) for k, v in faults.items()},
        "automap_vs_ram": wall["automap"] / wall["ram"],
        "automap_vs_accelerate": wall["automap"] / wall["accelerate"],
        "accelerate_vs_ram": wall["accelerate"] / wall["ram"],
        "automap_vs_ram_cpu_time": cpu["automap"] / cpu["ram"],
        "automap_vs_accelerate_cpu_time": cpu["automap"] / cpu["accelerate"],
    }


def interleaved_cold(root: Path, layers: int, hidden: int, device: str, runs: int) -> dict:
    """automap through the page cache, automap past it and accelerate set up in this one process,
    then in shuffled rounds: each one's offloaded files evicted, one cold forward each, and the
    disk's bound measured again (:func:`benchmarks.diskbound.disk_bound`): the load of a shared
    machine hits all of them alike."""
    import random

    setups = {
        "automap": setup_automap,
        "automap_direct": setup_automap_direct,
        "accelerate": setup_accelerate,
    }
    models = {kind: setup(root, layers, hidden, device) for kind, setup in setups.items()}
    os.sync()
    for model, unmap in models.values():
        time_forwards(model, device, 1)
        unmap()  # the first round starts cold too
    ranges = offloaded_ranges(root, root / f"plan-{device}.json")
    samples: dict[str, list[tuple[float, float]]] = {kind: [] for kind in models}
    bounds: list[float] = []
    warm: list[tuple[float, float]] = []
    for _ in range(runs):
        order = [*models, "bound"]
        random.shuffle(order)
        for kind in order:
            if kind == "bound":
                bounds.append(disk_bound(root / CHECKPOINT, ranges)["bound_seconds"])
            else:
                samples[kind] += time_forwards(models[kind][0], device, 1, before=models[kind][1])
                if kind == "automap":  # then warm, its pages just read: the compute's own floor
                    warm += time_forwards(models[kind][0], device, 1)
                # Pages mapped into this process are not dropped by the bound's eviction (nor by
                # the others'): each contender's are unmapped after its step, so the bound and
                # the others read cold (automap_direct maps them too where its budget has no
                # room for the ring of buffers and it reads through the page cache).
                models[kind][1]()
    cold = {k: statistics.median(w for w, _ in v) for k, v in samples.items()}
    bound, floor = (
        statistics.median(bounds),
        max(statistics.median(bounds), statistics.median(w for w, _ in warm)),
    )
    return {
        "kind": "cold",
        "rounds": runs,
        "median_cold_forward_seconds": cold,
        "bound_seconds": bounds,
        "median_bound_seconds": bound,
        "cold_forward_seconds": {k: [w for w, _ in v] for k, v in samples.items()},
        "median_cold_forward_cpu_seconds": {
            k: statistics.median(c for _, c in v) for k, v in samples.items()
        },
        "automap_warm_forward_seconds": [w for w, _ in warm],
        "median_automap_warm_forward_cpu_seconds": statistics.median(c for _, c in warm),
        **{f"{k}_cold_vs_max_of_bound_and_warm": cold[k] / floor for k in ("automap", "automap_direct")},
        **{f"{k}_cold_vs_disk_bound": cold[k] / bound for k in ("automap", "automap_direct")},
        **{
            f"{k}_cold_vs_accelerate_cold": cold[k] / cold["accelerate"]
            for k in ("automap", "automap_direct")
        },
    }


def worker(kind: str, root: Path, layers: int, hidden: int, device: str, runs: int, cold_runs: int) -> dict:
    preload()
    if kind == "timing":
        return interleaved(root, layers, hidden, device, runs)
    if kind == "cold":
        return interleaved_cold(root, layers, hidden, device, cold_runs)
    setup = {**SETUPS, **COLD_SETUPS}[kind]
    result = measure(
        lambda: setup(root, layers, hidden, device), device, runs, cold_runs if kind != "ram" else 0
    )
    if device == "cuda":
        result["pinned_h2d_bytes_per_second"] = pinned_bandwidth()
    return {"kind": kind, **result}


def pinned_bandwidth(nbytes: int = 512 << 20) -> float:
    import torch

    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times)


# ------------------------------------------------------------------ the report


def cold_ratios(am: dict, acc: dict, bound: dict) -> dict:
    """The cold forward against the disk's bound (offloaded bytes / the better of one reader
    and several in flight, measured in this run) and against accelerate's cold forward; and
    against the larger of the bound and automap's own warm forward (compute sets a floor too)."""
    cold = am["cold_forward_median_seconds"]
    if not cold:
        return {}
    floor = max(bound["bound_seconds"], am["forward_median_seconds"])
    return {
        "disk_bound": bound,
        "automap_cold_vs_disk_bound": cold / bound["bound_seconds"],
        "automap_cold_vs_accelerate_cold": cold / acc["cold_forward_median_seconds"]
        if acc["cold_forward_median_seconds"]
        else None,
        "automap_cold_vs_max_of_bound_and_warm": cold / floor,
    }


def summarise(results: dict[str, dict], plan_path: Path, bandwidth: float, device: str) -> dict:
    import automap

    plan = automap.Plan.from_json(plan_path.read_text())
    units = plan.units
    offloaded = [u for u, d in zip(units, plan.placement) if plan.placements.by_home[d].offloaded]
    streamed = sum(u.weight_bytes for u in offloaded)
    ram, am, acc, timing = results["ram"], results["automap"], results["accelerate"], results["timing"]
    budget = plan.device("cpu" if device == "cpu" else "cuda:0").capacity_bytes
    bound = budget + max(u.weight_bytes for u in units) + 200_000_000
    summary = {
        "device": device,
        "budget_bytes": budget,
        "model_bytes": sum(u.weight_bytes for u in units),
        "offloaded_bytes": streamed,
        "offloaded_units": len(offloaded),
        "interleaved": {k: v for k, v in timing.items() if k not in ("kind",)},
        "separate_processes": {
            "automap_vs_ram": am["forward_median_seconds"] / ram["forward_median_seconds"],
            "automap_vs_accelerate": am["forward_median_seconds"] / acc["forward_median_seconds"],
            "automap_vs_ram_cpu_time": am["forward_median_cpu_seconds"] / ram["forward_median_cpu_seconds"],
            "automap_vs_accelerate_cpu_time": am["forward_median_cpu_seconds"]
            / acc["forward_median_cpu_seconds"],
        },
        "peak_anon_above_base_bytes": {
            k: r["peak_anon_above_base_bytes"]
            for k, r in (("ram", ram), ("automap", am), ("accelerate", acc))
        },
        "peak_file_above_base_bytes": {
            k: r["peak_file_above_base_bytes"]
            for k, r in (("ram", ram), ("automap", am), ("accelerate", acc))
        },
        "setup_write_bytes": {k: r["setup_write_bytes"] for k, r in (("automap", am), ("accelerate", acc))},
        "automap_anon_bound_bytes": bound,
        "automap_anon_within_bound": am["peak_anon_above_base_bytes"] <= bound,
        "disk_read_bytes_per_second": bandwidth,
    }
    for name, r in (("automap", am), ("accelerate", acc)):
        if r["cold_forward_median_seconds"]:
            summary[f"{name}_cold_bound_seconds"] = r["cold_read_bytes_per_forward"] / bandwidth
    for name, r in (("automap", am), ("accelerate", acc)):
        if r["cold_forward_median_seconds"]:
            summary[f"{name}_cold_forward_seconds"] = r["cold_forward_median_seconds"]
            summary[f"{name}_cold_read_bytes"] = r["cold_read_bytes_per_forward"]
    if device == "cuda":
        summary["automap_h2d_bytes_per_second"] = streamed / am["forward_median_seconds"]
        summary["pinned_h2d_bytes_per_second"] = am.get("pinned_h2d_bytes_per_second")
    return summary


def main(argv: list[str] | None = None) -> None:
    global TOKENS  # --tokens: every function here reads it
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "role", nargs="?", default="main", choices=["main", "timing", "cold", *SETUPS, *COLD_SETUPS]
    )
    parser.add_argument("--root", type=Path, default=Path("/tmp/automap-bench"))
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--budget-share", type=float, default=0.25)
    parser.add_argument(
        "--dtype", default="float32", help="of the checkpoint written (bfloat16: use another --root)"
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--cold-runs", type=int, default=2)
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    parser.add_argument(
        "--tokens", type=int, default=TOKENS, help="tokens per forward (the plan's and the timed ones)"
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    TOKENS = args.tokens
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s: %(message)s")
    if args.role != "main":
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        result = worker(
            args.role, args.root, args.layers, args.hidden, args.device, args.runs, args.cold_runs
        )
        print(json.dumps(result))
        return
    build_checkpoint(args.root, args.layers, args.hidden, args.dtype)
    plan_path = make_plan(args.root, args.layers, args.hidden, args.budget_share, args.device)
    bandwidth = disk_bandwidth(args.root / CHECKPOINT)
    bound = (
        disk_bound(args.root / CHECKPOINT, offloaded_ranges(args.root, plan_path)) if args.cold_runs else None
    )
    flags = [
        "--root",
        str(args.root),
        "--layers",
        str(args.layers),
        "--hidden",
        str(args.hidden),
        "--device",
        args.device,
        "--runs",
        str(args.runs),
        "--cold-runs",
        str(args.cold_runs),
        "--threads",
        str(args.threads),
        "--tokens",
        str(args.tokens),
    ]
    results = {}
    for kind in (
        "ram",
        "automap",
        "accelerate",
        "timing",
        *((*COLD_SETUPS, "cold") if args.cold_runs else ()),
    ):
        log.info("running %s in a fresh process", kind)
        results[kind] = run_fresh("benchmarks.offload", kind, *flags)
    summary = summarise(results, plan_path, bandwidth, args.device)
    if bound is not None:
        best = best_disk_bound(args.root, plan_path, bound)
        summary.update(cold_ratios(results["automap"], results["accelerate"], best))
        direct = cold_ratios(results["automap_direct"], results["accelerate"], best)
        summary.update(
            {
                f"{k.replace('automap', 'automap_direct', 1)}": v
                for k, v in direct.items()
                if k != "disk_bound"
            }
        )
        summary["automap_direct_cold_forward_seconds"] = results["automap_direct"][
            "cold_forward_median_seconds"
        ]
        summary["automap_direct_warm_forward_seconds"] = results["automap_direct"]["forward_median_seconds"]
        summary["interleaved_cold"] = {k: v for k, v in results["cold"].items() if k != "kind"}
    report = {"summary": {**summary, "threads": args.threads, "tokens": args.tokens}, "runs": results}
    text = json.dumps(report, indent=1)
    (args.out or args.root / f"offload-{args.device}.json").write_text(text)
    print(text)
    if "automap_cold_vs_disk_bound" in summary:
        log.info(
            "cold forward: %.2f x the disk bound (%.2f s: %.2f GB at %.2f GB/s), %.2f x accelerate's cold forward",
            summary["automap_cold_vs_disk_bound"],
            summary["disk_bound"]["bound_seconds"],
            summary["disk_bound"]["bytes"] / 1e9,
            summary["disk_bound"]["best_bytes_per_second"] / 1e9,
            summary["automap_cold_vs_accelerate_cold"] or float("nan"),
        )
        log.info(
            "cold forward past the page cache (O_DIRECT): %.2f x the disk bound, %.2f x accelerate's cold forward",
            summary["automap_direct_cold_vs_disk_bound"],
            summary["automap_direct_cold_vs_accelerate_cold"] or float("nan"),
        )
        cold = summary["interleaved_cold"]
        log.info(
            "interleaved cold rounds: O_DIRECT %.2f x the disk bound, %.2f x accelerate; through the page cache "
            "%.2f x, %.2f x",
            cold["automap_direct_cold_vs_disk_bound"],
            cold["automap_direct_cold_vs_accelerate_cold"],
            cold["automap_cold_vs_disk_bound"],
            cold["automap_cold_vs_accelerate_cold"],
        )


if __name__ == "__main__":
    main()
