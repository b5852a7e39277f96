"""The plan as a picture: memory and FLOPs per device, and which units sit where.

Drawn with matplotlib's object API (no pyplot, so no global state and no display needed).
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from automap.errors import ReportError
from automap.planning.model import Origin, unit_label
from automap.report.facts import Facts, facts_of, format_seconds
from automap.userfiles import check_output_path
from automap.report.output import replace_whole
from automap.report.text import unit_ranges
from automap.sizes import format_bytes

if TYPE_CHECKING:
    from automap.planning import DeviceSummary, Plan

FORMATS = ("png", "svg", "pdf")
_ACCELERATOR_COLOURS = (
    "#4C72B0",
    "#55A868",
    "#8172B3",
    "#64B5CD",
    "#2F6B3A",
    "#DA8BC3",
    "#1F3F73",
    "#CCB974",
)
_KIND_COLOURS = {"cpu": "#DD8452", "disk": "#937860"}
# Memory parts get neutral colours of their own so they are not read as devices.
MEMORY_COLOURS = {"weights": "#5B6C7D", "activations": "#E5B13A", "kv cache": "#8172B3", "reserve": "#C44E52"}
_LABEL_CHARS = 110  # legend lines are cut here; the text report has the full ranges


def figure(plan: Plan, path: str | Path, *, title: str | None = None) -> Path:
    """Draw ``plan`` and save it to ``path`` (``.png``, ``.svg`` or ``.pdf``).

    Top left: per device, weights / activations / KV cache / reserve as a share of its capacity. Top
    right: the share of the model's FLOPs each device computes (streamed units count on the
    device they stream to) and its predicted time per forward. Then a strip of the units in
    execution order, each as wide as its weights, coloured by device, with the cuts marked;
    which units each device holds; and the planner's choices and the warnings.

    Args:
        plan: a :class:`~automap.planning.Plan`, or :func:`automap.placement`'s view of a
            dispatched model.
        path: where to write; the suffix picks the format.
        title: replaces the default title (strategy, sizes and predicted times).

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        ReportError: unknown suffix, or the file cannot be written.

    Example:
        >>> automap.report.figure(automap.plan(model, max_memory={0: "8GiB", 1: "8GiB"}), "plan.png")
    """
    target = check_figure_path(path)
    fmt = target.suffix.lower().lstrip(".")
    import matplotlib

    fig = draw(plan, title=title)
    try:
        with matplotlib.rc_context({"svg.fonttype": "none"}):  # SVG text stays text: searchable, small
            replace_whole(target, lambda file: fig.savefig(file, format=fmt, dpi=120, bbox_inches="tight"))
    except OSError as exc:
        raise ReportError(
            f"cannot write the figure to {str(target)!r}: {exc.strerror or exc}; choose a writable path"
        ) from exc
    return target


def check_figure_path(path: str | Path) -> Path:
    """Return ``path`` if a figure can be written there (:func:`~automap.userfiles.check_output_path`:
    a known suffix, an existing writable folder, a name that is no folder, link loop or too long).

    Raises:
        ReportError: which of these fails.
    """
    return check_output_path(path, "figure", FORMATS)


def draw(plan: Plan, *, title: str | None = None) -> Any:
    """The :class:`matplotlib.figure.Figure` that :func:`figure` saves."""
    from matplotlib.figure import Figure

    facts = facts_of(plan)
    colours = device_colours(plan)
    rows = len(facts.rows)
    legend_rows = sum(1 for r in facts.rows if r.units)
    notes = _notes(plan, facts)
    # inches: bars, strip, legend, choices and warnings
    heights = [0.5 * rows + 0.6, 1.5, 0.22 * legend_rows + 0.1, 0.16 * len(notes) + 0.1]
    fig = Figure(figsize=(12, sum(heights) + 0.6), layout="constrained")
    grid = fig.add_gridspec(4, 2, height_ratios=heights, width_ratios=[3, 2])
    _memory_panel(fig.add_subplot(grid[0, 0]), facts)
    _flops_panel(fig.add_subplot(grid[0, 1]), plan, facts, colours)
    _strip_panel(fig.add_subplot(grid[1, :]), plan, facts, colours)
    _legend_panel(fig.add_subplot(grid[2, :]), plan, facts, colours)
    _notes_panel(fig.add_subplot(grid[3, :]), notes)
    fig.suptitle(title or _title(plan, facts), fontsize=11)
    return fig


def device_colours(plan: Plan) -> dict[str, str]:
    """One colour per device of ``plan``, the same in every panel."""
    colours, accelerators = {}, iter(_ACCELERATOR_COLOURS * 4)
    for device in plan.devices:
        colours[device.name] = _KIND_COLOURS.get(device.kind) or next(accelerators)
    return colours


def _title(plan: Plan, facts: Facts) -> str:
    what = "actual placement" if plan.origin is Origin.ACTUAL else f"automap plan ({plan.source})"
    return (
        f"{what}: {len(plan.units)} units, {format_bytes(facts.weight_bytes)} of weights; "
        f"bottleneck {facts.bottleneck_device or '-'} {format_seconds(facts.bottleneck_seconds)}, "
        f"forward {format_seconds(facts.forward_seconds)}"
    )


def _device_axis(ax: Any, facts: Facts, with_capacity: bool) -> None:
    labels = [
        f"{r.device.name}\n{format_bytes(r.device.capacity_bytes)}" if with_capacity else r.device.name
        for r in facts.rows
    ]
    ax.set_yticks(range(len(facts.rows)), labels, fontsize=9)
    ax.set_ylim(len(facts.rows) - 0.5, -0.5)  # fastest tier on top, as in the text report
    ax.grid(axis="x", alpha=0.3)
    ax.set_axisbelow(True)


_MAX_PERCENT = 150.0  # an overfull device's bar is cut here; its label keeps the true number
_VISIBLE_PERCENT = 0.15  # a memory part narrower than this on every bar is not drawn visibly: no legend entry


def _memory_panel(ax: Any, facts: Facts) -> None:
    from matplotlib.patches import Patch

    peak = 100.0
    for y, row in enumerate(facts.rows):
        peak = max(peak, _memory_row(ax, y, row))
    drawn = {
        part
        for row in facts.rows
        for part, nbytes in _memory_parts(row)
        if nbytes and 100 * nbytes >= _VISIBLE_PERCENT * row.device.capacity_bytes
    }
    handles = [Patch(color=colour, label=part) for part, colour in MEMORY_COLOURS.items() if part in drawn]
    handles.append(Patch(facecolor="none", edgecolor="#444444", label="capacity"))
    ax.set_xlim(0, min(peak, _MAX_PERCENT) + 32)
    ax.set_xticks(range(0, int(min(peak, _MAX_PERCENT)) + 1, 25))
    ax.set_xlabel("memory used, % of each device's capacity (label: bytes used)")
    ax.legend(
        handles=handles,
        loc="lower right",
        bbox_to_anchor=(1.0, 1.0),
        fontsize=8,
        ncol=4,
        frameon=False,
        borderaxespad=0.1,
    )
    _device_axis(ax, facts, with_capacity=True)
    ax.set_title("memory", fontsize=10, loc="left")


def _memory_row(ax: Any, y: int, row: DeviceSummary) -> float:
    """Draw one device's weights / activations / KV cache / reserve against its capacity; return the % used."""
    cap = row.device.capacity_bytes
    if cap <= 0:  # a device found in an actual placement that no plan budgeted
        ax.text(1.5, y, f"{format_bytes(row.used_bytes)} (capacity unknown)", va="center", fontsize=8)
        return 0.0
    ax.barh(y, 100, color="none", edgecolor="#444444", linewidth=0.8, height=0.6)
    left = 0.0
    for part, nbytes in _memory_parts(row):
        width = 100 * nbytes / cap
        shown = max(0.0, min(left + width, _MAX_PERCENT) - left)
        ax.barh(y, shown, left=min(left, _MAX_PERCENT), color=MEMORY_COLOURS[part], height=0.6)
        left += width
    ax.text(
        min(max(left, 100), _MAX_PERCENT) + 1.5,
        y,
        f"{format_bytes(row.used_bytes)} ({left:.0f}%)",
        va="center",
        fontsize=8,
    )
    return left


def _memory_parts(row: DeviceSummary) -> tuple[tuple[str, int], ...]:
    return (
        ("weights", row.weight_bytes),
        ("activations", row.activation_bytes),
        ("kv cache", row.kv_bytes),
        ("reserve", row.reserve_bytes),
    )


def _flops_panel(ax: Any, plan: Plan, facts: Facts, colours: dict[str, str]) -> None:
    """Each device's share of the FLOPs it computes (a tier that only stores computes none:
    its units count on the device they stream to) and its predicted time per forward."""
    for y, row in enumerate(facts.rows):
        name = row.device.name
        share = 100 * facts.computed_share(name)
        ax.barh(y, share, color=colours[name], height=0.6)
        if name in facts.compute_seconds:
            label = f"{share:.1f}%, {format_seconds(facts.compute_seconds[name])} per forward"
        elif row.units:
            streams_to = plan.placements.by_home[name].compute
            label = f"stores only: streams to {streams_to} ({format_seconds(row.stage_seconds)})"
        else:
            label = "-"
        ax.text(share + 1.5, y, label, va="center", fontsize=8)
    ax.set_xlim(0, 160)
    ax.set_xticks([0, 25, 50, 75, 100])
    ax.set_xlabel("share of the model's FLOPs each device computes, %")
    _device_axis(ax, facts, with_capacity=False)
    ax.set_title("compute", fontsize=10, loc="left")


def _runs(plan: Plan) -> list[tuple[float, float, str]]:
    """Maximal runs ``(start, stop, device)`` of consecutive units on one device, in bytes of
    weights from the model's first unit (the strip is drawn to scale)."""
    runs: list[tuple[float, float, str]] = []
    position = 0.0
    for unit, device in zip(plan.units, plan.placement):
        stop = position + unit.weight_bytes
        if runs and runs[-1][2] == device:
            runs[-1] = (runs[-1][0], stop, device)
        else:
            runs.append((position, stop, device))
        position = stop
    return runs


# A character of a 7-point label, with its padding, is about this share of the strip's width
# (12-inch figure).
_CHAR_WIDTH = 0.0068
_LABEL_TIERS = 3  # cut labels stack in up to this many rows above the strip before one is left out


def _strip_panel(ax: Any, plan: Plan, facts: Facts, colours: dict[str, str]) -> None:
    total = float(max(sum(u.weight_bytes for u in plan.units), 1))
    for start, stop, device in _runs(plan):
        hatch = "//" if plan.placements.by_home[device].offloaded else None
        ax.barh(
            0,
            stop - start,
            left=start,
            height=0.6,
            color=colours[device],
            edgecolor="white",
            linewidth=0.5,
            hatch=hatch,
        )
        if (stop - start) / total > _CHAR_WIDTH * (len(device) + 2) * 1.3:  # 9-point bold: wider characters
            ax.text(
                (start + stop) / 2,
                0,
                device,
                ha="center",
                va="center",
                fontsize=9,
                color="white",
                fontweight="bold",
            )
    placed, omitted = _cut_labels(plan, facts, total)
    for position, text, tier in placed:
        ax.plot([position, position], [-0.3, 0.36 + 0.2 * tier], color="black", linewidth=1.0)
        if text:
            ax.text(
                position,
                0.36 + 0.2 * tier,
                text,
                ha="center",
                va="bottom",
                fontsize=7,
                bbox={"facecolor": "white", "edgecolor": "none", "pad": 1},
            )
    ax.set_xlim(0, total)
    ticks = [total * k / 4 for k in range(5)]
    ax.set_xticks(ticks, [format_bytes(t) for t in ticks], fontsize=8)
    ax.set_ylim(-0.32, 0.58 + 0.2 * max((tier for _, text, tier in placed if text), default=0))
    ax.set_yticks([])
    left_out = f"; {omitted} labels left out where they would overlap" if omitted else ""
    ax.set_xlabel(
        f"{len(plan.units)} units in execution order, each as wide as its weights (black lines: cuts, "
        f"labelled with the activation bytes crossing; hatched: streamed{left_out})",
        fontsize=9,
    )
    ax.set_title("which units sit where", fontsize=10, loc="left")


def _cut_labels(plan: Plan, facts: Facts, total: float) -> tuple[list[tuple[float, str, int]], int]:
    """``(position, label, tier)`` per cut, each label in the lowest tier where it overlaps no
    other (positions in bytes of weights); how many found no tier."""
    starts, position = {}, 0.0
    for unit in plan.units:
        starts[unit.name] = position
        position += unit.weight_bytes
    ends: list[float] = [float("-inf")] * _LABEL_TIERS
    placed, omitted = [], 0
    for cut in facts.cuts:
        if cut.after not in starts:
            continue
        x, text = starts[cut.after], format_bytes(cut.bytes)
        half = _CHAR_WIDTH * (len(text) + 1) * total / 2
        tier = next((t for t in range(_LABEL_TIERS) if ends[t] < x - half), None)
        if tier is None:
            omitted += 1
            placed.append((x, "", 0))
            continue
        ends[tier] = x + half
        placed.append((x, text, tier))
    return placed, omitted


def _legend_panel(ax: Any, plan: Plan, facts: Facts, colours: dict[str, str]) -> None:
    """Which unit ranges each device holds, under the strip (the strip is too narrow for them)."""
    from matplotlib.patches import Patch

    hatches = {name: "//" if p.offloaded else None for name, p in plan.placements.by_home.items()}
    handles = [
        Patch(
            facecolor=colours[r.device.name],
            hatch=hatches[r.device.name],
            label=_legend_label(plan, r.device.name, r.units),
        )
        for r in facts.rows
        if r.units
    ]
    ax.axis("off")
    if handles:
        ax.legend(handles=handles, loc="upper center", fontsize=8, frameon=False, borderaxespad=0)


# Lines of choices and warnings drawn under the legend, each cut at this many characters.
_NOTE_CHARS = 140
_MAX_NOTES = 14


def _notes(plan: Plan, facts: Facts) -> list[str]:
    """The planner's choices and the warnings, wrapped to the figure's width, as the text
    report lists them."""
    lines: list[str] = []
    for title, notes in (("choices", plan.choices), ("warnings", facts.warnings)):
        if notes:
            lines.append(f"{title}:")
            for note in notes:
                lines += textwrap.wrap(note, _NOTE_CHARS, initial_indent="  - ", subsequent_indent="    ")
    if len(lines) > _MAX_NOTES:
        lines = lines[: _MAX_NOTES - 1] + [f"  ... {len(lines) - _MAX_NOTES + 1} more lines in plan.report()"]
    return lines or ["choices: none; warnings: none"]


def _notes_panel(ax: Any, notes: Sequence[str]) -> None:
    ax.axis("off")
    ax.text(
        0.0,
        1.0,
        "\n".join(notes),
        ha="left",
        va="top",
        fontsize=8,
        family="monospace",
        transform=ax.transAxes,
    )


def _legend_label(plan: Plan, device: str, units: tuple[str, ...]) -> str:
    offloaded = plan.placements.by_home[device].offloaded
    note = f" (offloaded, runs on {plan.execution_device})" if offloaded else ""
    text = f"{device}{note}: {unit_ranges([unit_label(u) for u in units])}"
    return text if len(text) <= _LABEL_CHARS else text[: _LABEL_CHARS - 3] + "..."


def bar_chart(
    means: Sequence[float],
    stds: Sequence[float],
    labels: Sequence[str],
    path: str | Path,
    ylabel: str,
    *,
    title: str | None = None,
) -> Path:
    """One bar per configuration (mean, with a +-std error bar), saved to ``path`` — the
    model-parallel tutorial's timing plot.

    Args:
        means, stds, labels: one entry per bar, in the order to draw them.
        path: ``.png``, ``.svg`` or ``.pdf``; its folder must exist.
        ylabel: the value axis, with its unit (``"ResNet-50 training time (s)"``).
        title: drawn above the bars when given.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        ReportError: the three sequences differ in length, or the path cannot be written.

    Example:
        >>> bar_chart([3.1, 2.0], [0.1, 0.05], ["one GPU", "pipelined"], "times.png", "seconds")
    """
    from matplotlib.figure import Figure

    if not len(means) == len(stds) == len(labels):
        raise ReportError(
            f"bar_chart needs one mean, std and label per bar; got {len(means)} means, "
            f"{len(stds)} stds and {len(labels)} labels"
        )
    target = check_figure_path(path)
    fig = Figure(figsize=(max(6.0, 0.9 * len(means) + 2.0), 4.5), layout="constrained")
    ax = fig.add_subplot()
    positions = range(len(means))
    ax.bar(positions, means, yerr=stds, align="center", alpha=0.6, ecolor="red", capsize=8, width=0.6)
    ax.set_ylabel(ylabel)
    ax.set_xticks(list(positions), list(labels), rotation=30, ha="right")
    ax.yaxis.grid(True)
    if title:
        ax.set_title(title, fontsize=10)
    try:
        replace_whole(
            target, lambda file: fig.savefig(file, format=target.suffix.lower().lstrip("."), dpi=120)
        )
    except OSError as exc:
        raise ReportError(f"cannot write the chart to {str(target)!r}: {exc.strerror or exc}") from exc
    return target
