"""Files a user names go through one reader (``automap.userfiles``): a FIFO never hangs, a
missing path, a folder, a link loop, a name too long, bytes that are not UTF-8 or JSON nested too
deeply are each an ``AutomapError`` naming the path; every path automap writes is checked before
the long work. Each entry that reads a user's file is tried on each hostile file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import automap
from automap.errors import AutomapError, FormatError, PlanError, ReportError, SpecError
from automap.report import check_figure_path, check_json_path, read_json, write_json
from automap.specs import build_model
from automap.userfiles import MAX_DEPTH, MAX_JSON_BYTES, check_output_path, load_json, read_json_file

HOSTILE_FILES = [
    "missing",
    "folder",
    "fifo",
    "loop",
    "long",
    "not_utf8",
    "deep",
    "huge_number",
    "infinity",
    "twice",
    "empty",
    "list",
    "too_large",
]


def hostile(tmp_path: Path, kind: str) -> Path:
    """A path of ``kind`` under ``tmp_path``: what a careless or hostile user may name."""
    path = tmp_path / f"{kind}.json"
    contents = {
        "not_utf8": b'{"a": "\xff\xfe"}',
        "deep": b"[" * 200_000,
        "huge_number": b'{"a": 1' + b"0" * 5000 + b"}",
        "infinity": b'{"a": Infinity}',
        "twice": b'{"a": 1, "a": 2}',
        "empty": b"",
        "list": b"[1, 2]",
    }
    if kind in contents:
        path.write_bytes(contents[kind])
    elif kind == "folder":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "loop":
        path.symlink_to(path.name)
    elif kind == "long":
        path = tmp_path / ("x" * 300 + ".json")
    elif kind == "too_large":
        with open(path, "wb") as file:
            file.truncate(MAX_JSON_BYTES + 1)  # sparse: no disk used
    return path


def _within(seconds: float, call):
    """``call()``'s outcome (a value or the exception it raised), failing if it blocks."""
    outcome: list = []

    def run() -> None:
        try:
            outcome.append(call())
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert outcome, f"{call} blocked for {seconds} s (a FIFO read without O_NONBLOCK?)"
    return outcome[0]


@pytest.mark.parametrize("kind", HOSTILE_FILES)
def test_read_json_refuses_each_hostile_file_with_a_plan_error_naming_it(tmp_path, kind):
    path = hostile(tmp_path, kind)
    outcome = _within(20, lambda: read_json(path))
    assert isinstance(outcome, PlanError), repr(outcome)
    assert path.name[:40] in str(outcome) or kind in ("list", "twice", "infinity", "huge_number"), str(
        outcome
    )


@pytest.mark.parametrize("kind", HOSTILE_FILES)
def test_a_hf_config_spec_refuses_each_hostile_file_with_a_spec_error(tmp_path, kind):
    pytest.importorskip("transformers")
    path = hostile(tmp_path, kind)
    outcome = _within(20, lambda: build_model(f"hf:{path}"))
    assert isinstance(outcome, SpecError), repr(outcome)


@pytest.mark.parametrize("kind", ["not_utf8", "deep", "fifo", "folder", "huge_number", "list"])
@pytest.mark.parametrize("name", ["config.json", "generation_config.json"])
def test_a_model_folder_with_a_hostile_config_is_refused_by_load(tmp_path, kind, name):
    pytest.importorskip("transformers")
    from conftest import tiny_llama

    folder = tmp_path / "model"
    tiny_llama(1).save_pretrained(folder)
    (folder / name).unlink()
    made = hostile(tmp_path, kind)
    os.rename(made, folder / name)
    outcome = _within(
        60, lambda: automap.load(folder, max_memory={"cpu": "1GB"}, offload_dir=tmp_path / "off")
    )
    assert isinstance(outcome, AutomapError), repr(outcome)
    assert name in str(outcome), str(outcome)
    assert not (tmp_path / "off").exists() or not any((tmp_path / "off").iterdir())


def test_the_one_reader_reads_a_plain_json_file(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps({"a": [1, 2.5, "x"]}))
    assert read_json_file(tmp_path / "a.json", "file", hint="", error=PlanError) == {"a": [1, 2.5, "x"]}


@pytest.mark.parametrize("kind", ["missing_folder", "folder", "loop", "long", "loop_folder", "bytes", "fifo"])
def test_output_paths_are_refused_before_any_work(tmp_path, kind):
    target: object = {
        "missing_folder": tmp_path / "nope" / "plan.json",
        "folder": tmp_path,
        "loop": tmp_path / "loop.json",
        "long": tmp_path / ("y" * 300 + ".json"),
        "loop_folder": tmp_path / "loopdir" / "plan.json",
        "bytes": b"plan.json",
        "fifo": tmp_path / "fifo.json",
    }[kind]
    if kind == "loop":
        (tmp_path / "loop.json").symlink_to("loop.json")
    if kind == "loop_folder":
        (tmp_path / "loopdir").symlink_to("loopdir")
    if kind == "fifo":
        os.mkfifo(tmp_path / "fifo.json")
    for check in (check_json_path, lambda p: check_output_path(p, "plan JSON")):
        with pytest.raises(ReportError, match="cannot write the plan JSON|plan JSON="):
            check(target)
    figure = Path(os.fsdecode(target)).with_suffix(".png") if kind != "bytes" else target
    if kind not in ("loop", "fifo", "folder"):  # the .png beside them is a fine name
        with pytest.raises(ReportError):
            check_figure_path(figure)
    plan = automap.plan(nn.Linear(4, 4), max_memory={"cpu": "1GB"})
    with pytest.raises(ReportError):
        write_json(plan, target)


# ------------------------------------------------------------------ nesting, counted before parsing

_SCALARS = st.one_of(st.integers(-(10**6), 10**6), st.text(alphabet='[]{}"\\ab', max_size=6), st.booleans())


@settings(max_examples=200, deadline=None)
@given(
    depth=st.integers(1, 160), leaf=_SCALARS, as_object=st.lists(st.booleans(), min_size=160, max_size=160)
)
def test_nesting_is_counted_past_brackets_inside_strings(depth, leaf, as_object):
    value = leaf
    for wrap in as_object[:depth]:
        value = {"k]}": value} if wrap else [value, "[{"]
    text = json.dumps(value)
    if depth <= MAX_DEPTH:
        assert load_json(text, "x.json is not valid", "fix it") == value
    else:
        with pytest.raises(
            FormatError,
            match=rf"x.json is not valid \(its JSON nests deeper than {MAX_DEPTH} levels\); fix it",
        ):
            load_json(text, "x.json is not valid", "fix it")


def test_a_deeply_nested_file_is_refused_without_reaching_the_recursion_limit(tmp_path):
    # Python's parser recurses once per level; near the recursion limit a finalizer that runs
    # meanwhile fails too ("Exception ignored in ..."): the depth is refused before parsing.
    script = (
        "import gc, sys\n"
        "from automap.userfiles import load_json\n"
        "from automap.errors import FormatError\n"
        "class Finalized:\n"
        "    def __del__(self): [0 for _ in range(3)]\n"
        "for n in (10**3, 10**5):\n"
        "    junk = [Finalized() for _ in range(1000)]\n"
        "    for j in junk: j.me = j\n"
        "    del junk\n"
        "    try: load_json('[' * n + ']' * n, 'x', '')\n"
        "    except FormatError as e: print(e)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "Exception ignored" not in done.stderr, done.stderr[-2000:]
    assert done.stdout.count(f"nests deeper than {MAX_DEPTH} levels") == 2
