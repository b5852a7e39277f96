"""The ``automap`` command on hostile arguments and spec files: every subcommand answers bad
input with exit status 2 and one line on stderr, never a traceback; an exception automap did
not expect is one line asking for a bug report, with ``--debug`` for its traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from automap import cli
from automap.cli import main

ROOT = Path(__file__).resolve().parents[2]
LONG = "a" * 300


@pytest.fixture
def files(tmp_path, monkeypatch):
    """Hostile files in a working directory of their own."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "not_utf8.json").write_bytes(b'{"model_type": "llama", "x": "\xff"}')
    (tmp_path / "deep.json").write_bytes(b"[" * 100_000)
    (tmp_path / "list.json").write_text("[1, 2]")
    os.mkfifo(tmp_path / "fifo.json")
    (tmp_path / "loop").symlink_to("loop")
    (tmp_path / "loop.png").symlink_to("loop.png")
    (tmp_path / "a_folder").mkdir()
    fields = {
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "vocab_size": 100,
    }
    bad_fields = {
        "bad_type": {"hidden_size": "big"},
        "negative": {"hidden_size": -64},
        "huge_vocab": {"vocab_size": 10**12},
        "rope": {"rope_scaling": {"rope_type": "bogus", "factor": 2}},
        "arch": {"architectures": [5]},
        "family": {"model_type": 5},
        "nested": {"num_hidden_layers": [[[]]]},
        "float_layers": {"num_hidden_layers": 1.5},
        "big_int": {"hidden_size": 10**30},
    }
    for name, change in bad_fields.items():
        (tmp_path / f"{name}.json").write_text(json.dumps({**fields, **change}))
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({**fields, **change}))
    (tmp_path / "ok.json").write_text(json.dumps(fields))
    return tmp_path


HOSTILE_SPECS = [
    "hf:./not_utf8.json",
    "hf:./deep.json",
    "hf:./list.json",
    "hf:./fifo.json",
    "hf:./missing.json",
    "hf:./a_folder",
    "hf:./loop",
    "loop",
    LONG,
    f"hf:./{LONG}.json",
    f"{LONG}:build",
    "hf:" + LONG,
    "hf:./bad_type.json",
    "hf:./negative.json",
    "hf:./huge_vocab.json",
    "hf:./rope.json",
    "hf:./arch.json",
    "hf:./family.json",
    "hf:./nested.json",
    "hf:./float_layers.json",
    "hf:./big_int.json",
    "negative",
    "huge_vocab",
    "arch",
    "bad_type",
    "nested",
    "big_int",
    "torchvision:nope",
    "nope:nope",
    ":",
    "hf:",
]
HOSTILE_ARGUMENTS = [
    ["--max-memory", "cpu=1e300GB"],
    ["--max-memory", "cpu=-1GB"],
    ["--max-memory", "cpu=nan"],
    ["--max-memory", "cpu=inf"],
    ["--max-memory", f"{10**400}=1GB"],
    ["--max-memory", "cuda:99999999999999999999=1GB"],
    ["--max-memory", "cpu=1GB,cpu=2GB"],
    ["--max-memory", "cpu"],
    ["--max-memory", f"cpu={'9' * 5000}"],
    ["--batch", "0"],
    ["--batch", str(10**30)],
    ["--batch", "1.5"],
    ["--seq-len", "x"],
    ["--max-length", "1"],
    ["--max-length", str(2**31 + 1)],
    ["--input-shape", "0x3"],
    ["--input-shape", "99999999999999999999x1"],
    ["--input-shape", "1x-3"],
    ["--json", "loop"],
    ["--json", LONG + ".json"],
    ["--json", "a_folder"],
    ["--json", "missing/plan.json"],
    ["--json", "loop/plan.json"],
    ["--figure", "plan.gif"],
    ["--figure", "loop.png"],
    ["--figure", LONG + ".png"],
    ["--dtype", "fp7"],
    ["--strategy", "fastest"],
    ["--example-inputs", "nope:nope"],
    ["--set", "hidden_size"],
    ["--set", "=3"],
]


def _run(capsys, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().err


def _one_line(code: int, err: str) -> None:
    assert code == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "internal error" not in err, err


@pytest.mark.parametrize("spec", HOSTILE_SPECS, ids=lambda s: s[:30])
def test_plan_on_a_hostile_spec_exits_2_with_one_line(files, capsys, spec):
    pytest.importorskip("transformers")
    _one_line(*_run(capsys, "plan", spec, "--max-memory", "cpu=1GB"))


@pytest.mark.parametrize("argv", HOSTILE_ARGUMENTS, ids=lambda a: " ".join(a)[:40])
def test_plan_on_a_hostile_argument_exits_2_with_one_line(files, capsys, argv):
    pytest.importorskip("transformers")
    extra = [] if "--max-memory" in argv else ["--max-memory", "cpu=1GB"]
    _one_line(*_run(capsys, "plan", "hf:./ok.json", *argv, *extra))


@pytest.mark.parametrize(
    "argv",
    [
        ["bench", "--json", "loop"],
        ["bench", "--json", "missing/rows.json"],
        ["bench", "--json", LONG + ".json"],
        ["bench", "--json", "a_folder"],
        ["demo", "--bogus"],
        ["bench", "--bogus"],
        ["nope"],
        ["plan"],
        ["plan", "hf:./ok.json", "--bogus"],
    ],
    ids=" ".join,
)
def test_every_subcommand_refuses_hostile_arguments_with_one_line(files, capsys, argv):
    _one_line(*_run(capsys, *argv))


def test_an_unexpected_exception_is_one_line_asking_for_a_report_and_debug_shows_it(
    files, capsys, monkeypatch
):
    def broken(args):
        raise ZeroDivisionError("a bug")

    monkeypatch.setitem(cli._COMMANDS, "demo", broken)
    code, err = _run(capsys, "demo")
    assert code == 1 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert "internal error: ZeroDivisionError: a bug" in err and "--debug" in err, err
    code, err = _run(capsys, "demo", "--debug")
    assert code == 1 and "Traceback" in err and "ZeroDivisionError" in err, err


def test_in_a_real_process_hostile_input_is_one_line_without_traceback(files):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for argv in (
        ["plan", "hf:./not_utf8.json"],
        ["plan", "hf:./deep.json"],
        ["plan", LONG],
        ["plan", "hf:./ok.json", "--max-memory", "cpu=1e300GB"],
        ["plan", "hf:./ok.json", "--max-memory", "cpu=1GB", "--json", "loop"],
    ):
        done = subprocess.run(
            [sys.executable, "-m", "automap", *argv],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
            cwd=files,
        )
        assert done.returncode == 2 and "Traceback" not in done.stderr, (argv, done.stderr[-2000:])
        assert len(done.stderr.strip().splitlines()) == 1, (argv, done.stderr)
