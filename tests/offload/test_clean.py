"""``automap.clean`` / ``automap clean DIR`` remove automap's own offload stores and nothing else:
not a user's file beside a store or inside one, not a link carrying a store's name (nor what it
points to), not a hard link to a user's file, not a store-named folder without automap's
manifest, not a store a live process holds (a real second process, then ``kill -9``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import automap
from automap.cli import main
from automap.offload import LOCK, MANIFEST, OffloadStore, TensorSpec, clean, store_size


def _store(root: Path, rows: int = 64) -> Path:
    specs = {
        "fc.weight": TensorSpec("fc", torch.float32, (rows, 16)),
        "fc.bias": TensorSpec("fc", torch.float32, (16,)),
    }
    store = OffloadStore.write(root, specs, lambda name: torch.ones(specs[name].shape))
    store.close()
    return store.directory


def _tree(root: Path) -> dict[str, bytes | str]:
    """Every path under ``root`` (links not followed) with its content or link target."""
    found: dict[str, bytes | str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            rel = str(path.relative_to(root))
            found[rel] = (
                "-> " + os.readlink(path)
                if path.is_symlink()
                else "dir"
                if path.is_dir()
                else path.read_bytes()
            )
    return found


def test_a_dispatched_models_store_goes_and_the_users_files_stay(tmp_path):
    offload = tmp_path / "offload"
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)]).eval()
    automap.dispatch(model, max_memory={"cpu": "300KB"}, offload_dir=offload)
    automap.undispatch(model)
    (offload / "notes.txt").write_text("mine")
    (offload / "automap-store-mine").mkdir()  # a store-like name that is not a store's
    (offload / "automap-store-mine" / "data.bin").write_bytes(b"data")
    stores = sorted(offload.glob("automap-store-*-*"))
    stores = [s for s in stores if s.name != "automap-store-mine"]
    assert len(stores) == 1
    size = store_size(stores[0])
    others = {k: v for k, v in _tree(offload).items() if not k.startswith(stores[0].name)}
    result = clean(offload)
    assert result.removed == [(stores[0], size)] and result.freed == size > 256 * 256 * 4
    assert not stores[0].exists() and _tree(offload) == others
    assert f"removed {stores[0]}" in result.summary() and "freed" in result.summary()


def test_a_store_holding_a_users_file_or_a_hard_link_is_left_whole(tmp_path):
    offload = tmp_path / "offload"
    inside = _store(offload)
    (inside / "my-results.csv").write_text("1,2,3")
    linked = _store(offload, rows=32)
    users = tmp_path / "users.safetensors"
    users.write_bytes(b"user bytes")
    victim = next(p for p in linked.iterdir() if p.suffix == ".safetensors")
    victim.unlink()
    os.link(users, victim)  # the store's file is now also a name of the user's file
    before = _tree(tmp_path)
    result = clean(offload)
    assert result.removed == [] and _tree(tmp_path) == before
    reasons = dict(result.kept)
    assert "my-results.csv" in reasons[inside] and "not automap's" in reasons[linked]
    assert users.read_bytes() == b"user bytes"


def test_a_link_with_a_stores_name_and_a_folder_without_a_manifest_are_left(tmp_path):
    offload = tmp_path / "offload"
    offload.mkdir()
    real = _store(tmp_path / "elsewhere")  # a real store, reached only through a link
    users = tmp_path / "users-folder"
    users.mkdir()
    (users / "thesis.tex").write_text("years of work")
    (offload / "automap-store-0123456789abcdef-0").symlink_to(users)
    (offload / f"{real.name}").symlink_to(real)
    fake = offload / "automap-store-fedcba9876543210-0"
    fake.mkdir()
    (fake / LOCK).write_text("{}")  # a lock file, but no manifest of automap's
    before = _tree(tmp_path)
    result = clean(offload)
    assert result.removed == [] and _tree(tmp_path) == before
    assert len(result.kept) == 3
    assert "symbolic link" in dict(result.kept)[offload / "automap-store-0123456789abcdef-0"]
    assert MANIFEST in dict(result.kept)[fake]


HOLDER = textwrap.dedent("""
    import sys, torch
    from automap.offload import OffloadStore, TensorSpec
    specs = {"w": TensorSpec("u", torch.float32, (32, 32))}
    store = OffloadStore.write(sys.argv[1], specs, lambda name: torch.ones(32, 32))
    print(store.directory, flush=True)
    sys.stdin.read()
""")


def test_a_store_a_live_process_holds_is_left_until_it_dies(tmp_path):
    offload = tmp_path / "offload"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(offload)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        held = Path(holder.stdout.readline().strip())
        assert held.is_dir()
        before = _tree(offload)
        result = clean(offload)
        assert result.removed == [] and _tree(offload) == before
        assert f"pid {holder.pid}" in dict(result.kept)[held]
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert clean(offload).removed[0][0] == held and not held.exists()


def test_the_command_prints_what_it_removed_and_refuses_a_missing_folder(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    store = _store(Path("offload"))
    assert main(["clean"]) == 0
    out = capsys.readouterr().out
    assert f"removed {store}" in out and "freed" in out and not store.exists() and Path("offload").is_dir()
    assert main(["clean", "offload"]) == 0 and "nothing freed" in capsys.readouterr().out
    assert main(["clean", "missing"]) == 2
    assert "missing does not exist" in capsys.readouterr().err
    with pytest.raises(automap.OffloadError, match="does not exist"):
        automap.clean(tmp_path / "missing")


def test_a_store_named_directly_is_removed(tmp_path):
    store = _store(tmp_path / "offload")
    assert clean(store).removed[0][0] == store and not store.exists()
