"""GPU dispatch: a cuda:0 + cpu + disk plan (CPU units streamed from pinned RAM on a side
stream, disk units staged through a pinned buffer) gives the GPU-resident model's results.
Skipped without CUDA (see conftest)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import automap
from automap.runtime import dispatch_plan, state_of
from automap.errors import DispatchError
from conftest import ToyModel, tiny_gpt2, tiny_llama

pytestmark = pytest.mark.cuda

_LLAMA_MAP = {
    "model.embed_tokens": 0,
    "model.rotary_emb": 0,
    "model.layers.0": 0,
    "model.layers.1": "cpu",
    "model.layers.2": "disk",
    "model.layers.3": "disk",
    "model.norm": 0,
    "lm_head": "cpu",
}


def _plain_on_gpu(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model).to("cuda:0")


def test_cuda_cpu_disk_plan_matches_the_gpu_model(tmp_path):
    model = tiny_llama(layers=4)
    plain = _plain_on_gpu(model)
    ids = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        expected = plain(ids.cuda()).logits
    plan = automap.plan(model, _LLAMA_MAP)
    assert plan.execution_device == "cuda:0" and set(plan.offloaded_units) >= {
        "model.layers.1",
        "model.layers.2",
    }
    automap.dispatch(model, plan, offload_dir=tmp_path)
    weight = model.model.layers[1].mlp.up_proj.weight
    assert weight.device.type == "cpu" and weight.is_pinned() and weight.shape == (128, 64), (
        "between forwards an offloaded weight is its real (pinned) host copy"
    )
    with torch.no_grad():
        got = model(ids).logits  # inputs on CPU: the hooks move them
    torch.cuda.synchronize()
    assert got.device == torch.device("cuda:0")
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    assert all(
        i.tensor.device.type == "cpu" and i.tensor.data_ptr() == i.home.data_ptr()
        for i in state_of(model).streamed.values()
    ), "the GPU copies left with their units"
    automap.undispatch(model)
    assert model.model.layers[2].mlp.up_proj.weight.device.type == "cpu"


def test_offloaded_weights_leave_the_gpu_after_their_unit(tmp_path):
    model = tiny_llama(layers=4)
    automap.dispatch(model, _LLAMA_MAP, offload_dir=tmp_path)
    torch.cuda.synchronize()
    resident = torch.cuda.memory_allocated(0)
    with torch.no_grad():
        model(torch.randint(0, 256, (1, 8)))
    torch.cuda.synchronize()
    largest_unit = max(u.weight_bytes for u in state_of(model).plan.units)
    # One prefetched unit may be waiting for the next forward; nothing else stays.
    assert torch.cuda.memory_allocated(0) - resident <= largest_unit + 1_000_000


@pytest.mark.parametrize("build", [tiny_gpt2, tiny_llama], ids=["gpt2", "llama"])
def test_generate_on_cuda_cpu_disk_gives_the_same_tokens(build, tmp_path):
    model = build(layers=4)
    plain = _plain_on_gpu(model)
    ids = torch.randint(1, 256, (1, 6))
    options = dict(max_new_tokens=20, min_new_tokens=20, do_sample=False, pad_token_id=0)
    expected = plain.generate(ids.cuda(), attention_mask=torch.ones_like(ids).cuda(), **options)
    units = [u.name for u in automap.plan(model, max_memory={0: "64GB"}).units]
    device_map = {
        u: (0 if i < 2 or i >= len(units) - 2 else ("cpu" if i % 2 else "disk")) for i, u in enumerate(units)
    }
    automap.dispatch(model, device_map, offload_dir=tmp_path)
    got = model.generate(ids.cuda(), attention_mask=torch.ones_like(ids).cuda(), **options)
    assert torch.equal(got.cpu(), expected.cpu())


def test_training_with_a_frozen_cpu_offloaded_unit_matches():
    torch.manual_seed(0)
    model = ToyModel()
    plain = _plain_on_gpu(model)
    for m in (model, plain):
        m.net2.requires_grad_(False)
    dispatch_plan(model, automap.plan(model, {"net1": 0, "relu": 0, "net2": "cpu"}))
    x, y = torch.randn(20, 10), torch.randn(20, 5)
    loss = nn.functional.mse_loss(model(x), y.cuda())
    loss.backward()
    expected = nn.functional.mse_loss(plain(x.cuda()), y.cuda())
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(model.net1.weight.grad, plain.net1.weight.grad, rtol=0, atol=1e-6)


def test_training_a_trainable_offloaded_unit_is_refused_at_backward():
    model = ToyModel().train()
    dispatch_plan(model, automap.plan(model, {"net1": 0, "relu": 0, "net2": "cpu"}))
    out = model(torch.randn(4, 10))
    with pytest.raises(DispatchError, match="gradient reached offloaded parameter 'net2.weight'|'net2.bias'"):
        out.sum().backward()


@pytest.mark.multi_gpu
def test_training_across_two_gpus_matches():
    torch.manual_seed(0)
    model = ToyModel()
    plain = _plain_on_gpu(model)
    automap.dispatch(model, {"net1": 0, "relu": 0, "net2": 1})
    x, y = torch.randn(20, 10), torch.randn(20, 5)
    loss = nn.functional.mse_loss(model(x), y.to("cuda:1"))
    loss.backward()
    expected = nn.functional.mse_loss(plain(x.cuda()), y.cuda())
    expected.backward()
    torch.testing.assert_close(loss.cpu(), expected.cpu(), rtol=0, atol=1e-6)
    for name in ("net1.weight", "net2.weight"):
        got = model.get_parameter(name).grad.cpu()
        torch.testing.assert_close(got, plain.get_parameter(name).grad.cpu(), rtol=0, atol=1e-6)
