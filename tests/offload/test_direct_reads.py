"""Offloaded units read past the page cache (``O_DIRECT`` into a ring of automap's buffers): the
same outputs as the plain model, ring buffers reused and never what the user reaches, files that
shrink refused by name, file systems without ``O_DIRECT`` read through the page cache, and the rule
that picks the path.
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import automap
from automap.errors import OffloadError
from automap.offload import CheckpointSource, DirectTransfer, PageTransfer, backing_file, make_transfer
from automap.offload.direct import SLOTS, direct_reads, reads_direct, unit_reads
from automap.runtime import state_of
from conftest import tiny_llama

TESTS = Path(__file__).resolve().parents[1]


def device_map(layers: int, on_disk: range) -> dict[str, str]:
    found = {"model.embed_tokens": "cpu", "model.norm": "cpu", "lm_head": "cpu", "model.rotary_emb": "cpu"}
    found.update({f"model.layers.{i}": "disk" if i in on_disk else "cpu" for i in range(layers)})
    return found


def dispatched_direct(tmp_path: Path, monkeypatch, layers: int = 6):
    monkeypatch.setenv("AUTOMAP_COLD_READS", "direct")
    model = tiny_llama(layers)
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = model(ids).logits
    automap.dispatch(model, device_map=device_map(layers, range(1, layers)), offload_dir=tmp_path)
    assert isinstance(state_of(model).transfer, DirectTransfer)
    return model, ids, expected


def test_outputs_equal_the_plain_model_and_the_ring_is_reused(tmp_path, monkeypatch):
    model, ids, expected = dispatched_direct(tmp_path, monkeypatch, layers=7)  # 6 streamed units, 3 slots
    ring = state_of(model).transfer.reads.ring
    with torch.no_grad():
        first = model(ids).logits
        buffers = [b.data_ptr() for b in ring._buffers if b is not None]
        for _ in range(3):
            assert torch.equal(model(ids).logits, expected)
    assert torch.equal(first, expected)
    assert len(buffers) == SLOTS and [b.data_ptr() for b in ring._buffers] == buffers  # reused, none added
    automap.undispatch(model)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, expected)


def test_state_dict_during_and_after_forwards_holds_the_mapped_tensors(tmp_path, monkeypatch):
    model, ids, _ = dispatched_direct(tmp_path, monkeypatch)
    seen: list[dict[str, torch.Tensor]] = []
    handle = model.model.layers[3].register_forward_hook(lambda *_: seen.append(model.state_dict()))
    with torch.no_grad():
        model(ids)
    handle.remove()
    ring = {
        b.untyped_storage().data_ptr() for b in state_of(model).transfer.reads.ring._buffers if b is not None
    }
    for state in [seen[0], model.state_dict()]:
        for layer in (2, 3, 4):
            weight = state[f"model.layers.{layer}.mlp.up_proj.weight"]
            assert weight.untyped_storage().data_ptr() not in ring
            assert backing_file(weight) is not None and backing_file(weight).suffix == ".safetensors"


def test_writes_between_forwards_are_what_the_next_forward_uses(tmp_path, monkeypatch):
    model, ids, _ = dispatched_direct(tmp_path, monkeypatch)
    plain = tiny_llama(6)
    with torch.no_grad():
        model(ids)
        for m in (model, plain):
            m.model.layers[2].mlp.up_proj.weight.mul_(0.5)
        model.load_state_dict({"model.layers.4.mlp.down_proj.weight": torch.ones(64, 128)}, strict=False)
        plain.load_state_dict({"model.layers.4.mlp.down_proj.weight": torch.ones(64, 128)}, strict=False)
        assert torch.equal(model(ids).logits, plain(ids).logits)
        assert torch.equal(model(ids).logits, plain(ids).logits)


def test_a_view_that_outlives_its_unit_is_never_overwritten(tmp_path):
    path = tmp_path / "w.safetensors"
    tensors = {f"t{i}": torch.full((1024, 300), float(i)) for i in range(SLOTS + 2)}
    save_file(tensors, str(path))
    source = CheckpointSource({n: (path, n) for n in tensors})
    transfer = DirectTransfer(source, direct_reads(source))
    kept = [transfer.take(n, [n])[n] for n in tensors]  # every one held: no slot is free for the later ones
    for name, got in zip(tensors, kept):
        assert torch.equal(got, tensors[name])
    transfer.close()


def test_tensors_at_offsets_their_dtype_cannot_view_are_read_exactly(tmp_path):
    path = tmp_path / "odd.safetensors"
    header = {
        "a": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]},
        "b": {"dtype": "F32", "shape": [5, 7], "data_offsets": [3, 143]},
        "c": {"dtype": "F64", "shape": [9], "data_offsets": [143, 215]},
    }
    import json

    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    b, c = torch.randn(5, 7), torch.randn(9, dtype=torch.float64)
    body = bytes([1, 2, 3]) + b.numpy().tobytes() + c.numpy().tobytes()
    path.write_bytes(struct.pack("<Q", len(text)) + text + body)
    source = CheckpointSource({n: (path, n) for n in "abc"})
    transfer = DirectTransfer(source, direct_reads(source))
    got = transfer.take("u", ["a", "b", "c"])
    assert got["a"].tolist() == [1, 2, 3] and torch.equal(got["b"], b) and torch.equal(got["c"], c)
    transfer.close()


def test_unit_reads_are_aligned_and_cover_every_tensor(tmp_path):
    path = tmp_path / "w.safetensors"
    save_file({"x": torch.randn(3000), "y": torch.randn(77, 5), "z": torch.randn(1 << 20)}, str(path))
    source = CheckpointSource({n: (path, n) for n in "xyz"})
    mapped = source.files[source.entries["x"][0]]
    layout = unit_reads([(n, mapped, n) for n in "xyz"], request_bytes=1 << 20)
    assert all(r.offset % 4096 == 0 and r.at % 4096 == 0 and r.length % 4096 == 0 for r in layout.requests)
    assert max(r.length for r in layout.requests) <= 1 << 20
    for piece in layout.pieces:
        info = mapped.info(piece.key)
        request = next(r for r in layout.requests if r.offset <= info.begin < r.offset + r.length)
        assert piece.at - request.at == info.begin - request.offset


def run_python(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(TESTS.parent)])}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300, env=env
    )


@pytest.mark.parametrize("when", ["before the take", "under the read"])
def test_a_file_truncated_under_the_model_is_an_offload_error_never_a_crash(tmp_path, when):
    result = run_python(f"""
        import os
        from pathlib import Path
        import torch
        from safetensors.torch import save_file
        from automap.errors import OffloadError
        from automap.offload import CheckpointSource, DirectTransfer
        from automap.offload.direct import direct_reads
        path = Path({str(tmp_path)!r}) / "w.safetensors"
        save_file({{"a": torch.randn(4096), "b": torch.randn(300000)}}, str(path))
        source = CheckpointSource({{n: (path, n) for n in "ab"}})
        transfer = DirectTransfer(source, direct_reads(source))
        os.truncate(path, 20000)
        try:
            if {when!r} == "before the take":
                transfer.take("u", ["a", "b"])
            else:
                transfer.reads.read(["a", "b"], spare=False)  # the check passed, then the file shrank
        except OffloadError as exc:
            assert "w.safetensors" in str(exc) and "truncated" in str(exc), exc
            print("OK refused:", exc)
        """)
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stderr[-3000:]}"
    assert "OK refused" in result.stdout, result.stdout + result.stderr[-2000:]


@pytest.fixture
def ramfs(tmp_path):
    """A ramfs (no ``O_DIRECT``: opening with it is EINVAL) mounted under tmp_path; root only."""
    folder = tmp_path / "ramfs"
    folder.mkdir()
    if (
        os.geteuid() != 0
        or subprocess.run(["mount", "-t", "ramfs", "ramfs", str(folder)], capture_output=True).returncode != 0
    ):
        pytest.skip("mounting a ramfs needs root")
    yield folder
    subprocess.run(["umount", "-l", str(folder)], check=False)


def test_a_file_system_without_o_direct_is_read_through_the_page_cache(ramfs, monkeypatch):
    monkeypatch.setenv("AUTOMAP_COLD_READS", "direct")
    path = ramfs / "w.safetensors"
    save_file({"a": torch.randn(64, 64)}, str(path))
    with pytest.raises(OSError):
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
    source = CheckpointSource({"a": (path, "a")})
    assert direct_reads(source) is None
    transfer = make_transfer(source, "cpu")
    assert isinstance(transfer, PageTransfer)
    assert torch.equal(transfer.take("u", ["a"])["a"], source.get("a"))
    transfer.close()


def test_the_rule_reads_past_the_page_cache_only_when_the_files_do_not_fit(monkeypatch):
    monkeypatch.delenv("AUTOMAP_COLD_READS", raising=False)
    assert reads_direct(10 << 30, 8 << 30) and not reads_direct(2 << 30, 8 << 30)
    assert not reads_direct(8 << 30, 8 << 30) and not reads_direct(
        10 << 30, None
    )  # room unknown: the page cache
    assert reads_direct(1, 8 << 30, "direct") and not reads_direct(10 << 30, 1, "mapped")
    monkeypatch.setenv("AUTOMAP_COLD_READS", " Direct ")
    assert reads_direct(1, 8 << 30)
    monkeypatch.setenv("AUTOMAP_COLD_READS", "fast")
    with pytest.raises(OffloadError, match=r"AUTOMAP_COLD_READS='fast'.*auto, direct, mapped"):
        reads_direct(1, 1)


def test_dispatch_chooses_pages_when_the_offloaded_files_fit(tmp_path, monkeypatch):
    monkeypatch.delenv("AUTOMAP_COLD_READS", raising=False)
    model = tiny_llama(3)
    automap.dispatch(model, device_map=device_map(3, range(1, 3)), offload_dir=tmp_path)
    assert isinstance(state_of(model).transfer, PageTransfer)  # a few hundred KB fit in any page cache
    automap.undispatch(model)


def test_the_ring_is_used_only_where_the_budget_has_room_for_it(tmp_path, monkeypatch):
    # The ring (SLOTS buffers, and one of its own when every slot is held) is anonymous memory the
    # mapped path does not take: it must fit beside the plan's predicted peak, or the budget breaks.
    monkeypatch.setenv("AUTOMAP_COLD_READS", "direct")
    from automap.planning.memory import streaming_buffers
    from tiny_configs import beside_the_run

    model = tiny_llama(6)
    layer = sum(t.numel() * t.element_size() for t in model.model.layers[1].state_dict().values())
    resident = sum(t.numel() * t.element_size() for t in model.state_dict().values()) - 5 * layer
    ids = torch.randint(0, 256, (2, 8))
    for room, ring in [(2 * layer, False), (8 * layer, True)]:
        budget = {"cpu": beside_the_run(model, resident + room, example_inputs=(ids,)), "disk": "1GB"}
        plan = automap.plan(
            model, device_map(6, range(1, 6)), max_memory=budget, offload_dir=tmp_path, example_inputs=(ids,)
        )
        buffers = streaming_buffers(plan)
        assert (buffers > SLOTS) == ring, (buffers, room // layer)
        automap.dispatch(model, plan, offload_dir=tmp_path)
        assert isinstance(state_of(model).transfer, DirectTransfer if ring else PageTransfer)
        automap.undispatch(model)
    source = CheckpointSource({})
    assert isinstance(make_transfer(source, "cpu", SLOTS), PageTransfer)
