"""``make install`` (what ``make demo`` and ``make test`` run first) is quiet and honest: one line
per step with its time, pip's output in ``.venv/install.log``, at most 15 lines on success; a
failed step prints FAILED, the log's tail and its name. Run against the real Makefile with a
stand-in ``python`` that writes pip-like noise (a real install takes minutes and gigabytes:
docs/install.md has that run's output)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOISE = "WARNING: Location 'file:///opt/mirror/simple/x/' is ignored: it is neither a file nor a directory."


def _make(tmp_path: Path, exit_code: int) -> subprocess.CompletedProcess:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(
        "#!/bin/sh\n"
        'case "$*" in *--version*) echo "automap 0.1.0"; exit 0;; esac\n'
        f"for i in $(seq 40); do echo \"{NOISE}\" >&2; echo 'Collecting something'; done\n"
        f'case "$*" in *-e*) exit {exit_code};; esac\nexit 0\n'
    )
    python.chmod(0o755)
    return subprocess.run(
        ["make", "--no-print-directory", "-C", str(ROOT), "install", f"VENV={venv}", f"PY={python}"],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_a_successful_install_prints_one_line_per_step_and_keeps_pips_output_in_the_log(tmp_path):
    done = _make(tmp_path, 0)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    lines = out.strip().splitlines()
    assert len(lines) <= 15, lines
    assert "WARNING" not in out and "Collecting" not in out
    steps = [line for line in lines if line.startswith("  ")]
    assert len(steps) == 4 and all(line.rstrip().endswith(" s") for line in steps), steps
    log = (tmp_path / "venv" / "install.log").read_text()
    assert log.count(NOISE) == 3 * 40  # pip, torch, automap: all in the log
    venv = tmp_path / "venv"
    again = subprocess.run(
        [
            "make",
            "--no-print-directory",
            "-C",
            str(ROOT),
            "install",
            f"VENV={venv}",
            f"PY={venv / 'bin' / 'python'}",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert again.returncode == 0 and "installing" not in again.stdout  # the stamp: nothing installed twice


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_a_failed_step_names_the_log_and_shows_its_tail(tmp_path):
    done = _make(tmp_path, 1)
    assert done.returncode != 0
    log = tmp_path / "venv" / "install.log"
    assert "FAILED" in done.stdout and f"the whole output is in {log}" in done.stdout
    assert NOISE in done.stdout  # the tail of the log, where pip said why
    assert not (tmp_path / "venv" / ".automap-installed").exists()
