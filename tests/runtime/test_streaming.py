"""The accelerator path of the runtime — a device copy swapped in for each streamed unit, written
back and swapped out after it, re-read by name for backward — run on the CPU through
:class:`~automap.offload.StagedTransfer` with :class:`~automap.offload.HostCopyOps` (real copies
into tensors of their own). The same code runs on a GPU with CUDA streams; here it proves the
swap, write-back, saved-tensor and locking logic without one."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from torch import nn

import automap
from automap.errors import DispatchError
from automap.offload import HostCopyOps, StagedTransfer
from automap.runtime import dispatch_plan, state_of
from conftest import ids_and_logits, logits_of, tiny_gpt2, tiny_llama


def _staged(source, device, buffers=None):
    return StagedTransfer(source, HostCopyOps())


_LLAMA_MAP = {
    "model.embed_tokens": "cpu",
    "model.rotary_emb": "cpu",
    "model.layers.0": "cpu",
    "model.layers.1": "disk",
    "model.layers.2": "disk",
    "model.layers.3": "cpu",
    "model.norm": "disk",
    "lm_head": "cpu",
}


def _dispatch(model, device_map, tmp_path):
    return dispatch_plan(model, automap.plan(model, device_map), offload_dir=tmp_path, transfer=_staged)


def _at_home(model) -> bool:
    return all(
        i.tensor.data_ptr() == i.home.data_ptr() and i.users == 0 for i in state_of(model).streamed.values()
    )


def test_swapped_copies_give_the_same_outputs_and_leave_after_each_unit(tmp_path):
    model = tiny_llama(layers=4)
    ids, expected = ids_and_logits(model, (2, 9))
    _dispatch(model, _LLAMA_MAP, tmp_path)
    assert state_of(model).transfer.swaps
    seen = {}
    layer = model.model.layers[1]
    # Registered after dispatch, so it runs after automap's pre-hook: inside the unit.
    layer.register_forward_pre_hook(lambda m, a: seen.update(ptr=m.mlp.up_proj.weight.data_ptr()))
    assert torch.equal(logits_of(model, ids), expected)
    assert seen["ptr"] != layer.mlp.up_proj.weight.data_ptr(), "the unit ran on a copy"
    assert _at_home(model)


def test_generate_gives_the_same_tokens(tmp_path):
    model = tiny_gpt2(layers=4)
    ids = torch.randint(1, 256, (1, 6), generator=torch.Generator().manual_seed(3))
    options = dict(
        max_new_tokens=12,
        min_new_tokens=12,
        do_sample=False,
        pad_token_id=0,
        attention_mask=torch.ones_like(ids),
    )
    expected = model.generate(ids, **options)
    device_map = {
        "transformer.wte": "disk",
        "transformer.wpe": "cpu",
        "transformer.drop": "cpu",
        "transformer.h.0": "disk",
        "transformer.h.1": "cpu",
        "transformer.h.2": "disk",
        "transformer.h.3": "cpu",
        "transformer.ln_f": "cpu",
        "lm_head": "disk",
    }
    _dispatch(model, device_map, tmp_path)
    assert torch.equal(model.generate(ids, **options), expected)


def test_training_through_frozen_streamed_units_matches(tmp_path):
    plain = tiny_llama(layers=4).train()
    placed = copy.deepcopy(plain)
    for model in (plain, placed):
        for unit in ("model.layers.1", "model.layers.2", "model.norm"):
            model.get_submodule(unit).requires_grad_(False)
    _dispatch(placed, _LLAMA_MAP, tmp_path)
    ids = torch.randint(0, 256, (2, 10))
    losses, grads = [], []
    for model in (plain, placed):
        loss = model(ids, labels=ids).loss
        loss.backward()  # backward re-reads the streamed weights by name
        losses.append(loss.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert torch.equal(losses[0], losses[1])
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name in grads[0]:
        assert torch.equal(grads[0][name], grads[1][name]), name
    assert _at_home(placed)


def test_a_gradient_reaching_a_streamed_weight_is_refused_at_backward(tmp_path):
    model = tiny_llama(layers=4).train()
    _dispatch(model, _LLAMA_MAP, tmp_path)
    ids = torch.randint(0, 256, (1, 6))
    loss = model(ids, labels=ids).loss  # the forward runs in train mode
    with pytest.raises(
        DispatchError, match=r"gradient reached offloaded parameter '(model\.layers\.[12]|model\.norm)"
    ):
        loss.backward()
    assert _at_home(model)


class _WithNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear1, self.batchnorm, self.linear2 = nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 5)

    def forward(self, x):
        return self.linear2(self.batchnorm(self.linear1(x)))


def test_batchnorm_statistics_of_a_streamed_unit_are_written_back(tmp_path):
    torch.manual_seed(0)
    plain = _WithNorm()
    placed = copy.deepcopy(plain)
    plan = automap.plan(placed, {"linear1": "disk", "batchnorm": "disk", "linear2": "disk"})
    dispatch_plan(placed, plan, offload_dir=tmp_path, transfer=_staged)
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(8, 3)
            assert torch.equal(placed(x), plain(x))
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        assert torch.equal(getattr(placed.batchnorm, name), getattr(plain.batchnorm, name)), name
    assert placed.batchnorm.num_batches_tracked.item() == 3


def test_an_in_place_write_inside_the_unit_takes_effect(tmp_path):
    model = tiny_llama(layers=4)
    ids = torch.randint(0, 256, (1, 6))
    _dispatch(model, _LLAMA_MAP, tmp_path)
    norm = model.model.layers[1].input_layernorm
    before = norm.weight.detach().clone()

    def scale(module, args):
        with torch.no_grad():
            module.weight.mul_(1.5)  # runs on the unit's copy

    handle = norm.register_forward_pre_hook(scale)
    logits_of(model, ids)
    handle.remove()
    assert torch.equal(norm.weight.detach(), before * 1.5), "the write was written back to the weight's home"


def test_forwards_from_several_threads_take_turns_and_are_right(tmp_path):
    model = tiny_llama(layers=4)
    inputs = [torch.randint(0, 256, (1, 7), generator=torch.Generator().manual_seed(i)) for i in range(4)]
    expected = [logits_of(model, ids) for ids in inputs]
    _dispatch(model, _LLAMA_MAP, tmp_path)
    wrong, errors = [], []

    def run(i):
        try:
            for _ in range(5):
                if not torch.equal(logits_of(model, inputs[i]), expected[i]):
                    wrong.append(i)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and not wrong
    assert _at_home(model)


def test_placement_counts_the_staging_buffer_as_pinned_host_memory(tmp_path):
    from automap.offload.transfer import aligned
    from automap.sizes import format_bytes

    model = tiny_llama(layers=4)
    _dispatch(model, _LLAMA_MAP, tmp_path)
    state = state_of(model)
    assert state.stats().pinned_bytes == 0, "the staging buffer is allocated by the first staged unit"
    logits_of(model, torch.randint(0, 256, (1, 6)))
    # One buffer, reused: the largest streamed unit's bytes, each tensor aligned to 256 bytes.
    staging = max(sum(aligned(state.source.get(n).nbytes) for n in group.names) for group in state.groups)
    assert state.transfer.pinned_bytes == staging == state.stats().pinned_bytes
    report = automap.placement(model).report()
    assert f"{format_bytes(staging)} of pinned host memory (RAM copies and staging)" in report
