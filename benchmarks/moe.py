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

With ``--floors`` this checkout's process also measures, on the same store files and cold, what
the disk allows (:func:`floors`): each layer's routed experts read once its routing is known
(by automap's routed reader and by ``O_DIRECT`` with every request in flight, the faster kept;
their sum is the least a forward can spend on reads made after each router), everything the
forward needs read at once (by ``O_DIRECT`` and by automap's reader of whole units, the faster
kept: the floor with the routing of every layer known in advance), the forward with every
page in memory (its compute), the best schedule of those reads and that compute on one disk
(:func:`best_schedule`: the floor of a cold forward whose experts are read after their
router, the dense parts read by the disk in the time the routed reads leave it), and cold
forwards with the experts read as the runtime chooses, always by routed rows and always whole
with their layer, alternating in the same process after a round that is not timed
(:func:`read_choices`).

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
from pathlib import Path
from typing import Any

from benchmarks.memwatch import run_fresh

PAGE = mmap.PAGESIZE
LIBC = ctypes.CDLL(None, use_errno=True)
LIBC.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)


# ------------------------------------------------------------------ models


def build(kind: str, layers: int) -> Any:
    import torch
    import transformers

    common = dict(
        vocab_size=1024,
        hidden_size=512,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=128,
    )
    if kind == "mixtral":
        config = transformers.MixtralConfig(
            **common, intermediate_size=1536, num_local_experts=8, num_experts_per_tok=2
        )
        model_class = transformers.MixtralForCausalLM
    elif kind == "qwen2_moe":
        config = transformers.Qwen2MoeConfig(
            **common,
            intermediate_size=1536,
            num_experts=16,
            num_experts_per_tok=4,
            moe_intermediate_size=768,
            shared_expert_intermediate_size=2048,
        )
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
            routed[index].update(
                int(i) for i in args[1].flatten().tolist() if 0 <= int(i) < module.num_experts
            )

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


# ------------------------------------------------------------------ what the disk allows


DIRECT_REQUEST = (
    4 << 20
)  # O_DIRECT requests of 4 MiB, all in flight: this disk's best for ranges of a few MiB


def tensor_range(source: Any, name: str) -> tuple[str, int, int]:
    """(file, offset, bytes) of one stored tensor."""
    path = source.file_of(name)
    tensor = source.get(name)
    return str(path), tensor.data_ptr() - source.files[path].address, tensor.nbytes


def layer_ranges(model: Any, source: Any, routed: list[set[int]]) -> list[tuple[list, list]]:
    """Per layer: the byte ranges of its dense part and of its routed experts' rows."""
    from automap.profiling.routed import find_experts

    layers = []
    for index, layer in enumerate(model.model.layers):
        prefix = f"model.layers.{index}"
        stacked = {n: e for e in find_experts(layer, prefix) if e.stacked for n in e.tensors}
        dense, experts = [], []
        for name in (f"{prefix}.{n}" for n in layer.state_dict()):
            if name not in source.names():
                continue
            path, offset, nbytes = tensor_range(source, name)
            if name not in stacked:
                dense.append((path, offset, nbytes))
                continue
            row = nbytes // stacked[name].count
            experts.extend((path, offset + r * row, row) for r in sorted(routed[index]))
        layers.append((dense, experts))
    return layers


def read_direct(ranges: list[tuple[str, int, int]]) -> float:
    """Seconds to read ``ranges`` with ``O_DIRECT`` (the page cache bypassed), cut into
    :data:`DIRECT_REQUEST` requests, every one in flight at once (a thread each, at most 32)."""
    from concurrent.futures import ThreadPoolExecutor

    descriptors = {path: os.open(path, os.O_RDONLY | os.O_DIRECT) for path in {r[0] for r in ranges}}
    requests = []
    for path, offset, nbytes in ranges:
        start, end = (
            offset - offset % PAGE,
            -(-(offset + nbytes) // PAGE) * PAGE,
        )  # O_DIRECT wants aligned ranges
        requests.extend(
            (descriptors[path], at, min(DIRECT_REQUEST, end - at)) for at in range(start, end, DIRECT_REQUEST)
        )
    workers = min(32, len(requests))
    buffers = [mmap.mmap(-1, DIRECT_REQUEST) for _ in range(workers)]

    def read(worker: int) -> None:  # worker i reads requests i, i + workers, ... into its own buffer
        for descriptor, at, nbytes in requests[worker::workers]:
            os.preadv(descriptor, [memoryview(buffers[worker])[:nbytes]], at)

    try:
        began = time.perf_counter()
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(read, range(workers)))
        return time.perf_counter() - began
    finally:
        for descriptor in descriptors.values():
            os.close(descriptor)
        for buffer in buffers:
            buffer.close()


def read_mapped(source: Any, ranges: list[tuple[str, int, int]], whole: bool) -> float:
    """Seconds for one of automap's readers to read ``ranges`` into the page cache: the
    routed reader the experts hooks use (``whole`` False: readahead off, 1 MiB requests), or
    the one that reads units ahead (readahead on, 16 MiB requests)."""
    from automap.offload.readahead import ROUTED, SHARED

    by_file: dict[str, list[tuple[int, int]]] = {}
    for path, offset, nbytes in ranges:
        by_file.setdefault(path, []).append((offset, nbytes))
    began = time.perf_counter()
    for path, spans in by_file.items():
        mapped = source.files[Path(path)]
        aligned = [(mapped.address + o - o % PAGE, n + o % PAGE) for o, n in spans]
        if whole:
            SHARED.read(aligned, mapped.fd, mapped.address)
        else:
            ROUTED.read(aligned, mapped.rows_fd, mapped.address)
    return time.perf_counter() - began


def floors(model: Any, source: Any, routed: list[set[int]], runs: int, forward: Any) -> dict[str, Any]:
    """What this disk allows the forward, measured cold on the store's own files (see the
    module's docstring); seconds are medians over ``runs``."""
    layers = layer_ranges(model, source, routed)

    def cold(read: Any, ranges: list) -> float:
        times = []
        for _ in range(runs):
            os.sync()
            source.evict()
            times.append(read(ranges))
        return statistics.median(times)

    per_layer = []
    for _, experts in layers:
        direct, ours = cold(read_direct, experts), cold(lambda r: read_mapped(source, r, False), experts)
        per_layer.append(
            {"bytes": sum(n for *_, n in experts), "direct_seconds": direct, "automap_seconds": ours}
        )
    everything = [r for dense, experts in layers for r in (*dense, *experts)]
    forward()  # every page the forward needs is in memory now
    warm = []
    for _ in range(runs):
        began = time.perf_counter()
        forward()
        warm.append(time.perf_counter() - began)
    found = {
        "per_layer": per_layer,
        "after_each_router_seconds": sum(min(p["direct_seconds"], p["automap_seconds"]) for p in per_layer),
        "all_at_once_seconds": min(
            cold(read_direct, everything), cold(lambda r: read_mapped(source, r, True), everything)
        ),
        "all_at_once_bytes": sum(n for *_, n in everything),
        "warm_seconds": statistics.median(warm),
    }
    rate = found["all_at_once_bytes"] / found["all_at_once_seconds"]  # the disk's best, bytes a second
    found["schedule_seconds"] = best_schedule(
        [sum(n for *_, n in dense) / rate for dense, _ in layers],
        [min(p["direct_seconds"], p["automap_seconds"]) for p in per_layer],
        found["warm_seconds"] / len(layers),
    )
    return found


def best_schedule(dense: list[float], routed: list[float], compute: float) -> float:
    """Seconds of the best schedule of a cold forward on one disk: layer ``i``'s dense part
    takes ``dense[i]`` seconds of the disk and may be read at any time before its layer
    runs; its routed experts take ``routed[i]`` and can be asked for only once its router ran,
    half-way through its ``compute`` (the warm forward's time per layer); the disk serves one
    read at a time, routed reads first (a dense read waiting for the disk while they run).

    Without the dense parts this is the sum of the routed reads and the compute; with them the
    disk's time for everything is a bound too, and the schedule shows how much of it the
    compute hides."""
    busy: list[tuple[float, float]] = []  # the disk's time taken by routed reads

    def dense_read_by(work: float) -> float:  # when the disk's free time adds up to ``work``
        at = 0.0
        for start, end in busy:
            if start - at >= work:
                break
            work -= max(0.0, start - at)
            at = max(at, end)
        return at + work

    clock, queued = 0.0, 0.0
    for dense_seconds, routed_seconds in zip(dense, routed):
        queued += dense_seconds
        router = max(clock, dense_read_by(queued)) + compute / 2
        busy.append((router, router + routed_seconds))
        clock = router + routed_seconds + compute / 2
    return clock


def read_choices(model: Any, source: Any, runs: int, forward: Any) -> dict[str, float]:
    """Cold forwards with the routed experts read as the runtime chooses (``auto``), always by
    routed rows, and always whole with their layer ahead, the three alternating forward by
    forward in this process (rotating which goes first) after one round not timed (the first
    cold forwards of a process are slower whatever they read); medians of ``runs`` each."""
    from automap.runtime.experts import ExpertReads
    from automap.runtime.state import state_of

    reads = next((h for h in state_of(model).hooks if isinstance(h, ExpertReads)), None)
    if reads is None:
        return {}
    chosen = reads.observe

    def forced(whole: bool) -> Any:
        def observe(routed: int, count: int) -> None:
            for group in reads.groups:
                group.whole = whole

        return observe

    modes = {"auto": chosen, "rows": forced(False), "whole": forced(True)}
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    try:
        for index in range(-1, runs):  # round -1 is not timed: the process's first cold forwards
            order = list(modes)[index % 3 :] + list(modes)[: index % 3]
            for mode in order:
                reads.observe = modes[mode]
                forward()  # settles the choice (the first layer reads as the last call chose)
                os.sync()
                source.evict()
                began = time.perf_counter()
                forward()
                if index >= 0:
                    times[mode].append(time.perf_counter() - began)
    finally:
        reads.observe = chosen
    return {f"{mode}_seconds": statistics.median(found) for mode, found in times.items()}


# ------------------------------------------------------------------ one measured process


def worker(
    kind: str, batch: int, runs: int, layers: int, automap_from: str | None, with_floors: bool = False
) -> dict[str, Any]:
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
    device_map: dict[str, Any] = {
        "model.embed_tokens": "cpu",
        "model.norm": "cpu",
        "lm_head": "cpu",
        "model.rotary_emb": "cpu",
    }
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
        floor = None
        if with_floors:

            def forward() -> None:
                with torch.no_grad():
                    model(ids, use_cache=False)

            floor = floors(model, source, routed, runs, forward)
            floor["reads"] = read_choices(model, source, runs, forward)
        automap.undispatch(model)
    return {
        "model": kind,
        "batch": batch,
        "cold_seconds": statistics.median(seconds),
        "all_seconds": seconds,
        "read_bytes": statistics.median(read),
        "need_bytes": needed,
        "routed_experts": [sorted(r) for r in routed],
        "max_abs_diff": diff,
        "automap": automap_from or "this checkout",
        "floors": floor,
    }


# ------------------------------------------------------------------ the comparison


def measure(kind: str, batch: int, args: argparse.Namespace, automap_from: str | None) -> dict[str, Any]:
    extra = ["--automap-from", automap_from] if automap_from else (["--floors"] if args.floors else [])
    return run_fresh(
        "benchmarks.moe",
        "--worker",
        kind,
        "--batch",
        str(batch),
        "--runs",
        str(args.runs),
        "--layers",
        str(args.layers),
        *extra,
    )


def compare(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for kind in args.models.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            ours = measure(kind, batch, args, None)
            row: dict[str, Any] = {
                "model": kind,
                "batch": batch,
                "automap": ours,
                "read_vs_need": ours["read_bytes"] / ours["need_bytes"],
            }
            if args.baseline:
                base = measure(kind, batch, args, args.baseline)
                row["baseline"] = base
                row["speedup_vs_baseline"] = base["cold_seconds"] / ours["cold_seconds"]
                row["baseline_read_vs_need"] = base["read_bytes"] / base["need_bytes"]
            rows.append(row)
            print(line(row), flush=True)
            if ours.get("floors"):
                print(floor_line(row), flush=True)
    return rows


def line(row: dict[str, Any]) -> str:
    ours = row["automap"]
    text = (
        f"{row['model']:>9} batch {row['batch']}: read {ours['read_bytes'] / 2**20:.1f} MiB, router needs "
        f"{ours['need_bytes'] / 2**20:.1f} MiB ({row['read_vs_need']:.2f}x), cold forward "
        f"{ours['cold_seconds'] * 1e3:.0f} ms, max abs diff {ours['max_abs_diff']}"
    )
    if "baseline" in row:
        base = row["baseline"]
        text += (
            f"; baseline read {base['read_bytes'] / 2**20:.1f} MiB ({row['baseline_read_vs_need']:.2f}x), "
            f"{base['cold_seconds'] * 1e3:.0f} ms: {row['speedup_vs_baseline']:.2f}x faster"
        )
    return text


def floor_line(row: dict[str, Any]) -> str:
    floor = row["automap"]["floors"]
    layers = ", ".join(
        f"{min(p['direct_seconds'], p['automap_seconds']) * 1e3:.0f}" for p in floor["per_layer"]
    )
    text = (
        f"{'':>9} floors: reads after each router {floor['after_each_router_seconds'] * 1e3:.0f} ms "
        f"(per layer {layers}), "
        f"all {floor['all_at_once_bytes'] / 2**20:.0f} MiB at once {floor['all_at_once_seconds'] * 1e3:.0f} ms, "
        f"warm forward {floor['warm_seconds'] * 1e3:.0f} ms; "
        f"best schedule of these on one disk {floor['schedule_seconds'] * 1e3:.0f} ms "
        f"(cold forward {row['automap']['cold_seconds'] / floor['schedule_seconds']:.2f}x)"
    )
    if "baseline" in row:
        text += f"; 2.5x the baseline would be {row['baseline']['cold_seconds'] / 2.5 * 1e3:.0f} ms"
    reads = floor.get("reads")
    if reads:
        text += (
            f"; alternating: as chosen {reads['auto_seconds'] * 1e3:.0f} ms, by rows "
            f"{reads['rows_seconds'] * 1e3:.0f} ms, whole layers {reads['whole_seconds'] * 1e3:.0f} ms"
        )
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mixtral,qwen2_moe")
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--baseline", help="a checkout whose automap package to compare against")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument(
        "--floors", action="store_true", help="also measure what the disk allows (this checkout)"
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--automap-from", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(
            json.dumps(
                worker(args.worker, args.batch, args.runs, args.layers, args.automap_from, args.floors)
            )
        )
        return
    rows = compare(args)
    print(json.dumps(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
