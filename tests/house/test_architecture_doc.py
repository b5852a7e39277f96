"""``docs/architecture.md`` is drawn from the code (issue 24): its module table names every module
of the package, and nothing the package lacks.

A row's module cell lists files in backticks; the first names its folder (``planning/partition.py``)
and the bare names after it (``packing.py``) sit in the same folder; a name without a folder is at
the package's top (``api.py``). Package ``__init__.py`` files are the packages' public surface and
need no row."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"


def documented(text: str) -> set[str]:
    """Module paths (relative to ``automap/``) the table's module cells name."""
    found = set()
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or len(cells) < 3:
            continue
        folder = ""
        for name in re.findall(r"`([^`]+)`", cells[1]):
            if "/" in name:
                folder, _, name = name.rpartition("/")
            if name.endswith(".py"):
                found.add(f"{folder}/{name}" if folder else name)
    return found


def modules(root: Path = ROOT / "automap") -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*.py") if p.name != "__init__.py"}


def test_the_table_names_every_module_and_only_those():
    named, present = documented(DOC.read_text()), modules()
    assert not present - named, f"give these modules a row in docs/architecture.md: {sorted(present - named)}"
    assert not named - present, (
        f"docs/architecture.md names modules that do not exist: {sorted(named - present)}"
    )


def test_the_reading_of_a_row_is_what_it_says():
    row = "| planning | `planning/partition.py`, `packing.py` | x |\n| api | `api.py`, `pipelining/` | y |"
    assert documented(row) == {"planning/partition.py", "planning/packing.py", "api.py"}
