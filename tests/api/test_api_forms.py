"""transformers' argument forms in ``automap.load`` and ``automap.plan``: dtype names and
``"auto"``, ``torch_dtype=`` and ``offload_folder=``, one device as the whole ``device_map``;
bad values are AutomapErrors that say what to give instead."""

from __future__ import annotations

import pytest
import torch

import automap
from automap.devices import canonical_name
from automap.errors import DeviceError, PlanError
from conftest import logits_of, tiny_gpt2, tiny_llama, weight_bytes
from tiny_configs import beside_the_run


def _ids() -> torch.Tensor:
    return torch.randint(0, 256, (1, 7), generator=torch.Generator().manual_seed(2))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    real = tiny_llama(layers=2)
    path = tmp_path_factory.mktemp("forms") / "llama"
    real.to(torch.bfloat16).save_pretrained(path)  # stored, and said in config.json, as bfloat16
    return real, path


@pytest.mark.parametrize(
    "form",
    [
        {"dtype": "float16"},
        {"dtype": "torch.float16"},
        {"torch_dtype": torch.float16},
        {"torch_dtype": "float16"},
    ],
)
def test_dtype_by_name_or_by_its_old_keyword(folder, form):
    real, path = folder
    model = automap.load(path, max_memory={"cpu": "1GB"}, quiet=True, **form)
    assert {p.dtype for p in model.parameters()} == {torch.float16}
    # the same weights (bf16 values are exact in fp16 here); buffers computed at fp16 may round apart
    torch.testing.assert_close(
        logits_of(model, _ids()), logits_of(real.to(torch.float16), _ids()), atol=2e-3, rtol=2e-3
    )


def test_auto_dtype_is_the_checkpoints_in_both_forms(folder, tmp_path):
    real, path = folder
    model = automap.load(path, dtype="auto", max_memory={"cpu": "1GB"}, quiet=True)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    with automap.empty_model():
        skeleton = type(real)(real.config).to(torch.float32)
    loaded = automap.load(skeleton, path, {"": "cpu"}, dtype="auto", quiet=True)
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}
    assert (
        loaded.model.rotary_emb.inv_freq.dtype == torch.float32
    )  # computed, not a weight: as accelerate keeps it
    assert torch.equal(logits_of(loaded, _ids()), logits_of(model, _ids()))


def test_offload_folder_is_offload_dir(folder, tmp_path):
    real, path = folder
    budget = beside_the_run(real, weight_bytes(real), torch.float32)  # at fp32: about half on disk
    model = automap.load(
        path, dtype=torch.float32, max_memory={"cpu": budget}, quiet=True, offload_folder=tmp_path / "off"
    )
    assert "disk" in automap.placement(model).placement
    assert any((tmp_path / "off").iterdir()), "converted weights were written where offload_folder points"
    with pytest.raises(PlanError, match="same argument"):
        automap.load(path, offload_dir=tmp_path / "a", offload_folder=tmp_path / "b")
    with pytest.raises(PlanError, match="same argument"):
        automap.load(path, dtype="float16", torch_dtype="float16")


@pytest.mark.parametrize("device", ["cpu", "cuda:0", 0, torch.device("cuda", 1), "disk"])
def test_one_device_is_the_whole_model_there(device):
    model = tiny_gpt2()
    plan = automap.plan(model, device, max_memory={0: "1GB", 1: "1GB", "cpu": "1GB"})
    expected = canonical_name(str(device) if isinstance(device, torch.device) else device)
    assert set(plan.placement) == {expected}


def test_one_device_map_loads_on_the_cpu_and_refuses_a_missing_gpu(folder):
    real, path = folder
    model = automap.load(path, device_map="cpu", dtype="bfloat16", quiet=True)
    assert set(automap.placement(model).placement) == {"cpu"}
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.bfloat16
    ).eval()  # a folder loads as it does
    assert torch.equal(logits_of(model, _ids()), logits_of(plain, _ids()))
    if not torch.cuda.is_available():
        with pytest.raises(DeviceError):
            automap.load(path, device_map=0, quiet=True)


@pytest.mark.parametrize(
    "bad, match",
    [
        ("bfloat17", "not a floating-point dtype"),
        (torch.int8, "floating-point"),
        ("auto", "checkpoint's dtype, in automap.load"),
        (3, "floating-point"),
    ],
)
def test_bad_dtypes_are_plan_errors_with_the_forms_to_use(bad, match):
    with pytest.raises(PlanError, match=match):
        automap.plan(tiny_gpt2(), max_memory={"cpu": "1GB"}, dtype=bad)


def test_bad_device_maps_name_the_strategies_and_devices():
    with pytest.raises(PlanError, match="neither a strategy .*auto.* nor a device"):
        automap.plan(tiny_gpt2(), "fastest", max_memory={"cpu": "1GB"})
    with pytest.raises(PlanError, match="strategy name, a device"):
        automap.plan(tiny_gpt2(), 1.5, max_memory={"cpu": "1GB"})
