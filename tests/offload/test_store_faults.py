"""Nothing of the user's is lost and no raw exception escapes, second round (issue #23, the files
half): every file automap reads goes through one strict parser; a foreign, linked or unwritable
store is passed over; a full disk or inode table leaves nothing behind; no write follows a link;
the lock is taken in one step; what a killed writer left is cleaned. Real mechanisms throughout:
tmpfs mounts, ``chattr +i``, another uid (``chown``, ``setuid``), real ``kill -9``, real forks and
two real processes."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import automap
from automap.errors import CheckpointError, OffloadError
from automap.offload import LOCK, MANIFEST
from automap.runtime import state_of
from conftest import store_dirs

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
OTHER_UID = 65534  # "nobody"
DISK = {"0": "cpu", "1": "disk", "2": "cpu", "3": "disk", "4": "cpu", "5": "disk"}


def small() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)]).eval()


def out(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(x)


def dispatched_once(folder: Path) -> Path:
    """Dispatch and undispatch the small model into ``folder``: its (free) store's path."""
    model = small()
    automap.dispatch(model, DISK, offload_dir=folder)
    automap.undispatch(model)
    (store,) = store_dirs(folder)
    return store


def digest(folder: Path) -> dict[str, tuple[str, int]]:
    """sha256 and mtime of every file under ``folder``, links not followed."""
    return {
        str(p.relative_to(folder)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
        for p in sorted(folder.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


def env() -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parent), str(TESTS), str(ROOT)]),
    }


def run_python(code: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env(),
    )


def ok(result: subprocess.CompletedProcess) -> str:
    detail = f"exit {result.returncode}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    assert result.returncode == 0 and "OK" in result.stdout, detail
    return result.stdout


def header_file(path: Path, header: bytes, data: bytes = b"\0" * 64) -> None:
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)


# ------------------------------------------------------------------ 1. one strict parser


HOSTILE = {
    "deep nesting": b'{"w": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "a list for a dtype": b'{"w": {"dtype": ["F32"], "shape": [4], "data_offsets": [0, 16]}}',
    "a 5,000-digit number": b'{"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 1'
    + b"0" * 5000
    + b"]}}",
    "1e400": b'{"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 1e400]}}',
    "NaN": b'{"w": {"dtype": "F32", "shape": [NaN], "data_offsets": [0, 16]}}',
    "a dict for a dtype": b'{"w": {"dtype": {"a": 1}, "shape": [4], "data_offsets": [0, 16]}}',
    "100 dimensions": b'{"w": {"dtype": "F32", "shape": ['
    + b", ".join([b"1"] * 100)
    + b'], "data_offsets": [0, 4]}}',
    "not UTF-8": b'{"w\xff\xfe": 1}',
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_checkpoint_headers_are_a_format_error(tmp_path, case):
    path = tmp_path / "bad.safetensors"
    header_file(path, HOSTILE[case])
    with pytest.raises(CheckpointError, match="bad.safetensors") as info:
        automap.load(small(), path, {str(i): "cpu" for i in range(6)}, quiet=True)
    assert isinstance(info.value, OffloadError), "a FormatError: both kinds"


@pytest.mark.parametrize("case", ["deep nesting", "a list for a dtype", "a 5,000-digit number", "1e400"])
def test_a_store_file_with_a_hostile_header_is_rebuilt(tmp_path, case):
    store = dispatched_once(tmp_path)
    victim = sorted(store.glob("*.safetensors"))[0]
    header_file(victim, HOSTILE[case])
    model, x = small(), torch.randn(3, 64)
    expected = out(model, x)
    automap.dispatch(model, DISK, offload_dir=tmp_path)
    assert store_dirs(tmp_path) == [store], "the damaged store itself was rebuilt"
    assert torch.equal(out(model, x), expected)
    automap.undispatch(model)
    model = small()
    automap.dispatch(model, DISK, offload_dir=tmp_path)  # and every later dispatch works too
    assert torch.equal(out(model, x), expected)


@pytest.mark.parametrize(
    "damage",
    [
        '{"format": "automap-offload-store", "version": 2, "complete": true, "files": [], "tensors": '
        '{"1.weight": {"file": "1.safetensors", "key": "1.weight", "dtype": "F32", "shape": [64, 64], '
        '"nbytes": 1e400, "crc32": 0}}}',
        "[" * 100_000 + "]" * 100_000,
        '{"format": "automap-offload-store", "version": 2, "complete": true, "files": '
        + "[" * 100_000
        + "]" * 100_000
        + "}",
        '{"format": "automap-offload-store", "version": 2, "complete": true, "files": [], "tensors": '
        '{"1.weight": {"file": "1.safetensors", "key": "1.weight", "dtype": "F32", "shape": [64, 64], '
        '"nbytes": 1' + "0" * 5000 + ', "crc32": 0}}}',
    ],
    ids=["1e400", "deep", "deep files", "5000 digits"],
)
def test_a_hostile_manifest_means_rebuild(tmp_path, damage):
    store = dispatched_once(tmp_path)
    (store / MANIFEST).write_text(damage)
    model, x = small(), torch.randn(3, 64)
    expected = out(model, x)
    automap.dispatch(model, DISK, offload_dir=tmp_path)
    assert torch.equal(out(model, x), expected)
    assert json.loads((store / MANIFEST).read_text())["complete"] is True


@pytest.mark.parametrize(
    "index",
    [
        "[" * 100_000 + "]" * 100_000,
        '{"metadata": {"total_size": 1e400}, "weight_map": {"0.weight": "model.safetensors"}}',
        '{"weight_map": {"0.weight": ["model.safetensors"]}}',
        '{"weight_map": {"0.weight": 1' + "0" * 5000 + "}}",
    ],
    ids=["deep", "1e400", "list", "5000 digits"],
)
@pytest.mark.parametrize("name", ["model.safetensors.index.json", "pytorch_model.bin.index.json"])
def test_a_hostile_shard_index_is_a_checkpoint_error(tmp_path, index, name):
    torch.save(small().state_dict(), tmp_path / "pytorch_model.bin")
    save_file(small().state_dict(), tmp_path / "model.safetensors")
    (tmp_path / name).write_text(index)
    with pytest.raises(CheckpointError, match=rf"index .*{name}.*(fix or remove the index)"):
        automap.load(small(), tmp_path / name, {str(i): "cpu" for i in range(6)}, quiet=True)
    (
        tmp_path / "model.safetensors"
    ).unlink()  # the folder: read through its index once no model.safetensors wins
    (tmp_path / "pytorch_model.bin").rename(tmp_path / "pytorch_model-00001-of-00001.bin")
    with pytest.raises(CheckpointError, match=rf"index .*{name}.*(fix or remove the index)"):
        automap.load(small(), tmp_path, {str(i): "cpu" for i in range(6)}, quiet=True)


# ------------------------------------------------------------------ 2. foreign and unwritable stores


def test_another_users_store_is_passed_over(tmp_path):
    store = dispatched_once(tmp_path)
    for path in [store, *store.iterdir()]:
        os.chown(path, OTHER_UID, OTHER_UID)
    before = digest(store)
    model, x = small(), torch.randn(3, 64)
    expected = out(model, x)
    automap.dispatch(model, DISK, offload_dir=tmp_path)
    assert len(store_dirs(tmp_path)) == 2, "a store of this user's own was made"
    assert torch.equal(out(model, x), expected)
    automap.undispatch(model)
    assert digest(store) == before and store.stat().st_uid == OTHER_UID, "the other user's store is untouched"


def _reachable_by_others(path: Path) -> list[tuple[Path, int]]:
    """Let another uid reach ``path`` (search permission on each folder above); returns the
    modes to restore."""
    changed = []
    for folder in [path, *path.parents]:
        mode = folder.stat().st_mode & 0o7777
        if not mode & 0o001:
            changed.append((folder, mode))
            folder.chmod(mode | 0o001)
    return changed


def test_a_process_of_another_user_makes_a_store_of_its_own(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    store = dispatched_once(shared)  # root's store, free
    shared.chmod(0o1777)  # a shared folder, like /tmp
    before = digest(store)
    changed = _reachable_by_others(shared)
    try:
        out_text = ok(
            run_python(
                f"""
            import os, sys, tempfile, torch, automap
            from test_store_faults import DISK, out, small
            model, x = small(), torch.randn(3, 64)
            expected = out(model, x)
            with tempfile.TemporaryDirectory() as warm:  # imports what a dispatch needs while root: this
                automap.dispatch(model, DISK, offload_dir=warm)  # Python's stdlib under /root is unreadable
                automap.undispatch(model)  # to the other user, its own Python would not be
            os.setgid({OTHER_UID}); os.setuid({OTHER_UID})
            automap.dispatch(model, DISK, offload_dir=sys.argv[1])
            assert torch.equal(out(model, x), expected)
            automap.undispatch(model)
            print("OK")
        """,
                str(shared),
            )
        )
    finally:
        for folder, mode in changed:
            folder.chmod(mode)
    assert "OK" in out_text
    stores = store_dirs(shared)
    assert len(stores) == 2 and {s.stat().st_uid for s in stores} == {0, OTHER_UID}
    assert digest(store) == before


def _chattr(flag: str, path: Path) -> None:
    if subprocess.run(["chattr", flag, str(path)], capture_output=True).returncode != 0:
        pytest.skip(f"chattr {flag} is not available on this file system")


def test_a_store_with_an_immutable_lock_file_is_passed_over(tmp_path):
    store = dispatched_once(tmp_path)
    _chattr("+i", store / LOCK)
    try:
        model, x = small(), torch.randn(3, 64)
        expected = out(model, x)
        automap.dispatch(model, DISK, offload_dir=tmp_path)
        assert torch.equal(out(model, x), expected)
        assert len(store_dirs(tmp_path)) == 2
        automap.undispatch(model)
    finally:
        subprocess.run(["chattr", "-i", str(store / LOCK)], check=True)


def test_an_immutable_store_folder_is_passed_over(tmp_path):
    store = dispatched_once(tmp_path)
    victim = sorted(store.glob("*.safetensors"))[0]
    os.truncate(victim, 100)  # damaged: it must be rewritten, and cannot be here
    before = digest(store)
    _chattr("+i", store)
    try:
        model, x = small(), torch.randn(3, 64)
        expected = out(model, x)
        automap.dispatch(model, DISK, offload_dir=tmp_path)
        assert torch.equal(out(model, x), expected)
        automap.undispatch(model)
    finally:
        subprocess.run(["chattr", "-i", str(store)], check=True)
    assert len(store_dirs(tmp_path)) == 2 and digest(store) == before


# ------------------------------------------------------------------ 3. full disk, no inodes


@pytest.fixture
def small_mount(tmp_path, request):
    """A tmpfs mounted with ``request.param`` as its options, unmounted after."""
    point = tmp_path / "mnt"
    point.mkdir()
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", request.param, "tmpfs", str(point)], capture_output=True, text=True
    )
    if result.returncode != 0:
        pytest.skip(
            f"cannot mount a tmpfs here ({result.stderr.strip()}); needs root in a namespace that allows it"
        )
    yield point
    subprocess.run(["umount", "-l", str(point)], check=True)


@pytest.mark.parametrize(
    "small_mount",
    ["nr_inodes=2", "nr_inodes=3", "nr_inodes=4", "nr_inodes=6", "size=4k", "size=20k"],
    indirect=True,
)
def test_a_full_disk_or_inode_table_is_an_offload_error_leaving_nothing(small_mount):
    model, x = small(), torch.randn(3, 64)
    expected = out(model, x)
    before = dict(model.state_dict(keep_vars=True))
    with pytest.raises(OffloadError, match=r"(?i)offload.*(free space there|free inodes).*offload_dir"):
        automap.dispatch(model, DISK, offload_dir=small_mount / "off")
    assert os.listdir(small_mount) == [], "no store, no lock, not even the offload_dir it created"
    assert state_of(model) is None and all(
        t is before[n] for n, t in model.state_dict(keep_vars=True).items()
    )
    assert torch.equal(out(model, x), expected)


@pytest.mark.parametrize("small_mount", ["nr_inodes=8"], indirect=True)
def test_no_inodes_for_a_second_store_leaves_the_first_intact(small_mount):
    first = small()
    automap.dispatch(first, DISK, offload_dir=small_mount)
    (store,) = store_dirs(small_mount)
    before = digest(store)
    second = small()
    with pytest.raises(OffloadError):
        automap.dispatch(second, DISK, offload_dir=small_mount)  # the first holds its store: needs a second
    assert store_dirs(small_mount) == [store] and {k: v for k, v in digest(store).items() if k != LOCK} == {
        k: v for k, v in before.items() if k != LOCK
    }
    x = torch.randn(3, 64)
    assert torch.equal(out(first, x), out(small(), x))
    automap.undispatch(first)


# ------------------------------------------------------------------ 4. no write follows a link


def test_a_store_named_link_to_a_users_folder_is_never_written(tmp_path):
    store = dispatched_once(tmp_path / "off")
    users = tmp_path / "users"
    users.mkdir()
    (users / LOCK).write_text("the user's notes, named like automap's lock")
    (users / MANIFEST).write_text("the user's")
    before = digest(users)
    name = store.name
    subprocess.run(["rm", "-rf", str(store)], check=True)
    (tmp_path / "off" / name).symlink_to(users, target_is_directory=True)
    model, x = small(), torch.randn(3, 64)
    expected = out(model, x)
    time.sleep(0.01)  # an mtime written now would differ
    automap.dispatch(model, DISK, offload_dir=tmp_path / "off")
    assert torch.equal(out(model, x), expected)
    automap.undispatch(model)
    assert digest(users) == before and sorted(os.listdir(users)) == [MANIFEST, LOCK]
    assert (tmp_path / "off" / name).is_symlink()


@pytest.mark.parametrize("link", ["symlink", "hard link"])
@pytest.mark.parametrize("name", [LOCK, MANIFEST])
def test_a_store_file_replaced_by_a_link_to_a_users_file_never_writes_it(tmp_path, link, name):
    store = dispatched_once(tmp_path / "off")
    precious = tmp_path / "precious.txt"
    precious.write_text("years of work")
    mtime = precious.stat().st_mtime_ns
    os.remove(store / name)
    if link == "symlink":
        (store / name).symlink_to(precious)
    else:
        os.link(precious, store / name)
    time.sleep(0.01)
    for _ in range(2):
        model, x = small(), torch.randn(3, 64)
        expected = out(model, x)
        automap.dispatch(model, DISK, offload_dir=tmp_path / "off")
        assert torch.equal(out(model, x), expected)
        automap.undispatch(model)
    assert precious.read_text() == "years of work" and precious.stat().st_mtime_ns == mtime


def test_a_link_named_like_a_unit_file_is_left_alone(tmp_path):
    precious = tmp_path / "precious.txt"
    precious.write_text("years of work")
    (tmp_path / "off").mkdir()
    store = dispatched_once(tmp_path / "off")
    os.remove(store / "1.safetensors")
    manifest = json.loads((store / MANIFEST).read_text())
    manifest["files"] = [f for f in manifest["files"] if f != "1.safetensors"]
    manifest["tensors"] = {k: v for k, v in manifest["tensors"].items() if v["file"] != "1.safetensors"}
    (store / MANIFEST).write_text(json.dumps(manifest))  # the store no longer owns that name
    (store / "1.safetensors").symlink_to(tmp_path / "dangling")
    (store / ".1.safetensors.123.tmp").symlink_to(precious)
    model, x = small(), torch.randn(3, 64)
    expected = out(model, x)
    automap.dispatch(model, DISK, offload_dir=tmp_path / "off")
    assert torch.equal(out(model, x), expected)
    assert (store / "1.safetensors").is_symlink() and (store / ".1.safetensors.123.tmp").is_symlink()
    assert precious.read_text() == "years of work"


# ------------------------------------------------------------------ 5. the lock is taken in one step

# The first process stops just before its first flock() (a profile hook on the call, in the
# process itself: nothing of automap's is replaced) until the second has dispatched.
_PAUSE_BEFORE_FLOCK = """
    import fcntl, sys, time, torch, automap
    from pathlib import Path
    from test_store_faults import DISK, out, small
    folder, paused, go = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    state = {"done": False}
    def hook(frame, event, arg):
        if event == "c_call" and arg is fcntl.flock and not state["done"]:
            state["done"] = True
            paused.write_text("")
            deadline = time.time() + 200
            while not go.exists() and time.time() < deadline:
                time.sleep(0.01)
    model, x = small(), torch.randn(3, 64)
    expected = out(model, x)
    sys.setprofile(hook)
    automap.dispatch(model, DISK, offload_dir=folder)
    sys.setprofile(None)
    assert state["done"], "the hook never ran"
    assert torch.equal(out(model, x), expected)
    print("OK")
"""

_HOLD = """
    import sys, time, torch, automap
    from pathlib import Path
    from test_store_faults import DISK, out, small
    folder, ready, done = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    model, x = small(), torch.randn(3, 64)
    expected = out(model, x)
    automap.dispatch(model, DISK, offload_dir=folder)
    ready.write_text("")
    deadline = time.time() + 200
    while not done.exists() and time.time() < deadline:
        time.sleep(0.01)
    assert torch.equal(out(model, x), expected)
    automap.undispatch(model)
    print("OK")
"""


def _wait_for(path: Path, proc: subprocess.Popen) -> None:
    deadline = time.time() + 200
    while not path.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    assert path.exists(), (proc.poll(), proc.stderr.read()[-3000:] if proc.poll() is not None else "timeout")


def test_a_store_being_created_is_never_taken_by_a_second_process(tmp_path):
    folder = tmp_path / "off"
    first = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(_PAUSE_BEFORE_FLOCK),
            str(folder),
            str(tmp_path / "paused"),
            str(tmp_path / "go"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env(),
    )
    second = None
    try:
        _wait_for(tmp_path / "paused", first)  # the first made its store folder and stopped before locking it
        second = subprocess.Popen(
            [
                sys.executable,
                "-c",
                textwrap.dedent(_HOLD),
                str(folder),
                str(tmp_path / "ready"),
                str(tmp_path / "done"),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env(),
        )
        _wait_for(tmp_path / "ready", second)  # the second dispatched and holds its store
        (tmp_path / "go").write_text("")
        first_out, first_err = first.communicate(timeout=300)
    finally:
        (tmp_path / "go").write_text("")
        (tmp_path / "done").write_text("")
        if second is not None:
            second_out, second_err = second.communicate(timeout=300)
        first.wait(timeout=300)
    assert first.returncode == 0 and "OK" in first_out, first_err[-3000:]
    assert second.returncode == 0 and "OK" in second_out, second_err[-3000:]
    assert len(store_dirs(folder)) == 2, "each process has a store of its own"


# ------------------------------------------------------------------ 6. what a crash leaves is cleaned


def test_kill_9_while_renaming_the_manifest_leaves_nothing_for_long(tmp_path):
    folder = tmp_path / "off"
    writer = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent("""
        import os, sys, time, torch, automap
        from pathlib import Path
        from test_store_faults import DISK, small
        folder, paused = Path(sys.argv[1]), Path(sys.argv[2])
        def hook(frame, event, arg):
            # just before a rename, with the manifest's temporary file written: stop there
            renaming = event == "c_call" and arg in (os.replace, os.rename)
            if renaming and list(folder.glob("*/.automap-store.json.*.tmp")):
                paused.write_text("")
                time.sleep(600)
        sys.setprofile(hook)
        automap.dispatch(small(), DISK, offload_dir=folder)
    """),
            str(folder),
            str(tmp_path / "paused"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env(),
    )
    try:
        _wait_for(tmp_path / "paused", writer)
        os.kill(writer.pid, signal.SIGKILL)
    finally:
        writer.wait(timeout=60)
    assert writer.returncode == -signal.SIGKILL
    (store,) = store_dirs(folder)
    assert list(store.glob(".automap-store.json.*.tmp")), "killed with the manifest's temporary file in place"
    model, x = small(), torch.randn(3, 64)
    expected = out(model, x)
    automap.dispatch(model, DISK, offload_dir=folder)
    assert store_dirs(folder) == [store], "the killed writer's store is taken over"
    assert not [p.name for p in store.iterdir() if p.name.startswith(".")], "and its temporary files are gone"
    assert torch.equal(out(model, x), expected)


def test_a_forked_child_alive_at_undispatch_does_not_hold_the_store(tmp_path):
    ok(
        run_python(
            """
        import os, sys, time, torch, automap
        from pathlib import Path
        from conftest import store_dirs
        from test_store_faults import DISK, out, small
        folder = Path(sys.argv[1])
        model, x = small(), torch.randn(3, 64)
        expected = out(model, x)
        automap.dispatch(model, DISK, offload_dir=folder)
        child = os.fork()
        if child == 0:
            time.sleep(30)  # a worker that outlives the parent's undispatch
            os._exit(0)
        try:
            automap.undispatch(model)
            (store,) = store_dirs(folder)
            stamps = {p.name: p.stat().st_mtime_ns for p in store.glob("*.safetensors")}
            again = small()
            automap.dispatch(again, DISK, offload_dir=folder)
            assert store_dirs(folder) == [store], "the store is free again: no second copy"
            assert {p.name: p.stat().st_mtime_ns for p in store.glob("*.safetensors")} == stamps, "nothing rewritten"
            assert torch.equal(out(again, x), expected)
        finally:
            os.kill(child, 9)
            os.waitpid(child, 0)
        print("OK")
    """,
            str(tmp_path / "off"),
        )
    )


# ------------------------------------------------------------------ 7. clear messages


def test_a_dangling_link_as_offload_dir_says_so(tmp_path):
    (tmp_path / "off").symlink_to(tmp_path / "gone")
    model = small()
    with pytest.raises(
        OffloadError, match=r"off is a symbolic link to .*gone, which does not exist; create that"
    ):
        automap.dispatch(model, DISK, offload_dir=tmp_path / "off")
    assert state_of(model) is None and not (tmp_path / "gone").exists()


@pytest.mark.parametrize("how", ["map", "max_memory"])
def test_an_offload_dir_under_proc_says_so(how):
    model = small()
    with pytest.raises(
        OffloadError,
        match=r"/proc/nope is on proc, a kernel interface that stores no files; pass a "
        r"directory on a disk",
    ):
        if how == "map":
            automap.dispatch(model, DISK, offload_dir="/proc/nope")
        else:
            automap.dispatch(model, max_memory={"cpu": "20KB"}, offload_dir="/proc/nope")
    assert state_of(model) is None


class LongNames(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.add_module("a" * 300, nn.Linear(8, 8))
        self.add_module("b" * 300, nn.Linear(8, 8))

    def forward(self, x):
        return getattr(self, "b" * 300)(getattr(self, "a" * 300)(x))


def test_a_unit_name_of_300_characters_is_stored(tmp_path):
    model, x = LongNames().eval(), torch.randn(2, 8)
    expected = out(model, x)
    automap.dispatch(model, {"a" * 300: "disk", "b" * 300: "disk"}, offload_dir=tmp_path)
    assert torch.equal(out(model, x), expected)
    (store,) = store_dirs(tmp_path)
    assert all(len(p.name) < 160 for p in store.iterdir())
    automap.undispatch(model)
    automap.dispatch(model, {"a" * 300: "disk", "b" * 300: "disk"}, offload_dir=tmp_path)
    assert store_dirs(tmp_path) == [store] and torch.equal(out(model, x), expected)


def test_too_few_file_descriptors_is_an_offload_error_naming_the_limit(tmp_path):
    # A real limit (RLIMIT_NOFILE), in a subprocess: the store cannot open its files.
    out_text = ok(
        run_python(
            """
        import os, resource, sys, tempfile, torch, automap
        from test_store_faults import DISK, out, small
        model, x = small(), torch.randn(3, 64)
        expected = out(model, x)
        with tempfile.TemporaryDirectory() as warm:  # the code a dispatch runs is imported first
            automap.dispatch(model, DISK, offload_dir=warm)
            automap.undispatch(model)
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 1, hard))
        try:
            automap.dispatch(model, DISK, offload_dir=sys.argv[1])
        except automap.OffloadError as exc:
            assert "ulimit -n" in str(exc), exc
        else:
            raise SystemExit("dispatched with one file descriptor to spare")
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        assert torch.equal(out(model, x), expected)  # the model is as it was
        print("OK")
    """,
            str(tmp_path / "off"),
        )
    )
    assert "OK" in out_text
    assert not (tmp_path / "off").exists() or not any((tmp_path / "off").iterdir())
