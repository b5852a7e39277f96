"""What `import automap` and the `automap` command import (issue 25), read from the
interpreter's own `-X importtime` log in a fresh process: torch._dynamo, matplotlib and
transformers wait for the calls that use them; `automap --help` and a bad argument answer
before torch is imported. (The seconds are a benchmark's business: benchmarks/import_time.py.)"""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("torch._dynamo", "matplotlib", "transformers", "networkx")


def imported(*args: str) -> tuple[set[str], subprocess.CompletedProcess]:
    """Modules a fresh ``python -X importtime ARGS`` imported, and the finished process."""
    done = subprocess.run(
        [sys.executable, "-X", "importtime", *args], capture_output=True, text=True, timeout=300
    )
    names = {
        line.rsplit("|", 1)[1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")
    }
    return names, done


@pytest.mark.parametrize(
    "statement",
    [
        "import automap",
        "import automap; automap.plan; automap.dispatch",
        "from automap import load, placement, pipeline, Plan",
    ],
)
def test_import_leaves_the_heavy_libraries_for_later(statement):
    names, done = imported("-c", statement)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "automap" in names
    found = sorted(n for n in names if n in HEAVY or n.startswith(tuple(h + "." for h in HEAVY)))
    assert not found, f"{statement!r} imported {found[:5]}"


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["plan", "--help"],
        ["-v", "plan", "x", "--figure", "out.jpg"],
        ["plan", "x", "--max-memory", "cpu=2GB,cpu=3GB"],
        ["plan", "x", "--dtype", "bf15"],
    ],
)
def test_the_command_answers_help_and_bad_arguments_before_torch(argv):
    names, done = imported("-m", "automap", *argv)
    assert done.returncode == (0 if "--help" in argv else 2), done.stderr[-2000:]
    assert "torch" not in names


def test_the_lazy_package_still_offers_every_name_and_submodule():
    code = (
        "import automap; names = dir(automap); assert 'plan' in names and 'SizeError' in names; "
        "assert callable(automap.progress.silenced); assert automap.__all__ == sorted(automap.__all__); "
        "[getattr(automap, n) for n in automap.__all__]; "
        "import torchvision; assert 'cuda:0' in automap.plan(torchvision.models.resnet18(), "
        "max_memory={0: '1GB'}).report()"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_submodule_imported_alone_still_renders_its_plans():
    # torchrun scripts import automap.distributed only; Plan.report() must not need `import automap`
    # (the composition that makes their plans registers the renderers; the planner names none)
    code = (
        "import sys, torch; from torch import nn; from automap.distributed import plan_for_ranks; "
        "plan = plan_for_ranks(nn.Sequential(*[nn.Linear(32, 32) for _ in range(4)]), 2); "
        "text = plan.report(); "
        "assert 'rank' in text or 'cuda' in text or 'cpu' in text, text; assert plan.to_json().startswith('{')"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
