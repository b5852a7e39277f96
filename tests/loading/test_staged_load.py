"""Loading to an accelerator through pinned staging buffers, held to CUDA's stream rules on the
CPU by the fake ops (tests/fake_streams.py): every tensor arrives whole and equal, no buffer is
refilled before the device's copy out of it ran, and the device's stream waits for the copies
before anything reads them."""

import os
import sys
import threading

import pytest
import torch
from fake_streams import FakeOps
from conftest import tiny_gpt2
from safetensors.torch import save_model

import automap
from automap.loading import staged
from automap.errors import CheckpointError
from automap.loading.staged import DeviceSends, FileReads, StagedCopies, staging_bytes, stages_to

ODD = [
    torch.randn(1000, 37),  # several buffers' worth at the small size below
    torch.randn(()),  # a scalar
    torch.empty(0, 8),  # nothing to copy
    torch.randint(0, 2, (333,), dtype=torch.bool),
    torch.randn(17, 5).to(torch.bfloat16),
    torch.randint(-(2**40), 2**40, (9,), dtype=torch.int64),
    torch.randn(64, 3, 3, 3).to(memory_format=torch.channels_last),  # not contiguous: sent with .to
    torch.randn(4096),
]


@pytest.mark.parametrize("slots", [1, 2, 4])
def test_every_tensor_arrives_equal_through_a_small_ring_reused_many_times(slots):
    ops = FakeOps()
    copies = StagedCopies(ops, torch.device("cpu"), slots=slots, slot_bytes=4096)
    sent = [copies.send(t) for t in ODD]
    copies.finish()
    ops.read(*sent)  # the compute stream uses them: it must have waited for their copies
    ops.assert_clean()
    for value, out in zip(ODD, sent):
        assert out.dtype == value.dtype and out.shape == value.shape and torch.equal(out, value)
    assert copies.copies > 2 * slots, "the ring went round: each buffer was refilled"
    assert ops.pageable_copies == 0, "the device copies from page-locked buffers only"
    assert copies.pinned_bytes == 0, "the buffers are given back once the copies ended"


@pytest.mark.parametrize("forget", ["synchronize", "wait"])
def test_the_fake_catches_a_ring_that_skips_a_rule(forget):
    ops = FakeOps(forget={forget})
    copies = StagedCopies(ops, torch.device("cpu"), slots=2, slot_bytes=4096)
    sent = [copies.send(t) for t in ODD]
    copies.finish()
    ops.read(*sent)
    with pytest.raises(AssertionError, match="staging buffer was reused|wait_event is missing"):
        ops.assert_clean()


def test_host_waits_once_per_buffer_refilled_and_once_at_the_end():
    ops = FakeOps()
    copies = StagedCopies(ops, torch.device("cpu"), slots=2, slot_bytes=1 << 16)
    tensor = torch.randn(10 * (1 << 14))  # ten buffers' worth, in ten pieces
    out = copies.send(tensor)
    copies.finish()
    ops.read(out)
    ops.assert_clean()
    assert torch.equal(out, tensor)
    assert copies.copies == 10
    assert ops.syncs == 10 - 2 + 1, "a wait before each of the 8 refills, and one at the end"


def test_staging_memory_is_bounded_and_counted():
    assert staging_bytes(0) == 0
    assert staging_bytes(1) == 2 * staged.SLOT_BYTES
    assert staging_bytes(10 << 30) == (staged.SLOTS + staged.READ_SLOTS) * staged.SLOT_BYTES
    assert not stages_to("cpu") and not stages_to(torch.device("cpu"))
    assert stages_to("cuda:0"), "CUDA's kind has stream ops: loads to it are staged"
    assert not stages_to("mps") and not stages_to("xpu:0"), "copies that overlap nothing: sent with .to"


def test_a_load_through_the_staged_path_gives_the_plain_model(tmp_path, monkeypatch):
    """automap.load of GPT-2 (tied embeddings) with every tensor sent through fake staged copies
    (as to a GPU): the same weights and outputs as the plain model, and the rules held."""
    from transformers import GPT2LMHeadModel

    plain = tiny_gpt2(layers=2)
    path = tmp_path / "model.safetensors"
    save_model(plain, str(path))
    ops = FakeOps()
    made: list[StagedCopies] = []

    class Recording(DeviceSends):
        def _copies(self, device):
            found = super()._copies(device)
            if found is not None and found not in made:
                made.append(found)
            return found

    monkeypatch.setattr(staged, "staged_ops", lambda device: ops)
    monkeypatch.setattr(sys.modules["automap.loading.materialise"], "DeviceSends", Recording)
    with automap.empty_model():
        model = GPT2LMHeadModel(plain.config).eval()
    automap.load(model, str(path), {"": "cpu"}, quiet=True)
    (copies,) = made
    assert copies.reads.copies >= len(plain.transformer.h) * 4, (
        "stored tensors read from the file into buffers"
    )
    ops.read(*model.state_dict().values())
    ops.assert_clean()
    assert model.lm_head.weight is model.transformer.wte.weight, "the tie kept"
    for key, value in plain.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key
    ids = torch.randint(0, plain.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, plain(ids).logits)


def _file_of(tmp_path, values: list[torch.Tensor]):
    """The tensors' bytes one after another in a file; (descriptor, offsets)."""
    path, offsets, at = tmp_path / "raw.bin", [], 0
    with open(path, "wb") as f:
        for value in values:
            offsets.append(at)
            data = value.reshape(-1).view(torch.uint8).numpy().tobytes()
            f.write(data)
            at += len(data)
    return os.open(path, os.O_RDONLY), offsets, path


@pytest.mark.parametrize("slots", [1, 2, 4])
def test_tensors_read_from_their_file_into_a_small_ring_arrive_equal(tmp_path, slots):
    values = [torch.randn(3000, 7), torch.randn(5).to(torch.bfloat16), torch.arange(999, dtype=torch.int64)]
    fd, offsets, _ = _file_of(tmp_path, values)
    ops = FakeOps()
    copies = StagedCopies(ops, torch.device("cpu"), slot_bytes=4096)
    copies.reads = FileReads(ops, copies.stream, slots=slots, slot_bytes=4096)
    try:
        sent = [copies.send_file(v.shape, v.dtype, fd, at) for v, at in zip(values, offsets)]
        copies.finish()
    finally:
        os.close(fd)
    ops.read(*sent)
    ops.assert_clean()
    assert all(torch.equal(a, b) for a, b in zip(sent, values))
    assert copies.reads.copies == sum(-(-v.nbytes // 4096) for v in values) > slots
    assert ops.pageable_copies == 0


def test_a_file_truncated_during_the_load_fails_it_with_a_clear_error_and_nothing_hangs(tmp_path):
    values = [torch.randn(4096), torch.randn(4096)]
    fd, offsets, path = _file_of(tmp_path, values)
    os.truncate(path, offsets[1] + 100)  # the second tensor is cut short
    sends = DeviceSends(ops_for=lambda device: FakeOps())
    try:
        with pytest.raises(
            CheckpointError, match="truncated during the load"
        ):  # at the next send, or at the end
            for value, at in zip(values, offsets):
                sends.send_file(torch.device("cpu"), value.shape, value.dtype, path, lambda: os.dup(fd), at)
            sends.finish()
        sends.finish(failed=True)  # what a failed load does on its way out: nothing raised over its error
    finally:
        os.close(fd)
    assert not [t for t in threading.enumerate() if t.name.startswith("automap-load-read")]
    assert not sends._files, "the descriptors it opened are closed"
