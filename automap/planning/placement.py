"""The planner's decision per unit as a typed record: where its weights live (a tier and a
device), where it computes, and how its weights get there (resident, streamed or staged).
Resolved once per plan; dispatch, load and the report read it instead of re-deriving it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Iterator, Mapping, Sequence

from automap.kinds import kind_of


class Route(str, enum.Enum):
    """How a unit's weights reach the device that computes it. A ``str`` enum: JSON writes the
    plain value and ``route == "staged"`` reads as it should."""

    RESIDENT = "resident"
    STREAMED = "streamed"
    STAGED = "staged"


@dataclass(frozen=True)
class Placement:
    """One unit's resolved placement.

    Attributes:
        home: the device whose memory (or files) holds the unit's weights (``"cuda:0"``,
            ``"cpu"``, ``"disk"``): the name in ``plan.placement``.
        tier: the kind of ``home`` (``"cuda"``, ``"cpu"``, ``"disk"``).
        compute: the device that runs the unit (its home when resident, else the plan's
            execution device).
        route: how its weights get from ``home`` to ``compute``.
    """

    home: str
    tier: str
    compute: str
    route: Route

    @property
    def offloaded(self) -> bool:
        """The weights are brought in for each call (streamed or staged), not resident."""
        return self.route is not Route.RESIDENT

    @property
    def in_store(self) -> bool:
        """The home is a tier that stores only (disk): its weights live in a weight source of
        files, under ``offload_dir`` where they must be written."""
        return kind_of(self.tier).stores_only

    def as_dict(self) -> dict[str, Any]:
        """The JSON form (``docs/plan-schema.md``)."""
        return {
            "home": self.home,
            "tier": self.tier,
            "compute_device": self.compute,
            "route": self.route.value,
        }


def resolve(home: str, execution: str) -> Placement:
    """The placement of a unit whose weights live on ``home``, in a plan whose offloaded units
    compute on ``execution``: resident where the home computes (and is not a storage tier
    streaming to another executor), staged when the home's tier sends its weights through host
    memory to an accelerator, else streamed."""
    kind = kind_of(home)
    if not kind.is_storage or (kind.computes and home == execution):
        return Placement(home, kind.name, home, Route.RESIDENT)
    staged = kind.staged_via_host and kind_of(execution).is_accelerator
    return Placement(home, kind.name, execution, Route.STAGED if staged else Route.STREAMED)


@dataclass(frozen=True)
class PlacementTable:
    """A plan's placement, resolved once: per unit (aligned with the plan's units) its
    :class:`Placement` and weight bytes, and per home device how its units run. Iterating it
    yields the units' placements in order; the report, decode, layout and runtime read it
    instead of resolving device names again.

    Attributes:
        units: the unit names, in execution order.
        rows: each unit's placement, aligned with ``units``.
        weight_bytes: each unit's weight bytes, aligned with ``units``.
        execution_device: where offloaded units compute.
        by_home: every device of the plan (and every home a unit names) -> its placement.
        used_devices: the devices holding at least one unit, in the plan's device order.
        bytes_on: weight bytes per home device (0 for a device that holds nothing).
    """

    units: tuple[str, ...]
    rows: tuple[Placement, ...]
    weight_bytes: tuple[int, ...]
    execution_device: str
    by_home: Mapping[str, Placement]
    used_devices: tuple[str, ...]
    bytes_on: Mapping[str, int]

    def __iter__(self) -> Iterator[Placement]:
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> Placement:
        return self.rows[index]

    @property
    def offloaded_units(self) -> tuple[str, ...]:
        """The units whose weights are brought in for each call, in order."""
        return tuple(name for name, p in zip(self.units, self.rows) if p.offloaded)

    @property
    def offloaded_bytes(self) -> int:
        """Weight bytes of the offloaded units."""
        return sum(b for b, p in zip(self.weight_bytes, self.rows) if p.offloaded)


def placement_table(
    units: Sequence[tuple[str, int]], homes: Sequence[str], devices: Sequence[str], executor: str = ""
) -> PlacementTable:
    """The table of units ``(name, weight bytes)`` living on ``homes``, over ``devices`` (names,
    fastest tier first); offloaded units compute on ``executor``, else on the first accelerator
    holding a unit, else on the CPU."""
    used = set(homes)
    used_devices = tuple(d for d in devices if d in used)
    execution = executor or next((d for d in used_devices if kind_of(d).is_accelerator), "cpu")
    by_home = {home: resolve(home, execution) for home in (*devices, *sorted(used - set(devices)))}
    held: dict[str, int] = dict.fromkeys(by_home, 0)
    for (_, nbytes), home in zip(units, homes):
        held[home] += nbytes
    return PlacementTable(
        tuple(name for name, _ in units),
        tuple(by_home[h] for h in homes),
        tuple(nbytes for _, nbytes in units),
        execution,
        MappingProxyType(by_home),
        used_devices,
        MappingProxyType(held),
    )
