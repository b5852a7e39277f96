"""An adversary against the offload store and in-place checkpoint reading, with real mechanisms
(``fork``, links, small tmpfs mounts, ``RLIMIT_FSIZE``): what a user or another process does to
automap's files, or to their own, never loses a byte of theirs, never hangs or crashes the
process, and ends in the right weights or an ``AutomapError`` naming the fix. Every case that
could hang or crash runs in a fresh interpreter with a timeout."""

from __future__ import annotations

import copy
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import safetensors.torch
import torch
from torch import nn

import automap
from automap.errors import OffloadError
from automap.offload import MANIFEST
from conftest import store_dirs

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent

# A three-layer net with two layers offloaded to disk, shared by the subprocess cases.
NET = """
import copy, os, sys, torch, automap
from torch import nn
torch.manual_seed(0)

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 8)
    def forward(self, x):
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))

DISK = {"a": "cpu", "b": "disk", "c": "disk"}
plain = Net().eval()
model = copy.deepcopy(plain)
x = torch.randn(2, 64)
"""


def run_python(code: str, *args: str, timeout: int = 60) -> subprocess.CompletedProcess:
    """Run ``NET`` then ``code`` in a fresh interpreter; a hang fails the test at ``timeout``,
    and the interpreter and every process it forked are killed then."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(TESTS)])}
    proc = subprocess.Popen(
        [sys.executable, "-c", NET + textwrap.dedent(code), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        err += f"\nkilled after {timeout} s: it hung"
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def ok(result: subprocess.CompletedProcess) -> str:
    detail = (
        f"exit {result.returncode} (a negative code is the signal that killed it)\n{result.stderr[-3000:]}"
    )
    assert result.returncode == 0 and "OK" in result.stdout, detail
    return result.stdout


# ------------------------------------------------------------------ fork


def test_a_dispatched_model_runs_in_forked_dataloader_workers_and_leaves_the_parents_store(tmp_path):
    # The parent's prefetch pool believes its idle threads still run in the child: a forward
    # there queued its prefetch, which no thread ever ran, and waited for it for ever.
    ok(
        run_python(
            """
        off = sys.argv[1]
        automap.dispatch(model, DISK, offload_dir=off)
        with torch.no_grad():
            want = plain(x)
            for _ in range(3):  # prefetches done: the pool counts its threads idle
                assert torch.equal(model(x), want)

        class Forwards(torch.utils.data.Dataset):
            def __len__(self):
                return 4
            def __getitem__(self, i):
                with torch.no_grad():
                    return model(x)

        loader = torch.utils.data.DataLoader(Forwards(), batch_size=None, num_workers=2,
                                             multiprocessing_context="fork")
        assert all(torch.equal(out, want) for out in loader)
        before = sorted(os.listdir(off))
        pid = os.fork()
        if pid == 0:  # a child that undispatches its copy and exits through atexit
            automap.undispatch(model)
            sys.exit(0)
        assert os.waitpid(pid, 0)[1] == 0
        assert sorted(os.listdir(off)) == before
        with torch.no_grad():
            assert torch.equal(model(x), want)
        automap.undispatch(model)
        assert torch.equal(model(x), plain(x))
        print("OK")
    """,
            str(tmp_path / "off"),
            timeout=30,
        )
    )


def test_a_fork_while_a_prefetch_holds_the_transfers_lock_leaves_the_child_working(tmp_path):
    # A thread of the parent inside Transfer.prefetch holds its lock at the fork; the child
    # inherits the lock held by a thread it does not have. Held here by the parent itself.
    ok(
        run_python(
            """
        from automap.runtime import state_of
        automap.dispatch(model, DISK, offload_dir=sys.argv[1])
        with torch.no_grad():
            want = plain(x)
            assert torch.equal(model(x), want)
        state_of(model).transfer._state.acquire()
        pid = os.fork()
        if pid == 0:
            torch.set_num_threads(1)  # as a DataLoader worker: torch's OpenMP pool is the parent's
            with torch.no_grad():
                same = torch.equal(model(x), want)
            automap.undispatch(model)
            os._exit(0 if same and torch.equal(model(x), want) else 3)
        assert os.waitpid(pid, 0)[1] == 0
        state_of(model).transfer._state.release()
        with torch.no_grad():
            assert torch.equal(model(x), want)
        print("OK")
    """,
            str(tmp_path / "off"),
            timeout=30,
        )
    )


# ------------------------------------------------------------------ what is put into a store


def _net() -> nn.Sequential:
    return nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)).eval()


def _net_and_copy():
    torch.manual_seed(0)
    plain = _net()
    return plain, copy.deepcopy(plain)


_DISK = {"0": "cpu", "1": "cpu", "2": "disk", "3": "cpu", "4": "disk"}


def _round_trip(off: Path) -> None:
    """Dispatch a fresh copy into ``off``: same outputs, then undispatch."""
    plain, model = _net_and_copy()
    x = torch.randn(3, 16)
    automap.dispatch(model, _DISK, offload_dir=off)
    assert torch.equal(model(x), plain(x))
    automap.undispatch(model)


@pytest.mark.parametrize("name", ["2.safetensors", MANIFEST])
def test_a_folder_put_in_place_of_a_store_file_is_left_alone_and_dispatch_still_works(tmp_path, name):
    # A rename onto a folder fails: every later dispatch into this offload_dir failed with
    # "writing the offload store failed (Is a directory) ... Free space there".
    off = tmp_path / "off"
    _round_trip(off)
    (store,) = store_dirs(off)
    (store / name).unlink()
    (store / name).mkdir()
    (store / name / "mine.txt").write_text("the user's")
    for _ in range(2):
        _round_trip(off)
    assert (store / name / "mine.txt").read_text() == "the user's"


def test_a_folder_named_like_a_store_holding_a_users_file_named_like_its_manifest_is_left_alone(tmp_path):
    # A store folder without a lock file is taken over only when a crash left it: then its
    # manifest is automap's JSON (written whole, then renamed). A user's file of that name in
    # a folder of that name was deleted, and the folder used as a store.
    off = tmp_path / "off"
    _round_trip(off)
    (store,) = store_dirs(off)
    shutil.rmtree(store)
    store.mkdir()
    (store / MANIFEST).write_text("the user's notes")
    _round_trip(off)
    assert os.listdir(store) == [MANIFEST] and (store / MANIFEST).read_text() == "the user's notes"
    assert len(store_dirs(off)) == 2, "the dispatch made a store of its own beside it"


# ------------------------------------------------------------------ a checkpoint read in place, changed


def _rewrite_in_place(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """Write a safetensors file into the same inode (what ``save_file`` does not: it makes a new one)."""
    data = safetensors.torch.save(tensors)
    with open(path, "r+b") as f:
        f.write(data)
        f.truncate(len(data))


@pytest.mark.parametrize("mapped_layout", ["same", "other"])
def test_a_checkpoint_rewritten_in_place_after_its_folder_moved_is_judged_by_its_own_header(
    tmp_path, mapped_layout
):
    # The layout check read the header of whatever the old name held: a same-layout file put
    # there made a mapped file rewritten with another layout pass, and the model silently ran
    # on shifted bytes; a file of another layout there refused a mapped file that was fine.
    plain, other = _net_and_copy()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1)
    weights = {k: v.contiguous() for k, v in plain.state_dict().items()}
    new = {k: v.contiguous() for k, v in other.state_dict().items()}
    (tmp_path / "ck").mkdir()
    safetensors.torch.save_file(weights, tmp_path / "ck" / "model.safetensors")
    with automap.empty_model():
        model = _net()
    automap.load(model, tmp_path / "ck" / "model.safetensors", device_map=_DISK)
    os.rename(tmp_path / "ck", tmp_path / "ck.old")
    (tmp_path / "ck").mkdir()
    shifted = {"first": torch.ones(100), **new}
    at_name, mapped = (shifted, new) if mapped_layout == "same" else (weights, shifted)
    safetensors.torch.save_file(at_name, tmp_path / "ck" / "model.safetensors")
    _rewrite_in_place(mapped, tmp_path / "ck.old" / "model.safetensors")
    x = torch.randn(3, 16)
    if mapped_layout == "other":
        with pytest.raises(OffloadError, match="rewritten with another layout"):
            model(x)
        return
    for name in ("0", "1", "3"):  # the units in memory were read at load: the plain model's
        setattr(other, name, getattr(plain, name))
    assert torch.equal(model(x), other(x))


# ------------------------------------------------------------------ torch's API on offloaded weights


def test_share_memory_of_offloaded_weights_is_refused_and_changes_nothing(tmp_path):
    # It went through: the offloaded weights were copied into shared memory (RAM), while the
    # report went on saying they were read from their files in place.
    plain, model = _net_and_copy()
    automap.dispatch(model, _DISK, offload_dir=tmp_path / "off")
    with pytest.raises(automap.ConversionError, match=r"'2\.weight' into shared memory .*map them to 'cpu'"):
        model.share_memory()
    assert not any(t.is_shared() for t in model.state_dict().values())
    assert "read from files in place" in automap.placement(model).report()
    model[0].share_memory()  # a resident unit may be shared
    x = torch.randn(3, 16)
    assert torch.equal(model(x), plain(x))
    automap.undispatch(model)


# ------------------------------------------------------------------ limits


def test_a_file_size_limit_while_loading_names_the_limit_and_leaves_nothing(tmp_path):
    # RLIMIT_FSIZE (EFBIG) was told to "free space there", which does not help.
    out = ok(
        run_python(
            """
        import resource, signal
        from safetensors.torch import save_model
        save_model(plain, sys.argv[1])
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (600, 600))  # the manifest fits, a unit's file does not
        with automap.empty_model():
            skeleton = Net().eval()
        before = {n: (t.device, t.dtype) for n, t in skeleton.state_dict().items()}
        try:  # float16: the checkpoint's float32 weights cannot be read in place, they are written
            automap.load(skeleton, sys.argv[1], device_map=DISK, offload_dir=sys.argv[2], dtype=torch.float16)
        except automap.OffloadError as exc:
            print("OK", exc)
        assert automap.runtime.state_of(skeleton) is None
        assert {n: (t.device, t.dtype) for n, t in skeleton.state_dict().items()} == before
    """,
            str(tmp_path / "m.safetensors"),
            str(tmp_path / "off"),
        )
    )
    assert "File too large" in out and "ulimit -f" in out, out
    assert not (tmp_path / "off").exists()


def test_no_file_descriptors_left_fails_dispatch_naming_the_limit_and_leaves_nothing(tmp_path):
    # RLIMIT_NOFILE a few descriptors above what is open: some step of writing or mapping the
    # store cannot open its file, wherever that falls.
    out = ok(
        run_python(
            """
        import resource
        off = sys.argv[1]
        os.makedirs(off)
        with open(os.path.join(off, "mine.txt"), "w") as f:
            f.write("keep")
        want = plain(x)
        open_now = len(os.listdir("/proc/self/fd"))
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        for extra in (2, 4, 6, 8):
            resource.setrlimit(resource.RLIMIT_NOFILE, (open_now + extra, hard))
            try:
                automap.dispatch(model, DISK, offload_dir=off)
            except automap.AutomapError as exc:
                assert "ulimit -n" in str(exc), exc
                assert sorted(os.listdir(off)) == ["mine.txt"], os.listdir(off)  # nothing half-written
                print("refused", extra)
            else:
                automap.undispatch(model)
            finally:
                resource.setrlimit(resource.RLIMIT_NOFILE, (4096, hard))
            assert torch.equal(model(x), want)
        assert open(os.path.join(off, "mine.txt")).read() == "keep"
        print("OK")
    """,
            str(tmp_path / "off"),
        )
    )
    assert "refused" in out
