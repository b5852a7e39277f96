"""Weights come only from the files automap wrote and holds open: a second process (another user
where the swap needs no more than a shared ``offload_dir``) swaps the store folder for a link to a
folder of same-named files (same headers, zero weights), renames or replaces a store file, while
a model is dispatched or while its store is being written. The forward, ``undispatch`` and the
next dispatch give the original outputs (or a clear error), never the zero weights."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
import torch
from torch import nn

import automap
from automap.errors import AutomapError
from automap.offload import OffloadStore, TensorSpec
from conftest import store_dirs

OTHER_UID = 65534  # "nobody"
DISK = {"0": "cpu", "1": "disk", "2": "cpu", "3": "disk", "4": "cpu", "5": "disk"}


def small(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)]).eval()


def out(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(x)


def zero_store(folder: Path) -> Path:
    """A store of the same model with every weight zero: same folder name pattern, same file
    names, same headers; what an attacker would put in place."""
    model = small()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    automap.dispatch(model, DISK, offload_dir=folder)
    automap.undispatch(model)
    (store,) = store_dirs(folder)
    return store


def as_other_user(script: str, *paths: Path) -> None:
    """Run the shell ``script`` as another user (a second process, no Python needed), with
    search permission on the folders above ``paths``; modes restored after."""
    changed = []
    for path in paths:
        for folder in [path, *path.parents]:
            mode = folder.stat().st_mode & 0o7777
            if not mode & 0o001:
                changed.append((folder, mode))
                folder.chmod(mode | 0o001)
    try:
        subprocess.run(
            [
                "setpriv",
                f"--reuid={OTHER_UID}",
                f"--regid={OTHER_UID}",
                "--clear-groups",
                "sh",
                "-ec",
                script,
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )
    finally:
        for folder, mode in reversed(changed):
            folder.chmod(mode)


def same_user(script: str) -> None:
    subprocess.run(["sh", "-ec", script], check=True, capture_output=True, timeout=60)


@pytest.fixture()
def shared(tmp_path):
    """An offload_dir another account may write in, without the sticky bit; and the attacker's
    folder of zero-weight files, the attacker's own."""
    folder = tmp_path / "shared"
    folder.mkdir()
    folder.chmod(0o777)
    decoy = zero_store(tmp_path / "attacker")
    for path in [decoy.parent, decoy, *decoy.iterdir()]:
        os.chown(path, OTHER_UID, OTHER_UID)
        path.chmod(0o755 if path.is_dir() else 0o644)
    return folder, decoy


def check_original(model: nn.Module, x: torch.Tensor, expected: torch.Tensor, folder: Path) -> None:
    """Forward, undispatch and a second dispatch into the same folder give the original
    outputs, or a clear error; never the zero weights."""
    try:
        assert torch.equal(out(model, x), expected)
    except AutomapError:
        pass  # refused with an error naming the file: acceptable, nothing wrong was read
    automap.undispatch(model)
    assert torch.equal(out(model, x), expected)
    automap.dispatch(model, DISK, offload_dir=folder)
    assert torch.equal(out(model, x), expected)
    automap.undispatch(model)
    assert torch.equal(out(model, x), expected)


def test_a_store_created_by_automap_is_private(tmp_path):
    model = small()
    automap.dispatch(model, DISK, offload_dir=tmp_path / "off")
    try:
        (store,) = store_dirs(tmp_path / "off")
        assert stat.S_IMODE(store.stat().st_mode) & 0o077 == 0
    finally:
        automap.undispatch(model)


def test_a_folder_swapped_for_a_link_by_another_user_under_a_live_model(shared):
    folder, decoy = shared
    model, x = small(), torch.randn(3, 64)
    expected = out(model, x)
    automap.dispatch(model, DISK, offload_dir=folder)
    (store,) = store_dirs(folder)
    as_other_user(f"mv '{store}' '{folder}/stolen'; ln -s '{decoy}' '{store}'", folder, decoy)
    assert store.is_symlink()
    check_original(model, x, expected, folder)


def test_a_store_file_renamed_and_replaced_under_a_live_model(tmp_path):
    folder = tmp_path / "off"
    decoy = zero_store(tmp_path / "attacker")
    model, x = small(), torch.randn(3, 64)
    expected = out(model, x)
    automap.dispatch(model, DISK, offload_dir=folder)
    (store,) = store_dirs(folder)
    files = sorted(p.name for p in store.glob("*.safetensors"))
    first, second = files[0], files[1]
    same_user(
        f"mv '{store}/{first}' '{store}/{first}.old'; cp '{decoy}/{first}' '{store}/{first}'; "
        f"cp '{decoy}/{second}' '{store}/.new'; mv '{store}/.new' '{store}/{second}'"
    )
    check_original(model, x, expected, folder)


def test_a_folder_swapped_while_the_store_is_written(shared):
    """The swap lands between the writing of the store's files and their mapping: the files
    are mapped through the folder automap holds open, not through the link now in its place."""
    folder, decoy = shared
    model = small()
    tensors = {
        n: p.detach().clone() for n, p in model.named_parameters() if n.split(".")[0] in {"1", "3", "5"}
    }
    specs = {n: TensorSpec(n.split(".")[0], t.dtype, tuple(t.shape)) for n, t in tensors.items()}
    last = list(tensors)[-1]

    def read(name: str) -> torch.Tensor:
        if name == last:  # every other file is written: the other account swaps the folder now
            (store,) = store_dirs(folder)
            as_other_user(f"mv '{store}' '{folder}/stolen'; ln -s '{decoy}' '{store}'", folder, decoy)
        return tensors[name]

    store = OffloadStore.write(folder, specs, read)
    try:
        for name, value in tensors.items():
            assert torch.equal(store.get(name), value), name
    finally:
        store.close()


def test_a_store_file_replaced_between_writing_and_mapping_is_refused(tmp_path):
    """A file replaced under its name (in the folder automap holds) before it was mapped is not
    the file written (its inode differs): refused with its name, never read."""
    folder = tmp_path / "off"
    decoy = zero_store(tmp_path / "attacker")
    model = small()
    tensors = {
        n: p.detach().clone() for n, p in model.named_parameters() if n.split(".")[0] in {"1", "3", "5"}
    }
    specs = {n: TensorSpec(n.split(".")[0], t.dtype, tuple(t.shape)) for n, t in tensors.items()}
    last = list(tensors)[-1]

    def read(name: str) -> torch.Tensor:
        if name == last:
            (store,) = store_dirs(folder)
            first = sorted(p.name for p in store.glob("*.safetensors"))[0]
            same_user(f"cp '{decoy}/{first}' '{store}/.x'; mv '{store}/.x' '{store}/{first}'")
        return tensors[name]

    with pytest.raises(AutomapError, match="not the file automap wrote"):
        OffloadStore.write(folder, specs, read)


def test_a_reused_store_with_a_link_in_place_of_a_file_is_rebuilt(tmp_path):
    folder = tmp_path / "off"
    decoy = zero_store(tmp_path / "attacker")
    model, x = small(), torch.randn(3, 64)
    expected = out(model, x)
    automap.dispatch(model, DISK, offload_dir=folder)
    automap.undispatch(model)
    (store,) = store_dirs(folder)
    first = sorted(p.name for p in store.glob("*.safetensors"))[0]
    (store / first).unlink()
    (store / first).symlink_to(decoy / first)
    automap.dispatch(model, DISK, offload_dir=folder)
    try:
        assert torch.equal(out(model, x), expected)
    finally:
        automap.undispatch(model)
    assert torch.equal(out(model, x), expected)
    shutil.rmtree(decoy)
