"""Layout kinds as registered objects (:func:`register_layout`), and the :class:`LayoutContext`
every kind reads. A kind owns its fit test and the layouts it builds; splitting keeps the fastest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from automap.devices import DeviceSpec
from automap.errors import PlanError
from automap.kinds import kind_of
from automap.planning.items import Groups, Items, grouped
from automap.planning.partition import Chain, Range, Slot
from automap.planning.strategies import Strategy
from automap.sizes import format_bytes

RESIDENT, PACKED, STREAMED, CPU_COMPUTES = "resident", "packed", "streamed", "cpu computes"
# Routed experts apart from their layers (automap.planning.experts): offered by its own step of
# make_plan, which compares decode rates, never by the forward-time choice among the others.
EXPERTS = "experts apart"


@dataclass(frozen=True)
class Layout:
    """Device name per item, the bytes reserved per device beyond weights/activations, and the
    execution device when the layout chooses one (``""``: the plan's default)."""

    devices: tuple[str, ...]
    reserves: dict[str, int]
    notes: tuple[str, ...] = ()
    executor: str = ""


@dataclass(frozen=True)
class Option:
    """One layout that works, and which kind it is (``RESIDENT``, ``PACKED``, ...)."""

    kind: str
    layout: Layout


def room(device: DeviceSpec, reserve: Mapping[str, int]) -> int:
    """Bytes of ``device`` the planner may fill: its capacity less the user's reserve there."""
    return max(device.capacity_bytes - reserve.get(device.name, 0), 0)


def tiers(devices: Sequence[DeviceSpec]) -> tuple[list[DeviceSpec], list[DeviceSpec]]:
    """Computing devices (accelerators, else the CPU) and storage tiers (CPU RAM, disk)."""
    accelerators = [d for d in devices if d.is_accelerator]
    hosts = [d for d in devices if kind_of(d).is_host]
    disks = [d for d in devices if kind_of(d).stores_only]
    return (accelerators, hosts + disks) if accelerators else (hosts, disks)


@dataclass(frozen=True)
class LayoutContext:
    """What every layout kind reads: the items and their groups, the computing devices and
    their rooms, the storage tiers, the strategy and the user's reserve per device name."""

    items: Items
    groups: Groups
    devices: tuple[DeviceSpec, ...]
    compute: tuple[DeviceSpec, ...]
    storage: tuple[DeviceSpec, ...]
    rooms: tuple[int, ...]
    strategy: Strategy
    reserve: Mapping[str, int]

    @classmethod
    def of(
        cls, items: Items, devices: Sequence[DeviceSpec], strategy: Strategy, reserve: Mapping[str, int]
    ) -> LayoutContext:
        """The context for ``items`` on ``devices`` (sorted, fastest first)."""
        compute, storage = tiers(devices)
        return cls(
            items,
            grouped(items),
            tuple(devices),
            tuple(compute),
            tuple(storage),
            tuple(room(d, reserve) for d in compute),
            strategy,
            reserve,
        )

    def with_reserve(self, reserve: Mapping[str, int]) -> LayoutContext:
        """The same items, devices and strategy with another reserve per device name."""
        return LayoutContext.of(self.items, self.devices, self.strategy, reserve)

    @property
    def accelerated(self) -> bool:
        """The computing devices are accelerators (else the CPU computes everything)."""
        return bool(self.compute) and self.compute[0].is_accelerator

    @property
    def total_fits(self) -> bool:
        """The weights fit the computing devices and the storage tiers together."""
        return sum(self.items.chain.weight) <= sum(
            room(d, self.reserve) for d in [*self.compute, *self.storage]
        )

    @property
    def host_stores(self) -> bool:
        """CPU RAM is a storage tier (so the CPU can compute what it stores)."""
        return any(kind_of(d).is_host for d in self.storage)

    def stages(
        self, chain: Chain, rooms: Sequence[int], base: float = 0.0, floor: int = 0, executor: int = 0
    ) -> list[Range | None]:
        """Split ``chain`` (known to fit ``rooms``) over the computing devices with the
        strategy; the one at index ``executor`` also runs the offloaded units (``base``
        seconds, ``floor`` activation bytes)."""
        slots = [
            Slot(
                r,
                d.flops_per_second,
                d.link_bytes_per_second,
                base if i == executor else 0.0,
                floor if i == executor else 0,
            )
            for i, (d, r) in enumerate(zip(self.compute, rooms))
        ]
        return self.strategy.split(chain, slots, False)

    def names(
        self, kept: Sequence[Range | None], offset: int = 0, where: Mapping[int, DeviceSpec] | None = None
    ) -> tuple[str, ...]:
        """Device name per item: stored items where ``where`` says, kept groups ``offset +
        range`` on their computing device."""
        names = [""] * sum(len(g) for g in self.groups.items)
        for i, tier in (where or {}).items():
            names[i] = tier.name
        for device, span in zip(self.compute, kept):
            if span is not None:
                for g in range(offset + span[0], offset + span[1]):
                    for i in self.groups.items[g]:
                        names[i] = device.name
        assert all(names), "every item is placed"
        return tuple(names)

    def nothing_fits(self) -> PlanError:
        """The error when no kind builds a layout: the numbers, and why."""
        if not self.accelerated:
            return self.does_not_fit(0)
        fits = self.total_fits
        reason = (
            ""
            if not (fits and self.storage)
            else "no accelerator can hold its units beside the room to stream "
            "the largest offloaded one"
            + (
                ""
                if self.host_stores
                else ", and no CPU budget lets the CPU compute them (allow 'cpu' in max_memory)"
            )
        )
        return self.does_not_fit(max(self.groups.stream, default=0) if fits else 0, reason)

    def does_not_fit(self, extra: int, reason: str = "") -> PlanError:
        """The model does not fit even with offloading (and ``extra`` bytes to stream
        offloaded units): what it needs, what the devices hold."""
        chain, reserve, every = self.items.chain, self.reserve, [*self.compute, *self.storage]
        weights = sum(chain.weight)
        peak = max(chain.activation, default=0) if self.accelerated else 0
        listed = ", ".join(f"{d.name} {format_bytes(room(d, reserve))}" for d in every)
        available = sum(room(d, reserve) for d in every)
        short = weights + peak + extra - available
        has_disk = any(kind_of(d).stores_only for d in self.storage)
        if short > 0:
            verdict = f"total {format_bytes(available)}, about {format_bytes(short)} short"
        else:  # room enough in all, but not where it is needed
            largest = max(range(len(chain)), key=lambda i: chain.weight[i] + chain.activation[i], default=0)
            need = chain.weight[largest] + chain.activation[largest] if len(chain) else 0
            verdict = (
                f"total {format_bytes(available)} is enough, but its largest piece ({format_bytes(need)} of "
                "weights and activations) must be in the memory of a device that computes to run, and the "
                f"most one has is {format_bytes(max((room(d, reserve) for d in self.compute), default=0))}"
            )
        return PlanError(
            f"the model does not fit even with offloading{': ' + reason if reason else ''}; it needs "
            f"{format_bytes(weights)} of weights + {format_bytes(peak)} of activations + {format_bytes(extra)} to "
            f"stream offloaded units, but the devices hold {listed} ({verdict}); raise max_memory"
            + (", free space where offload_dir points" if has_disk else ", allow 'disk' in max_memory")
            + ", or load the weights in a smaller dtype (dtype=torch.float16 halves float32 weights)"
        )


class LayoutKind:
    """One registered kind of layout. ``kind`` names its options (``RESIDENT``, ...; two
    kinds may share one, as the CPU alone and the accelerators both hold everything
    resident); ``exclusive``: when it builds a layout, no later kind is tried."""

    kind: str = ""
    exclusive: bool = False

    def fits(self, ctx: LayoutContext) -> bool:
        """Whether this kind can apply to ``ctx`` at all (cheap; :meth:`build` may still find
        that nothing fits)."""
        raise NotImplementedError

    def build(self, ctx: LayoutContext) -> list[Layout]:
        """The layouts of this kind for ``ctx``; empty when none fits."""
        raise NotImplementedError


LAYOUT_KINDS: dict[str, LayoutKind] = {}


def register_layout(name: str) -> Callable[[type[LayoutKind]], type[LayoutKind]]:
    """Register the decorated :class:`LayoutKind` subclass as ``name``; kinds are tried in the
    order they are registered."""

    def decorate(cls: type[LayoutKind]) -> type[LayoutKind]:
        if name in LAYOUT_KINDS:
            raise ValueError(f"layout kind {name!r} is registered twice")
        LAYOUT_KINDS[name] = cls()
        return cls

    return decorate
