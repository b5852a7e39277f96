"""Ordinary PyTorch modules and scripts, as a user writes them without automap in mind, give the
outputs (and side effects) they give plainly: hooks the user registered, reparametrized weights,
modules used the way torch's own API allows."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn
from safetensors.torch import save_file
from torch.nn.utils import prune, weight_norm

import automap
from automap.errors import CheckpointError, DispatchError


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.Linear(16, 4)).eval()


def _observed(model: nn.Module, seen: dict[str, list]) -> None:
    """Hooks as feature extraction and gradient logging register them: each call appends."""
    layer = model[2]
    layer.register_forward_pre_hook(lambda m, args: seen["pre"].append(args[0].detach()))
    layer.register_forward_hook(lambda m, args, out: seen["forward"].append(out.detach()))
    layer.register_full_backward_pre_hook(lambda m, grad_out: seen["backward_pre"].append(grad_out[0]))
    layer.register_full_backward_hook(lambda m, grad_in, grad_out: seen["backward"].append(grad_out[0]))


def _run(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    x = x.clone().requires_grad_(True)
    model(x).sum().backward()
    assert x.grad is not None
    return x.grad


def test_planning_and_dispatch_call_no_hook_the_user_registered(tmp_path):
    plain, placed = _mlp().requires_grad_(False), _mlp().requires_grad_(False)
    seen_plain: dict[str, list] = {k: [] for k in ("pre", "forward", "backward_pre", "backward")}
    seen: dict[str, list] = {k: [] for k in seen_plain}
    _observed(plain, seen_plain)
    _observed(placed, seen)
    automap.plan(placed, max_memory={"cpu": 0}, example_inputs=(torch.randn(2, 16),))
    automap.profile(placed, measure=True, device="cpu", repeats=1)
    automap.dispatch(placed, device_map="auto", max_memory={"cpu": 0}, offload_dir=tmp_path)
    assert all(not calls for calls in seen.values()), {k: len(v) for k, v in seen.items()}
    x = torch.randn(3, 16)
    assert torch.equal(_run(placed, x), _run(plain, x))
    for kind, calls in seen_plain.items():  # one call each, the same tensors as the plain model's
        assert len(seen[kind]) == len(calls) == 1, kind
        assert seen[kind][0].device.type == "cpu" and torch.equal(seen[kind][0], calls[0]), kind
    automap.undispatch(placed)


def _reparametrized() -> nn.Sequential:
    """torch's own hook-based reparametrizations: the weight is rebuilt by a pre-hook."""
    model = _mlp()
    weight_norm(model[0])
    prune.l1_unstructured(model[2], "weight", amount=0.5)
    return model


def test_torchs_own_hooks_still_run_in_the_trace_and_the_forward(tmp_path):
    prof = automap.profile(_reparametrized(), example_inputs=(torch.randn(2, 16),))
    assert all(not unit.untraced and unit.flops > 0 for unit in prof.units), [
        (u.name, u.untraced) for u in prof.units
    ]
    plain, placed = _reparametrized(), _reparametrized()
    automap.dispatch(placed, device_map="auto", max_memory={"cpu": 0}, offload_dir=tmp_path)
    x = torch.randn(3, 16)
    with torch.no_grad():
        assert torch.equal(placed(x), plain(x))
    automap.undispatch(placed)


def _widened() -> nn.Sequential:
    """A user's pre-hook that the forward needs: it doubles the width of layer 2's input."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(32, 16), nn.Linear(16, 4)).eval()
    model[2].register_forward_pre_hook(lambda m, args: (torch.cat([args[0], args[0]], -1),))
    return model


def test_a_user_hook_the_forward_needs_is_traced_with_it(tmp_path):
    x = torch.randn(3, 16)
    prof = automap.profile(_widened(), example_inputs=(x,))
    assert all(not unit.untraced and unit.flops > 0 for unit in prof.units), [
        (u.name, u.untraced) for u in prof.units
    ]
    plain, placed = _widened(), _widened()
    automap.dispatch(
        placed, device_map="auto", max_memory={"cpu": 0}, offload_dir=tmp_path, example_inputs=(x,)
    )
    with torch.no_grad():
        assert torch.equal(placed(x), plain(x))


def _no_guard_left(model: nn.Module) -> bool:
    return all(
        not (module.__dict__.keys() & {"_apply", "__getstate__", "__deepcopy__"})
        and not module._forward_hooks
        and not module._forward_pre_hooks
        for module in model.modules()
    )


@pytest.mark.parametrize(
    "first, second, says",
    [
        (lambda m: m[2], lambda m: m, "submodule '2' (Linear) is dispatched already"),
        (lambda m: m, lambda m: m[2], "Linear is a part of a Sequential that automap dispatched"),
    ],
)
def test_a_part_of_a_dispatched_model_and_a_model_with_a_dispatched_part_are_refused(
    first, second, says, tmp_path
):
    model = _mlp()
    x = torch.randn(3, 16)
    with torch.no_grad():
        expected = model(x)
    automap.dispatch(first(model), device_map="auto", max_memory={"cpu": 0}, offload_dir=tmp_path / "a")
    with pytest.raises(DispatchError, match=re.escape(says)):
        automap.dispatch(second(model), device_map="auto", max_memory={"cpu": 0}, offload_dir=tmp_path / "b")
    with torch.no_grad():
        assert torch.equal(model(x), expected)
    automap.undispatch(first(model))
    assert _no_guard_left(model)
    automap.dispatch(model, device_map="auto", max_memory={"cpu": 0}, offload_dir=tmp_path / "c")
    automap.undispatch(model)


def test_a_module_two_models_share_is_dispatched_with_one_of_them_only(tmp_path):
    shared = nn.Linear(16, 16)
    one, two = nn.Sequential(nn.Linear(16, 16), shared), nn.Sequential(shared, nn.Linear(16, 4))
    automap.dispatch(one, device_map="auto", max_memory={"cpu": 0}, offload_dir=tmp_path)
    with pytest.raises(
        DispatchError, match=r"shares its module '0' with a Sequential that automap dispatched \(its '1'\)"
    ):
        automap.dispatch(two, device_map="auto", max_memory={"cpu": 0}, offload_dir=tmp_path)
    automap.undispatch(one)
    assert _no_guard_left(one) and _no_guard_left(two)


class Scaled(nn.Module):
    """A module with extra state (``get_extra_state``): a plain float saved in its state dict."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)
        self.scale = 2.0

    def get_extra_state(self):
        return {"scale": self.scale}

    def set_extra_state(self, state):
        self.scale = state["scale"]

    def forward(self, x):
        return self.b(self.a(x)) * self.scale


class TensorScaled(Scaled):
    """Extra state as a tensor (as Transformer Engine saves its own), which safetensors holds."""

    def get_extra_state(self):
        return torch.tensor([self.scale])

    def set_extra_state(self, state):
        self.scale = float(state[0])


@pytest.mark.parametrize(
    "kind, suffix", [(Scaled, ".pt"), (TensorScaled, ".pt"), (TensorScaled, ".safetensors")]
)
@pytest.mark.parametrize("budget", [0, "1GiB"])
def test_a_modules_extra_state_is_loaded_as_load_state_dict_loads_it(kind, suffix, budget, tmp_path):
    torch.manual_seed(0)
    saved = kind().eval()
    saved.scale = 3.0
    path = tmp_path / f"model{suffix}"
    if suffix == ".pt":
        torch.save(saved.state_dict(), path)
    else:
        save_file(saved.state_dict(), path)
    with automap.empty_model():
        model = kind().eval()
    automap.load(model, path, max_memory={"cpu": budget}, offload_dir=tmp_path / "off")
    assert model.scale == 3.0
    x = torch.randn(3, 16)
    with torch.no_grad():
        assert torch.equal(model(x), saved(x))


def test_extra_state_a_checkpoint_lacks_is_missing_unless_not_strict(tmp_path):
    saved = Scaled()
    path = tmp_path / "model.safetensors"
    save_file({k: v for k, v in saved.state_dict().items() if isinstance(v, torch.Tensor)}, path)
    with automap.empty_model():
        model = Scaled()
    with pytest.raises(CheckpointError, match="_extra_state"):
        automap.load(model, path, max_memory={"cpu": 0}, offload_dir=tmp_path / "off")
    with pytest.warns(UserWarning, match="_extra_state"):
        automap.load(model, path, max_memory={"cpu": 0}, offload_dir=tmp_path / "off", strict=False)
    assert model.scale == 2.0  # its own, as load_state_dict(strict=False) leaves it
