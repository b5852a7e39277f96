"""The ``moe`` step of ``make gpu-check``: mixture-of-experts layers streamed to the GPU by
routed experts (:mod:`automap.runtime.experts`).

A Mixtral-shaped and a Qwen2-MoE-shaped model (transformers, random weights, fp32) run on
``cuda:0`` with, in turn, every decoder layer on disk, every decoder layer in CPU RAM, and only
the routed experts in CPU RAM (the rest on the GPU). For each: logits against the model all on
the GPU, ``generate`` tokens, the median one-token forward, and the bytes copied to the GPU per
forward against the bytes of the offloaded weights (only the routed experts' rows cross). On a
GPU, also automap's own plan for a decode with half the model's bytes of GPU room, which may
keep the experts apart (``plan.experts``), computed by the CPU at a decode step and streamed to the
GPU from the plan's token count on (:class:`~automap.runtime.experts.ExpertsByCall`): a
``LONG``-token prefill checks that choice per call against the plain model.
In a dry run the CPU executes and the copies go through ``StagedTransfer(source, HostCopyOps())``.
"""

from __future__ import annotations

import copy
import statistics
import time
from typing import Any

import torch
from torch import nn

import automap
from automap.offload import CudaOps, HostCopyOps, StagedTransfer
from automap.runtime import dispatch_plan, state_of
from automap.runtime.experts import ExpertsByCall
from benchmarks.gpu_steps import CheckFailed, Context, TimedOps


LONG = 1024  # tokens of the long prefill (planned device maps, on a GPU)


def build(kind: str, dry: bool) -> nn.Module:
    import transformers

    hidden, layers = (64, 2) if dry else (512, 6)
    common = dict(
        vocab_size=256 if dry else 4096,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128 if dry else LONG,
    )
    if kind == "mixtral":
        config = transformers.MixtralConfig(**common, num_local_experts=8, num_experts_per_tok=2)
        model_class = transformers.MixtralForCausalLM
    else:
        config = transformers.Qwen2MoeConfig(
            **common,
            num_experts=16,
            num_experts_per_tok=4,
            moe_intermediate_size=hidden,
            shared_expert_intermediate_size=2 * hidden,
        )
        model_class = transformers.Qwen2MoeForCausalLM
    torch.manual_seed(0)
    return model_class(config).eval()


def device_maps(model: nn.Module, dry: bool) -> dict[str, dict[str, Any]]:
    """The placements to check; in a dry run the "GPU" is the CPU and CPU RAM becomes disk."""
    gpu, ram = ("cpu", "disk") if dry else (0, "cpu")
    count = len(model.model.layers)
    layers = {f"model.layers.{i}": "disk" for i in range(count)}
    return {
        "layers-on-disk": {"": gpu, **layers},
        "layers-in-ram": {"": gpu, **{k: ram for k in layers}},
        "experts-in-ram": {
            "": gpu,
            **{name: ram for name, _ in model.named_modules() if name.endswith(".experts")},
        },
    }


def forward(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, use_cache=False).logits.float().cpu()


def median_seconds(ctx: Context, model: nn.Module, ids: torch.Tensor, runs: int = 5) -> float:
    times = []
    for _ in range(runs):
        ctx.sync()
        start = time.perf_counter()
        forward(model, ids)
        ctx.sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


PLANNED = {"planned": None, "planned-fast-cpu-memory": 200e9}  # the second: experts computed on the CPU


def planned(model: nn.Module, cpu_bandwidth: float | None = None) -> Any:
    """automap's own plan for a decode of the model with half of it fitting on the GPU: the
    planner may keep the experts apart (in CPU RAM, computed by the CPU or streamed; a fast CPU
    memory, ``cpu_bandwidth`` bytes/s, makes computing them there win)."""
    total = sum(t.nbytes for t in model.state_dict().values())
    return automap.plan(
        model,
        max_memory={0: total // 2, "cpu": 8 << 30},
        batch=1,
        max_length=64,
        bandwidths={"cpu": cpu_bandwidth} if cpu_bandwidth else None,
    )


def check_mode(
    ctx: Context, base: nn.Module, device_map: Any, name: str, reference: tuple[torch.Tensor, torch.Tensor]
) -> dict[str, Any]:
    model = copy.deepcopy(base)
    ids, gen = _inputs(ctx, model)
    ops = TimedOps(HostCopyOps() if ctx.dry else CudaOps(ctx.device))
    plan = (
        planned(model, PLANNED[device_map])
        if isinstance(device_map, str)
        else automap.plan(model, device_map)
    )
    experts = plan.experts.as_dict() if getattr(plan, "experts", None) is not None else None
    dispatch_plan(
        model,
        plan,
        offload_dir=ctx.scratch / f"moe-{name}",
        transfer=lambda source, *_: StagedTransfer(source, ops),
    )
    try:
        logits = forward(model, ids)
        tokens = model.generate(**gen).cpu()
        ops.timings.clear()
        forward(model, ids)
        copied = sum(sum(t.sizes) for t in ops.timings)
        seconds = median_seconds(ctx, model, ids)
        long = _long_prefill(model, reference[2]) if len(reference) > 2 else None
        offloaded = sum(
            u.param_bytes + u.buffer_bytes for u, p in zip(plan.units, plan.placements) if p.offloaded
        )
    finally:
        automap.undispatch(model)
    diff = (logits - reference[0]).abs().max().item()
    return {
        "max_abs_diff": diff,
        "outputs_match": bool(torch.allclose(logits, reference[0], rtol=1e-4, atol=1e-5)),
        "generate_identical": bool(torch.equal(tokens, reference[1])),
        "copied_bytes_per_forward": copied,
        "offloaded_bytes": offloaded,
        "copied_vs_offloaded": copied / max(offloaded, 1),
        "median_forward_seconds": seconds,
        "execution_device": plan.execution_device,
        "experts": experts,
        **({"long_prefill": long} if long is not None else {}),
    }


def _long_prefill(model: nn.Module, reference: tuple[torch.Tensor, torch.Tensor]) -> dict[str, Any]:
    """A ``LONG``-token forward of the dispatched model against the plain one's, and how many
    calls of experts the CPU computes at a decode step ran on the GPU for it."""
    ids, expected = reference
    hooks = [h for h in state_of(model).hooks if isinstance(h, ExpertsByCall)]
    before = sum(h.streamed_calls for h in hooks)
    logits = forward(model, ids)
    return {
        "tokens": ids.shape[-1],
        "experts_by_call": len(hooks),
        "stream_from_tokens": sorted({h.stream_from for h in hooks}),
        "streamed_calls": sum(h.streamed_calls for h in hooks) - before,
        "max_abs_diff": (logits - expected).abs().max().item(),
        "outputs_match": bool(torch.allclose(logits, expected, rtol=1e-4, atol=1e-5)),
    }


def _inputs(ctx: Context, model: nn.Module) -> tuple[torch.Tensor, dict[str, Any]]:
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (1, 1), generator=torch.Generator().manual_seed(1)).to(ctx.device)
    prompt = torch.randint(0, vocab, (1, 6), generator=torch.Generator().manual_seed(2)).to(ctx.device)
    gen = {
        "input_ids": prompt,
        "attention_mask": torch.ones_like(prompt),
        "max_new_tokens": 6,
        "min_new_tokens": 6,
        "do_sample": False,
        "pad_token_id": 0,
    }
    return ids, gen


def check_model(ctx: Context, kind: str) -> dict[str, Any]:
    base = build(kind, ctx.dry)
    plain = copy.deepcopy(base).to(ctx.device)
    ids, gen = _inputs(ctx, plain)
    reference: tuple[Any, ...] = (forward(plain, ids), plain.generate(**gen).cpu())
    if not ctx.dry:
        long = torch.randint(
            0, plain.config.vocab_size, (1, LONG), generator=torch.Generator().manual_seed(3)
        ).to(ctx.device)
        reference += ((long, forward(plain, long)),)
    found: dict[str, Any] = {"all_on_device_seconds": median_seconds(ctx, plain, ids)}
    del plain
    maps: dict[str, Any] = {**device_maps(base, ctx.dry), **({} if ctx.dry else {p: p for p in PLANNED})}
    for name, device_map in maps.items():
        found[name] = check_mode(ctx, base, device_map, f"{kind}-{name}", reference)
    return found


def moe(ctx: Context) -> dict[str, Any]:
    results = {kind: check_model(ctx, kind) for kind in ("mixtral", "qwen2_moe")}
    bad = [
        f"{k}/{m}: {r}"
        for k, modes in results.items()
        for m, r in modes.items()
        if isinstance(r, dict)
        and not (
            r["outputs_match"]
            and r["generate_identical"]
            and r.get("long_prefill", {}).get("outputs_match", True)
        )
    ]
    if bad:
        raise CheckFailed("routed experts not transparent: " + "; ".join(bad))
    worst = max(
        r["copied_vs_offloaded"] for modes in results.values() for r in modes.values() if isinstance(r, dict)
    )
    streamed = sum(
        r.get("long_prefill", {}).get("streamed_calls", 0)
        for modes in results.values()
        for r in modes.values()
        if isinstance(r, dict)
    )
    return {
        "models": results,
        "headline": f"mixtral, qwen2_moe: layers on disk / in RAM, experts in RAM: outputs match, generate identical;"
        f" copied at most {worst:.2f}x of the offloaded bytes per forward;"
        f" {LONG}-token prefills of the planned maps: outputs match, {streamed} experts calls streamed",
    }
