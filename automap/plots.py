"""Bar charts of timings with error bars, as the model-parallel tutorial draws them.

Kept apart until it moves into :mod:`automap.report.figure`; drawn with matplotlib's object
API (no pyplot: no global state, no display needed).
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from automap.errors import AutomapError


def bar_chart(means: Sequence[float], stds: Sequence[float], labels: Sequence[str], path: str | Path,
              ylabel: str, *, title: str | None = None) -> Path:
    """One bar per configuration (mean, with a +-std error bar), saved to ``path``.

    Args:
        means, stds, labels: one entry per bar, in the order to draw them.
        path: ``.png``, ``.svg`` or ``.pdf``; its folder must exist.
        ylabel: the value axis, with its unit (``"ResNet-50 training time (s)"``).
        title: drawn above the bars when given.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        AutomapError: the three sequences differ in length, or the path cannot be written.

    Example:
        >>> bar_chart([3.1, 2.0], [0.1, 0.05], ["one GPU", "pipelined"], "times.png", "seconds")
    """
    from matplotlib.figure import Figure

    if not len(means) == len(stds) == len(labels):
        raise AutomapError(f"bar_chart needs one mean, std and label per bar; got {len(means)} means, "
                           f"{len(stds)} stds and {len(labels)} labels")
    target = Path(path)
    if target.suffix.lower() not in (".png", ".svg", ".pdf") or not target.parent.is_dir():
        raise AutomapError(f"cannot write a chart to {str(target)!r}: use an existing folder and a .png, "
                           ".svg or .pdf name")
    fig = Figure(figsize=(max(6.0, 0.9 * len(means) + 2.0), 4.5), layout="constrained")
    ax = fig.add_subplot()
    positions = range(len(means))
    ax.bar(positions, means, yerr=stds, align="center", alpha=0.6, ecolor="red", capsize=8, width=0.6)
    ax.set_ylabel(ylabel)
    ax.set_xticks(list(positions), list(labels), rotation=30, ha="right")
    ax.yaxis.grid(True)
    if title:
        ax.set_title(title, fontsize=10)
    fig.savefig(target, dpi=120)
    return target
