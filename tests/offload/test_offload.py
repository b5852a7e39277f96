"""The offload store, checkpoint sources and transfers: what is written (only inside a store
directory automap owns), what is reused, what is refused, that reads are zero-copy
copy-on-write views, and that the transfer hands them out one unit ahead."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch
from safetensors.torch import save_file

import automap
from automap.errors import OffloadError
from automap.offload import (
    LOCK,
    MANIFEST,
    CheckpointSource,
    HostCopyOps,
    MappedFile,
    OffloadStore,
    PageTransfer,
    StagedTransfer,
    TensorSpec,
)
from conftest import file_backing, store_dirs


def _tensors() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {
        "a.weight": torch.randn(64, 32),
        "a.bias": torch.randn(64),
        "b.weight": torch.randn(16, 64).half(),
        "b.count": torch.arange(5),
    }


def _write(root, tensors=None) -> OffloadStore:
    tensors = tensors or _tensors()
    specs = {n: TensorSpec(n.split(".")[0], t.dtype, tuple(t.shape)) for n, t in tensors.items()}
    return OffloadStore.write(root, specs, tensors.__getitem__)


def _manifest(store: OffloadStore) -> dict:
    return json.loads((store.directory / MANIFEST).read_text())


def test_round_trip_is_exact_and_zero_copy(tmp_path):
    tensors = _tensors()
    store = _write(tmp_path, tensors)
    for name, tensor in tensors.items():
        got = store.get(name)
        assert got.dtype == tensor.dtype and torch.equal(got, tensor), name
    assert store.get("a.weight").data_ptr() == store.get("a.weight").data_ptr(), "reads are views, not copies"
    assert file_backing(store.get("a.weight")) == store.directory / "a.safetensors"
    store.verify()
    assert store_dirs(tmp_path) == [store.directory], "everything lives in one directory automap made"
    assert sorted(os.listdir(store.directory)) == sorted(["a.safetensors", "b.safetensors", MANIFEST, LOCK])


def test_each_tensor_has_a_storage_of_its_own(tmp_path):
    """So torch.save writes each tensor's bytes once, and tensors of other dtypes in one file
    never share a storage (torch.save refuses that)."""
    store = _write(tmp_path)
    a, b = store.get("b.weight"), store.get("b.count")
    assert a.untyped_storage().nbytes() == a.numel() * 2 and b.untyped_storage().nbytes() == b.numel() * 8
    torch.save({"w": a, "c": b}, tmp_path / "saved.pt")
    again = torch.load(tmp_path / "saved.pt")
    assert torch.equal(again["w"], a) and torch.equal(again["c"], b)


def test_manifest_records_dtype_shape_size_checksum(tmp_path):
    store = _write(tmp_path)
    manifest = _manifest(store)
    assert manifest["complete"] is True and manifest["format"] == "automap-offload-store"
    entry = manifest["tensors"]["b.weight"]
    assert entry["dtype"] == "F16" and entry["shape"] == [16, 64] and entry["nbytes"] == 16 * 64 * 2
    assert isinstance(entry["crc32"], int)


def test_matching_store_is_reused_not_rewritten(tmp_path):
    store = _write(tmp_path)
    directory = store.directory
    before = {f: os.stat(directory / f).st_mtime_ns for f in ("a.safetensors", "b.safetensors")}
    store.close()
    time.sleep(0.01)
    changed = _tensors()
    changed["b.weight"] = changed["b.weight"] + 1
    again = _write(tmp_path, changed)
    assert again.directory == directory, "a free store of the same tensors is reused"
    assert os.stat(directory / "a.safetensors").st_mtime_ns == before["a.safetensors"]
    assert os.stat(directory / "b.safetensors").st_mtime_ns != before["b.safetensors"]
    assert torch.equal(again.get("b.weight"), changed["b.weight"])


def test_a_store_in_use_is_never_touched_a_second_gets_its_own(tmp_path):
    first = _write(tmp_path)
    stamp = {f: os.stat(first.directory / f).st_mtime_ns for f in os.listdir(first.directory) if f != LOCK}
    changed = _tensors()
    changed["a.weight"] = changed["a.weight"] * 2
    second = _write(tmp_path, changed)
    assert second.directory != first.directory and len(store_dirs(tmp_path)) == 2
    assert {f: os.stat(first.directory / f).st_mtime_ns for f in stamp} == stamp
    assert torch.equal(first.get("a.weight"), _tensors()["a.weight"])
    assert torch.equal(second.get("a.weight"), changed["a.weight"])


def test_unwritable_directory_is_refused(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(OffloadError, match=r"file/sub is not writable.*writable directory"):
        _write(blocker / "sub")
    assert blocker.read_text() == "x"


def test_truncated_file_is_refused_when_mapped(tmp_path):
    store = _write(tmp_path)
    path = store.directory / "a.safetensors"
    os.truncate(path, path.stat().st_size - 100)
    with pytest.raises(OffloadError, match=r"a.safetensors is truncated: \d+ bytes, its header needs \d+"):
        MappedFile(path)


@pytest.mark.parametrize(
    "damage",
    [
        "not json",
        "{}",
        '{"format": "other"}',
        "[1, 2]",
        '{"format": "automap-offload-store", "version": 1, "complete": true}',
    ],
)
def test_a_damaged_or_foreign_manifest_means_rebuild(tmp_path, damage):
    store = _write(tmp_path)
    store.close()
    (store.directory / MANIFEST).write_text(damage)
    again = _write(tmp_path)
    assert again.directory == store.directory
    assert torch.equal(again.get("a.bias"), _tensors()["a.bias"])
    assert _manifest(again)["complete"] is True


def test_changed_bytes_fail_checksum(tmp_path):
    store = _write(tmp_path)
    path = store.directory / "a.safetensors"
    data = bytearray(path.read_bytes())
    data[-4:] = b"\x00\x00\x80\x7f"
    path.write_bytes(bytes(data))
    with pytest.raises(
        OffloadError, match=r"'a\.(weight|bias)' in .*a.safetensors does not match its checksum"
    ):
        store.check_unchanged(["a.weight"])


def test_change_after_mapping_is_detected_and_a_restored_file_accepted(tmp_path):
    store = _write(tmp_path)
    store.check_unchanged(["a.weight"])
    path = store.directory / "a.safetensors"
    good = path.read_bytes()
    os.truncate(path, 200)
    with pytest.raises(OffloadError, match="a.safetensors is truncated"):
        store.check_unchanged(["a.weight"])
    with pytest.raises(OffloadError, match="truncated"):  # still refused on the next try
        store.check_unchanged(["a.weight"])
    path.write_bytes(good)
    store.check_unchanged(["a.weight"])
    assert torch.equal(store.get("a.weight"), _tensors()["a.weight"])


def test_a_deleted_file_still_holds_its_bytes_through_the_map(tmp_path):
    store = _write(tmp_path)
    store.check_unchanged(["b.weight"])
    os.remove(store.directory / "b.safetensors")
    store.check_unchanged(["b.weight"])  # the map, not the name, holds the bytes (issue #23)
    assert torch.equal(store.get("b.weight"), _tensors()["b.weight"])


def test_writes_into_a_view_stay_in_memory_and_are_counted(tmp_path):
    store = _write(tmp_path)
    path = store.directory / "a.safetensors"
    on_disk = path.read_bytes()
    assert store.stats().written_bytes == 0
    store.get("a.weight").mul_(2)
    assert torch.equal(store.get("a.weight"), _tensors()["a.weight"] * 2), "the write takes effect"
    assert path.read_bytes() == on_disk, "and never reaches the file"
    assert store.stats().written_bytes >= 64 * 32 * 4
    with pytest.raises(OffloadError, match="written in memory.*would lose them"):
        store.evict()


def test_checkpoint_is_referenced_in_place(tmp_path):
    tensors = _tensors()
    ckpt = tmp_path / "model.safetensors"
    save_file(tensors, str(ckpt))
    before = sorted(os.listdir(tmp_path))
    source = CheckpointSource({"x." + n: (ckpt, n) for n in tensors})
    assert sorted(os.listdir(tmp_path)) == before, "a reference must not copy or write anything"
    assert torch.equal(source.get("x.a.weight"), tensors["a.weight"])
    assert source.file_of("x.a.weight") == ckpt.resolve() == file_backing(source.get("x.a.weight"))


def test_checkpoint_reference_to_missing_key_is_refused(tmp_path):
    save_file({"w": torch.ones(2)}, str(tmp_path / "m.safetensors"))
    with pytest.raises(OffloadError, match="has no tensor 'v'"):
        CheckpointSource({"layer.v": (tmp_path / "m.safetensors", "v")})


def test_prefetch_and_evict_keep_values(tmp_path):
    store = _write(tmp_path)
    store.prefetch(["a.weight", "b.weight"])
    store.evict()
    assert torch.equal(store.get("a.weight"), _tensors()["a.weight"])


def test_a_warm_prefetch_asks_the_kernel_for_nothing_and_a_reclaimed_one_reads_again(tmp_path, monkeypatch):
    """Prefetching pages already mapped in and still in memory would only take CPU from the
    threads computing; pages the kernel dropped since are read again."""
    import automap.offload.mapped as mapped_module

    path = tmp_path / "w.safetensors"
    weights = {"w": torch.randn(512, 1024), "v": torch.randn(300)}
    save_file(weights, str(path))
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)  # dirty pages would stay in the page cache through the eviction below
    os.close(fd)
    mapped = MappedFile(path)
    calls = []
    real = mapped_module.madvise
    monkeypatch.setattr(mapped_module, "madvise", lambda *a: calls.append(a[2]) or real(*a))
    mapped.advise(["w", "v"])
    assert len(calls) == 4 and mapped.resident(["w", "v"])
    mapped.advise(["w", "v"])
    mapped.advise(["w"], populate=False)
    assert len(calls) == 4, "nothing asked of the kernel for pages mapped in and resident"
    mapped.evict()  # the pages leave this process and the page cache, as under memory pressure
    assert not mapped.resident(["w"])
    mapped.advise(["w"])
    assert len(calls) == 6 and mapped.resident(["w"])
    assert all(torch.equal(mapped.tensor(k), t) for k, t in weights.items())


class _Spy:
    """A weight source that records what it was asked to prefetch."""

    def __init__(self, inner):
        self.inner, self.asked = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def prefetch(self, names, populate=True):
        self.asked.append((tuple(names), populate))
        self.inner.prefetch(names, populate)


def test_page_transfer_prefetches_and_takes_zero_copy_views(tmp_path):
    source = _Spy(_write(tmp_path))
    transfer = PageTransfer(source)
    transfer.prefetch("a", ["a.weight", "a.bias"])
    transfer.drain()  # the worker ran the prefetch
    assert (("a.weight", "a.bias"), True) in source.asked
    got = transfer.take("a", ["a.weight", "a.bias"])
    assert got["a.weight"].data_ptr() == source.get("a.weight").data_ptr()
    assert torch.equal(got["a.bias"], _tensors()["a.bias"])
    transfer.take("b", ["b.weight"])
    assert (("b.weight",), False) in source.asked, "a unit not prefetched has its reads queued at once"
    transfer.close()


def test_transfer_drops_a_wrong_guess_and_loads_what_runs(tmp_path):
    store = _write(tmp_path)
    transfer = PageTransfer(store)
    transfer.prefetch("a", ["a.weight"])
    transfer.prefetch("b", ["b.weight"])
    assert list(transfer._pending) == ["b"], "at most one unit in flight"
    assert torch.equal(transfer.take("a", ["a.weight"])["a.weight"], _tensors()["a.weight"])
    transfer.close()


def test_transfer_refuses_a_changed_file(tmp_path):
    store = _write(tmp_path)
    transfer = PageTransfer(store)
    transfer.take("a", ["a.weight"])
    path = store.directory / "a.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(
        OffloadError, match=r"'a\.(weight|bias)' in .*a.safetensors does not match its checksum"
    ):
        transfer.take("a", ["a.weight", "a.bias"])
    transfer.close()


def test_staged_transfer_hands_out_copies_of_the_source(tmp_path):
    store = _write(tmp_path)
    transfer = StagedTransfer(store, HostCopyOps())
    transfer.prefetch("a", ["a.weight", "a.bias"])
    got = transfer.take("a", ["a.weight", "a.bias", "b.count"])
    for name in got:
        assert torch.equal(got[name], store.get(name)) and got[name].data_ptr() != store.get(name).data_ptr()
    assert transfer.pinned_bytes >= 64 * 32 * 4
    transfer.close()


def test_corrupted_file_is_rewritten_not_reused(tmp_path):
    store = _write(tmp_path)
    store.close()
    path = store.directory / "a.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    again = _write(tmp_path)
    again.verify()
    assert torch.equal(again.get("a.bias"), _tensors()["a.bias"])


def test_discarding_a_new_store_removes_only_what_it_created(tmp_path):
    (tmp_path / "mine.txt").write_text("the user's file")
    store = _write(tmp_path / "off")
    store.close(discard=True)
    assert not (tmp_path / "off").exists(), "the folder automap made is gone again"
    assert (tmp_path / "mine.txt").read_text() == "the user's file"


def test_store_files_are_aligned_and_valid_safetensors(tmp_path):
    """Every tensor starts 64-byte aligned (kernels then compute as from RAM), and the padding
    is declared, so the safetensors library itself reads automap's files."""
    from safetensors import safe_open

    store = _write(tmp_path)
    for name in _tensors():
        assert store.get(name).data_ptr() % 64 == 0, name
    with safe_open(str(store.directory / "a.safetensors"), "pt") as f:
        assert torch.equal(f.get_tensor("a.bias"), _tensors()["a.bias"])
    with safe_open(str(store.directory / "b.safetensors"), "pt") as f:
        assert torch.equal(f.get_tensor("b.weight"), _tensors()["b.weight"])


def test_shared_anonymous_memory_is_not_a_backing_file():
    # Pinned host memory from CUDA's allocator is a shared anonymous mapping, which
    # /proc/self/maps names "/dev/zero (deleted)": RAM, not a file a weight is read from.
    import mmap

    from automap.offload import backing_file

    shared = mmap.mmap(-1, 1 << 16, flags=mmap.MAP_SHARED)
    tensor = torch.frombuffer(shared, dtype=torch.uint8)
    with open("/proc/self/maps") as maps:
        assert any("/dev/zero" in line for line in maps), "the kernel names shared anonymous memory otherwise"
    assert backing_file(tensor) is None
    del tensor
    shared.close()


class _WithExtra(torch.nn.Module):
    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
        values = torch.randn(8, dtype=dtype) if dtype.is_complex else torch.arange(8).to(dtype)
        self.b.register_buffer("extra", values)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        extra = self.b.extra
        return self.b(self.a(x)) + (extra.real if extra.is_complex() else extra.to(torch.float32))


@pytest.mark.parametrize(
    "dtype", [torch.complex64, torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fnuz]
)
def test_every_dtype_safetensors_holds_is_offloaded_to_disk(dtype, tmp_path):
    torch.manual_seed(0)
    model = _WithExtra(dtype).eval()
    x = torch.randn(2, 8)
    expected, extra = model(x), model.b.extra.clone()
    automap.dispatch(model, device_map={"a": "cpu", "b": "disk"}, offload_dir=tmp_path)
    assert torch.equal(model(x), expected)
    assert model.b.extra.dtype == dtype and torch.equal(
        model.b.extra.view(torch.uint8), extra.view(torch.uint8)
    )
    automap.undispatch(model)


def test_a_dtype_safetensors_lacks_is_refused_before_anything_is_written(tmp_path):
    model = _WithExtra(torch.complex128).eval()
    with pytest.raises(OffloadError, match=r"'b.extra' \(complex128\); keep its module in memory"):
        automap.dispatch(model, device_map={"a": "cpu", "b": "disk"}, offload_dir=tmp_path / "off")
    assert not (tmp_path / "off").exists()
    assert automap.runtime.state_of(model) is None and model(torch.randn(1, 8)).shape == (1, 8)
