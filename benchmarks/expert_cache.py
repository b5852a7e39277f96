"""Hot experts kept in memory: hit rate against Belady's optimal cache, and bytes read by a
cold decode with and without the cache.

Builds the Mixtral shape of ``benchmarks/moe.py`` (8 experts, top 2, 6 layers, fp32) and skews
its routers towards a Zipf distribution (:func:`skew`): each expert's logit is a per-token
random draw plus a bias of ``-alpha * log(rank)``, ranks drawn at random per layer. The plain model decodes
``--tokens`` tokens after a short prompt (random ids fed one at a time, with its KV cache) and
its routing is recorded: one list of experts per call of a layer's experts.

- **Offline**, on that trace, with room for a quarter of the experts:
  :class:`automap.planning.experts.HotExperts` at several fading rates (1: plain counts; small:
  close to LRU) against :func:`automap.planning.experts.belady_hits`.
- **Dispatched**: every decoder layer on disk, two copies of the model in one process, one
  with the cache (room for a quarter of the experts: ``max_memory["cpu"]`` set so that
  :func:`~automap.planning.experts.cache_room` is that), one without (its budget set to 0);
  before each decode step both stores' pages are dropped from the page cache (the decode of a
  model bigger than RAM), then each runs the step, alternating which goes first. Bytes read are
  the store's pages brought into memory by the step (``mincore``), as in ``benchmarks/moe.py``;
  times are medians. Outputs are compared with the plain model's.

    python -m benchmarks.expert_cache --tokens 48 --json benchmarks/notes/expert-cache.json
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import tempfile
import time
from typing import Any

from benchmarks.moe import build, expert_modules, resident_bytes


def skew(model: Any, alpha: float, seed: int = 2) -> None:
    """Route ``model``'s tokens by a known law (see the module docstring): hidden features
    ``0..CHANNELS`` of the residual stream are set aside (no attention or expert output writes
    to them): feature 0 holds one value for every token, features ``1..CHANNELS`` random values
    per token (from the embeddings). Each layer's router reads only those: random weights on
    the per-token features (each expert's logit gets noise of spread 1) and, on feature 0, a
    bias of ``alpha * -log(rank)`` per expert, ranks drawn at random per layer. The routing is
    then a Zipf-biased draw per token and layer, independent between tokens."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    embed = model.model.embed_tokens.weight
    with torch.no_grad():
        embed[:, 0] = 1.0
        embed[:, 1 : CHANNELS + 1] = torch.randn(embed.shape[0], CHANNELS, generator=generator)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[: CHANNELS + 1] = 0
            layer.mlp.experts.down_proj[:, : CHANNELS + 1] = 0
            count = layer.mlp.gate.weight.shape[0]
            ranks = torch.randperm(count, generator=generator).float() + 1
            weight = torch.zeros_like(layer.mlp.gate.weight)
            weight[:, 1 : CHANNELS + 1] = torch.randn(count, CHANNELS, generator=generator) / CHANNELS**0.5
            weight[:, 0] = alpha * -torch.log(ranks)
            layer.mlp.gate.weight.copy_(weight)


CHANNELS = 32  # features of the residual stream that carry the routing's per-token draw


def decode_plain(model: Any, prompt: Any, steps: Any) -> tuple[list[list[tuple[str, int]]], list[Any]]:
    """The routing trace (one list of (module, expert) per call of a layer's experts) and the
    logits of the prompt and of each step, decoding ``steps`` one at a time after ``prompt``."""
    import torch
    from transformers import DynamicCache

    trace: list[list[tuple[str, int]]] = []
    names = {id(m): f"model.layers.{i}.mlp.experts" for i, m in enumerate(expert_modules(model))}
    handles = [
        m.register_forward_pre_hook(
            lambda mod, args: trace.append(
                [(names[id(mod)], e) for e in sorted(set(args[1].flatten().tolist()))]
            )
        )
        for m in expert_modules(model)
    ]
    logits = []
    cache = DynamicCache()
    with torch.no_grad():
        for ids in (prompt, *steps):
            logits.append(model(ids, past_key_values=cache, use_cache=True).logits)
    for handle in handles:
        handle.remove()
    return trace, logits


def offline(
    trace: list[list[tuple[str, int]]], room: int, expert_bytes: int, decays: list[float], skip: int
) -> dict[str, Any]:
    """Hit rates on the trace's calls after the first ``skip`` (the prompt's) of the policy at
    each fading rate and of Belady's cache, all fed the whole trace."""
    from automap.planning.experts import HotExperts, belady_hits

    def rate(hits: int, total: int) -> float:
        return hits / total if total else 0.0

    decode_calls = sum(len(call) for call in trace[skip:])
    best = belady_hits(trace, room, expert_bytes) - belady_hits(trace[:skip], room, expert_bytes)
    rows = {}
    for decay in decays:
        policy = HotExperts(room, decay)
        for call in trace[:skip]:
            policy.access(call, expert_bytes)
        before = policy.hits
        for call in trace[skip:]:
            policy.access(call, expert_bytes)
        rows[str(decay)] = rate(policy.hits - before, decode_calls)
    return {"calls": decode_calls, "belady_hit_rate": rate(best, decode_calls), "policy_hit_rates": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=48, help="decode steps")
    parser.add_argument("--prompt", type=int, default=8, help="prompt tokens")
    parser.add_argument("--alpha", type=float, default=1.5, help="the Zipf bias (0: no skew)")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()

    import torch
    from transformers import DynamicCache

    import automap
    from automap.planning.experts import DECAY, host_taken
    from automap.runtime.experts import ExpertReads, expert_cache
    from automap.runtime.state import state_of

    torch.set_num_threads(2)
    model = build("mixtral", args.layers)
    skew(model, args.alpha)
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 1024, (1, args.prompt), generator=generator)
    steps = [torch.randint(0, 1024, (1, 1), generator=generator) for _ in range(args.tokens)]
    trace, expected = decode_plain(model, prompt, steps)
    experts = expert_modules(model)
    expert_bytes = sum(p.nbytes // p.shape[0] for p in experts[0].parameters(recurse=False))
    room = len(experts) * experts[0].num_experts * expert_bytes // 4
    skip = len(experts)  # the prompt's calls
    found = offline(trace, room, expert_bytes, [1.0, 0.999, 0.99, 0.9], skip)

    device_map: dict[str, Any] = {
        "model.embed_tokens": "cpu",
        "model.norm": "cpu",
        "lm_head": "cpu",
        "model.rotary_emb": "cpu",
    }
    device_map.update({f"model.layers.{i}": "disk" for i in range(args.layers)})
    taken = host_taken(automap.plan(model, device_map, max_memory={"cpu": 1 << 30}))
    max_memory = {"cpu": taken + room}
    cached, plain = model, copy.deepcopy(model)
    result: dict[str, Any] = {
        "offline": found,
        "room_bytes": room,
        "expert_bytes": expert_bytes,
        "experts": len(experts) * experts[0].num_experts,
        "decay": DECAY,
    }
    with (
        tempfile.TemporaryDirectory(prefix="automap-cache-") as first,
        tempfile.TemporaryDirectory(prefix="automap-cache-") as second,
    ):
        automap.dispatch(cached, device_map, max_memory=max_memory, offload_dir=first)
        automap.dispatch(plain, device_map, max_memory=max_memory, offload_dir=second)
        cache = expert_cache(cached)
        assert cache is not None and cache.policy.budget == room, (
            "the plan leaves room for a quarter of the experts"
        )
        off = expert_cache(plain)
        if off is not None:
            off.policy.budget = 0
        runs = {
            "cache": {"model": cached, "kv": DynamicCache(), "read": [], "seconds": [], "diff": 0.0},
            "none": {"model": plain, "kv": DynamicCache(), "read": [], "seconds": [], "diff": 0.0},
        }
        for run in runs.values():
            run["state"] = state_of(run["model"])
            run["files"] = list(run["state"].source.files.values())
            run["reads"] = next(h for h in run["state"].hooks if isinstance(h, ExpertReads))
        for index, ids in enumerate((prompt, *steps)):
            order = list(runs) if index % 2 else list(reversed(runs))
            for name in order:
                run = runs[name]
                for other in runs.values():
                    other["reads"].settle()
                    other["state"].source.evict()
                before = resident_bytes(run["files"])
                began = time.perf_counter()
                with torch.no_grad():
                    logits = run["model"](ids, past_key_values=run["kv"], use_cache=True).logits
                seconds = time.perf_counter() - began
                run["reads"].settle()
                read = resident_bytes(run["files"]) - before
                if index:  # the decode steps; the prompt fills the cache
                    run["read"].append(read)
                    run["seconds"].append(seconds)
                run["diff"] = max(run["diff"], (logits - expected[index]).abs().max().item())
        policy = cache.policy
        result["dispatched"] = {
            name: {
                "read_bytes_total": sum(r["read"]),
                "read_bytes_median": statistics.median(r["read"]),
                "step_seconds_median": statistics.median(r["seconds"]),
                "max_abs_diff": r["diff"],
            }
            for name, r in runs.items()
        }
        result["dispatched"]["cache"].update(
            hits=policy.hits, misses=policy.misses, hit_rate=policy.hit_rate, held_bytes=cache.held_bytes
        )
        for model_ in (cached, plain):
            automap.undispatch(model_)
    # The runtime's hit rate counts the prompt's calls too; the offline one at the same decay
    # over the whole trace must give the same count (the same policy on the same routing).
    from automap.planning.experts import HotExperts

    check = HotExperts(room)
    for call in trace:
        check.access(call, expert_bytes)
    result["offline"]["runtime_matches_offline"] = (check.hits, check.misses) == (policy.hits, policy.misses)
    ours = found["policy_hit_rates"][str(DECAY)]
    result["hit_rate_vs_belady"] = ours / found["belady_hit_rate"] if found["belady_hit_rate"] else 0.0
    result["read_vs_no_cache"] = result["dispatched"]["cache"]["read_bytes_total"] / max(
        result["dispatched"]["none"]["read_bytes_total"], 1
    )
    print(
        f"trace: {found['calls']} decode calls, room for {room // expert_bytes} of {result['experts']} experts"
    )
    for decay, rate in found["policy_hit_rates"].items():
        print(
            f"  fading {decay}: hit rate {rate:.3f} ({rate / found['belady_hit_rate']:.2f}x Belady's "
            f"{found['belady_hit_rate']:.3f})"
        )
    cached_row, plain_row = result["dispatched"]["cache"], result["dispatched"]["none"]
    print(
        f"dispatched, cold decode of {args.tokens} tokens: read {cached_row['read_bytes_total'] / 2**20:.0f} MiB with "
        f"the cache vs {plain_row['read_bytes_total'] / 2**20:.0f} MiB without ({result['read_vs_no_cache']:.2f}x); "
        f"step {cached_row['step_seconds_median'] * 1e3:.0f} vs {plain_row['step_seconds_median'] * 1e3:.0f} ms "
        f"(medians); runtime hit rate {cached_row['hit_rate']:.3f} (prompt included; same as offline: "
        f"{result['offline']['runtime_matches_offline']}); max abs diff {cached_row['max_abs_diff']} / "
        f"{plain_row['max_abs_diff']}"
    )
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
