"""The planner's decision per unit as a typed record: where its weights live (a tier and a
device), where it computes, and how its weights get there (resident, streamed or staged).
Resolved once per plan; dispatch, load and the report read it instead of re-deriving it.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Sequence

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
        return {"home": self.home, "tier": self.tier, "compute_device": self.compute, "route": self.route.value}


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


def placements_of(homes: Sequence[str], execution: str) -> tuple[Placement, ...]:
    """The placement of each unit whose weights live on ``homes`` (a plan's ``placement``), its
    offloaded units computing on ``execution``; one record per distinct home."""
    by_home = {home: resolve(home, execution) for home in set(homes)}
    return tuple(by_home[home] for home in homes)

