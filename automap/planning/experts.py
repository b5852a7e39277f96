"""Routed experts placed apart from their layer: the one cost model that picks how they run
(computed on the CPU where they live, or streamed to the GPU), and the plan's per-layer record.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from automap.devices import DeviceSpec
from automap.kinds import available_ram_bytes, kind_of
from automap.planning.cost import flop_seconds, read_seconds, transfer_seconds
from automap.profiling import Unit

# The largest token count :func:`stream_from` looks at: beyond it every layer's experts are
# all touched, so the crossing, if any, lies below.
MAX_TOKENS = 1 << 20


class ExpertsMode(str, enum.Enum):
    """How a layer's routed experts run in one phase. A ``str`` enum: JSON writes the value."""

    RESIDENT = "resident"  # on the GPU with the rest of their layer
    CPU_COMPUTES = "cpu computes"  # the CPU runs them; activations cross the link
    STREAMED = "streamed"  # their weights cross the link to the GPU each call


def touched_fraction(unit: Unit, tokens: float) -> float:
    """The expected share of ``unit``'s experts that ``tokens`` tokens are routed to (1 for a
    unit that holds no routed experts)."""
    if not unit.experts or not unit.experts_per_token:
        return 1.0
    missed = 1.0 - min(unit.experts_per_token / unit.experts, 1.0)
    return 1.0 - missed ** max(tokens, 0.0)


def touched_bytes(unit: Unit, tokens: float) -> float:
    """Bytes of ``unit``'s weights that ``tokens`` tokens use: for routed experts only the
    experts they are routed to, else all of them."""
    return unit.weight_bytes * touched_fraction(unit, tokens)


@dataclass(frozen=True)
class ExpertsCost:
    """What one layer's routed experts need per token, from the profile: FLOPs (``k`` experts'
    three matmuls) and the bytes of hidden state that cross to the CPU and back."""

    unit: Unit
    flops_per_token: float
    activation_per_token: float

    @classmethod
    def of(cls, unit: Unit, tokens: int) -> ExpertsCost:
        """From ``unit`` as profiled on ``tokens`` tokens: its input and its output are the
        tokens' hidden states, of one size, so twice its output crosses per call."""
        tokens = max(tokens, 1)
        return cls(unit, unit.flops / tokens, 2 * unit.output_bytes / tokens)


def mode_seconds(
    cost: ExpertsCost, tokens: float, home: DeviceSpec, cpu: DeviceSpec, gpu: DeviceSpec
) -> dict[ExpertsMode, float]:
    """Predicted seconds of one call of the experts on ``tokens`` tokens, per mode (see the
    module docstring): the one cost model both the choice and the report use."""
    touched = touched_bytes(cost.unit, tokens)
    on_cpu = (
        flop_seconds(cost.flops_per_token * tokens, cpu.flops_per_second)
        + read_seconds(touched, home)
        + transfer_seconds(cost.activation_per_token * tokens, cpu, gpu)
    )
    return {ExpertsMode.CPU_COMPUTES: on_cpu, ExpertsMode.STREAMED: transfer_seconds(touched, home, gpu)}


def best_mode(
    cost: ExpertsCost, tokens: float, home: DeviceSpec, cpu: DeviceSpec, gpu: DeviceSpec
) -> ExpertsMode:
    """The faster mode at ``tokens`` tokens; a tie computes on the CPU (no weights move)."""
    seconds = mode_seconds(cost, tokens, home, cpu, gpu)
    return min(seconds, key=lambda mode: (seconds[mode], mode is ExpertsMode.STREAMED))


def stream_from(cost: ExpertsCost, home: DeviceSpec, cpu: DeviceSpec, gpu: DeviceSpec) -> int:
    """The fewest tokens at which streaming costs less than computing on the CPU; 0 when it
    never does up to :data:`MAX_TOKENS`. CPU work grows with the tokens while the streamed bytes
    stop growing, so the modes cross once: a bisection finds it."""

    def streams(tokens: int) -> bool:
        return best_mode(cost, tokens, home, cpu, gpu) is ExpertsMode.STREAMED

    if not streams(MAX_TOKENS):
        return 0
    low, high = 0, MAX_TOKENS  # streams(high); not streams(low) by convention
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if streams(middle) else (middle, high)
    return high


@dataclass(frozen=True)
class ExpertsLayer:
    """One layer's routed experts in a plan.

    Attributes:
        layer: the unit they were split out of (``"model.layers.3"``).
        unit: the experts' own unit (``"model.layers.3.mlp.experts"``).
        home: where their weights live (``"cuda:0"``, ``"cpu"``, ``"disk"``).
        decode, prefill: how they run at the planned decode step and at the prompt's prefill.
        stream_from: from how many tokens per call they are streamed to the accelerator (1:
            at every call; 0: never, resident experts or the CPU computing them at every call).
    """

    layer: str
    unit: str
    home: str
    decode: ExpertsMode
    prefill: ExpertsMode
    stream_from: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "layer": self.layer,
            "unit": self.unit,
            "home": self.home,
            "decode": self.decode.value,
            "prefill": self.prefill.value,
            "stream_from_tokens": self.stream_from,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ExpertsLayer:
        return cls(
            str(data["layer"]),
            str(data["unit"]),
            str(data["home"]),
            ExpertsMode(data["decode"]),
            ExpertsMode(data["prefill"]),
            int(data.get("stream_from_tokens", 0)),
        )


@dataclass(frozen=True)
class ExpertsPlan:
    """A plan's routed experts apart from their layers, and the decode rate it is predicted
    to reach against the best plan that keeps each layer whole.

    Attributes:
        layers: one record per layer, in execution order.
        decode_tokens: tokens per decode step (the batch); prefill_tokens: the prompt's tokens.
        tokens_per_second: this plan's predicted decode rate.
        whole_layer_tokens_per_second: the best whole-layer plan's predicted decode rate.
    """

    layers: tuple[ExpertsLayer, ...]
    decode_tokens: int
    prefill_tokens: int
    tokens_per_second: float
    whole_layer_tokens_per_second: float

    def as_dict(self) -> dict[str, Any]:
        """The JSON form (``docs/plan-schema.md``)."""
        return {
            "decode_tokens": self.decode_tokens,
            "prefill_tokens": self.prefill_tokens,
            "tokens_per_second": self.tokens_per_second,
            "whole_layer_tokens_per_second": self.whole_layer_tokens_per_second,
            "layers": [layer.as_dict() for layer in self.layers],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> ExpertsPlan | None:
        """The record :meth:`as_dict` wrote; None for plan JSON without one."""
        if not data:
            return None
        return cls(
            tuple(ExpertsLayer.from_dict(d) for d in data["layers"]),
            int(data["decode_tokens"]),
            int(data["prefill_tokens"]),
            float(data["tokens_per_second"]),
            float(data["whole_layer_tokens_per_second"]),
        )


# ------------------------------------------------------------------ hot experts kept in memory

# How much an expert's routing count fades per call of any layer's experts: 1 would be plain
# counts (LFU), a small value "the most recent first" (close to LRU). Chosen by measurement on
# Zipf-skewed routing traces against Belady's optimal cache (benchmarks/expert_cache.py;
# figures in benchmarks/notes/moe.md): counts that fade slowly keep what real skew makes hot
# and still follow a routing that changes over a long generation.
DECAY = 0.999

Key = tuple[str, int]  # (experts module, expert number)


@dataclass
class CacheChange:
    """What one call's routing changes in a :class:`HotExperts` cache: the experts to keep
    (``hold``) and to give back (``drop``), both lists of keys; ``hits`` of the call's
    experts were held already."""

    hold: list[Key]
    drop: list[Key]
    hits: int


class HotExperts:
    """Which routed experts stay in memory within ``budget`` bytes: those routed most often,
    their counts fading by :data:`DECAY` per call. The policy only, without I/O: the runtime
    (:class:`~automap.runtime.experts.ExpertsCache`) applies its changes, and a benchmark can run
    it on a recorded routing trace (:func:`belady_hits` is the optimum to compare it with).

    Each call's routed experts count as hits when held, else misses; a missed expert is kept
    when there is room, or when the experts it would push out (the least counted first) all
    count less than it does. Nothing else is ever read for the cache: an expert is kept just
    after the call that read it.

    Example:
        >>> cache = HotExperts(budget=2 * expert_bytes)
        >>> change = cache.access([("layers.0.experts", 3), ("layers.0.experts", 5)], expert_bytes)
    """

    def __init__(self, budget: int, decay: float = DECAY):
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must lie in (0, 1], not {decay}")
        self.budget, self.decay = max(int(budget), 0), decay
        self.held: dict[Key, int] = {}  # key -> its bytes
        self.used = 0
        self.hits = self.misses = 0
        self._score: dict[Key, float] = {}
        self._step = 1.0  # what one routing adds now: grows by 1/decay per call, so older counts weigh less
        self._refused: set[Key] = set()  # the runtime could not keep these: never asked for again

    @property
    def hit_rate(self) -> float:
        """Hits over routed experts so far (0.0 before any call)."""
        total = self.hits + self.misses
        return self.hits / total if total else 0.0

    def score(self, key: Key) -> float:
        return self._score.get(key, 0.0)

    def access(self, keys: Sequence[Key], nbytes: int | Sequence[int]) -> CacheChange:
        """One call routed to ``keys`` (each ``nbytes`` big, or each its own size): count it
        and say what to keep and give back."""
        sizes = [nbytes] * len(keys) if isinstance(nbytes, int) else list(nbytes)
        hits = sum(1 for k in keys if k in self.held)
        self.hits += hits
        self.misses += len(keys) - hits
        for key in keys:
            self._score[key] = self._score.get(key, 0.0) + self._step
        self._step /= self.decay
        if self._step > 1e100:  # rescale before the floats overflow; the order stays
            self._score = {k: v / self._step for k, v in self._score.items()}
            self._step = 1.0
        change = CacheChange([], [], hits)
        missed = sorted(
            ((k, s) for k, s in zip(keys, sizes) if k not in self.held and k not in self._refused),
            key=lambda ks: -self._score[ks[0]],
        )
        for key, size in missed:
            if size > self.budget:
                continue
            victims = self._victims(key, size, set(keys))
            if victims is None:
                continue
            for victim in victims:
                self.used -= self.held.pop(victim)
                change.drop.append(victim)
            self.held[key] = size
            self.used += size
            change.hold.append(key)
        return change

    def _victims(self, key: Key, size: int, now: set[Key]) -> list[Key] | None:
        """The held experts to give back so that ``key`` fits (the least counted first, each
        counting less than ``key``), or None when it should not be kept."""
        free = self.budget - self.used
        victims: list[Key] = []
        if free >= size:
            return victims
        for other in sorted(self.held, key=self.score):
            if self.score(other) >= self.score(key) or other in now:
                return None
            victims.append(other)
            free += self.held[other]
            if free >= size:
                return victims
        return None

    def refuse(self, key: Key) -> None:
        """The runtime could not keep ``key`` (its pages written by the user, an old kernel):
        forget it was held and never keep it."""
        self._refused.add(key)
        size = self.held.pop(key, None)
        if size is not None:
            self.used -= size


def belady_hits(trace: Sequence[Sequence[Key]], capacity: int, sizes: Mapping[Key, int] | int) -> int:
    """Hits of Belady's optimal cache on a routing ``trace`` (one list of keys per call):
    after each call the cache keeps, within ``capacity`` bytes, the experts whose next call
    comes soonest, leaving out any (also one just read) needed later than the others or never;
    for experts of one size no cache does better. Offline: it reads the whole trace."""
    size_of = (lambda key: sizes) if isinstance(sizes, int) else sizes.__getitem__
    upcoming: dict[Key, list[int]] = {}
    for step in range(len(trace) - 1, -1, -1):
        for key in set(trace[step]):
            upcoming.setdefault(key, []).append(step)  # descending steps: the last is the next use
    held: set[Key] = set()
    hits = 0
    for step, keys in enumerate(trace):
        for key in set(keys):
            upcoming[key].pop()
        hits += sum(1 for k in keys if k in held)
        candidates = sorted(held | set(keys), key=lambda k: upcoming[k][-1] if upcoming[k] else math.inf)
        held, used = set(), 0
        for key in candidates:
            if not upcoming[key]:
                break
            if used + size_of(key) <= capacity:
                held.add(key)
                used += size_of(key)
    return hits


# A host budget the user set at or above this share of the RAM free now binds nothing: the page
# cache keeps what RAM holds, as without one.
BUDGET_SHARE = 0.9


def cache_room(plan: Any) -> int:
    """Host memory a plan leaves free for keeping hot routed experts whose home is a storage
    tier (the disk): the host's capacity less the weights the plan puts there, its reserve and
    the units read ahead into the page cache on the way (two of the largest offloaded); 0 when
    the host's capacity is unknown, nothing is offloaded to a storage tier, or the capacity is
    no budget: detected rather than given (``max_memory`` not given: the page cache keeps what
    RAM holds already, and the kernel may take it back, which it may not from experts kept
    here), or given at or above :data:`BUDGET_SHARE` of the RAM free now. Whether a budget was
    given is the plan's device's own record (``measured``), never read from how its figure
    compares with the RAM free now: a detected figure may come from the machine's record, made
    when less RAM was free.
    The runtime keeps experts in it only where it finds routed experts in those units."""
    hosts = [d for d in plan.devices if kind_of(d.name).is_host and 0 < d.capacity_bytes]
    stored = [u for u, p in zip(plan.units, plan.placements) if p.offloaded and p.in_store]
    if not hosts or not stored or "capacity_bytes" in hosts[0].measured:
        return 0  # detected, not given: no budget (the figure may be the machine record's, older)
    if hosts[0].capacity_bytes >= BUDGET_SHARE * available_ram_bytes():
        return 0
    return max(hosts[0].capacity_bytes - host_taken(plan, hosts[0].name), 0)


def host_taken(plan: Any, host: str = "cpu") -> int:
    """What :func:`cache_room` takes from the host's capacity before keeping experts: the
    weights the plan puts there, its reserve there, and two of the largest units offloaded to
    a storage tier (read ahead into the page cache)."""
    stored = [u for u, p in zip(plan.units, plan.placements) if p.offloaded and p.in_store]
    reserve = sum(b for name, b in plan.reserves if name == host)
    return (
        plan.placements.bytes_on.get(host, 0) + reserve + 2 * max((u.weight_bytes for u in stored), default=0)
    )


# ------------------------------------------------------------------ rows or whole layers

# Routed rows are ranges of a few MB read once the router has run; whole layers are long reads
# queued ahead. On the development machine's disk the first come in at 1.0-1.3 GB/s, the second
# at 2.3-2.9 GB/s (benchmarks/read_modes.py, benchmarks/notes/moe.md): ranged reads at about
# this share of the rate of long ones.
RANGED_SHARE = 0.45


def reads_whole(routed: int, whole: int) -> bool:
    """Whether a layer's routed experts are predicted faster read whole with its dense part
    ahead (``whole`` bytes at the disk's rate for long reads) than by the rows a call routes
    to (``routed`` bytes at :data:`RANGED_SHARE` of it), both counting only what is not kept in
    memory already. The disk's rate divides out: whole when ``whole <= routed / RANGED_SHARE``;
    at batch 1 (a quarter of the experts routed) rows, at batch 4 (about 70 %) whole layers."""
    return whole > 0 and whole * RANGED_SHARE <= routed
