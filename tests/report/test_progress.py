"""Progress on long work (automap/progress.py): drawn on a terminal only, after a second, never
under quiet. Real terminals: the commands run in a subprocess whose stderr is a pseudo-terminal
(or a pipe, for the log case), and planning a real model is the long step."""

from __future__ import annotations

import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios
import textwrap

import pytest

# Plans ResNet-18 on meta with the delay at 0 (so the test needs no long step); argv[1] says how.
SCRIPT = textwrap.dedent("""
    import sys
    import torchvision
    import automap
    import automap.progress as progress

    progress.DELAY_SECONDS = 0
    model = torchvision.models.resnet18()
    if sys.argv[1] == "quiet":
        with progress.silenced():
            automap.plan(model, max_memory={"cpu": "1GB"})
    else:
        automap.plan(model, max_memory={"cpu": "1GB"})
    print("planned", file=sys.stderr)
""")


def _stderr_of(mode: str, *, terminal: bool) -> str:
    """Run SCRIPT; return what it wrote to stderr (a pseudo-terminal when ``terminal``)."""
    env = dict(os.environ)
    if not terminal:
        done = subprocess.run(
            [sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=300, env=env
        )
        assert done.returncode == 0, done.stderr
        return done.stderr
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # a 120-column terminal
    try:
        proc = subprocess.Popen(
            [sys.executable, "-c", SCRIPT, mode], stderr=follower, stdout=subprocess.DEVNULL, env=env
        )
        os.close(follower)
        chunks = []
        while True:
            try:
                chunk = os.read(leader, 4096)
            except OSError:  # the other side closed: the process is done
                break
            if not chunk:
                break
            chunks.append(chunk)
        assert proc.wait(timeout=300) == 0, b"".join(chunks).decode(errors="replace")
    finally:
        os.close(leader)
    return b"".join(chunks).decode(errors="replace")


def test_a_terminal_sees_tracing_and_planning():
    err = _stderr_of("plain", terminal=True)
    assert "automap: tracing ResNet" in err and "automap: planning" in err, err
    assert "planned" in err


def test_quiet_and_logs_see_nothing():
    assert _stderr_of("quiet", terminal=True).strip() == "planned"
    assert _stderr_of("plain", terminal=False).strip() == "planned"


def test_a_step_inside_a_step_renames_the_bar_and_restores_it(monkeypatch):
    import automap.progress as progress

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    with progress.step("outer"):
        outer = progress._active.get()
        with progress.step("inner"):
            assert progress._active.get() is outer and outer.desc == "inner"
        assert outer.desc == "outer"
    assert progress._active.get() is None


@pytest.mark.parametrize("quiet", [True, False])
def test_bars_follow_the_same_rule(monkeypatch, quiet):
    import automap.progress as progress

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    with progress.bar(10, "count", quiet=quiet) as counting:
        assert counting.disable is quiet
    with progress.silenced(), progress.bar(10, "count") as counting:
        assert counting.disable
