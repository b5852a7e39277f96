"""The dataflow graph between units, shaped so that a cut's cost is a sum over its edges.

A tensor produced by one unit and read by several later ones (T5's encoder states, read by
every decoder block; Llama's cos/sin, read by every layer) is drawn as a relay: producer ->
first reader -> next reader ..., as a pipeline carries it from stage to stage. Then exactly one
of its edges crosses any cut it is live across, and summing ``bytes`` over the edges a cut
crosses gives :meth:`Profile.cut_bytes <automap.profiling.result.Profile.cut_bytes>` without
counting a tensor twice.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:  # networkx is imported when a graph is built, not with automap
    import networkx as nx

from automap.profiling.result import INPUT, OUTPUT, Flow, Unit, live_bytes


def build_graph(units: Sequence[Unit], flows: Sequence[Flow]) -> nx.DiGraph:
    """A ``DiGraph`` over ``"<input>"``, unit names and ``"<output>"``.

    Args:
        units: units in execution order (positions are indices).
        flows: every tensor passed between units, as traced.

    Returns:
        The graph. Nodes carry ``position``, ``flops`` and ``weight_bytes``; an edge carries
        ``bytes`` (every distinct tensor passed along it, relayed ones included),
        ``produced_bytes`` (those its source produced) and ``tensors`` (how many).
    """
    import networkx as nx

    graph = nx.DiGraph()
    graph.add_node(INPUT, position=-1)
    for i, u in enumerate(units):
        graph.add_node(u.name, position=i, flops=u.flops, weight_bytes=u.weight_bytes)
    graph.add_node(OUTPUT, position=len(units))
    links: dict[tuple[str, str], list[tuple[Flow, bool]]] = {}
    for link in _relays(units, flows):
        links.setdefault((link[0].src, link[0].dst), []).append(link)
    for (src, dst), group in links.items():
        passed = [f for f, _ in group]
        graph.add_edge(
            src,
            dst,
            bytes=live_bytes(passed),
            produced_bytes=live_bytes(f for f, first in group if first),
            tensors=len({f.tensor for f in passed}),
        )
    return graph


def _relays(units: Sequence[Unit], flows: Sequence[Flow]) -> list[tuple[Flow, bool]]:
    """Each tensor's chain of links (producer -> reader -> next reader), with ``True`` on the
    link that leaves the producer; model outputs link straight from their producer."""
    readers: dict[tuple[int, int, str], set[int]] = {}
    sample: dict[tuple[int, int, str], Flow] = {}
    links: list[tuple[Flow, bool]] = []
    for f in flows:
        if f.dst == OUTPUT:
            links.append((f, True))
            continue
        key = (f.tensor, f.start, f.src)
        readers.setdefault(key, set()).add(f.end)
        sample.setdefault(key, f)
    for key, ends in readers.items():
        f = sample[key]
        stops = [f.start, *sorted(e for e in ends if e > f.start)]
        for a, b in zip(stops, stops[1:]):
            src = f.src if a == f.start else units[a].name
            links.append((replace(f, src=src, dst=units[b].name, start=a, end=b), a == f.start))
    return links
