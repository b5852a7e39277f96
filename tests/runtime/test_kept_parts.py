"""Dispatch state owned by every module it touches: a part the user keeps after dropping the
dispatched model (``backbone = model.backbone; del model``, peft's ``merge_and_unload``) runs as
before, is converted under the same rules as the model (a refusal, never an AssertionError), is
undispatched by itself, and is dispatched again as a model of its own without a second set of
hooks; a dispatched model dropped without undispatch frees its store for the next dispatch."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

import automap
from automap.errors import ConversionError, DispatchError
from automap.runtime import state_of
from conftest import file_backing, store_dirs, tiny_llama


class Tower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.backbone = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])
        self.head = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))


DISK = {
    "backbone.0": "cpu",
    "backbone.1": "cpu",
    "backbone.2": "disk",
    "backbone.3": "disk",
    "backbone.4": "disk",
    "backbone.5": "disk",
    "head": "cpu",
}


def x() -> torch.Tensor:
    return torch.randn(3, 64, generator=torch.Generator().manual_seed(1))


def hooks(model: nn.Module) -> int:
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())


def plain(model: nn.Module) -> bool:
    overrides = [m for m in model.modules() if {"_apply", "__getstate__", "__deepcopy__"} & set(m.__dict__)]
    in_files = [n for n, t in model.state_dict().items() if file_backing(t) is not None]
    return not hooks(model) and not overrides and not in_files and state_of(model) is None


def kept_backbone(tmp_path) -> tuple[nn.Sequential, torch.Tensor]:
    """The backbone of a dispatched Tower (4 of its 6 layers on disk), the Tower dropped."""
    model = automap.dispatch(Tower().eval(), DISK, offload_dir=tmp_path / "off")
    with torch.no_grad():
        expected = Tower().eval().backbone(x())
    backbone = model.backbone
    del model
    gc.collect()
    return backbone, expected


def test_a_kept_part_runs_as_before_and_is_converted_under_the_models_rules(tmp_path):
    backbone, expected = kept_backbone(tmp_path)
    with torch.no_grad():
        assert torch.equal(backbone(x()), expected)
    for convert in (lambda m: m.half(), lambda m: m.to(torch.float64), lambda m: m[3].bfloat16()):
        with pytest.raises(ConversionError, match="automap.undispatch"):
            convert(backbone)
    assert backbone.to("cpu") is backbone  # changes nothing: goes through
    with torch.no_grad():
        assert torch.equal(backbone(x()), expected)


def test_a_kept_part_is_undispatched_by_itself(tmp_path):
    backbone, expected = kept_backbone(tmp_path)
    assert automap.undispatch(backbone) is backbone
    assert plain(backbone)
    with torch.no_grad():
        assert torch.equal(backbone(x()), expected)
    backbone.half()  # a plain model again: converted like any other
    with pytest.raises(DispatchError, match="not dispatched"):
        automap.undispatch(backbone)


def test_a_kept_part_is_dispatched_again_as_its_own_model_without_stacked_hooks(tmp_path):
    backbone, expected = kept_backbone(tmp_path)
    fresh = automap.dispatch(
        Tower().eval().backbone,
        {"0": "cpu", "1": "cpu", "2": "disk", "3": "disk", "4": "disk", "5": "disk"},
        offload_dir=tmp_path / "off2",
    )
    automap.dispatch(
        backbone,
        {"0": "cpu", "1": "cpu", "2": "disk", "3": "disk", "4": "disk", "5": "disk"},
        offload_dir=tmp_path / "off",
    )
    assert hooks(backbone) == hooks(fresh)
    assert state_of(backbone).model is backbone
    with torch.no_grad():
        assert torch.equal(backbone(x()), expected)
    automap.undispatch(backbone)
    assert plain(backbone)


def test_a_part_of_a_live_dispatched_model_is_refused_with_the_model_to_undo(tmp_path):
    model = automap.dispatch(Tower().eval(), DISK, offload_dir=tmp_path / "off")
    with pytest.raises(DispatchError, match="part of a dispatched Tower"):
        automap.undispatch(model.backbone)
    with pytest.raises(DispatchError, match="part of a Tower"):
        automap.dispatch(model.backbone, "auto")
    with pytest.raises(ConversionError):
        model.backbone.half()
    automap.undispatch(model)
    assert plain(model)


def test_a_dropped_dispatched_model_frees_its_store_for_the_next_dispatch_of_the_same_weights(tmp_path):
    model = automap.dispatch(Tower().eval(), DISK, offload_dir=tmp_path / "off")
    with torch.no_grad():
        model(x())
    del model
    gc.collect()
    again = automap.dispatch(Tower().eval(), DISK, offload_dir=tmp_path / "off")
    assert len(store_dirs(tmp_path / "off")) == 1  # the store reused, not a second one written
    with torch.no_grad():
        assert torch.equal(again(x()), Tower().eval()(x()))
    automap.undispatch(again)


def test_a_kept_part_still_holds_the_store_until_it_is_dropped_too(tmp_path):
    backbone, _ = kept_backbone(tmp_path)
    second = automap.dispatch(Tower().eval(), DISK, offload_dir=tmp_path / "off")
    assert len(store_dirs(tmp_path / "off")) == 2  # the kept part's store is locked: a second one
    automap.undispatch(second)
    del backbone
    gc.collect()
    third = automap.dispatch(Tower().eval(), DISK, offload_dir=tmp_path / "off")
    assert len(store_dirs(tmp_path / "off")) == 2  # one of the two reused
    automap.undispatch(third)


def lora_llama():
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    return get_peft_model(tiny_llama(layers=4), config).eval()


def test_peft_merge_and_unload_of_a_dispatched_model_keeps_a_model_that_runs_and_undispatches(tmp_path):
    ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = lora_llama().merge_and_unload()(ids).logits
    model = automap.dispatch(
        lora_llama(),
        {"": "cpu", "base_model.model.model.layers.2": "disk", "base_model.model.model.layers.3": "disk"},
        offload_dir=tmp_path / "off",
    )
    model = model.merge_and_unload()  # the PeftModel, the dispatched root, is dropped
    gc.collect()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, expected)
    with pytest.raises(ConversionError):
        model.half()
    automap.undispatch(model)
    assert plain(model)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, expected)
    automap.dispatch(model, {"": "cpu", "model.layers.3": "disk"}, offload_dir=tmp_path / "off")
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, expected)
    automap.undispatch(model)
    assert plain(model)
