"""automap's drop-ins for accelerate's big-model functions: the same script run with
``accelerate``'s functions and with ``automap``'s gives the same outputs; the argument
combinations of accelerate's big-model-inference docs work; what automap cannot honour fails
with an AutomapError, and a model accelerate dispatched is refused until its hooks are gone."""
from __future__ import annotations

import importlib
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

import automap
from automap.errors import CheckpointError, DispatchError, PlanError
from conftest import logits_of, store_dirs, tiny_gpt2, tiny_llama, weight_bytes


def _ids() -> torch.Tensor:
    return torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(5))


def _saved(tmp_path: Path, builder=tiny_gpt2, shard: str = "100KB") -> tuple[torch.nn.Module, Path]:
    real = builder()
    folder = tmp_path / "checkpoint"
    real.save_pretrained(folder, max_shard_size=shard)
    return real, folder


def _skeleton(lib, folder: Path) -> torch.nn.Module:
    """The skeleton accelerate's docs build: from_config under init_empty_weights, ties tied."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with lib.init_empty_weights():
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    model.tie_weights()
    return model.eval()


def _script(lib, folder: Path, real: torch.nn.Module, offload: Path, budget: int, block: str) -> dict:
    """One script, written against accelerate's API; ``lib`` is accelerate or automap."""
    model = _skeleton(lib, folder)
    device_map = lib.infer_auto_device_map(model, max_memory={"cpu": budget}, no_split_module_classes=[block])
    model = lib.load_checkpoint_and_dispatch(model, folder, device_map=device_map, offload_folder=offload / "load")
    loaded = logits_of(model, _ids())
    by_hand = {name: "disk" if i % 2 else "cpu" for i, (name, _) in enumerate(real.named_children())}
    dispatched = lib.dispatch_model(real, device_map=by_hand, offload_dir=offload / "dispatch")
    return {"map": device_map, "hf_device_map": model.hf_device_map, "loaded": loaded,
            "dispatched": logits_of(dispatched, _ids()), "by_hand_map": dispatched.hf_device_map}


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_same_script_with_accelerate_and_with_automap_gives_the_same_outputs(name, tmp_path):
    builder, block = {"gpt2": (tiny_gpt2, "GPT2Block"), "llama": (tiny_llama, "LlamaDecoderLayer")}[name]
    results = {}
    for lib_name in ("accelerate", "automap"):
        real, folder = _saved(tmp_path / lib_name, builder)
        expected = logits_of(real, _ids())
        results[lib_name] = _script(importlib.import_module(lib_name), folder, real, tmp_path / lib_name / "off",
                                    weight_bytes(real) // 2, block)
        assert torch.equal(results[lib_name]["loaded"], expected), lib_name
        assert torch.equal(results[lib_name]["dispatched"], expected), lib_name
    ours, theirs = results["automap"], results["accelerate"]
    assert torch.equal(ours["loaded"], theirs["loaded"]) and torch.equal(ours["dispatched"], theirs["dispatched"])
    for result in (ours, theirs):  # same return types and the same kind of map
        assert type(result["map"]) is OrderedDict and set(result["map"].values()) == {"cpu", "disk"}
        assert result["hf_device_map"] == dict(result["map"])
    assert ours["by_hand_map"] == theirs["by_hand_map"]
    # automap read the offloaded safetensors in place: nothing written by the load
    assert not store_dirs(tmp_path / "automap" / "off" / "load")


def test_infer_auto_device_map_as_in_the_docs_plans_hypothetical_gpus():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=4096)
    with automap.init_empty_weights():
        model = LlamaForCausalLM(config)
    size = weight_bytes(model)  # 25 MB at fp32
    # the docs' call, verbatim: two 10 GiB GPUs this machine does not have
    device_map = automap.infer_auto_device_map(model, max_memory={0: "10GiB", 1: "10GiB", "cpu": "30GiB"})
    assert isinstance(device_map, OrderedDict) and set(device_map.values()) <= {0, 1}
    # GPUs that hold 60 % each: split over both, nothing on CPU
    split = automap.infer_auto_device_map(model, max_memory={0: int(size * 0.6), 1: int(size * 0.6), "cpu": "1GB"},
                                          no_split_module_classes=["LlamaDecoderLayer"], dtype="float32")
    assert set(split.values()) == {0, 1}
    # at fp16 the same model takes half the bytes: 35 % each is enough; one key per unit
    half = automap.infer_auto_device_map(model, max_memory={0: int(size * 0.35), 1: int(size * 0.35), "cpu": "1GB"},
                                         dtype=torch.float16, clean_result=False)
    assert set(half.values()) == {0, 1} and "model.layers.0" in half
    assert automap.infer_auto_device_map(model, max_memory={"cpu": "1GB"}) == {"": "cpu"}


def test_load_checkpoint_and_dispatch_as_in_the_docs(tmp_path):
    real, folder = _saved(tmp_path)
    expected = logits_of(real, _ids())
    single = tmp_path / "single"
    real.save_pretrained(single)

    def skeleton():
        return _skeleton(automap, folder)

    calls = {
        "file, auto": lambda: automap.load_checkpoint_and_dispatch(skeleton(), checkpoint=single / "model.safetensors",
                                                                   device_map="auto"),
        "folder, auto, no split": lambda: automap.load_checkpoint_and_dispatch(
            skeleton(), checkpoint=folder, device_map="auto", no_split_module_classes=["GPT2Block"]),
        "positional sharded": lambda: automap.load_checkpoint_and_dispatch(
            skeleton(), str(folder), device_map="auto", no_split_module_classes="GPT2Block"),
        "own map": lambda: automap.load_checkpoint_and_dispatch(
            skeleton(), checkpoint=folder, offload_folder=tmp_path / "off",
            device_map={"transformer.wte": "cpu", "transformer.wpe": "cpu", "transformer.drop": "cpu",
                        "transformer.h.0": "disk", "transformer.h.1": "cpu", "transformer.h.2": "disk",
                        "transformer.h.3": "cpu", "transformer.ln_f": "cpu", "lm_head": "cpu"}),
        "budget": lambda: automap.load_checkpoint_and_dispatch(
            skeleton(), folder, device_map="sequential", max_memory={"cpu": weight_bytes(real) // 3},
            offload_folder=tmp_path / "off2", offload_buffers=True, offload_state_dict=True, strict=True,
            skip_keys="past_key_values", preload_module_classes=["GPT2Block"], force_hooks=True),
    }
    for what, call in calls.items():
        model = call()
        assert torch.equal(logits_of(model, _ids()), expected), what
        assert model.hf_device_map and automap.placement(model).placement, what
        automap.undispatch(model)
    plain = automap.load_checkpoint_and_dispatch(skeleton(), folder, device_map=None)
    assert automap.runtime.state_of(plain) is None and not hasattr(plain, "hf_device_map")
    assert torch.equal(logits_of(plain, _ids()), expected)
    half = automap.load_checkpoint_and_dispatch(skeleton(), folder, dtype="float16", max_memory={"cpu": "1GB"})
    assert half.lm_head.weight.dtype == torch.float16


def test_dispatch_model_as_in_the_docs(tmp_path):
    real = tiny_llama(layers=2)
    expected = logits_of(real, _ids())
    device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "disk",
                  "model.layers.1": "cpu", "model.norm": "cpu", "lm_head": "disk"}
    model = automap.dispatch_model(real, device_map=device_map, offload_dir=tmp_path / "off")
    assert model is real and model.hf_device_map == device_map
    assert torch.equal(logits_of(model, _ids()), expected)
    automap.undispatch(model)
    model = automap.dispatch_model(real, {"": "cpu"}, main_device="cpu", force_hooks=True)
    assert torch.equal(logits_of(model, _ids()), expected)


def test_what_automap_cannot_honour_is_refused_with_the_fix(tmp_path):
    real, folder = _saved(tmp_path)
    with pytest.raises(PlanError, match="special_dtypes"):
        automap.infer_auto_device_map(real, special_dtypes={"lm_head.weight": torch.float32})
    with pytest.raises(PlanError, match="unknown dtype"):
        automap.infer_auto_device_map(real, dtype="float17")
    with pytest.raises(DispatchError, match="state_dict"):
        automap.dispatch_model(real, {"": "cpu"}, state_dict=real.state_dict())
    with pytest.raises(DispatchError, match="offload_index"):
        automap.dispatch_model(real, {"": "cpu"}, offload_index={})
    with pytest.raises(DispatchError, match="main_device"):
        automap.dispatch_model(real, {"transformer": "disk", "lm_head": "cpu"}, main_device="cuda:0",
                               offload_dir=tmp_path / "off")
    assert automap.runtime.state_of(real) is None, "a refused dispatch leaves the model as it was"
    with pytest.raises(CheckpointError, match="one process"):
        automap.load_checkpoint_and_dispatch(_skeleton(automap, folder), folder, full_state_dict=False)
    with pytest.raises(CheckpointError, match="include_buffers"):
        with automap.init_empty_weights(include_buffers=True):
            pass


def test_model_dispatched_by_accelerate_is_refused_until_its_hooks_are_removed(tmp_path):
    import accelerate
    from accelerate.hooks import remove_hook_from_module

    real = tiny_gpt2()
    expected = logits_of(real, _ids())
    accelerate.dispatch_model(real, {"transformer": "cpu", "lm_head": "disk"}, offload_dir=str(tmp_path / "acc"))
    with pytest.raises(DispatchError, match=r"remove_hook_from_module\(model, recurse=True\)"):
        automap.dispatch(real, max_memory={"cpu": "10GB"})
    with pytest.raises(DispatchError, match="dispatched by accelerate"):
        automap.dispatch_model(real, {"": "cpu"})
    remove_hook_from_module(real, recurse=True)
    model = automap.dispatch(real, max_memory={"cpu": weight_bytes(real) // 2}, offload_dir=tmp_path / "ours")
    assert "disk" in automap.placement(model).placement
    assert torch.equal(logits_of(model, _ids()), expected)


def test_grouped_merges_modules_on_one_resident_device_only():
    device_map = {"a.0": "cpu", "a.1": "cpu", "b.0": "disk", "b.1": "disk", "c": 0, "d.x": 0, "d.y": 1}
    assert automap.accelerate_compat.grouped(device_map) == {"a": "cpu", "b.0": "disk", "b.1": "disk", "c": 0,
                                                             "d.x": 0, "d.y": 1}
    assert automap.accelerate_compat.grouped({"a": "cpu", "b.c": "cpu"}) == {"": "cpu"}
