"""The package's seams, checked from the source with ``ast``: imports point one way (DESIGN.md's
layer order), the import graph has no cycle, and no module imports another's underscore names.
Every reference to a module counts: ``import`` and ``from ... import`` (inside functions and under
``TYPE_CHECKING`` too), ``importlib.import_module`` and ``__import__`` by name, and strings that name
a module of the package (``"automap.offload.transfer"`` or ``"automap.offload.transfer:CudaOps"``),
since each is an import made later."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[2] / "automap"

# DESIGN.md: sizes/errors <- devices (and kinds, its registry) <- profiling <- planning <- offload <- runtime <-
# loading <- report, pipelining, distributed, compose <- api <- cli. A module may import its own layer or lower ones.
LAYERS = {
    "errors": 0,
    "sizes": 0,
    "version": 0,
    "progress": 0,
    "interrupts": 0,
    "userfiles": 0,
    "devices": 1,
    "kinds": 1,
    "machine": 1,
    "machine_probes": 1,
    "probe_block": 1,
    "disk_probe": 1,
    "page_cache": 0,
    "profiling": 2,
    "planning": 3,
    "offload": 4,
    "runtime": 5,
    "loading": 6,
    "report": 7,
    "pipelining": 7,
    "distributed": 7,
    "compose": 7,
    "api": 8,
    "cli": 9,
    "commands": 9,
    "specs": 9,
    "presets": 9,
    "spec_plan": 9,
    "bench": 9,
    "demo": 9,
    "__main__": 9,
    "accelerate_compat": 8,
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


# A string that names a module of the package, with or without ``:attribute``.
MODULE_STRING = re.compile(r"automap(\.[A-Za-z_]\w*)+(:[A-Za-z_]\w*)?")


def docstrings(tree: ast.AST) -> set[int]:
    """``id``s of the string constants that are docstrings (prose, not references)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def named_module(text: str, known: dict[str, Path]) -> str | None:
    """The module of the package a string names (``"automap.x.y"`` or ``"automap.x.y:attr"``),
    else None: a logger's or a progress bar's name that is no module is not a reference."""
    if not MODULE_STRING.fullmatch(text):
        return None
    module = text.partition(":")[0]
    return module if module in known else None


def imports_of(name: str, path: Path, known: dict[str, Path]) -> list[tuple[str, str, int]]:
    """``(target module, imported name or "", line)`` for every reference to a module in ``path``:
    import statements, import by name, and module strings."""
    found = []
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    prose = docstrings(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose:
            target = named_module(node.value, known)
            if target is not None and target != name:
                found.append((target, "", node.lineno))
        elif isinstance(node, ast.Import):
            found += [(a.name, "", node.lineno) for a in node.names if a.name.split(".")[0] == "automap"]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            if base.split(".")[0] != "automap":
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.append((sub, "", node.lineno) if sub in known else (base, alias.name, node.lineno))
    return found


def layer(name: str) -> int:
    parts = name.split(".")
    if len(parts) == 1:
        return 10  # automap/__init__.py: the public surface imports everything
    return LAYERS[parts[1]]


def test_every_module_has_a_layer():
    unknown = sorted({n.split(".")[1] for n in modules() if "." in n and n.split(".")[1] not in LAYERS})
    assert not unknown, f"give these parts a layer in LAYERS (and DESIGN.md): {unknown}"


def test_imports_point_one_way():
    known = modules()
    wrong = []
    for name, path in known.items():
        for target, _, line in imports_of(name, path, known):
            if target in known and layer(target) > layer(name):
                wrong.append(f"{path.relative_to(ROOT.parent)}:{line} {name} imports {target}")
    assert not wrong, "imports against the layer order:\n" + "\n".join(wrong)


def test_import_graph_has_no_cycle():
    known = modules()
    graph = nx.DiGraph()
    for name, path in known.items():
        graph.add_node(name)
        for target, _, _ in imports_of(name, path, known):
            if target in known and target != name:
                graph.add_edge(name, target)
    cycles = list(nx.simple_cycles(graph))
    assert not cycles, f"import cycles: {cycles[:5]}"


def private_module(target: str, importer: str) -> bool:
    """A module named ``_x`` is private to its package: only its siblings may import it."""
    parent, _, leaf = target.rpartition(".")
    return leaf.startswith("_") and leaf != "__main__" and not importer.startswith(parent + ".")


def test_no_module_imports_another_modules_private_names():
    known = modules()
    wrong = []
    for name, path in known.items():
        for target, imported, line in imports_of(name, path, known):
            if imported.startswith("_") or private_module(target, name):
                wrong.append(
                    f"{path.relative_to(ROOT.parent)}:{line} imports {imported or target} from {target}"
                )
    assert not wrong, "private names used across modules (make them public or move the code):\n" + "\n".join(
        wrong
    )


@pytest.mark.parametrize(
    "source, expected",
    [
        ("from automap.planning.model import _secret\n", "private"),
        ("from automap.report import render_text\n", "layer"),
        ("from .partition import Chain\n", "relative"),
        ("importlib.import_module('automap.report')\n", "layer"),
        ("__import__('automap.runtime.tiers')\n", "layer"),
        ("OPS = 'automap.offload.transfer:CudaOps'\n", "layer"),
        ("log = 'automap.planning.nothing_here'\n", "none"),
        ('def f():\n    """automap.report draws it."""\n', "none"),
    ],
)
def test_the_checks_catch_what_they_look_for(tmp_path, source, expected):
    """The checks above are only worth something if they can fail: feed them a fake module
    of automap.planning (written under tmp_path, read as if it sat in the package)."""
    fake = tmp_path / "probe.py"
    fake.write_text(source)
    known = modules()
    found = imports_of("automap.planning.probe", fake, known)
    if expected == "private":
        assert any(i.startswith("_") for _, i, _ in found)
    elif expected == "layer":
        assert any(layer(t) > layer("automap.planning.probe") for t, _, _ in found if t in known)
    elif expected == "none":
        assert found == []
    else:
        assert [t for t, _, _ in found] == ["automap.planning.partition"]


# ------------------------------------------------------------------ sizes

# Counted in statements (the lines on which one begins), not physical lines: a call the formatter
# lays over six lines is one statement, so the layout of the code does not move the count. The
# limits match what 450 lines a module and 40 a function held before the formatter came.
MAX_MODULE_STATEMENTS, MAX_FUNCTION_STATEMENTS = 300, 35
# What is still over, and what brings it under; a module or function that comes under must leave
# this table (the test says so), and nothing new may join it.
STILL_OVER: dict[str, str] = {}


def statements(nodes: list[ast.stmt]) -> int:
    """How many lines a statement of ``nodes`` (or one nested in them) begins on."""
    return len({n.lineno for node in nodes for n in ast.walk(node) if isinstance(n, ast.stmt)})


def function_statements(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """The statements of a function's body, its docstring not counted (a long docstring is welcome)."""
    body = node.body
    first = body[0]
    doc = (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
    )
    return statements(body[1:] if doc else body)


def oversized(paths: dict[str, Path], root: Path = ROOT.parent) -> dict[str, int]:
    """``{"automap/x.py": statements}`` for each module over the limit, ``{"automap/x.py:f":
    statements}`` for each function."""
    found = {}
    for path in paths.values():
        tree = ast.parse(path.read_text())
        rel = str(path.relative_to(root))
        if statements(tree.body) > MAX_MODULE_STATEMENTS:
            found[rel] = statements(tree.body)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if function_statements(node) > MAX_FUNCTION_STATEMENTS:
                    found[f"{rel}:{node.name}"] = function_statements(node)
    return found


def test_modules_and_functions_stay_small():
    found = oversized(modules())
    new = {k: v for k, v in found.items() if k not in STILL_OVER}
    assert not new, (
        f"over {MAX_MODULE_STATEMENTS} statements a module or {MAX_FUNCTION_STATEMENTS} a function "
        f"(docstring not counted): {new}; split it by concern"
    )
    under = sorted(set(STILL_OVER) - set(found))
    assert not under, f"{under} came under the limits: take them out of STILL_OVER"


def test_the_size_check_sees_a_long_function_and_module_whatever_their_layout(tmp_path):
    probe = tmp_path / "automap" / "probe.py"
    probe.parent.mkdir()
    documented = 'def short():\n    """doc\n\n\n\n    more doc"""\n' + "    x = 1\n" * 35
    spread = "def spread():\n" + "    f(\n        1,\n        2,\n    )\n" * 35
    long = "def long():\n" + "    x = 1\n" * 36
    probe.write_text("\n\n".join([documented, spread, long]) + "\ny = 2\n" * 191)
    assert oversized({"probe": probe}, root=tmp_path) == {
        "automap/probe.py": 301,
        "automap/probe.py:long": 36,
    }


# ------------------------------------------------------------------ device kinds

# DESIGN.md: a rule about a kind of device or tier lives with that kind in the registry
# (automap/kinds.py), never in an ``if kind == "disk"`` elsewhere. "meta" is not a kind (it holds
# no data), so comparing with it is allowed.
KIND_NAMES = {"cuda", "xpu", "mps", "cpu", "disk"}
REGISTRY_MODULES = {"automap.kinds"}


def names_a_kind(node: ast.AST) -> bool:
    """A string literal naming a kind or a device of one (``"cuda:0"``), or a tuple/set/list
    holding one."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value.strip().lower().split(":")[0] in KIND_NAMES
    if isinstance(node, (ast.Tuple, ast.Set, ast.List)):
        return any(names_a_kind(e) for e in node.elts)
    return False


def kind_comparisons(path: Path) -> list[str]:
    """``line: source`` of each comparison in ``path`` (==, !=, in, not in, is, ...) with a
    device-kind literal on either side."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Compare) and any(names_a_kind(o) for o in [node.left, *node.comparators]):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_device_kind_string_checks_outside_the_registry():
    wrong = [
        f"{path.relative_to(ROOT.parent)}:{hit}"
        for name, path in modules().items()
        if name not in REGISTRY_MODULES
        for hit in kind_comparisons(path)
    ]
    assert not wrong, (
        "compare kinds through automap.kinds (kind_of(device).computes, .is_storage, "
        ".host_addressable, .async_copies, ...), not with a string:\n" + "\n".join(wrong)
    )


@pytest.mark.parametrize(
    "source, hits",
    [
        ("if device.type == 'cuda': pass\n", 1),
        ("x = where != 'disk:0'\n", 1),
        ("y = kind in ('cpu', 'disk')\n", 1),
        ("z = 'mps' not in values\n", 1),
        ("w = {'xpu'} == found\n", 1),
        ("ok = device.type == 'meta' or name == 'cudagraph'\n", 0),
    ],
)
def test_the_kind_check_catches_what_it_looks_for(tmp_path, source, hits):
    probe = tmp_path / "probe.py"
    probe.write_text(source)
    assert len(kind_comparisons(probe)) == hits


# ------------------------------------------------------------------ a device map parsed once


def callers(function: str) -> set[str]:
    """``module:function`` of every function in the package that calls ``function`` by name."""
    found = set()
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for call in ast.walk(node):
                if isinstance(call, ast.Call):
                    callee = (
                        call.func.attr
                        if isinstance(call.func, ast.Attribute)
                        else getattr(call.func, "id", "")
                    )
                    if callee == function:
                        found.add(f"{name}:{node.name}")
    return found


def test_a_dict_device_map_is_parsed_in_one_place():
    """Every public entry that takes a dict device map (plan, dispatch, load, the accelerate
    drop-ins, the CLI) reaches it through automap.plan, which parses it once into a UserMap;
    only that value travels on."""
    assert callers("parse_device_map") == {"automap.compose:user_map"}
    assert callers("user_map") == {"automap.api:plan"}


PLACEMENT_QUESTIONS = re.compile(r"\b(is_offloaded|compute_device)\(")


def placement_questions(root: Path, skip: Path | None = None) -> dict[str, int]:
    """``{"path": count}`` of calls asking placement one device name at a time, under ``root``
    (not under ``skip``)."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        if skip is not None and path.is_relative_to(skip):
            continue
        count = len(PLACEMENT_QUESTIONS.findall(path.read_text()))
        if count:
            found[str(path.relative_to(root.parent))] = count
    return found


def test_placement_is_read_from_the_plans_table_not_asked_per_name():
    """Outside the planner, placement is read from ``plan.placements`` (the table resolved once
    per plan), never asked one name at a time."""
    asked = placement_questions(ROOT, skip=ROOT / "planning")
    asked.update(placement_questions(ROOT.parent / "benchmarks"))
    assert not asked, f"read plan.placements (rows, by_home, bytes_on) instead: {asked}"


def test_the_placement_count_sees_a_question(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text("x = plan.is_offloaded('cpu') or plan.compute_device('disk')\n")
    assert placement_questions(tmp_path / "pkg") == {"pkg/m.py": 2}


def test_a_plan_is_a_record():
    """``Plan`` holds what was decided and what from, in a few fields; its costs are functions of
    it (automap.planning.predict), its drawing is registered by automap.report."""
    import dataclasses

    from automap.planning.model import Plan

    assert len(dataclasses.fields(Plan)) <= 8
    own = {name for name in vars(Plan) if not name.startswith("__")}
    costs = {
        n
        for n in own
        if n.endswith("_seconds")
        or n in {"summary", "cuts", "bytes_on", "is_offloaded", "compute_device", "compute_seconds"}
    }
    assert not costs, f"{costs}: move them to automap.planning.predict as functions of a plan"
    drawn = {n for n in own if n.startswith(("render", "draw", "figure"))}
    assert not drawn and {"report", "to_json", "from_json"} <= own


def public_classes(paths: dict[str, Path]) -> dict[str, list[str]]:
    """Each public class name -> the modules that define one of that name."""
    found: dict[str, list[str]] = {}
    for name, path in paths.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                found.setdefault(node.name, []).append(name)
    return found


def test_no_two_public_classes_share_a_name():
    shared = {k: v for k, v in public_classes(modules()).items() if len(v) > 1}
    assert not shared, f"one name per thing: rename the less central of {shared}"


def test_the_class_name_check_sees_a_duplicate(tmp_path):
    (tmp_path / "a.py").write_text("class Spec:\n    pass\n\n\nclass _Own:\n    pass\n")
    (tmp_path / "b.py").write_text("def f():\n    class Spec:\n        pass\n\n\nclass _Own:\n    pass\n")
    found = public_classes({"a": tmp_path / "a.py", "b": tmp_path / "b.py"})
    assert found == {"Spec": ["a", "b"]}


# ------------------------------------------------------------------ module docstrings

MAX_MODULE_DOCSTRING_LINES = 12


def module_docstring_lines(path: Path) -> int:
    """Lines of the module's docstring; 0 when it has none."""
    tree = ast.parse(path.read_text(), str(path))
    first = tree.body[0] if tree.body else None
    if (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
    ):
        return first.end_lineno - first.lineno + 1
    return 0


def test_every_module_says_what_it_is_for_in_a_few_lines():
    """A module docstring says what the module is for and its one or two invariants; the long
    reasoning lives in docs/design-notes.md."""
    lines = {
        str(p.relative_to(ROOT.parent)): module_docstring_lines(p)
        for p in modules().values()
        if p.name != "__main__.py"
    }
    missing = sorted(name for name, n in lines.items() if n == 0)
    long = {name: n for name, n in lines.items() if n > MAX_MODULE_DOCSTRING_LINES}
    assert not missing, f"give these modules a docstring: {missing}"
    assert not long, (
        f"module docstrings over {MAX_MODULE_DOCSTRING_LINES} lines (move the reasoning to "
        f"docs/design-notes.md): {long}"
    )
