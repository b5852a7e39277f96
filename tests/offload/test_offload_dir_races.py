"""Two callers creating one new ``offload_dir`` at once (two threads, two processes): the folder
is made by exactly one of them, neither removes what the other made, and each gets a working
store of its own (or a clear error); nothing is left half-made."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import torch
from torch import nn

import automap
from automap.errors import AutomapError
from automap.offload.store_files import make_root, remove_folders
from conftest import store_dirs

DISK = {"0": "cpu", "1": "disk", "2": "cpu", "3": "disk"}
ROOT = Path(__file__).resolve().parents[2]


def small(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(32, 32) for _ in range(4)]).eval()


def test_two_threads_make_one_new_folder_each_owning_only_what_it_made(tmp_path):
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch between nearly every bytecode: the race is met
    try:
        _make_in_two_threads(tmp_path)
    finally:
        sys.setswitchinterval(before)


def _make_in_two_threads(tmp_path: Path) -> None:
    for round_ in range(200):
        target = tmp_path / f"r{round_}" / "a" / "b"
        barrier, made, errors = threading.Barrier(2), [], []

        def make() -> None:
            barrier.wait()
            try:
                made.append(make_root(target))
            except BaseException as exc:  # noqa: BLE001 - recorded for the assertion
                errors.append(exc)

        threads = [threading.Thread(target=make) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        owned = [p for paths in made for p in paths]
        assert len(owned) == len(set(owned)) == 3  # each folder made by exactly one caller
        assert target.is_dir()
        remove_folders(owned)


def test_two_threads_dispatch_into_one_new_offload_dir(tmp_path):
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        _dispatch_in_two_threads(tmp_path)
    finally:
        sys.setswitchinterval(before)


def _dispatch_in_two_threads(tmp_path: Path) -> None:
    for round_ in range(5):
        folder = tmp_path / f"r{round_}" / "off"
        models = [small(1), small(2)]
        x = torch.randn(2, 32)
        with torch.no_grad():
            expected = [m(x) for m in models]
        barrier, errors = threading.Barrier(2), []

        def run(model: nn.Module) -> None:
            barrier.wait()
            try:
                automap.dispatch(model, DISK, offload_dir=folder)
            except AutomapError as exc:
                errors.append(exc)  # a clear error is allowed; a raw one fails the thread

        threads = [threading.Thread(target=run, args=(m,)) for m in models]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors  # both got a store: the folder is shared, never removed under one
        assert 1 <= len(store_dirs(folder)) <= 2  # one free store reused when the first was done already
        for model, want in zip(models, expected):
            with torch.no_grad():
                assert torch.equal(model(x), want)
            automap.undispatch(model)


def test_a_failing_caller_never_removes_a_folder_another_made(tmp_path):
    """One caller's dispatch fails (no room for its store) right after making offload_dir; the
    other, which found the folder made, still gets its store."""
    folder = tmp_path / "new" / "off"
    good = small(1)
    made = make_root(folder)  # "the other caller" made it; this one's cleanup would rmdir it if empty
    automap.dispatch(good, DISK, offload_dir=folder)
    remove_folders(made)  # the maker gives up: its folder is not empty, so it stays
    try:
        assert folder.is_dir() and len(store_dirs(folder)) == 1
    finally:
        automap.undispatch(good)


def test_two_processes_dispatch_into_one_new_offload_dir(tmp_path):
    folder = tmp_path / "shared" / "off"
    go = tmp_path / "go"
    code = textwrap.dedent("""
        import os, sys, time, torch, automap
        from torch import nn
        torch.manual_seed(int(sys.argv[3]))
        model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(4)]).eval()
        x = torch.randn(2, 32)
        with torch.no_grad():
            want = model(x)
        print("READY", flush=True)
        while not os.path.exists(sys.argv[2]):
            time.sleep(0.001)
        automap.dispatch(model, {"0": "cpu", "1": "disk", "2": "cpu", "3": "disk"}, offload_dir=sys.argv[1])
        with torch.no_grad():
            assert torch.equal(model(x), want)
        automap.undispatch(model)
        print("OK")
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(folder), str(go), str(seed)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for seed in (1, 2)
    ]
    for proc in procs:  # both imported torch and built their model: they wait at the start line
        assert proc.stdout.readline().strip() == "READY", proc.stderr.read()[-2000:]
    go.touch()
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0 and "OK" in out, f"exit {proc.returncode}: {out[-500:]} {err[-2000:]}"
    assert 1 <= len(store_dirs(folder)) <= 2  # one free store reused when the first was done already
