"""What the profiler returns: :class:`Unit`, :class:`Flow` and :class:`Profile`.

Plain frozen data, no torch: the planner reads these and never re-measures.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Iterable

if TYPE_CHECKING:  # networkx is imported when a graph is built, not with automap
    import networkx as nx

from automap.errors import ProfileError


def _empty_graph() -> nx.DiGraph:
    import networkx as nx

    return nx.DiGraph()


INPUT = "<input>"
OUTPUT = "<output>"


@dataclass(frozen=True)
class Unit:
    """A module whose weights live on one device.

    Attributes:
        name: the module's dotted name in the model (``"model.layers.3"``).
        tensors: fully qualified names of the parameters and buffers it owns (a tied tensor
            is owned once, by the first unit that reaches it).
        loose: the subset of ``tensors`` owned directly by a non-unit ancestor (ViT's
            ``class_token``) and attached to the unit whose code first uses them; device maps
            list them by name.
        param_bytes, buffer_bytes: bytes of those tensors (at the profile's dtype when given).
        flops: forward FLOPs at the example inputs, including the code between units that
            runs just before this one (a parent's ``x + pos_embedding``).
        ops: aten ops its forward ran (all its calls, with the code between units counted as
            ``flops`` is): each costs the time to dispatch it beside its FLOPs.
        train_flops: forward + backward FLOPs, measured with a backward pass on meta (every
            floating parameter trainable, inputs not); 0 when profiled with ``backward=False``.
        output_bytes: bytes of the tensors the unit returns (largest call).
        peak_activation_bytes: inputs plus the most bytes allocated inside the unit and alive
            at once, as in an inference forward (largest call).
        calls: how many times the traced forward called it (0: never).
        aliases: other names of the same module object (a block registered twice, as
            ``model.head`` and ``model.tail``); device maps must list them too.
        dtype_bytes: bytes of the owned tensors per stored dtype (``{"float32": ...}``).
        input_bytes: bytes of the tensors passed to the unit (largest call).
        seconds: measured median forward time on ``Profile.measured_device`` (None: not measured).
        kv_bytes: bytes of the generation cache the unit holds after ``generate`` to
            ``Generation.max_length`` (storages, as allocated); 0 without a planned generation.
        kv_read_bytes: cache bytes the unit reads in one decode step, averaged over the decode.
        decode_flops: forward FLOPs of the unit in one decode step (one token per sequence),
            averaged over the decode.
        decode_weight_bytes: bytes of the unit's weights one decode step reads: all of a
            matrix a matmul uses, only the rows a lookup gathers (an embedding), none of a unit
            the step does not run (an encoder); None: not measured (read as all of them).
        decode_weight_rows: the rows of those bytes (a matrix's last dimension is a row): a
            matrix-vector product pays for each row beside its bytes.
        decode_ops: aten ops of the unit in one decode step.
        untraced: why the trace did not measure this unit ("" = it did): no trace ran, its
            forward cannot run on meta, or the forward stopped before it or while it ran (a
            meta limit, or any error on guessed example inputs; see ``profiling/fallback.py``);
            its bytes are exact, its other numbers are not measured.
        flops_estimated: ``flops`` (and ``train_flops``) are estimated from its weight shapes,
            not counted.
        split_from: the unit this one was split out of (``""``: not split), see
            :mod:`automap.profiling.refine`. That module's own forward code (a residual add)
            runs outside every unit, so every unit split from it computes on one device, and
            the module's inputs are sent there.
        experts, experts_per_token: for a unit that is a layer's routed experts (transformers'
            fused ``experts`` module, or a ``ModuleList`` of experts beside a router), how many
            experts it holds and how many each token is routed to; 0 for every other unit. A
            batch of ``t`` tokens touches about ``experts * (1 - (1 - k/experts) ** t)`` of them
            (:mod:`automap.planning.experts`).
    """

    name: str
    tensors: tuple[str, ...]
    loose: tuple[str, ...] = ()
    param_bytes: int = 0
    buffer_bytes: int = 0
    flops: int = 0
    ops: int = 0
    train_flops: int = 0
    output_bytes: int = 0
    peak_activation_bytes: int = 0
    calls: int = 0
    aliases: tuple[str, ...] = ()
    dtype_bytes: dict[str, int] = field(default_factory=dict)
    input_bytes: int = 0
    seconds: float | None = None
    kv_bytes: int = 0
    kv_read_bytes: int = 0
    decode_flops: int = 0
    decode_weight_bytes: int | None = None
    decode_weight_rows: int = 0
    decode_ops: int = 0
    untraced: str = ""
    flops_estimated: bool = False
    split_from: str = ""
    experts: int = 0
    experts_per_token: int = 0

    @property
    def weight_bytes(self) -> int:
        return self.param_bytes + self.buffer_bytes


@dataclass(frozen=True)
class Generation:
    """The generation a profile was measured for (see :mod:`automap.profiling.kvcache`).

    Attributes:
        batch: sequences decoded together.
        max_length: tokens per sequence at the end, as ``generate(max_length=...)`` counts them
            (the decoder's tokens for an encoder-decoder).
        prompt_length: tokens the decoder starts from (the prompt; 1, the start token, for an
            encoder-decoder).
        encoder_length: tokens of an encoder-decoder's input (0: decoder only).
        cache: the class of the cache the model keeps between decode steps ("" = none).
        notes: what a reader of the plan should know (no cache, bytes not attributed to a unit).
    """

    batch: int
    max_length: int
    prompt_length: int
    encoder_length: int = 0
    cache: str = ""
    notes: tuple[str, ...] = ()

    @property
    def new_tokens(self) -> int:
        """Decode steps after the prefill (each adds one token per sequence)."""
        return max(self.max_length - self.prompt_length - 1, 0)


@dataclass(frozen=True)
class Flow:
    """One tensor passed from the unit that produced it to a unit that consumed it.

    Attributes:
        src, dst: unit names (``"<input>"`` for the model's inputs, ``"<output>"`` for its outputs).
        start, end: execution positions of producer and consumer; the tensor is live across
            every cut ``p`` with ``start < p <= end``.
        tensor: an id of the tensor (storage and view), to count a tensor used twice once.
        storage: an id of its storage; views of one storage never count more than it holds.
        nbytes: bytes of the tensor; ``storage_bytes``: bytes of its storage.
    """

    src: str
    dst: str
    start: int
    end: int
    tensor: int
    storage: int
    nbytes: int
    storage_bytes: int


def live_bytes(flows: Iterable[Flow]) -> int:
    """Bytes of the distinct tensors in ``flows``, capped per storage."""
    per_storage: dict[int, dict[int, int]] = {}
    cap: dict[int, int] = {}
    for f in flows:
        per_storage.setdefault(f.storage, {})[f.tensor] = f.nbytes
        cap[f.storage] = f.storage_bytes
    return sum(min(sum(views.values()), cap[s]) for s, views in per_storage.items())


@dataclass(frozen=True)
class Profile:
    """Everything the planner needs to know about one model at one input size.

    Attributes:
        model_name: the model's class name.
        units: placement units in execution order (never-called units last).
        tie_groups: names that refer to one tensor (GPT-2's ``lm_head.weight`` and
            ``transformer.wte.weight``); the planner keeps each group on one device.
        graph: ``networkx.DiGraph`` over ``"<input>"``, unit names and ``"<output>"``; edge
            ``bytes`` is the size of the distinct tensors one unit passes to the other,
            including tensors that skip units (residual streams, encoder states). A tensor
            read by several later units is relayed from reader to reader, so the ``bytes`` of
            the edges a cut crosses add up to :meth:`cut_bytes` (see ``profiling/graph.py``);
            ``flows`` keep the true producer of every read.
        example: how the example inputs were obtained ("" when bytes only).
        uncalled: units the traced forward never called.
        flows: every tensor passed between units, with positions (see :meth:`cut_bytes`).
        dtype: the dtype bytes are counted at ("" = as stored).
        measured_device: where ``Unit.seconds`` were measured ("" = not measured).
        generation: the generation the units' ``kv_bytes`` and ``decode_flops`` were measured
            for (None: not planned for generation).
        strays: tensors the traced forward read while no unit holding them ran (a module's
            own code reading a child's weight, as ``nn.MultiheadAttention`` reads
            ``out_proj.weight``); such a tensor cannot be streamed in with its unit. Tensors
            held by a non-unit module (``Unit.loose``) are never strays.
        routed: the model's routed-experts modules (``"model.layers.0.mlp.experts"``, ...), in
            definition order, whether or not they are units; the planner may ask for them as
            units of their own (:mod:`automap.planning.experts_layout`).
    """

    model_name: str
    units: tuple[Unit, ...]
    tie_groups: tuple[tuple[str, ...], ...] = ()
    graph: nx.DiGraph = field(default_factory=_empty_graph, compare=False)
    example: str = ""
    uncalled: tuple[str, ...] = ()
    flows: tuple[Flow, ...] = field(default=(), compare=False)
    dtype: str = ""
    measured_device: str = ""
    generation: Generation | None = None

    @property
    def total_kv_bytes(self) -> int:
        return sum(u.kv_bytes for u in self.units)

    strays: tuple[str, ...] = ()
    routed: tuple[str, ...] = ()
    forward_peak_bytes: int = 0
    train_peak_bytes: int = 0
    training: bool = False

    @property
    def run_peak_bytes(self) -> int:
        """The activation peak of the forwards the model will run: a training forward's when it
        is in training mode and a backward was traced, else an inference forward's."""
        return self.train_peak_bytes if self.training and self.train_peak_bytes else self.forward_peak_bytes

    @property
    def total_flops(self) -> int:
        return sum(u.flops for u in self.units)

    @property
    def total_train_flops(self) -> int:
        return sum(u.train_flops for u in self.units)

    @property
    def total_bytes(self) -> int:
        return sum(u.weight_bytes for u in self.units)

    @property
    def has_compute(self) -> bool:
        return self.total_flops > 0

    @property
    def untraced(self) -> tuple[str, ...]:
        """Units planned without a trace measuring them (``Unit.untraced`` says why)."""
        return tuple(u.name for u in self.units if u.untraced)

    @property
    def untraced_summary(self) -> str:
        """One line on what was planned without a trace and why ("" when every unit was traced):
        ``"1 of 2 units (first 'head') planned from their weights without a trace, FLOPs estimated
        from their weight shapes: the forward failed on the guessed example inputs ..."``."""
        found = [u for u in self.units if u.untraced]
        if not found:
            return ""
        share = (
            f"all {len(found)} units"
            if len(found) == len(self.units)
            else f"{len(found)} of {len(self.units)} units (first {found[0].name or '<model>'!r})"
        )
        how = (
            "FLOPs estimated from their weight shapes"
            if any(u.flops_estimated for u in found)
            else "by their bytes"
        )
        return f"{share} planned from their weights without a trace, {how}: {found[0].untraced}"

    @property
    def repeated(self) -> tuple[str, ...]:
        """Units the traced forward called more than once (shared embeddings, ALBERT layers)."""
        return tuple(u.name for u in self.units if u.calls > 1)

    def index(self, name: str) -> int:
        for i, unit in enumerate(self.units):
            if unit.name == name or name in unit.aliases:
                return i
        raise KeyError(name)

    def cut_bytes(self, position: int) -> int:
        """Bytes of every tensor live across the cut before unit ``position``.

        A tensor counts when a unit before the cut (or the model's input) produced it and a
        unit at or after the cut consumes it; skip connections and the residual stream count
        even when they bypass the units next to the cut. Model outputs stay where they are
        produced and do not count.
        """
        if not self.flows:
            return self._cut_bytes_from_graph(position)
        return live_bytes(f for f in self.flows if f.dst != OUTPUT and f.start < position <= f.end)

    def _cut_bytes_from_graph(self, position: int) -> int:
        order = {u.name: i for i, u in enumerate(self.units)}
        total = 0
        for src, dst, data in self.graph.edges(data=True):
            if order.get(src, -1) < position <= order.get(dst, -1):
                total += int(data.get("bytes", 0))
        return total

    @property
    def achieved_flops_per_second(self) -> float | None:
        """Calibration: FLOPs of the measured units over their measured seconds (None if unmeasured)."""
        timed = [u for u in self.units if u.seconds is not None and u.seconds > 0]
        seconds = sum(u.seconds for u in timed if u.seconds is not None)
        flops = sum(u.flops for u in timed)
        return flops / seconds if timed and flops > 0 else None

    def with_measured_time(self) -> Profile:
        """This profile with each timed unit's FLOPs replaced by its measured seconds times the
        achieved FLOP/s, so a planner that balances FLOPs balances measured time instead.

        Units that do no FLOPs but take time (norms, embeddings, memory-bound ops) get their
        share; untimed units keep their FLOPs. ``train_flops`` scale by the unit's own
        forward/training ratio (the model's, for a unit without FLOPs).

        Returns:
            A new :class:`Profile`; totals stay comparable to the FLOP-based one.

        Raises:
            ProfileError: the profile was not measured (``measure=True, device=...``).

        Example:
            >>> prof = automap.profile(model, measure=True, device="cuda:0")
            >>> plan = automap.plan(prof.with_measured_time(), max_memory=...)
        """
        rate = self.achieved_flops_per_second
        if rate is None:
            raise ProfileError(
                f"profile of {self.model_name} has no measured units with FLOPs; "
                "profile it with measure=True, device=... and example inputs"
            )
        overall = self.total_train_flops / self.total_flops if self.total_flops else 0.0
        units = tuple(u if u.seconds is None else _timed(u, rate, overall) for u in self.units)
        return replace(self, units=units)


def _timed(unit: Unit, rate: float, overall_train_ratio: float) -> Unit:
    """``unit`` with measured work; a unit without FLOPs trains at the model's ratio."""
    assert unit.seconds is not None
    work = round(unit.seconds * rate)
    ratio = unit.train_flops / unit.flops if unit.flops else overall_train_ratio
    return replace(unit, flops=work, train_flops=round(work * ratio))


@dataclass
class TraceResult:
    """Per-unit measurements of one traced run, keyed by unit name."""

    order: list[str] = field(default_factory=list)
    calls: dict[str, int] = field(default_factory=dict)
    flops: dict[str, int] = field(default_factory=dict)
    ops: dict[str, int] = field(default_factory=dict)  # aten ops of the forward
    train_flops: dict[str, int] = field(default_factory=dict)
    input_bytes: dict[str, int] = field(default_factory=dict)
    output_bytes: dict[str, int] = field(default_factory=dict)
    peak_bytes: dict[str, int] = field(default_factory=dict)
    first_use: dict[str, str] = field(default_factory=dict)
    readers: dict[str, frozenset[str | None]] = field(default_factory=dict)
    flows: list[Flow] = field(default_factory=list)
    unit_inputs: dict[str, Any] = field(default_factory=dict)
    total_flops: int = 0
    output: Any = None  # what the forward returned, when run with keep_output
    producers: dict[int, str] = field(default_factory=dict)  # id of a storage alive at the end -> its unit
    failed: dict[str, str] = field(default_factory=dict)  # units that stood in (profiling/fallback.py), why
    stopped: str = ""  # where and why the forward ended early ("" = it ran to the end)
    guess_failed: bool = False  # it ended on an error of the guessed example inputs, not a meta limit
    interrupted: tuple[str, ...] = ()  # units running when it ended, outermost first
    forward_peak: int = 0  # most bytes of activations (inputs included) alive at once in the forward
    train_peak: int = 0  # the same with what a forward with grad keeps for its backward (0: not traced)
    weight_reads: dict[str, int] = field(default_factory=dict)  # weight name -> most bytes of it one op read
