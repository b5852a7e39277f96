"""A model in training mode is traced as it trains (automap/profiling/build.py): what autograd
keeps for the backward — dropout's masks, the attention scores a dropout needs (torch's CPU
math path), BatchNorm's batch statistics — is counted, and compared here with what a real
forward with grad keeps (the storages its saved-tensor hooks see, parameters aside)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import automap
from conftest import tiny_gpt2, tiny_llama


def kept_by_a_real_forward(model: nn.Module, inputs: dict | tuple) -> int:
    """Bytes of the distinct storages autograd saves in one forward with grad, and the output."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            saved[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(**inputs) if isinstance(inputs, dict) else model(*inputs)
    first = out.logits if hasattr(out, "logits") else out
    saved.setdefault(first.untyped_storage().data_ptr(), first.untyped_storage().nbytes())
    return sum(saved.values())


@pytest.mark.parametrize("build", [tiny_gpt2, tiny_llama], ids=["gpt2-dropout", "llama-no-dropout"])
def test_the_training_peak_is_what_a_real_forward_with_grad_keeps(build):
    torch.manual_seed(0)
    model = build().train()
    ids = {"input_ids": torch.randint(0, 200, (2, 64))}
    predicted = automap.profile(model, ids).train_peak_bytes
    real = kept_by_a_real_forward(model, ids)
    assert 0.95 * real <= predicted <= 1.25 * real, (predicted, real)


def test_dropout_in_training_counts_and_not_in_eval():
    model = nn.Sequential(nn.Linear(256, 1024), nn.Dropout(0.1), nn.GELU(), nn.Linear(1024, 256))
    x = (torch.randn(8, 256),)
    training = automap.profile(model.train(), x).train_peak_bytes
    evaluating = automap.profile(model.eval(), x).train_peak_bytes
    assert training >= evaluating + 8 * 1024 * 4  # the dropout's output is kept for the next Linear
    assert training >= 0.95 * kept_by_a_real_forward(model.train(), x)


def test_batchnorm_training_on_a_batch_of_one_is_traced_in_eval_mode():
    """A training forward BatchNorm refuses (one value per channel): the plan still comes, traced
    as an inference forward, and the model's modes are as they were."""
    model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4)).train()
    with pytest.raises(ValueError):
        model(torch.randn(1, 16))
    plan = automap.plan(model, max_memory={"cpu": "1GiB"}, example_inputs=(torch.randn(1, 16),))
    assert plan.activation_peak_bytes > 0
    assert all(m.training for m in model.modules())
    assert all(not u.untraced for u in plan.units)
