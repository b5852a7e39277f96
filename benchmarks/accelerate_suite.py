"""Run accelerate's own tests with automap's drop-ins in place of accelerate's four big-model
functions (``init_empty_weights``, ``infer_auto_device_map``, ``dispatch_model``,
``load_checkpoint_and_dispatch``), and print which pass.

Give it accelerate's test files (from a checkout of accelerate at the installed version); each
is copied into a scratch folder with every import of those four names from ``accelerate`` (at
any depth, inside functions too) rewritten to import them from ``automap.accelerate_compat``;
nothing else of accelerate is replaced. pytest then runs the copies with ``-k`` selecting the
tests that call the four functions (others are accelerate's business, not automap's).

    python -m benchmarks.accelerate_suite path/to/accelerate/tests/test_big_modeling.py \\
        path/to/accelerate/tests/test_modeling_utils.py --json out.json

``docs/accelerate-compat.md`` records a run and why each test that fails does.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

DROP_INS = ("init_empty_weights", "infer_auto_device_map", "dispatch_model", "load_checkpoint_and_dispatch")


def rewrite(source: str, dropped: frozenset[str] = frozenset()) -> str:
    """``source`` with the four names imported from automap wherever it imports them from
    accelerate, and the names in ``dropped`` (ones the installed accelerate lacks, when the test
    file is from another version) not imported at all."""
    lines = source.splitlines(keepends=True)
    edits = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "accelerate":
            if any(a.name in DROP_INS or a.name in dropped for a in node.names):
                edits.append(node)
    for node in sorted(edits, key=lambda n: -n.lineno):
        indent = " " * node.col_offset
        ours = [a for a in node.names if a.name in DROP_INS]
        rest = [a for a in node.names if a.name not in DROP_INS and a.name not in dropped]
        statements = [f"from {node.module} import ({', '.join(_alias(a) for a in rest)})"] if rest else []
        if ours:
            statements.append(f"from automap.accelerate_compat import {', '.join(_alias(a) for a in ours)}")
        assert node.end_lineno is not None
        # One line, then blank ones: the same line count, so tracebacks point at accelerate's lines.
        new = [f"{indent}{'; '.join(statements) or 'pass'}\n"] + ["\n"] * (node.end_lineno - node.lineno)
        lines[node.lineno - 1 : node.end_lineno] = new
    return "".join(lines)


def _alias(alias: ast.alias) -> str:
    return alias.name if alias.asname is None else f"{alias.name} as {alias.asname}"


def calling_tests(source: str) -> list[str]:
    """Names of the test functions whose body mentions one of the four functions."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
            body = ast.get_source_segment(source, node) or ""
            if any(re.search(rf"\b{name}\(", body) for name in DROP_INS):
                found.append(node.name)
    return found


def run(
    files: list[Path], scratch: Path, extra: list[str], dropped: frozenset[str] = frozenset()
) -> dict[str, str]:
    """Copy, rewrite and run ``files``; returns ``{test id: outcome}`` from pytest's report."""
    selected = []
    for path in files:
        source = path.read_text()
        (scratch / path.name).write_text(rewrite(source, dropped))
        selected += calling_tests(source)
    report = scratch / "report.xml"
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        f"--junitxml={report}",
        "-k",
        " or ".join(sorted(set(selected))) or "nothing",
        *extra,
        *(p.name for p in files),
    ]
    subprocess.run(command, cwd=scratch, check=False)
    return _outcomes(report)


def _outcomes(report: Path) -> dict[str, str]:
    import xml.etree.ElementTree as ElementTree

    outcomes = {}
    for case in ElementTree.parse(report).iter("testcase"):
        kinds = {child.tag for child in case}
        outcome = "failed" if kinds & {"failure", "error"} else "skipped" if "skipped" in kinds else "passed"
        outcomes[f"{case.get('classname')}::{case.get('name')}"] = outcome
    return outcomes


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "files", nargs="+", type=Path, help="accelerate test files (test_big_modeling.py, ...)"
    )
    parser.add_argument("--json", type=Path, help="write {test: outcome} here")
    parser.add_argument("--pytest-args", default="", help="more pytest arguments, e.g. '-x --tb=line'")
    parser.add_argument(
        "--drop",
        action="append",
        default=[],
        metavar="NAME",
        help="a name to leave out of accelerate imports (one the installed version lacks, "
        "e.g. FP8RecipeKwargs for test_accelerator.py at 1.15 with accelerate 1.16)",
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="automap-accelerate-suite-") as scratch:
        outcomes = run(
            [p.resolve() for p in args.files], Path(scratch), args.pytest_args.split(), frozenset(args.drop)
        )
    counts = {
        kind: sum(1 for o in outcomes.values() if o == kind) for kind in ("passed", "failed", "skipped")
    }
    for test, outcome in sorted(outcomes.items()):
        print(f"{outcome:8} {test}")
    print(json.dumps(counts))
    if args.json:
        args.json.write_text(json.dumps({"counts": counts, "tests": outcomes}, indent=1) + "\n")


if __name__ == "__main__":
    main()
