"""Files automap maps, truncated or written by another process while a model reads them: the
read lease (automap/offload/lease.py) makes the writer wait while the tensors' bytes are copied
into memory, so nothing ever crashes (SIGBUS); every read gives the right values or an
``OffloadError`` naming the file. A file that cannot be leased is checked before reads, as
before. Real processes truncate real files; the model runs in a fresh interpreter each time, so a
crash shows as a failed test."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from automap.offload import CheckpointSource, MappedFile

ROOT = Path(__file__).resolve().parents[2]


def _run(code: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)])}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def _truncate_elsewhere(path: Path, size: int = 0) -> None:
    """Another process cuts ``path`` to ``size`` bytes (it waits while this one holds a lease)."""
    subprocess.run(
        [
            sys.executable,
            "-c",
            "import os, sys; os.truncate(sys.argv[1], int(sys.argv[2]))",
            str(path),
            str(size),
        ],
        check=True,
        timeout=60,
    )


# The model: four layers, three of them on "disk" (a store automap writes, or the checkpoint read
# in place); another process cuts every mapped file to nothing and leaves it so.
KEPT_SHORT = """
    import glob, os, subprocess, sys, torch
    from torch import nn
    from safetensors.torch import save_file
    import automap
    from automap.errors import OffloadError
    from automap.runtime import state_of

    folder, kind = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    real = nn.Sequential(*[nn.Linear(128, 128) for _ in range(4)]).eval()
    where = {"0": "disk", "1": "disk", "2": "disk", "3": "cpu"}
    if kind == "checkpoint":
        ck = os.path.join(folder, "model.safetensors")
        save_file({k: v.contiguous() for k, v in real.state_dict().items()}, ck)
        with automap.empty_model():
            model = nn.Sequential(*[nn.Linear(128, 128) for _ in range(4)]).eval()
        automap.load(model, ck, where, quiet=True)
    else:
        model = nn.Sequential(*[nn.Linear(128, 128) for _ in range(4)]).eval()
        model.load_state_dict(real.state_dict())
        automap.dispatch(model, where, offload_dir=os.path.join(folder, "off"))
    files = [m for s in getattr(state_of(model).source, "sources", [state_of(model).source])
             for m in getattr(s, "files", {}).values()]
    assert files and all(m.unleased is None for m in files), [(m.path, m.unleased) for m in files]
    x = torch.randn(4, 128)
    expected, weight = real(x), real[1].weight.detach().clone()
    for mapped in files:
        subprocess.run([sys.executable, "-c", "import os, sys; os.truncate(sys.argv[1], 0)", str(mapped.path)],
                       check=True, timeout=60)
        assert os.path.getsize(mapped.path) == 0 and mapped.detached is not None
    outcomes = []
    for what, call, right in [
            ("forward", lambda: model(x), lambda out: torch.equal(out, expected)),
            ("param.sum()", lambda: model[1].weight.sum(), lambda out: torch.equal(out, weight.sum())),
            ("state_dict()", lambda: model.state_dict(), lambda out: torch.equal(out["1.weight"], weight))]:
        for _ in range(3):
            try:
                assert right(call()), f"{what}: wrong values"
                outcomes.append(what + " right")
            except OffloadError as exc:
                assert any(str(m.path) in str(exc) for m in files), exc
                outcomes.append(what + " refused")
    assert torch.equal(model[1].weight, weight)
    print("OK", sorted(set(outcomes)))
"""


@pytest.mark.parametrize("kind", ["store", "checkpoint"])
def test_a_mapped_file_truncated_and_kept_short_never_crashes(tmp_path, kind):
    result = _run(KEPT_SHORT, str(tmp_path), kind)
    assert result.returncode == 0 and "OK" in result.stdout, (result.returncode, result.stderr[-3000:])
    # The forward is refused (the file is not what was mapped); a read outside one gets the bytes.
    assert "forward refused" in result.stdout and "param.sum() right" in result.stdout, result.stdout


def _checkpoint(path: Path, seed: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    tensors = {"a": torch.randn(300, 257), "b": torch.randn(1000), "c": torch.randn(64, 64)}
    save_file(tensors, path)
    return tensors


def test_a_writer_waits_while_the_tensors_are_copied_and_the_file_is_read_again_once_restored(tmp_path):
    path = tmp_path / "m.safetensors"
    tensors = _checkpoint(path)
    data = path.read_bytes()
    source = CheckpointSource({k: (path, k) for k in tensors})
    mapped = source.files[path]
    assert mapped.unleased is None and mapped.detached is None
    _truncate_elsewhere(path, len(data) // 3)
    assert mapped.detached == 0 and all(torch.equal(source.get(k), v) for k, v in tensors.items())
    with pytest.raises(Exception, match="is truncated"):
        source.check_unchanged(tensors)
    # Restored with other bytes of the same layout: a checkpoint read in place uses its new contents.
    changed = _checkpoint(tmp_path / "other.safetensors", seed=1)
    with open(path, "r+b") as out:
        out.write((tmp_path / "other.safetensors").read_bytes())
    assert mapped.detached == 0  # broken by the open for writing above, already copied: nothing more
    source.check_unchanged(tensors)
    assert mapped.detached is None and mapped.unleased is None
    assert all(torch.equal(source.get(k), v) for k, v in changed.items())
    _truncate_elsewhere(path)  # leased again: the next writer waits again
    assert all(torch.equal(source.get(k), v) for k, v in changed.items())


def _saved(path: Path, tensors: dict[str, torch.Tensor]) -> bytes:
    save_file(tensors, path)
    return path.read_bytes()


def test_a_file_written_in_memory_is_not_mapped_again_after_a_writer(tmp_path):
    path = tmp_path / "m.safetensors"
    tensors = _checkpoint(path)
    source = CheckpointSource({k: (path, k) for k in tensors})
    source.get("b")[:] = 7.0  # the user's write, in memory (copy-on-write)
    _truncate_elsewhere(path)
    assert torch.equal(source.get("b"), torch.full((1000,), 7.0)) and torch.equal(
        source.get("a"), tensors["a"]
    )
    with open(path, "r+b") as out:  # restored in place, but the writes in memory cannot be merged with it
        out.write(_saved(path.parent / "copy.safetensors", tensors))
    with pytest.raises(Exception, match=r"m\.safetensors changed.*written in memory"):
        source.check_unchanged(["a"])
    assert torch.equal(source.get("b"), torch.full((1000,), 7.0))


HELD_FOR_WRITING = """
    import os, subprocess, sys, time, torch
    from torch import nn
    from safetensors.torch import save_file
    import automap
    from automap.errors import OffloadError
    from automap.runtime import state_of

    folder = sys.argv[1]
    torch.manual_seed(0)
    real = nn.Sequential(*[nn.Linear(128, 128) for _ in range(2)]).eval()
    ck = os.path.join(folder, "model.safetensors")
    save_file({k: v.contiguous() for k, v in real.state_dict().items()}, ck)
    holder = subprocess.Popen([sys.executable, "-c", "import os, sys; fd = os.open(sys.argv[1], os.O_WRONLY); "
                               "print(flush=True); sys.stdin.read()", ck], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    holder.stdout.readline()  # it holds the file open for writing: no read lease can be taken
    with automap.empty_model():
        model = nn.Sequential(*[nn.Linear(128, 128) for _ in range(2)]).eval()
    automap.load(model, ck, {"0": "disk", "1": "cpu"}, quiet=True)
    (mapped,) = state_of(model).source.files.values()
    assert mapped.unleased and "lease" in mapped.unleased, mapped.unleased
    x = torch.randn(2, 128)
    assert torch.equal(model(x), real(x))
    os.truncate(ck, 0)  # unleased: it is not waited for, and the check refuses the file before a read
    try:
        model(x)
        raise AssertionError("a truncated file was read")
    except OffloadError as exc:
        assert "is truncated" in str(exc) and ck in str(exc), exc
    holder.communicate(b"")
    print("OK")
"""


def test_a_file_that_cannot_be_leased_is_checked_before_reads_as_before(tmp_path):
    result = _run(HELD_FOR_WRITING, str(tmp_path))
    assert result.returncode == 0 and "OK" in result.stdout, (result.returncode, result.stderr[-3000:])


FORKED = """
    import os, subprocess, sys, torch
    from safetensors.torch import save_file
    from automap.offload import MappedFile

    folder = sys.argv[1]
    first, second = os.path.join(folder, "a.safetensors"), os.path.join(folder, "b.safetensors")
    for path in (first, second):
        save_file({"w": torch.arange(100000, dtype=torch.float32)}, path)
    parent = MappedFile(first)  # the lease thread starts in the parent
    pid = os.fork()
    if pid == 0:  # the child has no lease thread: a file it maps starts its own
        child = MappedFile(second)
        ok = child.unleased is None
        subprocess.run([sys.executable, "-c", "import os, sys; os.truncate(sys.argv[1], 0)", second], check=True)
        # numpy, not torch: torch's thread pool is not usable in a forked child
        ok = ok and child.detached == 0 and child.tensor("w").numpy().sum(dtype="float64") == sum(range(100000))
        os._exit(0 if ok else 1)
    assert os.waitpid(pid, 0)[1] == 0, "the child failed"
    subprocess.run([sys.executable, "-c", "import os, sys; os.truncate(sys.argv[1], 0)", first], check=True)
    assert parent.detached == 0 and parent.tensor("w").numpy().sum(dtype="float64") == sum(range(100000))
    print("OK")
"""


def test_a_forked_child_leases_the_files_it_maps_itself(tmp_path):
    result = _run(FORKED, str(tmp_path))
    assert result.returncode == 0 and "OK" in result.stdout, (result.returncode, result.stderr[-3000:])


LOCK_LEFT_TAKEN = """
    import os, sys, torch
    from safetensors.torch import save_file
    from automap.offload import MappedFile, lease

    folder = sys.argv[1]
    first, second = os.path.join(folder, "a.safetensors"), os.path.join(folder, "b.safetensors")
    for path in (first, second):
        save_file({"w": torch.arange(1000, dtype=torch.float32)}, path)
    MappedFile(first)  # the lease thread starts
    lease._watcher_lock.acquire()  # as an interrupt between taking and giving back could leave it
    print("OK" if MappedFile(second).unleased is None else "no lease")
"""


def test_a_lease_is_taken_even_with_the_lease_threads_lock_left_taken(tmp_path):
    """Once the lease thread runs, taking a lease does not wait on the lock that guards its start."""
    result = _run(LOCK_LEFT_TAKEN, str(tmp_path))
    assert result.returncode == 0 and "OK" in result.stdout, (result.returncode, result.stderr[-3000:])


def test_an_empty_mapped_file_needs_no_lease(tmp_path):
    save_file({"e": torch.empty(0)}, tmp_path / "e.safetensors")
    mapped = MappedFile(tmp_path / "e.safetensors")
    assert mapped.tensor("e").numel() == 0 and mapped.detached is None


# Random files, random writes in memory, random truncation points, restored with random bytes of
# the same layout: every tensor always reads what the process saw when the writer came, and once
# restored, the file again (or, with writes in memory, an error naming the file).
RANDOM_WRITERS = """
    import os, random, sys, torch
    from safetensors.torch import save_file
    from automap.errors import OffloadError
    from automap.offload import CheckpointSource

    folder, rng = sys.argv[1], random.Random(int(sys.argv[2]))
    for case in range(25):
        shapes = {f"t{i}": [rng.choice([0, 1, 3, 700, 5000])] + [rng.randint(1, 9)] * rng.randint(0, 2)
                  for i in range(rng.randint(1, 5))}
        dtype = rng.choice([torch.float32, torch.float16, torch.int8])
        made = lambda: {k: torch.randint(-100, 100, s).to(dtype) for k, s in shapes.items()}
        path, other = os.path.join(folder, f"{case}.safetensors"), os.path.join(folder, f"{case}.new")
        save_file(made(), path)
        save_file(made(), other)
        source = CheckpointSource({k: (path, k) for k in shapes})
        (mapped,) = source.files.values()
        assert mapped.unleased is None, mapped.unleased
        written = rng.random() < 0.3 and any(t.numel() for t in map(source.get, shapes))
        if written:
            next(t for t in map(source.get, shapes) if t.numel()).fill_(7)
        seen = {k: source.get(k).clone() for k in shapes}
        os.truncate(path, rng.randint(0, os.path.getsize(path)))  # this thread waits for the copy
        assert mapped.detached is not None and all(torch.equal(source.get(k), seen[k]) for k in shapes)
        with open(path, "r+b") as out:
            out.write(open(other, "rb").read())
        # a change the signature is sure to see, whatever the file system's timestamp granularity
        os.utime(path, ns=(mapped.signature[3] + 10**6, mapped.signature[3] + 10**6))
        try:
            source.check_unchanged(list(shapes))
            assert not written and mapped.detached is None, "accepted with writes in memory"
            new = CheckpointSource({k: (other, k) for k in shapes})
            assert all(torch.equal(source.get(k), new.get(k)) for k in shapes), "not the file's new bytes"
        except OffloadError as exc:
            assert written and path in str(exc), exc
            assert all(torch.equal(source.get(k), seen[k]) for k in shapes)
    print("OK")
"""


@pytest.mark.parametrize("seed", [0, 1])
def test_random_files_truncated_and_restored_read_what_was_seen_or_the_new_file(tmp_path, seed):
    result = _run(RANDOM_WRITERS, str(tmp_path), str(seed))
    assert result.returncode == 0 and "OK" in result.stdout, (result.returncode, result.stderr[-3000:])
