"""Checkpoint tensors that are not dense values in memory (sparse, meta, quantized without a
config, nested, subclasses) are refused when the checkpoint is opened, before anything is
installed or written, with the key named; the model stays on meta and ``offload_dir`` empty."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

import automap
from automap.errors import CheckpointError, DispatchError
from automap.loading.pickles import tensor_kind
from conftest import tiny_gpt2

VICTIM = "transformer.h.1.mlp.c_fc.weight"


def _odd(kind: str, dense: torch.Tensor) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if kind == "sparse_coo":
            return dense.to_sparse()
        if kind == "sparse_csr":
            return dense.to_sparse_csr()
        if kind == "meta":
            return torch.empty_like(dense, device="meta")
        if kind == "quantized":
            return torch.quantize_per_tensor(dense, 0.1, 0, torch.qint8)
        if kind == "nested":
            return torch.nested.nested_tensor([dense[0], dense[1, :3]])
    raise AssertionError(kind)


KINDS = ["sparse_coo", "sparse_csr", "meta", "quantized", "nested"]


def _empty_like(model: torch.nn.Module) -> torch.nn.Module:
    with automap.empty_model():
        return type(model)(model.config).eval()


@pytest.mark.parametrize("kind", KINDS)
def test_an_odd_tensor_in_a_pickle_is_refused_before_anything_is_installed(tmp_path, kind):
    real = tiny_gpt2()
    state = {k: v.clone() for k, v in real.state_dict().items()}
    state[VICTIM] = _odd(kind, state[VICTIM])
    checkpoint = tmp_path / "pytorch_model.bin"
    try:
        torch.save(state, checkpoint)
    except Exception as exc:  # noqa: BLE001 - a kind torch itself cannot save is no case here
        pytest.skip(f"torch.save cannot write a {kind} tensor: {exc}")
    model = _empty_like(real)
    offload = tmp_path / "off"
    device_map = {"": "disk"}
    with pytest.raises(CheckpointError) as caught:
        automap.load(model, checkpoint, device_map, offload_dir=offload, quiet=True)
    assert VICTIM in str(caught.value)
    assert all(p.device.type == "meta" for p in model.parameters())
    assert not os.path.exists(offload) or not os.listdir(offload)
    with pytest.raises(DispatchError, match="not dispatched"):  # nothing was installed
        automap.undispatch(model)


@pytest.mark.parametrize("kind", KINDS)
def test_the_one_test_names_every_kind(kind):
    dense = torch.randn(4, 4)
    assert tensor_kind(dense) is None and tensor_kind(torch.nn.Parameter(dense)) is None
    assert tensor_kind(_odd(kind, dense)) is not None
