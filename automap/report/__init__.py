"""Rendering a :class:`~automap.planning.Plan` or a dispatched model's actual placement: an
80-column text report, JSON for scripts and CI, and a picture.

    >>> print(plan.report())                          # render_text(plan)
    >>> automap.report.write_json(plan, "plan.json")  # docs/plan-schema.md
    >>> automap.report.figure(plan, "plan.png")
    >>> print(automap.placement(model).report())      # where the tensors really are
"""

from automap.planning.model import register_renderer
from automap.report.actual import placement
from automap.errors import ReportError
from automap.report.facts import format_seconds
from automap.report.figure import check_figure_path, draw, figure
from automap.report.schema import check_json_path, plan_dict, read_json, to_json, write_json
from automap.report.text import render_line, render_text, unit_ranges
from automap.report import export  # noqa: F401 - registers the engines of Plan.export

register_renderer("text", render_text)
register_renderer("json", to_json)
register_renderer("line", render_line)

__all__ = [
    "ReportError",
    "check_figure_path",
    "check_json_path",
    "draw",
    "figure",
    "format_seconds",
    "placement",
    "plan_dict",
    "read_json",
    "render_text",
    "to_json",
    "unit_ranges",
    "write_json",
]
