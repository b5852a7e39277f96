"""Plan quality: automap beside accelerate on hypothetical GPUs (+ CPU/disk when too small).

Models are built on the meta device from their configs (random shapes, nothing downloaded):
ResNet-50, ViT-B/16, GPT-2-XL, Llama-7B and Llama-70B. For 2/4/8 GPUs and two sizes (GPUs
holding 1.3x the model in total, and 0.6x with CPU and disk behind), each planner's map is
judged by one cost model (automap's Plan): bytes spilled to CPU/disk, the busiest GPU's FLOPs
share, the share of FLOPs the GPUs compute (resident or streamed to them), the bottleneck
relative to the optimal contiguous split (an independent O(k n^2) dynamic programme), and
planning time (median of repeats; automap's includes tracing the model again for each round of
splitting). automap plans from its default units, which it may split (the block classes stay
whole for transformers, whose ``_no_split_modules`` name them); accelerate gets the block
classes as ``no_split_module_classes``. Also: 1,000 units on 8 devices, the tutorial's hand
split of ResNet-50 beside automap's, and Llama-2-70B planned for ``generate`` at 16 x 8,192
tokens on 2 x 80 GiB: whether each planner's map leaves every GPU room for the KV cache of its
layers (the cache measured on meta by automap, for both maps).

    .venv/bin/python -m benchmarks.plan_quality --json benchmarks/notes/plan_quality.json
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import networkx as nx
import torch
from torch import nn

import automap
from automap.devices import DeviceSpec, make_device
from automap.errors import AutomapError
from automap.planning import Plan, make_plan, parse_device_map, plan_from_device_map
from automap.planning.items import all_cut_bytes, make_items
from automap.planning.predict import bottleneck_seconds, summary
from automap.profiling import Profile, Unit
from automap.profiling.kvcache import profile_generation
from automap.profiling.refine import Splitter

log = logging.getLogger("plan_quality")


@dataclass(frozen=True)
class Case:
    name: str
    build: Callable[[], nn.Module]
    no_split: list[str]
    dtype: torch.dtype


def _resnet50() -> nn.Module:
    import torchvision

    return torchvision.models.resnet50()


def _vit_b_16() -> nn.Module:
    import torchvision

    return torchvision.models.vit_b_16()


def _gpt2_xl() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_layer=48, n_embd=1600, n_head=25)).half()


def _llama(hidden: int, inter: int, layers: int, heads: int, kv: int) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            hidden_size=hidden,
            intermediate_size=inter,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv,
            vocab_size=32000,
        )
        return LlamaForCausalLM(config).half()

    return build


CASES = [
    Case("ResNet-50", _resnet50, ["Bottleneck"], torch.float32),
    Case("ViT-B/16", _vit_b_16, ["EncoderBlock"], torch.float32),
    Case("GPT-2-XL", _gpt2_xl, ["GPT2Block"], torch.float16),
    Case("Llama-7B", _llama(4096, 11008, 32, 32, 32), ["LlamaDecoderLayer"], torch.float16),
    Case("Llama-70B", _llama(8192, 28672, 80, 64, 8), ["LlamaDecoderLayer"], torch.float16),
]


def _median_seconds(fn: Callable[[], Any], repeats: int) -> tuple[Any, float]:
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return result, statistics.median(times)


def optimum(profile: Profile, gpus: tuple[DeviceSpec, ...]) -> float | None:
    """Smallest bottleneck of a contiguous split over ``gpus`` (identical links), by a plain
    dynamic programme over (device, prefix); independent of automap's bisection."""
    items = make_items(profile, all_cut_bytes(profile))
    chain, n = items.chain, len(items.chain)
    link = min(d.link_bytes_per_second for d in gpus)
    inf = float("inf")
    best = [0.0] + [inf] * n  # devices so far, prefix length -> bottleneck
    for device in gpus:
        nxt = best[:]
        for end in range(1, n + 1):
            weight, peak, work = 0, 0, 0.0
            for start in range(end - 1, -1, -1):
                weight += chain.weight[start]
                peak = max(peak, chain.activation[start])
                work += chain.work[start]
                if weight + peak > device.capacity_bytes:
                    break
                if best[start] < inf:
                    cost = work / device.flops_per_second + (chain.cut[start] / link if start else 0.0)
                    nxt[end] = min(nxt[end], max(best[start], cost))
        best = nxt
    return best[n] if best[n] < inf else None


def _devices(total: int, count: int, ratio: float) -> tuple[DeviceSpec, ...]:
    gpus = tuple(make_device(f"cuda:{i}", int(total * ratio / count)) for i in range(count))
    if ratio >= 1:
        return gpus + (make_device("cpu", 4 * total), make_device("disk", 100 * total))
    return gpus + (make_device("cpu", int(0.3 * total)), make_device("disk", 100 * total))


def _accelerate_maps(model: nn.Module, devices: tuple[DeviceSpec, ...], case: Case) -> dict[str, Any]:
    from accelerate.utils import get_balanced_memory, infer_auto_device_map

    budget: dict[int | str, int] = {
        d.index if d.kind == "cuda" else d.name: d.capacity_bytes for d in devices if d.kind != "disk"
    }
    kwargs = dict(no_split_module_classes=case.no_split, dtype=case.dtype)

    def balanced() -> dict:
        memory = get_balanced_memory(model, max_memory=dict(budget), **kwargs)
        return infer_auto_device_map(model, max_memory=memory, **kwargs)

    def sequential() -> dict:
        return infer_auto_device_map(model, max_memory=dict(budget), **kwargs)

    return {"accelerate balanced": balanced, "accelerate sequential": sequential}


def _judge(plan: Plan, best: float | None, seconds: float) -> dict[str, Any]:
    gpu_rows = [r for r in summary(plan) if r.device.is_accelerator]
    spilled = sum(plan.placements.bytes_on[d.name] for d in plan.devices if not d.is_accelerator)
    streamed = max((u.weight_bytes for u, p in zip(plan.units, plan.placements) if p.offloaded), default=0)
    over = [r for r in gpu_rows if _gpu_need(plan, r, streamed) > r.device.capacity_bytes]
    total = sum(u.flops for u in plan.units) or 1
    on_gpus = sum(
        u.flops
        for u, d in zip(plan.units, plan.placement)
        if plan.device(plan.placements.by_home[d].compute).is_accelerator
    )
    return {
        "oom": bool(over),
        "spilled_bytes": spilled,
        "busiest_gpu_flops_share": max((r.flops_share for r in gpu_rows), default=0.0),
        "gpu_flops_share": on_gpus / total,
        "units": len(plan.units),
        "bottleneck_seconds": bottleneck_seconds(plan),
        "bottleneck_vs_optimum": bottleneck_seconds(plan) / best if best else None,
        "planning_seconds": seconds,
    }


def _gpu_need(plan: Plan, row: Any, streamed: int) -> int:
    """What a GPU must hold at run time: weights, activations, the KV cache of the units
    computing there, and on the execution device the largest streamed unit."""
    staging = streamed if row.device.name == plan.execution_device else 0
    return row.weight_bytes + row.activation_bytes + row.kv_bytes + staging


def generation_fit(batch: int = 16, max_length: int = 8192) -> dict[str, Any]:
    """Llama-2-70B shape in bf16 on 2 x 80 GiB GPUs (+ 200 GiB CPU RAM) planned for ``generate``
    of ``batch`` x ``max_length`` tokens: per GPU, weights + prefill activations + KV cache
    (+ the streamed unit on the execution device) against its capacity, for automap's plan and
    for accelerate's map (balanced, as ``device_map="auto"``), both judged with the same cache."""
    case = next(c for c in CASES if c.name == "Llama-70B")
    dtype = torch.bfloat16
    with torch.device("meta"):
        model = case.build().eval()
    prompt = {"input_ids": torch.zeros(batch, 128, dtype=torch.long, device="meta")}
    prof = automap.profile(model, prompt, no_split=case.no_split, dtype=dtype, backward=False)
    prof = profile_generation(model, prof, prompt, batch=batch, max_length=max_length, dtype=dtype)
    gib = 2**30
    devices = (
        make_device("cuda:0", 80 * gib),
        make_device("cuda:1", 80 * gib),
        make_device("cpu", 200 * gib),
        make_device("disk", 2**40),
    )
    tensors = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    tensors += [n for n, _ in model.named_buffers(remove_duplicate=False)]
    plans = {"automap": make_plan(prof, devices, "auto")}
    balanced = _accelerate_maps(model, devices, Case(case.name, case.build, case.no_split, dtype))[
        "accelerate balanced"
    ]
    plans["accelerate balanced"] = plan_from_device_map(
        prof, devices, parse_device_map(balanced(), model.named_modules(remove_duplicate=False), tensors)
    )
    result: dict[str, Any] = {"batch": batch, "max_length": max_length, "kv_bytes": prof.total_kv_bytes}
    for label, plan in plans.items():
        streamed = max(
            (u.weight_bytes for u, p in zip(plan.units, plan.placements) if p.offloaded), default=0
        )
        rows = [
            {
                "device": r.device.name,
                "capacity_bytes": r.device.capacity_bytes,
                "weight_bytes": r.weight_bytes,
                "activation_bytes": r.activation_bytes,
                "kv_bytes": r.kv_bytes,
                "need_bytes": _gpu_need(plan, r, streamed),
            }
            for r in summary(plan)
            if r.device.is_accelerator
        ]
        result[label] = {
            "gpus": rows,
            "overflows": any(r["need_bytes"] > r["capacity_bytes"] for r in rows),
            "spilled_bytes": sum(plan.placements.bytes_on[d.name] for d in devices if not d.is_accelerator),
        }
    return result


def generation_markdown(fit: dict[str, Any]) -> str:
    gib = 2**30
    lines = [
        f"Llama-2-70B bf16, 2 x 80 GiB, generate {fit['batch']} x {fit['max_length']:,} tokens "
        f"(KV cache {fit['kv_bytes'] / gib:.1f} GiB)",
        "",
        "| planner | GPU | weights | activations | KV cache | needs / capacity | overflows |",
        "|---|---|---|---|---|---|---|",
    ]
    for label in ("automap", "accelerate balanced"):
        for r in fit[label]["gpus"]:
            lines.append(
                f"| {label} | {r['device']} | {r['weight_bytes'] / gib:.1f} GiB | "
                f"{r['activation_bytes'] / gib:.2f} GiB | {r['kv_bytes'] / gib:.1f} GiB | "
                f"{r['need_bytes'] / gib:.1f} / {r['capacity_bytes'] / gib:.0f} GiB | "
                f"{'**yes**' if r['need_bytes'] > r['capacity_bytes'] else 'no'} |"
            )
    return "\n".join(lines)


def run_case(case: Case, counts: list[int], ratios: list[float], repeats: int) -> list[dict[str, Any]]:
    with torch.device("meta"):
        model = case.build().eval()
    prof = automap.profile(model)  # the same units as no_split=case.no_split gives, but splittable
    splitter = Splitter(model)  # the model's own _no_split_modules, if any, stay whole
    tensors = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    tensors += [n for n, _ in model.named_buffers(remove_duplicate=False)]
    rows = []
    for count in counts:
        for ratio in ratios:
            devices = _devices(prof.total_bytes, count, ratio)
            best = optimum(prof, devices[:count]) if ratio >= 1 else None
            row: dict[str, Any] = {
                "model": case.name,
                "gpus": count,
                "gpu_total_vs_model": ratio,
                "model_bytes": prof.total_bytes,
                "units": len(prof.units),
            }
            plan, seconds = _median_seconds(
                lambda: make_plan(prof, devices, "auto", refine=splitter), repeats
            )
            row["automap"] = _judge(plan, best, seconds)
            for label, fn in _accelerate_maps(model, devices, case).items():
                try:
                    device_map, seconds = _median_seconds(fn, max(1, repeats // 3))
                    parsed = parse_device_map(
                        device_map, model.named_modules(remove_duplicate=False), tensors
                    )
                    judged = plan_from_device_map(prof, devices, parsed)
                    row[label] = _judge(judged, best, seconds)
                except (AutomapError, Exception) as exc:  # noqa: BLE001 - reported in the table
                    row[label] = {"error": f"{type(exc).__name__}: {exc}"[:160]}
            rows.append(row)
            log.info("%s x%d %.1fx done", case.name, count, ratio)
    return rows


def synthetic_speed(units: int = 1000, devices: int = 8, repeats: int = 5) -> dict[str, Any]:
    """Planning time for a 1,000-unit chain on 8 GPUs (the "never matters" target), when it
    fits (1.3x) and when 40% of it is offloaded to CPU RAM (0.6x)."""
    named = tuple(
        Unit(
            f"u{i}",
            (f"u{i}.w",),
            param_bytes=10**6 + (i * 7919) % 10**6,
            flops=10**9 + (i * 104729) % 10**9,
            peak_activation_bytes=10**5,
            calls=1,
        )
        for i in range(units)
    )
    graph = nx.DiGraph()
    for i in range(1, units):
        graph.add_edge(f"u{i - 1}", f"u{i}", bytes=10**5 + (i * 31) % 10**5)
    prof = Profile("Synthetic", named, graph=graph, example="synthetic")
    total = prof.total_bytes
    result: dict[str, Any] = {"units": units, "devices": devices}
    for ratio in (1.3, 0.6):
        gpus = tuple(make_device(f"cuda:{i}", int(total * ratio / devices)) for i in range(devices))
        _, seconds = _median_seconds(lambda: make_plan(prof, gpus + (make_device("cpu", total),)), repeats)
        result[f"median_seconds_gpu_total_{ratio}x"] = seconds
    return result


def tutorial_split() -> dict[str, Any]:
    """ResNet-50 split by hand as in the PyTorch model-parallel tutorial (conv1..layer2 |
    layer3..fc) beside automap's split on two GPUs, by training FLOPs."""
    with torch.device("meta"):
        model = _resnet50().eval()
    prof = automap.profile(model)
    devices = (make_device("cuda:0", 10**10), make_device("cuda:1", 10**10))
    first = {"conv1", "bn1", "relu", "maxpool", "layer1", "layer2"}
    hand = {u.name: ("cuda:0" if u.name.split(".")[0] in first else "cuda:1") for u in prof.units}
    tensors = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers()]
    hand_plan = plan_from_device_map(prof, devices, parse_device_map(hand, model.named_modules(), tensors))
    auto_plan = make_plan(prof, devices, "auto")
    nvlink = tuple(make_device(d.name, d.capacity_bytes, link_bytes_per_second=300e9) for d in devices)
    nvlink_plan = make_plan(prof, nvlink, "auto")
    total = sum(u.train_flops for u in prof.units) or 1

    def shares(plan: Plan) -> list[float]:
        return [
            sum(u.train_flops for u, d in zip(plan.units, plan.placement) if d == dev.name) / total
            for dev in devices
        ]

    return {
        "tutorial": shares(hand_plan),
        "automap": shares(auto_plan),
        "automap_nvlink": shares(nvlink_plan),
        "automap_split_after": next(
            (
                plan_unit.name
                for plan_unit, d, nxt in zip(auto_plan.units, auto_plan.placement, auto_plan.placement[1:])
                if d != nxt
            ),
            None,
        ),
        "bottleneck_ratio_tutorial_vs_automap": bottleneck_seconds(hand_plan) / bottleneck_seconds(auto_plan),
    }


def _cell(result: dict[str, Any]) -> str:
    if "error" in result:
        return "error"
    vs = result["bottleneck_vs_optimum"]
    spilled = result["spilled_bytes"] / 2**20
    return (
        f"{spilled:,.0f} MiB / {100 * result['busiest_gpu_flops_share']:.0f}% / "
        f"{100 * result['gpu_flops_share']:.0f}% / "
        f"{'-' if vs is None else f'{vs:.2f}x'} / {1e3 * result['planning_seconds']:.1f} ms"
        + (" **OOM**" if result["oom"] else "")
    )


def markdown(rows: list[dict[str, Any]]) -> str:
    head = (
        "| model | GPUs | GPU total / model | automap | accelerate balanced | accelerate sequential |\n"
        "|---|---|---|---|---|---|"
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['gpus']} | {r['gpu_total_vs_model']}x | {_cell(r['automap'])} | "
            f"{_cell(r['accelerate balanced'])} | {_cell(r['accelerate sequential'])} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--models", nargs="*", default=[c.name for c in CASES])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--generation-only", action="store_true", help="only the 70B generation check (seconds, not minutes)"
    )
    args = parser.parse_args()
    if args.generation_only:
        fit = generation_fit()
        print(generation_markdown(fit))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(fit, f, indent=2)
        return
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    warnings.filterwarnings("ignore")
    rows = []
    for case in CASES:
        if case.name in args.models:
            rows += run_case(case, [2, 4, 8], [1.3, 0.6], args.repeats)
    result = {
        "rows": rows,
        "speed_1000x8": synthetic_speed(),
        "tutorial_resnet50": tutorial_split(),
        "generation_70b": generation_fit(),
    }
    print(markdown(rows))
    print(generation_markdown(result["generation_70b"]))
    print(json.dumps({k: result[k] for k in ("speed_1000x8", "tutorial_resnet50")}, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
