"""The offload store and the loader: what is written, what is reused, what is refused, and
that reads are zero-copy views that the loader hands out one unit ahead."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from automap.errors import OffloadError
from automap.offload import INDEX_NAME, Loader, OffloadStore, checkpoint_entries


def _tensors() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {"a.weight": torch.randn(64, 32), "a.bias": torch.randn(64), "b.weight": torch.randn(16, 64).half(),
            "b.count": torch.arange(5)}


def _write(root, tensors=None) -> OffloadStore:
    tensors = tensors or _tensors()
    return OffloadStore.write(root, tensors, {n: n.split(".")[0] for n in tensors})


def test_round_trip_is_exact_and_zero_copy(tmp_path):
    tensors = _tensors()
    store = _write(tmp_path, tensors)
    again = OffloadStore.open(tmp_path)
    for name, tensor in tensors.items():
        got = again.get(name)
        assert got.dtype == tensor.dtype and torch.equal(got, tensor), name
    a, b = again.get("a.weight"), again.get("a.weight")
    assert a.data_ptr() == b.data_ptr(), "reads must be views of one map, not copies"
    store.verify()
    assert sorted(os.listdir(tmp_path)) == sorted(["a.safetensors", "b.safetensors", INDEX_NAME])


def test_index_records_dtype_shape_size_checksum(tmp_path):
    _write(tmp_path)
    index = json.loads((tmp_path / INDEX_NAME).read_text())["tensors"]
    assert index["b.weight"]["dtype"] == "F16"
    assert index["b.weight"]["shape"] == [16, 64]
    assert index["b.weight"]["nbytes"] == 16 * 64 * 2
    assert isinstance(index["b.weight"]["crc32"], int)


def test_matching_store_is_reused_not_rewritten(tmp_path):
    _write(tmp_path)
    before = {f: os.stat(tmp_path / f).st_mtime_ns for f in ("a.safetensors", "b.safetensors")}
    changed = _tensors()
    changed["b.weight"] = changed["b.weight"] + 1
    _write(tmp_path, changed)
    assert os.stat(tmp_path / "a.safetensors").st_mtime_ns == before["a.safetensors"]
    assert os.stat(tmp_path / "b.safetensors").st_mtime_ns != before["b.safetensors"]
    assert torch.equal(OffloadStore.open(tmp_path).get("b.weight"), changed["b.weight"])


def test_unwritable_directory_is_refused(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(OffloadError, match=r"file/sub is not writable.*writable directory"):
        _write(blocker / "sub")


def test_truncated_file_is_refused_at_open(tmp_path):
    _write(tmp_path)
    path = tmp_path / "a.safetensors"
    os.truncate(path, path.stat().st_size - 100)
    with pytest.raises(OffloadError, match=r"a.safetensors is truncated: \d+ bytes, its header needs \d+"):
        OffloadStore.open(tmp_path)


def test_missing_index_says_what_to_do(tmp_path):
    with pytest.raises(OffloadError, match="no offload index.*dispatch again"):
        OffloadStore.open(tmp_path)


def test_changed_bytes_fail_checksum(tmp_path):
    _write(tmp_path)
    path = tmp_path / "a.safetensors"
    data = bytearray(path.read_bytes())
    data[-4:] = b"\x00\x00\x80\x7f"
    path.write_bytes(bytes(data))
    with pytest.raises(OffloadError, match=r"'a\.(weight|bias)' in .*a.safetensors does not match its checksum"):
        OffloadStore.open(tmp_path).verify()


def test_change_after_mapping_is_detected_and_a_restored_file_accepted(tmp_path):
    store = _write(tmp_path)
    store.check_unchanged(["a.weight"])
    path = tmp_path / "a.safetensors"
    good = path.read_bytes()
    os.truncate(path, 200)
    with pytest.raises(OffloadError, match="a.safetensors is truncated"):
        store.check_unchanged(["a.weight"])
    with pytest.raises(OffloadError, match="truncated"):  # still refused on the next try
        store.check_unchanged(["a.weight"])
    path.write_bytes(good)
    store.check_unchanged(["a.weight"])
    assert torch.equal(store.get("a.weight"), _tensors()["a.weight"])


def test_deleted_file_is_named(tmp_path):
    store = _write(tmp_path)
    store.check_unchanged(["b.weight"])
    os.remove(tmp_path / "b.safetensors")
    with pytest.raises(OffloadError, match="b.safetensors was deleted"):
        store.check_unchanged(["b.weight"])


def test_checkpoint_is_referenced_in_place(tmp_path):
    tensors = _tensors()
    ckpt = tmp_path / "model.safetensors"
    save_file(tensors, str(ckpt))
    refs = checkpoint_entries(ckpt, {"x." + n: n for n in tensors})
    store = OffloadStore.write(tmp_path / "off", {}, {}, references=refs)
    assert os.listdir(tmp_path / "off") == [INDEX_NAME], "a reference must not copy the weights"
    again = OffloadStore.open(tmp_path / "off")
    assert torch.equal(again.get("x.a.weight"), tensors["a.weight"])
    assert store.path_of(again.entries["x.a.weight"]) == ckpt.resolve()


def test_checkpoint_reference_to_missing_key_is_refused(tmp_path):
    save_file({"w": torch.ones(2)}, str(tmp_path / "m.safetensors"))
    with pytest.raises(OffloadError, match="has no tensor 'v' \\(wanted for 'layer.v'\\)"):
        checkpoint_entries(tmp_path / "m.safetensors", {"layer.v": "v"})


def test_advise_and_drop_pages_keep_values(tmp_path):
    store = _write(tmp_path)
    store.advise(["a.weight", "b.weight"])
    store.drop_pages()
    assert torch.equal(store.get("a.weight"), _tensors()["a.weight"])


class _Spy(OffloadStore):
    advised: list[tuple[str, ...]] = []

    def advise(self, names, populate=True):
        type(self).advised.append(tuple(names))
        super().advise(names, populate)


def test_loader_prefetches_and_takes_zero_copy_views(tmp_path):
    _write(tmp_path)
    store = _Spy.open(tmp_path)
    loader = Loader(store, {"ram.w": torch.ones(3)}, torch.device("cpu"))
    loader.prefetch("a", ["a.weight", "a.bias"])
    loader._pool.submit(lambda: None).result()  # the worker ran the prefetch
    assert ("a.weight", "a.bias") in _Spy.advised
    got = loader.take("a", ["a.weight", "a.bias", "ram.w"])
    assert got["a.weight"].data_ptr() == store.get("a.weight").data_ptr()
    assert torch.equal(got["a.bias"], _tensors()["a.bias"]) and torch.equal(got["ram.w"], torch.ones(3))
    loader.close()


def test_loader_drops_a_wrong_guess_and_loads_what_runs(tmp_path):
    store = _write(tmp_path)
    loader = Loader(store, {}, torch.device("cpu"))
    loader.prefetch("a", ["a.weight"])
    loader.prefetch("b", ["b.weight"])
    assert list(loader._pending) == ["b"], "at most one unit in flight"
    got = loader.take("a", ["a.weight"])
    assert torch.equal(got["a.weight"], _tensors()["a.weight"])
    loader.close()


def test_loader_refuses_a_changed_file(tmp_path):
    store = _write(tmp_path)
    loader = Loader(store, {}, torch.device("cpu"))
    loader.take("a", ["a.weight"])
    path = tmp_path / "a.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(OffloadError, match=r"'a\.(weight|bias)' in .*a.safetensors does not match its checksum"):
        loader.take("a", ["a.weight", "a.bias"])
    loader.close()


def test_corrupted_file_is_rewritten_not_reused(tmp_path):
    _write(tmp_path)
    path = tmp_path / "a.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    store = _write(tmp_path)
    store.verify()
    assert torch.equal(store.get("a.bias"), _tensors()["a.bias"])
