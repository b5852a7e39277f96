"""``make gpu-check DRY=1`` in ``make test``: the GPU check's script runs every step's CPU
equivalent, so it does not rot between the rare runs on a GPU machine. What a step returns is
checked here, so a step that silently stops measuring fails too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpu-check")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.gpu_check",
            "--dry-run",
            "--out",
            str(tmp / "out"),
            "--scratch",
            str(tmp / "scratch"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    return done, tmp / "out"


@pytest.mark.slow
def test_the_dry_run_passes_every_step(dry_run):
    done, out = dry_run
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((out / "gpu-check.json").read_text())
    steps = {s["name"]: s for s in report["steps"]}
    assert [s["status"] for s in steps.values()] == ["ok"] * len(steps), report
    assert set(steps) >= {
        "environment",
        "tests",
        "transparency",
        "h2d",
        "llama-stream25",
        "llama-stream50",
        "llama-stream75",
        "llama-disk",
        "load",
        "tutorial",
    }
    for name in steps:
        assert f" {name}: ok (" in done.stdout, f"no progress line for {name}"
    assert "all steps passed" in (out / "gpu-check.txt").read_text()


@pytest.mark.slow
def test_each_step_reports_its_figures(dry_run):
    _, out = dry_run
    steps = {s["name"]: s["result"] for s in json.loads((out / "gpu-check.json").read_text())["steps"]}
    tests = steps["tests"]
    assert tests["skipped"] and not tests["failed"] and not tests["passed"], (
        "no GPU here: every GPU test skips"
    )
    archs = steps["transparency"]["architectures"]
    assert set(archs) == {"cnn", "vit", "gpt2", "llama", "t5"}
    assert all(a["ok"] and a["streamed_units"] > 0 and a["outputs_match"] for a in archs.values())
    assert all(archs[n]["generate_identical"] for n in ("gpt2", "llama", "t5"))
    disk = steps["h2d"]["from_disk"]
    assert disk["units_copied"] > 0 and disk["achieved_bytes_per_second"] > 0
    assert disk["pinned_copy_bytes_per_second"] > 0
    for config in ("stream25", "stream50", "stream75", "disk"):
        result = steps[f"llama-{config}"]
        assert result["shares"].get("disk", 0) > 0, f"{config}: something is streamed"
        assert set(result["median_forward_seconds"]) == {"ram", "automap", "accelerate"}
    for label in ("resident", "mixed"):
        assert steps["load"][label]["logits_max_abs_diff"] == 0.0
    assert len(steps["tutorial"]["rows"]) >= 3 and (out / "tutorial.png").stat().st_size > 0


def test_a_failing_step_is_reported_and_the_others_still_run(tmp_path, monkeypatch):
    from benchmarks import gpu_check
    from benchmarks.gpu_steps import CheckFailed, Context

    def broken(ctx):
        raise CheckFailed("this step found something wrong")

    def fine(ctx):
        return {"headline": "fine"}

    steps = [
        gpu_check.Step("environment", lambda ctx: {"gpu_count": 0}, 1),
        gpu_check.Step("broken", broken, 1),
        gpu_check.Step("crashing", lambda ctx: os._exit(3), 1),
        gpu_check.Step("fine", fine, 1),
        gpu_check.Step("slow", fine, 10_000),
    ]
    records = gpu_check.run_all(steps, Context(dry=True, out=tmp_path, scratch=tmp_path), budget=60)
    got = {r["name"]: (r["status"], r.get("error", "")) for r in records}
    assert got["broken"] == ("failed", "this step found something wrong")
    assert got["crashing"] == ("failed", "the step's process died (exit code 3)")
    assert got["fine"][0] == "ok"
    assert got["slow"][0] == "skipped" and got["slow"][1].startswith("skipped: out of time")


def test_a_step_still_running_when_the_budget_ends_is_killed_and_said_so(tmp_path):
    import time

    from benchmarks import gpu_check
    from benchmarks.gpu_steps import Context

    steps = [
        gpu_check.Step("environment", lambda ctx: {"gpu_count": 0}, 0.1),
        gpu_check.Step("endless", lambda ctx: time.sleep(600), 0.1),
        gpu_check.Step("after", lambda ctx: {"headline": "never started"}, 0.1),
    ]
    start = time.monotonic()
    records = gpu_check.run_all(steps, Context(dry=True, out=tmp_path, scratch=tmp_path), budget=3)
    assert time.monotonic() - start < 30
    assert records[1]["status"] == "skipped" and "killed at the" in records[1]["error"]
    assert records[2]["status"] == "skipped" and records[2]["error"].startswith("skipped: out of time")


def test_a_step_can_be_spawned_instead_of_forked(tmp_path):
    from functools import partial

    from benchmarks import gpu_check, gpu_steps
    from benchmarks.gpu_steps import Context

    step = gpu_check.Step("environment", partial(gpu_steps.environment), 1)
    record = gpu_check.run_step(step, Context(dry=True, out=tmp_path, scratch=tmp_path), 120, method="spawn")
    assert record["status"] == "ok" and record["result"]["gpu_count"] == 0
    assert gpu_check.POISONED_FORK.search("RuntimeError: Cannot re-initialize CUDA in forked subprocess.")
    assert gpu_check.POISONED_FORK.search("CUDA error: initialization error")
