"""The layout-kind registry (:mod:`automap.planning.layout_registry`): the built-in kinds are tried in
their registered order, a name registers once, and a kind registered from outside takes part in
planning like the built-in ones."""

from __future__ import annotations

import networkx as nx
import pytest

from automap.devices import make_device
from automap.planning.layout_plans import level_plans
from automap.planning.layout_kinds import layout_options
from automap.planning.layout_registry import (
    LAYOUT_KINDS,
    RESIDENT,
    STREAMED,
    Layout,
    LayoutContext,
    LayoutKind,
    register_layout,
)
from automap.planning.items import all_cut_bytes, make_items
from automap.planning.strategies import get_strategy
from automap.profiling import Profile, Unit

MB = 10**6


def chain_profile(weights: list[int]) -> Profile:
    """Units u0..u{n-1} in a chain, one weight each, no activations."""
    units = tuple(
        Unit(
            name=f"u{i}",
            tensors=(f"u{i}.weight",),
            param_bytes=w,
            flops=w,
            train_flops=3 * w,
            output_bytes=0,
            peak_activation_bytes=0,
            calls=1,
        )
        for i, w in enumerate(weights)
    )
    graph = nx.DiGraph()
    graph.add_nodes_from(["<input>", *(u.name for u in units)])
    for i in range(len(units)):
        graph.add_edge("<input>" if i == 0 else f"u{i - 1}", f"u{i}", bytes=0)
    return Profile("Chain", units, graph=graph, example="synthetic")


def context(profile: Profile, devices) -> LayoutContext:
    items = make_items(profile, all_cut_bytes(profile))
    return LayoutContext.of(items, devices, get_strategy("auto"), {})


def test_the_builtin_kinds_are_registered_in_the_order_they_are_tried():
    assert list(LAYOUT_KINDS)[:6] == [
        "resident on cpu",
        "streamed on cpu",
        "resident",
        "packed",
        "streamed",
        "cpu computes",
    ]


def test_a_name_registers_once():
    with pytest.raises(ValueError, match="registered twice"):
        register_layout("resident")(LayoutKind)


def test_an_exclusive_kind_that_fits_is_the_only_option():
    ctx = context(
        chain_profile([10 * MB] * 4), (make_device("cuda:0", 100 * MB), make_device("cpu", 100 * MB))
    )
    assert [o.kind for o in layout_options(ctx)] == [RESIDENT]
    tight = context(
        chain_profile([10 * MB] * 4), (make_device("cuda:0", 25 * MB), make_device("cpu", 100 * MB))
    )
    assert RESIDENT not in [o.kind for o in layout_options(tight)]


def test_a_kind_registered_from_outside_is_planned_like_the_builtin_ones():
    """A kind that keeps every item in CPU RAM, to be streamed to the first GPU: it fits only where
    the CPU budget holds the model, and its layouts come back as plans of its kind."""

    class AllStreamed(LayoutKind):
        kind = STREAMED

        def fits(self, ctx: LayoutContext) -> bool:
            return ctx.accelerated and sum(ctx.items.chain.weight) <= ctx.storage[0].capacity_bytes

        def build(self, ctx: LayoutContext) -> list[Layout]:
            return [Layout((ctx.storage[0].name,) * len(ctx.items.chain), {ctx.compute[0].name: 10 * MB})]

    profile = chain_profile([10 * MB] * 4)
    devices = (make_device("cuda:0", 25 * MB), make_device("cpu", 100 * MB))
    before = level_plans(profile, devices, get_strategy("auto"), {})
    register_layout("all streamed (test)")(AllStreamed)
    try:
        after = level_plans(profile, devices, get_strategy("auto"), {})
        small = level_plans(
            profile, (make_device("cuda:0", 25 * MB), make_device("cpu", 30 * MB)), get_strategy("auto"), {}
        )
    finally:
        del LAYOUT_KINDS["all streamed (test)"]
    assert len(after) == len(before) + 1
    assert after[-1].kind == STREAMED and set(after[-1].plan.placement) == {"cpu"}
    assert all(set(c.plan.placement) != {"cpu"} or c.kind != STREAMED for c in small)
