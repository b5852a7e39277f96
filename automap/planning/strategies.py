"""The named strategies: how the units kept on the computing devices are split among them.

Each strategy is one registration: a function from the chain of items and one
:class:`~automap.planning.partition.Slot` per computing device (room, speed, link, work it
already has) to one range of items per slot. Everything around it (tiers, offloading, tie
groups, reserves) is shared and lives in :mod:`automap.planning.layout_kinds`. A new strategy is a
function here with ``@register_strategy("name")``; ``device_map="name"`` then selects it, like
``torch.distributed.pipelining`` looks up its schedules by name.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Sequence

from automap.errors import PlanError
from automap.planning.partition import Chain, Range, Slot, fill, min_bottleneck

Split = Callable[[Chain, Sequence[Slot], bool], list["Range | None"]]


@dataclass(frozen=True)
class Strategy:
    """A registered strategy: its name, what it promises, and its split function. ``split``
    gets a chain that is known to fit the slots; with ``anchor_first`` the first slot must take
    the first item (it executes the offloaded units)."""

    name: str
    summary: str
    split: Split
    light_first: bool = False  # the first device executes streamed units only when no other can


STRATEGIES: dict[str, Strategy] = {}


def register_strategy(
    name: str, summary: str, *, aliases: Sequence[str] = (), light_first: bool = False
) -> Callable[[Split], Split]:
    """Register the decorated split function as strategy ``name`` (and ``aliases``); with
    ``light_first`` the first GPU keeps no streaming slot when another GPU can execute."""

    def decorate(split: Split) -> Split:
        for key in (name, *aliases):
            if key in STRATEGIES:
                raise ValueError(f"strategy {key!r} is registered twice")
            STRATEGIES[key] = Strategy(key, summary, split, light_first)
        return split

    return decorate


def get_strategy(name: str) -> Strategy:
    """The strategy registered as ``name``.

    Raises:
        PlanError: no strategy has that name.
    """
    try:
        return STRATEGIES[name]
    except KeyError:
        raise PlanError(
            f"unknown strategy {name!r}; use one of {', '.join(STRATEGIES)}, a dict, or a Plan"
        ) from None


def _balanced_split(chain: Chain, slots: Sequence[Slot], anchor_first: bool) -> list[Range | None]:
    ranges = min_bottleneck(chain, slots, anchor_first)
    assert ranges is not None, "the chain was checked to fit before balancing"
    return ranges


@register_strategy("balanced", "the contiguous split whose slowest stage is fastest", aliases=("auto",))
def balanced(chain: Chain, slots: Sequence[Slot], anchor_first: bool) -> list[Range | None]:
    return _balanced_split(chain, slots, anchor_first)


# GPU 0 is balanced as if half as fast: generate() runs its logits processing, sampling and the
# model's inputs and outputs there, as transformers expects.
LOW_0_SPEED_FACTOR = 0.5


@register_strategy("balanced_low_0", "balanced, with GPU 0 kept light for generate()", light_first=True)
def balanced_low_0(chain: Chain, slots: Sequence[Slot], anchor_first: bool) -> list[Range | None]:
    if len(slots) > 1:
        slots = [replace(slots[0], speed=slots[0].speed * LOW_0_SPEED_FACTOR), *slots[1:]]
    return _balanced_split(chain, slots, anchor_first)


@register_strategy("sequential", "fill GPU 0, then GPU 1, ... in order")
def sequential(chain: Chain, slots: Sequence[Slot], anchor_first: bool) -> list[Range | None]:
    ranges, _ = fill(chain, [s.room for s in slots], floors=[s.floor for s in slots])
    return [r if r[1] > r[0] else None for r in ranges]
