"""Loading to an accelerator through pinned staging buffers, held to CUDA's stream rules on the
CPU by the fake ops (tests/fake_streams.py): every tensor arrives whole and equal, no buffer is
refilled before the device's copy out of it ran, and the device's stream waits for the copies
before anything reads them."""

import sys

import pytest
import torch
from fake_streams import FakeOps
from safetensors.torch import save_file

import automap
from automap.loading import staged
from automap.loading.staged import DeviceSends, StagedCopies, staging_bytes, stages_to

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
    assert staging_bytes(1) == staged.SLOT_BYTES
    assert staging_bytes(10 << 30) == staged.SLOTS * staged.SLOT_BYTES
    assert not stages_to("cpu") and not stages_to(torch.device("cpu"))
    assert stages_to("cuda:0"), "CUDA's kind has stream ops: loads to it are staged"


def test_a_load_through_the_staged_path_gives_the_plain_model(tmp_path, monkeypatch):
    """automap.load with every tensor sent through fake staged copies (as to a GPU): the same
    weights and outputs as the plain model, and the rules held."""
    torch.manual_seed(0)
    plain = torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3),
        torch.nn.BatchNorm2d(16),
        torch.nn.Flatten(),
        torch.nn.Linear(16 * 30 * 30, 10),
    ).eval()
    path = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in plain.state_dict().items()}, str(path))
    ops = FakeOps()
    made: list[StagedCopies] = []

    class Recording(DeviceSends):
        def send(self, value, device):
            out = super().send(value, device)
            made.extend(s for s in self._staged.values() if s is not None and s not in made)
            return out

    monkeypatch.setattr(staged, "staged_ops", lambda device: ops)
    monkeypatch.setattr(sys.modules["automap.loading.materialise"], "DeviceSends", Recording)
    with automap.empty_model():
        model = torch.nn.Sequential(
            torch.nn.Conv2d(3, 16, 3),
            torch.nn.BatchNorm2d(16),
            torch.nn.Flatten(),
            torch.nn.Linear(16 * 30 * 30, 10),
        ).eval()
    automap.load(model, str(path), {"": "cpu"}, quiet=True)
    assert made and made[0].copies >= len(plain.state_dict()), "every tensor went through the buffers"
    ops.read(*model.state_dict().values())
    ops.assert_clean()
    for key, value in plain.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key
    x = torch.randn(2, 3, 32, 32)
    assert torch.equal(model(x), plain(x))
