"""The CUDA ordering of :class:`~automap.offload.StagedTransfer`, checked on a CPU: the transfer
runs with :class:`fake_streams.FakeOps`, whose copies land late and which names every rule of
CUDA's streams the code breaks (see fake_streams.py). Three rules, each with a scenario that
would break it:

- the compute stream waits on the copy's event before it reads the copy (``wait``);
- the staging buffer is drained before the next unit is staged into it (``synchronize``);
- device copies are kept alive for the compute stream (``keep_alive``, i.e. ``record_stream``),
  so the allocator does not hand their memory to the next copy while compute still reads it.

Each scenario runs clean with the real call sequence, and fails with the call forgotten
(``FakeOps(forget=...)``, the same as deleting that one line of ``StagedTransfer``)."""

from __future__ import annotations

import pytest
import torch

import automap
from automap.offload import RamSource, StagedTransfer
from automap.runtime import dispatch_plan, state_of
from conftest import ids_and_logits, logits_of, tiny_llama
from fake_streams import ComputeReads, FakeOps

UNITS = {"a": ["a.weight", "a.bias", "a.count"], "b": ["b.weight", "b.bias"], "c": ["c.weight", "c.bias"]}


def _tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    found = {}
    for unit in UNITS:
        found[f"{unit}.weight"] = torch.randn(32, 16, generator=generator)
        found[f"{unit}.bias"] = torch.randn(32, generator=generator)
    found["a.count"] = torch.arange(5)
    return found


def _transfer(ops: FakeOps, pinned: bool = False) -> tuple[StagedTransfer, dict[str, torch.Tensor]]:
    tensors = _tensors()
    if pinned:
        for tensor in tensors.values():
            ops.pin(tensor)
    return StagedTransfer(RamSource(tensors), ops), tensors


def _assert_values(ops: FakeOps, got: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor]) -> None:
    """Each copy holds its source's values; when one does not, the ordering rule broken says why."""
    for name, tensor in got.items():
        if not torch.equal(tensor, tensors[name]):
            ops.assert_clean()
            raise AssertionError(f"{name} holds other bytes than its source")


# ------------------------------------------------------------------ the three scenarios


def compute_reads_a_copied_unit(ops: FakeOps) -> None:
    """One unit copied when asked for (not prefetched), then one prefetched while the first is
    used, each read by the compute stream."""
    transfer, tensors = _transfer(ops)
    got = transfer.take("a", UNITS["a"])
    transfer.prefetch("b", UNITS["b"])
    ops.read(*got.values())
    _assert_values(ops, got, tensors)
    got = transfer.take("b", UNITS["b"])
    ops.read(*got.values())
    _assert_values(ops, got, tensors)
    transfer.close()


def next_unit_staged_while_compute_is_behind(ops: FakeOps) -> None:
    """Unit b is staged into the buffer unit a was staged in, before the compute stream (which
    is behind, as a GPU's queue is) reads a."""
    transfer, tensors = _transfer(ops)
    got_a = transfer.take("a", UNITS["a"])
    transfer.prefetch("b", UNITS["b"])
    got_b = transfer.take("b", UNITS["b"])  # waits for the prefetch: b is staged now
    ops.read(*got_a.values(), *got_b.values())
    _assert_values(ops, got_a, tensors)
    _assert_values(ops, got_b, tensors)
    transfer.close()


def unit_freed_while_compute_still_reads_it(ops: FakeOps) -> None:
    """Unit a's copies are read and dropped while the compute stream may still be reading them;
    then unit b, of the same sizes, is copied."""
    transfer, tensors = _transfer(ops)
    got = transfer.take("a", UNITS["a"])
    ops.read(*got.values())
    del got  # the unit ended: its copies are freed while its kernels may still be queued
    got = transfer.take("b", UNITS["b"])
    ops.read(*got.values())
    _assert_values(ops, got, tensors)
    transfer.close()


SCENARIOS = {
    "wait": (compute_reads_a_copied_unit, "wait_event is missing"),
    "synchronize": (
        next_unit_staged_while_compute_is_behind,
        r"staging bytes 0\.\.\d+\) changed before the copy ran: the staging buffer was reused",
    ),
    "keep_alive": (unit_freed_while_compute_still_reads_it, r"without keep_alive \(record_stream\)"),
}


@pytest.mark.parametrize("primitive", list(SCENARIOS))
def test_each_scenario_keeps_the_rules_with_the_real_call_sequence(primitive):
    ops = FakeOps()
    SCENARIOS[primitive][0](ops)
    ops.assert_clean()
    assert ops.pageable_copies == 0, "every copy reads pinned memory (the staging buffer)"


@pytest.mark.parametrize("primitive", list(SCENARIOS))
def test_a_forgotten_call_is_caught(primitive):
    scenario, message = SCENARIOS[primitive]
    with pytest.raises(AssertionError, match=message):
        ops = FakeOps(forget={primitive})
        scenario(ops)
        ops.assert_clean()


# ------------------------------------------------------------------ what the rules rest on


def test_the_compute_stream_waits_on_the_side_streams_events():
    ops = FakeOps()
    compute_reads_a_copied_unit(ops)
    assert ops.waits and all(w[0] == "compute" and w[1].startswith("side-") for w in ops.waits)
    assert [seq for *_, seq in ops.waits] == [3, 5], "one event per unit, after its last copy"
    assert ops.syncs == 2, "the host drains the staging buffer once per unit staged"


def test_a_copy_lands_only_when_ordered():
    ops = FakeOps(forget={"synchronize"})
    transfer, tensors = _transfer(ops)
    got = transfer.take("a", UNITS["a"])
    assert torch.isnan(got["a.weight"]).all(), (
        "without a synchronize or a wait-then-read, the copy has not run"
    )
    ops.read(got["a.weight"])  # waited, so reading it runs the copy first
    assert torch.equal(got["a.weight"], tensors["a.weight"])
    transfer.close()


def test_freed_copies_are_reused_once_the_compute_stream_is_done():
    ops = FakeOps()
    transfer, _ = _transfer(ops)
    got = transfer.take("a", UNITS["a"])
    ops.read(*got.values())
    del got
    ops.sync_stream()  # compute finished its kernels: the allocator may reuse a's blocks
    transfer.take("b", UNITS["b"])
    ops.assert_clean()
    assert ops.reused >= 2, "b's copies went into a's freed blocks"
    transfer.close()


def test_pinned_sources_are_copied_without_staging():
    ops = FakeOps()
    transfer, tensors = _transfer(ops, pinned=True)
    for unit in UNITS:
        got = transfer.take(unit, UNITS[unit])
        ops.read(*got.values())
        _assert_values(ops, got, tensors)
    assert transfer.pinned_bytes == 0, "nothing was staged"
    assert ops.syncs == 0, "no staging buffer to drain: the host never waits, the compute stream does"
    ops.assert_clean()
    transfer.close()


# ------------------------------------------------------------------ the runtime, end to end

_LLAMA_MAP = {
    "model.embed_tokens": "cpu",
    "model.rotary_emb": "cpu",
    "model.layers.0": "disk",
    "model.layers.1": "disk",
    "model.layers.2": "cpu",
    "model.layers.3": "disk",
    "model.norm": "disk",
    "lm_head": "cpu",
}


def test_a_real_model_through_the_fake_matches_and_breaks_no_rule(tmp_path):
    model = tiny_llama(layers=4).train()
    for unit in ("model.layers.0", "model.layers.1", "model.layers.3", "model.norm"):
        model.get_submodule(unit).requires_grad_(False)
    ids, expected = ids_and_logits(model.eval(), (2, 9))
    loss_expected = model.train()(ids, labels=ids).loss.detach()
    ops = FakeOps()
    dispatch_plan(
        model,
        automap.plan(model, _LLAMA_MAP),
        offload_dir=tmp_path,
        transfer=lambda source, *_: StagedTransfer(source, ops),
    )
    with ComputeReads(ops):
        got = logits_of(model.eval(), ids)
        loss = model.train()(ids, labels=ids).loss
        loss.backward()  # re-reads the streamed weights by name, on the compute stream
    ops.assert_clean()
    assert torch.equal(got, expected)
    assert torch.equal(loss.detach(), loss_expected)
    assert len(ops.waits) >= 5 and ops.pageable_copies == 0
    assert state_of(model).transfer.pinned_bytes > 0, "disk units were staged"
    automap.undispatch(model)
