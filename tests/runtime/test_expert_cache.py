"""Hot experts kept in host memory while a mixture-of-experts model decodes from disk
(:class:`automap.runtime.experts.ExpertsCache`): the plain model's outputs with the cache on,
its hits and misses those of its policy run on the same routing, its bytes within the room
the plan leaves in RAM, and a kept expert read from nothing after a cold start."""

from __future__ import annotations

import torch
from conftest import tiny_moe

import automap
from automap.planning.experts import HotExperts, host_taken
from automap.profiling.routed import routed_rows
from automap.runtime.experts import ExpertReads, expert_cache
from automap.runtime.state import state_of

LAYERS = 3


def _map() -> dict[str, str]:
    found = {"model.embed_tokens": "cpu", "model.norm": "cpu", "lm_head": "cpu", "model.rotary_emb": "cpu"}
    found.update({f"model.layers.{i}": "disk" for i in range(LAYERS)})
    return found


def _room_for(model, experts: int) -> dict[str, int]:
    """max_memory whose CPU room holds ``experts`` routed experts of ``model``."""
    taken = host_taken(automap.plan(model, _map(), max_memory={"cpu": 1 << 30}))
    return {"cpu": taken + experts * _expert_bytes(model)}


def _expert_bytes(model) -> int:
    experts = model.model.layers[0].mlp.experts
    return sum(p.nbytes // p.shape[0] for p in experts.parameters(recurse=False))


def _trace(model, steps) -> tuple[list[list[tuple[str, int]]], list[torch.Tensor]]:
    trace, logits, handles = [], [], []
    for index, layer in enumerate(model.model.layers):
        name = f"model.layers.{index}.mlp.experts"
        handles.append(
            layer.mlp.experts.register_forward_pre_hook(
                lambda m, a, k, name=name: trace.append(
                    [(name, r) for r in routed_rows(a, k, m.num_experts)]
                ),
                with_kwargs=True,
            )
        )
    with torch.no_grad():
        logits = [model(ids, use_cache=False).logits for ids in steps]
    for handle in handles:
        handle.remove()
    return trace, logits


def test_decoding_with_hot_experts_kept_gives_the_plain_outputs_and_counts_hits_as_its_policy(tmp_path):
    model = tiny_moe("mixtral", layers=LAYERS, hidden=64, experts=8, shared=0)
    steps = [torch.randint(0, 128, (1, 1), generator=torch.Generator().manual_seed(i)) for i in range(12)]
    trace, expected = _trace(model, steps)
    max_memory = _room_for(model, 6)
    automap.dispatch(model, _map(), max_memory=max_memory, offload_dir=tmp_path)
    try:
        cache = expert_cache(model)
        assert cache is not None and cache.policy.budget == 6 * _expert_bytes(model)
        state = state_of(model)
        reads = next(h for h in state.hooks if isinstance(h, ExpertReads))
        for ids, want in zip(steps, expected):
            with torch.no_grad():
                got = model(ids, use_cache=False).logits
            assert torch.equal(got, want)
            reads.settle()
            held = sum(f.held_bytes for f in state.source.files.values())
            assert held <= cache.policy.budget and cache.held_bytes <= cache.policy.budget
            state.source.evict()  # a cold start: only the kept experts stay
        policy = HotExperts(cache.policy.budget)
        for call in trace:
            policy.access(call, _expert_bytes(model))
        assert (cache.policy.hits, cache.policy.misses) == (policy.hits, policy.misses)
        assert cache.policy.hits > 0 and set(cache.policy.held) == set(policy.held)
        assert state.source.stats().written_bytes == 0  # kept experts are not the user's writes
    finally:
        automap.undispatch(model)
    with torch.no_grad():
        assert torch.equal(model(steps[0], use_cache=False).logits, expected[0])


def test_without_room_in_ram_no_expert_is_kept(tmp_path):
    model = tiny_moe("mixtral", layers=LAYERS, hidden=64, experts=8, shared=0)
    automap.dispatch(model, _map(), max_memory=_room_for(model, 0), offload_dir=tmp_path)
    try:
        assert expert_cache(model) is None
    finally:
        automap.undispatch(model)


def test_experts_written_in_place_are_neither_kept_nor_given_back(tmp_path):
    model = tiny_moe("mixtral", layers=LAYERS, hidden=64, experts=8, shared=0)
    ids = torch.randint(0, 128, (1, 1), generator=torch.Generator().manual_seed(0))
    automap.dispatch(model, _map(), max_memory=_room_for(model, 24), offload_dir=tmp_path)
    try:
        experts = model.model.layers[0].mlp.experts
        with torch.no_grad():
            experts.down_proj.mul_(2.0)  # the user's write: copy-on-write pages of the store's map
        written = state_of(model).source.stats().written_bytes
        with torch.no_grad():
            model(ids, use_cache=False)
        next(h for h in state_of(model).hooks if isinstance(h, ExpertReads)).settle()
        cache = expert_cache(model)
        assert not any(key[0] == "model.layers.0.mlp.experts" for key in cache.policy.held)
        assert state_of(model).source.stats().written_bytes == written  # nothing of the write dropped
    finally:
        automap.undispatch(model)


def test_without_a_ram_budget_the_page_cache_is_left_to_keep_what_it_keeps(tmp_path):
    model = tiny_moe("mixtral", layers=LAYERS, hidden=64, experts=8, shared=0)
    automap.dispatch(model, _map(), offload_dir=tmp_path)  # RAM detected: no budget was set
    try:
        assert expert_cache(model) is None
    finally:
        automap.undispatch(model)


def test_a_detected_ram_figure_below_the_ram_free_now_is_no_budget():
    """The host's capacity a plan detected may be the machine record's, made while less RAM was
    free than at dispatch: it must not read as a budget the user set (the cache then came and
    went from one process to the next with the RAM free)."""
    import dataclasses

    from automap.kinds import available_ram_bytes
    from automap.planning.experts import cache_room

    model = tiny_moe("mixtral", layers=LAYERS, hidden=64, experts=8, shared=0)
    plan = automap.plan(model, _map())
    host = next(d for d in plan.devices if d.name == "cpu")
    assert "capacity_bytes" in host.measured, "detected: no max_memory was given"
    lower = dataclasses.replace(host, capacity_bytes=min(host.capacity_bytes, available_ram_bytes() // 4))
    older = dataclasses.replace(plan, devices=tuple(lower if d is host else d for d in plan.devices))
    assert cache_room(older) == 0
    given = automap.plan(model, _map(), max_memory=_room_for(model, 4) | {"disk": 1 << 40})
    assert cache_room(given) >= 4 * _expert_bytes(model), "a budget the user set leaves its room"
