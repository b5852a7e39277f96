"""Weights offloaded in their memory order: a channels-last convolution weight or a transposed
parameter goes to the store as the bytes it is in memory, with the permutation that gives its
strides back (``automap.permutations`` in the file's metadata). The dispatched model computes
with the same layout as the plain one (the same kernels: bit for bit where the kernel's path
depends on it), and undispatch gives each weight back with the strides it had."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torchvision
from torch import nn

import automap
from automap.errors import FormatError
from automap.offload.format import PERMUTATIONS, memory_order, write_file
from automap.offload.mapped import MappedFile


class Transposed(nn.Module):
    """A parameter kept as the transpose of a contiguous one: ``x @ w`` runs on its strides."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(64, 16).t())
        self.head = nn.Linear(64, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x @ self.w)


def _strides(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Strides of every tensor with more than one element per dim (a size-1 dim's is arbitrary)."""
    return {n: tuple(s for s, d in zip(t.stride(), t.shape) if d > 1) for n, t in model.state_dict().items()}


@pytest.mark.parametrize("case", ["channels_last_resnet18", "transposed"])
def test_offloaded_weights_keep_their_strides_and_the_plain_outputs(case, tmp_path):
    torch.manual_seed(0)
    if case == "transposed":
        plain, x = Transposed().eval(), torch.randn(5, 16)
    else:
        plain = torchvision.models.resnet18().eval().to(memory_format=torch.channels_last)
        x = torch.randn(2, 3, 64, 64).to(memory_format=torch.channels_last)
    with torch.no_grad():
        expected = plain(x)
    model = copy.deepcopy(plain)
    automap.dispatch(model, device_map={"": "disk"}, offload_dir=tmp_path)
    assert _strides(model) == _strides(plain)
    with torch.no_grad():
        assert torch.equal(model(x), expected)
    automap.undispatch(model)
    assert _strides(model) == _strides(plain)
    again = copy.deepcopy(plain)  # the same weights: the store on disk is taken as it is
    automap.dispatch(again, device_map={"": "disk"}, offload_dir=tmp_path)
    assert _strides(again) == _strides(plain)
    with torch.no_grad():
        assert torch.equal(again(x), expected)


def test_memory_order_lays_out_what_a_permutation_can_and_copies_the_rest():
    base = torch.randn(4, 5, 6)
    stored, order = memory_order(base.permute(2, 0, 1))
    assert stored.is_contiguous() and stored.data_ptr() == base.data_ptr()  # no copy: the bytes as they are
    assert torch.equal(stored.permute(order), base.permute(2, 0, 1))
    assert memory_order(base)[1] is None
    gappy = base[:, ::2]  # elements with gaps between them: no order lays it out densely
    stored, order = memory_order(gappy)
    assert order is None and stored.is_contiguous() and torch.equal(stored, gappy)


@pytest.mark.parametrize(
    "entry", ['{"w": [0, 0]}', '{"w": [2, 0]}', '{"nope": [1, 0]}', "[1, 0]", '{"w": [1.0, 0]}']
)
def test_a_file_whose_permutations_do_not_fit_its_tensors_is_refused(entry, tmp_path):
    path = tmp_path / "bad.safetensors"
    write_file(path, {"w": torch.zeros(2, 3)}, {PERMUTATIONS: entry})
    with pytest.raises(FormatError, match="permutations"):
        MappedFile(path)


def test_a_file_with_permutations_maps_each_tensor_with_its_strides(tmp_path):
    path = tmp_path / "good.safetensors"
    weight = torch.randn(3, 4).t()
    stored, order = memory_order(weight)
    write_file(path, {"w": stored}, {PERMUTATIONS: json.dumps({"w": order})})
    mapped = MappedFile(path)
    assert torch.equal(mapped.tensor("w"), weight) and mapped.tensor("w").stride() == weight.stride()


def test_the_staged_path_copies_each_weight_into_its_own_strides(tmp_path):
    """As on a GPU (HostCopyOps stands in for the device): the copy a unit computes with has
    the weight's strides, so a channels-last model runs its channels-last kernels."""
    from automap.offload import HostCopyOps, StagedTransfer
    from automap.runtime import dispatch_plan

    torch.manual_seed(0)
    plain = torchvision.models.resnet18().eval().to(memory_format=torch.channels_last)
    x = torch.randn(2, 3, 64, 64).to(memory_format=torch.channels_last)
    with torch.no_grad():
        expected = plain(x)
    model = copy.deepcopy(plain)
    dispatch_plan(
        model,
        automap.plan(model, {"": "disk"}),
        offload_dir=tmp_path,
        transfer=lambda source, *_: StagedTransfer(source, HostCopyOps()),
    )
    seen = {}
    model.layer1[0].conv1.register_forward_pre_hook(lambda m, a: seen.update(stride=m.weight.stride()))
    with torch.no_grad():
        assert torch.equal(model(x), expected)
    assert seen["stride"] == plain.layer1[0].conv1.weight.stride()
