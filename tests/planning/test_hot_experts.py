"""The hot-expert policy (:class:`automap.planning.experts.HotExperts`) and Belady's optimal
cache it is measured against: hits counted per routed expert, the byte budget never exceeded,
Belady's hits equal to the best any cache of that size could get on small traces."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from automap.planning.experts import HotExperts, belady_hits


def _keys(*experts: int) -> list[tuple[str, int]]:
    return [("layers.0.experts", e) for e in experts]


def test_hits_and_misses_are_counted_per_routed_expert_on_a_hand_made_trace():
    cache = HotExperts(budget=2 * 10, decay=1.0)
    trace = [_keys(0, 1), _keys(0, 2), _keys(0, 1), _keys(3), _keys(0, 3)]
    changes = [cache.access(call, 10) for call in trace]
    # 0 and 1 fill the room; 2 counts no more than 1 does (a tie keeps what is held); 3,
    # routed once and then twice, never counts more than 1 (twice).
    assert [c.hits for c in changes] == [0, 1, 2, 0, 1]
    assert (cache.hits, cache.misses) == (4, 5)
    assert cache.hit_rate == pytest.approx(4 / 9)
    assert changes[0].hold == _keys(0, 1) and not changes[0].drop
    assert set(cache.held) == set(_keys(0, 1))


def test_an_expert_routed_more_often_pushes_out_the_least_routed_one():
    cache = HotExperts(budget=10, decay=1.0)
    cache.access(_keys(1), 10)
    change = cache.access(_keys(2), 10)
    assert not change.hold  # a tie: the held one stays
    change = cache.access(_keys(2), 10)
    assert change.hold == _keys(2) and change.drop == _keys(1)
    assert set(cache.held) == set(_keys(2))


def test_fading_counts_let_recent_routing_win_over_old_counts():
    faded, plain = HotExperts(budget=10, decay=0.5), HotExperts(budget=10, decay=1.0)
    for cache in (faded, plain):
        for call in [_keys(1)] * 3 + [_keys(2)] * 2:
            cache.access(call, 10)
    assert set(faded.held) == set(_keys(2)) and set(plain.held) == set(_keys(1))


def test_an_expert_the_runtime_could_not_keep_is_never_asked_for_again():
    cache = HotExperts(budget=20, decay=1.0)
    cache.access(_keys(1), 10)
    cache.refuse(_keys(1)[0])
    assert not cache.held and cache.used == 0
    assert not cache.access(_keys(1), 10).hold


traces = st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=3, unique=True), min_size=1, max_size=40)


@settings(max_examples=200, deadline=None)
@given(
    traces,
    st.integers(0, 60),
    st.sampled_from([1.0, 0.99, 0.5]),
    st.lists(st.integers(1, 25), min_size=6, max_size=6),
)
def test_what_is_held_never_exceeds_the_budget_and_follows_the_changes(trace, budget, decay, sizes):
    cache = HotExperts(budget, decay)
    held: set[tuple[str, int]] = set()
    for call in trace:
        keys = _keys(*call)
        change = cache.access(keys, [sizes[e] for e in call])
        assert not set(change.hold) & set(change.drop)
        held = (held - set(change.drop)) | set(change.hold)
        assert held == set(cache.held)
        assert cache.used == sum(cache.held.values()) <= budget
    assert cache.hits + cache.misses == sum(len(c) for c in trace)


def _best_hits(trace: list[list[tuple[str, int]]], slots: int) -> int:
    """Exhaustive: the most hits any cache of ``slots`` experts gets, choosing after each
    call what to keep among what it held and what the call read."""
    best = {frozenset(): 0}
    for call in trace:
        after: dict[frozenset, int] = {}
        for held, hits in best.items():
            hits += sum(1 for k in call if k in held)
            pool = held | set(call)
            for size in range(min(slots, len(pool)) + 1):
                for kept in itertools.combinations(sorted(pool), size):
                    key = frozenset(kept)
                    after[key] = max(after.get(key, -1), hits)
        best = after
    return max(best.values())


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=2, unique=True), min_size=1, max_size=9),
    st.integers(0, 3),
)
def test_belady_gets_the_most_hits_any_cache_of_its_size_gets(trace, slots):
    calls = [_keys(*c) for c in trace]
    assert belady_hits(calls, slots * 7, 7) == _best_hits(calls, slots)


@given(traces, st.integers(0, 4))
def test_no_policy_beats_belady(trace, slots):
    calls = [_keys(*c) for c in trace]
    cache = HotExperts(slots * 3, decay=0.99)
    for call in calls:
        cache.access(call, 3)
    assert cache.hits <= belady_hits(calls, slots * 3, 3)
