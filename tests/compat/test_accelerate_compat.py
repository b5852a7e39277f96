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
from tiny_configs import beside_the_run, part_on_disk


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
    model = lib.load_checkpoint_and_dispatch(
        model, folder, device_map=device_map, offload_folder=offload / "load"
    )
    loaded = logits_of(model, _ids())
    by_hand = {name: "disk" if i % 2 else "cpu" for i, (name, _) in enumerate(real.named_children())}
    dispatched = lib.dispatch_model(real, device_map=by_hand, offload_dir=offload / "dispatch")
    return {
        "map": device_map,
        "hf_device_map": model.hf_device_map,
        "loaded": loaded,
        "dispatched": logits_of(dispatched, _ids()),
        "by_hand_map": dispatched.hf_device_map,
    }


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_same_script_with_accelerate_and_with_automap_gives_the_same_outputs(name, tmp_path):
    builder, block = {"gpt2": (tiny_gpt2, "GPT2Block"), "llama": (tiny_llama, "LlamaDecoderLayer")}[name]
    results = {}
    for lib_name in ("accelerate", "automap"):
        real, folder = _saved(tmp_path / lib_name, builder)
        expected = logits_of(real, _ids())
        # half the weights in RAM: accelerate's budget counts weights only, automap's the run beside them
        budget = weight_bytes(real) // 2
        budget = budget if lib_name == "accelerate" else beside_the_run(real, budget)
        results[lib_name] = _script(
            importlib.import_module(lib_name), folder, real, tmp_path / lib_name / "off", budget, block
        )
        assert torch.equal(results[lib_name]["loaded"], expected), lib_name
        assert torch.equal(results[lib_name]["dispatched"], expected), lib_name
    ours, theirs = results["automap"], results["accelerate"]
    assert torch.equal(ours["loaded"], theirs["loaded"]) and torch.equal(
        ours["dispatched"], theirs["dispatched"]
    )
    for result in (ours, theirs):  # same return types and the same kind of map
        assert type(result["map"]) is OrderedDict and set(result["map"].values()) == {"cpu", "disk"}
        assert result["hf_device_map"] == dict(result["map"])
    assert ours["by_hand_map"] == theirs["by_hand_map"]
    # automap read the offloaded safetensors in place: nothing written by the load
    assert not store_dirs(tmp_path / "automap" / "off" / "load")


def test_infer_auto_device_map_as_in_the_docs_plans_hypothetical_gpus():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=4096,
    )
    with automap.init_empty_weights():
        model = LlamaForCausalLM(config)
    size = weight_bytes(model)  # 25 MB at fp32
    # the docs' call, verbatim: two 10 GiB GPUs this machine does not have
    device_map = automap.infer_auto_device_map(model, max_memory={0: "10GiB", 1: "10GiB", "cpu": "30GiB"})
    assert isinstance(device_map, OrderedDict) and set(device_map.values()) <= {0, 1}
    # GPUs that hold 60 % each: split over both, nothing on CPU
    split = automap.infer_auto_device_map(
        model,
        max_memory={0: int(size * 0.6), 1: int(size * 0.6), "cpu": "1GB"},
        no_split_module_classes=["LlamaDecoderLayer"],
        dtype="float32",
    )
    assert set(split.values()) == {0, 1}
    # at fp16 the same model takes half the bytes: 35 % each is enough; one key per unit
    half = automap.infer_auto_device_map(
        model,
        max_memory={0: int(size * 0.35), 1: int(size * 0.35), "cpu": "1GB"},
        dtype=torch.float16,
        clean_result=False,
    )
    assert set(half.values()) == {0, 1} and "model.layers.0" in half
    assert automap.infer_auto_device_map(model, max_memory={"cpu": "1GB"}) == {"": "cpu"}


def test_load_checkpoint_and_dispatch_as_in_the_docs(tmp_path):
    real, folder = _saved(tmp_path)
    expected = logits_of(real, _ids())
    single = tmp_path / "single"
    real.save_pretrained(single)

    def skeleton():
        return _skeleton(automap, folder)

    third = beside_the_run(real, weight_bytes(real) // 3)
    calls = {
        "file, auto": lambda: automap.load_checkpoint_and_dispatch(
            skeleton(), checkpoint=single / "model.safetensors", device_map="auto"
        ),
        "folder, auto, no split": lambda: automap.load_checkpoint_and_dispatch(
            skeleton(), checkpoint=folder, device_map="auto", no_split_module_classes=["GPT2Block"]
        ),
        "positional sharded": lambda: automap.load_checkpoint_and_dispatch(
            skeleton(), str(folder), device_map="auto", no_split_module_classes="GPT2Block"
        ),
        "own map": lambda: automap.load_checkpoint_and_dispatch(
            skeleton(),
            checkpoint=folder,
            offload_folder=tmp_path / "off",
            device_map={
                "transformer.wte": "cpu",
                "transformer.wpe": "cpu",
                "transformer.drop": "cpu",
                "transformer.h.0": "disk",
                "transformer.h.1": "cpu",
                "transformer.h.2": "disk",
                "transformer.h.3": "cpu",
                "transformer.ln_f": "cpu",
                "lm_head": "cpu",
            },
        ),
        "budget": lambda: automap.load_checkpoint_and_dispatch(
            skeleton(),
            folder,
            device_map="sequential",
            max_memory={"cpu": third},
            offload_folder=tmp_path / "off2",
            offload_buffers=True,
            offload_state_dict=True,
            strict=True,
            skip_keys="past_key_values",
            preload_module_classes=["GPT2Block"],
            force_hooks=True,
        ),
    }
    for what, call in calls.items():
        model = call()
        assert torch.equal(logits_of(model, _ids()), expected), what
        assert model.hf_device_map and automap.placement(model).placement, what
        automap.undispatch(model)
    plain = automap.load_checkpoint_and_dispatch(skeleton(), folder, device_map=None)
    assert automap.runtime.state_of(plain) is None and not hasattr(plain, "hf_device_map")
    assert torch.equal(logits_of(plain, _ids()), expected)
    half = automap.load_checkpoint_and_dispatch(
        skeleton(), folder, dtype="float16", max_memory={"cpu": "1GB"}
    )
    assert half.lm_head.weight.dtype == torch.float16


def test_dispatch_model_as_in_the_docs(tmp_path):
    real = tiny_llama(layers=2)
    expected = logits_of(real, _ids())
    device_map = {
        "model.embed_tokens": "cpu",
        "model.rotary_emb": "cpu",
        "model.layers.0": "disk",
        "model.layers.1": "cpu",
        "model.norm": "cpu",
        "lm_head": "disk",
    }
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
    with pytest.raises(PlanError, match="not a floating-point dtype"):
        automap.infer_auto_device_map(real, dtype="float17")
    with pytest.raises(DispatchError, match="state_dict"):
        automap.dispatch_model(real, {"": "cpu"}, state_dict=real.state_dict())
    with pytest.raises(DispatchError, match="offload_index"):
        automap.dispatch_model(real, {"": "cpu"}, offload_index={})
    with pytest.raises(DispatchError, match="main_device"):
        automap.dispatch_model(
            real,
            {"transformer": "disk", "lm_head": "cpu"},
            main_device="cuda:0",
            offload_dir=tmp_path / "off",
        )
    assert automap.runtime.state_of(real) is None, "a refused dispatch leaves the model as it was"
    with pytest.raises(CheckpointError, match="one process"):
        automap.load_checkpoint_and_dispatch(_skeleton(automap, folder), folder, full_state_dict=False)


def test_model_dispatched_by_accelerate_is_refused_until_its_hooks_are_removed(tmp_path):
    import accelerate
    from accelerate.hooks import remove_hook_from_module

    real = tiny_gpt2()
    expected = logits_of(real, _ids())
    accelerate.dispatch_model(
        real, {"transformer": "cpu", "lm_head": "disk"}, offload_dir=str(tmp_path / "acc")
    )
    with pytest.raises(DispatchError, match=r"remove_hook_from_module\(model, recurse=True\)"):
        automap.dispatch(real, max_memory={"cpu": "10GB"})
    with pytest.raises(DispatchError, match="dispatched by accelerate"):
        automap.dispatch_model(real, {"": "cpu"})
    remove_hook_from_module(real, recurse=True)
    model = automap.dispatch(real, max_memory=part_on_disk(real), offload_dir=tmp_path / "ours")
    assert "disk" in automap.placement(model).placement
    assert torch.equal(logits_of(model, _ids()), expected)


def test_grouped_merges_modules_on_one_resident_device_only_and_keeps_the_order():
    device_map = {"a.0": "cpu", "a.1": "cpu", "b.0": "disk", "b.1": "disk", "c": 0, "d.x": 0, "d.y": 1}
    assert automap.accelerate_compat.grouped(device_map) == {
        "a": "cpu",
        "b.0": "disk",
        "b.1": "disk",
        "c": 0,
        "d.x": 0,
        "d.y": 1,
    }
    assert automap.accelerate_compat.grouped({"a": "cpu", "b.c": "cpu"}) == {"": "cpu"}
    merged = automap.accelerate_compat.grouped({"x": 1, "a.0": 0, "a.1": 0, "b.y": 1, "b.z": 1})
    assert list(merged.items()) == [("x", 1), ("a", 0), ("b", 1)]


# --- scripts written for accelerate that must keep working ---------------------------------


class _Norm(torch.nn.Module):
    """A small model with a buffer-carrying layer, as accelerate's own tests use."""

    def __init__(self):
        super().__init__()
        self.linear1 = torch.nn.Linear(3, 4)
        self.batchnorm = torch.nn.BatchNorm1d(4)
        self.linear2 = torch.nn.Linear(4, 5)

    def forward(self, x):
        return self.linear2(self.batchnorm(self.linear1(x)))


def _norm_model() -> _Norm:
    torch.manual_seed(3)
    model = _Norm().eval()
    model.batchnorm.running_mean.uniform_(-1, 1)  # values a skeleton could not guess
    return model


def test_no_split_classes_the_model_lacks_are_ignored_as_accelerate_ignores_them():
    model = tiny_gpt2()
    size = weight_bytes(model)
    families = ["LlamaDecoderLayer", "GPT2Block", "T5Block", "MixtralDecoderLayer"]
    device_map = automap.infer_auto_device_map(
        model,
        max_memory={0: size // 2, 1: size, "cpu": "1GB"},
        no_split_module_classes=families,
        clean_result=False,
    )
    assert "transformer.h.0" in device_map and not any(k.startswith("transformer.h.0.") for k in device_map)
    with pytest.raises(
        automap.ProfileError, match="LlamaDecoderLayer"
    ):  # automap's own no_split still refuses
        automap.plan(model, max_memory={"cpu": "1GB"}, no_split=["LlamaDecoderLayer"])


def test_load_checkpoint_and_dispatch_loads_into_ram_undispatched_by_default(tmp_path):
    real = _norm_model()
    torch.save(real.state_dict(), tmp_path / "model.bin")
    with automap.init_empty_weights():
        skeleton = _Norm().eval()
    model = automap.load_checkpoint_and_dispatch(skeleton, tmp_path / "model.bin")
    assert automap.runtime.state_of(model) is None and not hasattr(model, "hf_device_map")
    assert all(t.device.type == "cpu" for t in model.state_dict().values())
    x = torch.randn(2, 3)
    assert torch.equal(model(x), real(x))


def test_strict_false_warns_and_loads_strict_true_raises(tmp_path):
    real = _norm_model()
    state = real.state_dict()
    state["extra.weight"] = torch.zeros(2)  # a key the model lacks
    kept = state.pop("linear2.bias")  # a tensor the checkpoint lacks
    torch.save(state, tmp_path / "model.bin")
    fresh = _Norm().eval()
    with pytest.raises(CheckpointError, match="missing"):
        automap.load_checkpoint_and_dispatch(fresh, tmp_path / "model.bin", strict=True)
    own_bias = fresh.linear2.bias.detach().clone()
    with pytest.warns(UserWarning, match=r"strict=False.*linear2\.bias.*extra\.weight"):
        model = automap.load_checkpoint_and_dispatch(fresh, tmp_path / "model.bin", device_map={"": "cpu"})
    assert torch.equal(model.linear1.weight, real.linear1.weight)
    assert torch.equal(model.linear2.bias, own_bias) and not torch.equal(own_bias, kept), "kept its own value"
    assert not hasattr(model, "_keys_to_ignore_on_load_missing"), "the model is left as it was"


def test_dispatch_model_on_a_dispatched_model_dispatches_it_again(tmp_path):
    real = tiny_llama(layers=2)
    expected = logits_of(real, _ids())
    first = {"model": "cpu", "lm_head": "disk"}
    second = {
        "model.embed_tokens": "disk",
        "model.rotary_emb": "cpu",
        "model.layers": "cpu",
        "model.norm": "cpu",
        "lm_head": "cpu",
    }
    automap.dispatch_model(real, first, offload_dir=tmp_path / "one")
    model = automap.dispatch_model(real, second, offload_dir=tmp_path / "two")
    assert model.hf_device_map == second
    placed = automap.placement(model)
    assert placed.device_of("model.embed_tokens") == "disk" and placed.device_of("lm_head") == "cpu"
    assert torch.equal(logits_of(model, _ids()), expected)


def test_init_empty_weights_with_buffers_puts_them_on_meta_and_the_checkpoint_fills_them(tmp_path):
    real = _norm_model()
    torch.save(real.state_dict(), tmp_path / "model.bin")
    with automap.init_empty_weights(include_buffers=True):
        skeleton = _Norm().eval()
    assert (
        skeleton.batchnorm.running_mean.device.type == "meta"
        and skeleton.linear1.weight.device.type == "meta"
    )
    assert torch.zeros(1).device.type == "cpu", "nothing stays patched"
    model = automap.load_checkpoint_and_dispatch(skeleton, tmp_path / "model.bin", device_map="auto")
    x = torch.randn(2, 3)
    assert torch.equal(model(x), real(x))


def test_max_memory_without_a_cpu_entry_computes_on_the_cpu_from_disk_as_accelerate_does(tmp_path):
    """accelerate plans `{0: 30}` (no "cpu" key) for a model no GPU can run as all on disk,
    computed by the CPU; the drop-in reads a missing "cpu" as a CPU that computes with 0 B of RAM."""
    real = _norm_model()
    device_map = automap.infer_auto_device_map(real, max_memory={0: 30})
    assert set(device_map.values()) == {"disk"}
    with pytest.raises(PlanError):  # automap.plan itself keeps the budgets as given: no CPU named, none used
        automap.plan(real, max_memory={0: 30})
    x = torch.randn(2, 3)
    expected = real(x)
    model = automap.dispatch_model(real, device_map, offload_dir=tmp_path / "off")
    assert automap.placement(model).device_of("linear1") == "disk"
    assert torch.equal(model(x), expected)


def _layers(count: int = 8) -> torch.nn.Module:
    """``count`` layers of 1 MiB each."""
    return torch.nn.Sequential(*[torch.nn.Linear(512, 512, bias=False) for _ in range(count)])


def _accelerate_reading(device_map) -> str:
    """Where accelerate's dispatch_model (and from_pretrained) computes a map's "cpu"/"disk"
    units: the first of the set of its other values, else the CPU (accelerate 1.16,
    big_modeling.dispatch_model, written out here to compare with automap's reading)."""
    gpus = set(device_map.values()) - {"cpu", "disk"}
    return f"cuda:{list(gpus)[0]}" if gpus else "cpu"


@pytest.mark.parametrize(
    "budgets",
    [
        {0: "1.5MiB", 1: "3MiB", "cpu": "1GB"},  # GPU 0 can only stream; GPU 1 can hold layers
        {
            0: "1.5MiB",
            "cpu": "1GB",
        },  # GPU 0 can only stream: accelerate would read {"": "cpu"} as CPU compute
        {0: "2.5MiB", 1: "2.5MiB", "cpu": "1GB"},
        {0: "600KiB", "cpu": "1GB"},
    ],
)
def test_infer_auto_device_map_returns_maps_that_mean_one_placement_to_every_reader(budgets):
    from automap.planning.usermap import expressible

    model = _layers()
    device_map = automap.infer_auto_device_map(model, max_memory=budgets)
    ours = automap.plan(model, dict(device_map), budgets)  # how automap's dispatch_model reads the map
    assert ours.execution_device == _accelerate_reading(device_map)
    assert not [w for w in ours.warnings if "may run out of memory" in w], ours.warnings
    assert [unit.name for unit in ours.units] == list(device_map) or "" in device_map
    if budgets == {0: "1.5MiB", 1: "3MiB", "cpu": "1GB"}:  # the case the planner alone gets wrong
        alone = automap.plan(model, "auto", budgets)
        assert not expressible(alone) and any(
            "would read this plan's device_map" in w for w in alone.warnings
        )
        assert ours.execution_device == "cuda:1" and 1 in device_map.values()


def test_the_suite_runner_swaps_only_the_four_imports_and_keeps_line_numbers():
    from benchmarks.accelerate_suite import calling_tests, rewrite

    source = (
        "from accelerate import Accelerator, init_empty_weights\n"
        "from accelerate.utils.modeling import (\n    compute_module_sizes,\n    infer_auto_device_map,\n)\n"
        "from accelerate.utils import FP8RecipeKwargs\n\n"
        "def test_a():\n    from accelerate import dispatch_model\n    dispatch_model(m, {})\n\n"
        "def test_b():\n    compute_module_sizes(m)\n"
    )
    out = rewrite(source, frozenset({"FP8RecipeKwargs"}))
    assert len(out.splitlines()) == len(source.splitlines())
    assert "from automap.accelerate_compat import init_empty_weights" in out
    assert "from automap.accelerate_compat import infer_auto_device_map" in out
    assert "    from automap.accelerate_compat import dispatch_model" in out
    assert "from accelerate import (Accelerator)" in out and "compute_module_sizes)" in out
    assert "FP8RecipeKwargs" not in out
    compile(out, "rewritten", "exec")
    assert calling_tests(source) == ["test_a"]


def test_force_hooks_moves_inputs_even_when_everything_is_on_one_device():
    from automap.runtime import state_of

    plain, hooked = tiny_llama(layers=2), tiny_llama(layers=2)
    expected = logits_of(plain, _ids())
    automap.dispatch_model(plain, {"": "cpu"})
    automap.dispatch_model(hooked, {"": "cpu"}, force_hooks=True)
    assert not state_of(plain).hooks  # nothing to do: as accelerate, no hooks
    assert state_of(hooked).hooks  # as accelerate: inputs are sent to the unit's device
    assert torch.equal(logits_of(hooked, _ids()), expected)
    automap.undispatch(hooked)
    automap.undispatch(plain)


def test_a_refused_conversion_is_the_runtime_error_accelerate_raises(tmp_path):
    model = tiny_llama(layers=2)
    automap.dispatch_model(model, {"model": "cpu", "lm_head": "disk"}, offload_dir=tmp_path)
    with pytest.raises(RuntimeError, match="undispatch"):  # scripts written for accelerate catch this
        model.half()
    with pytest.raises(automap.ConversionError):
        model.to(torch.float64)
    assert model.lm_head.weight.dtype == torch.float32
    automap.undispatch(model)


class _TiedBiasHead(torch.nn.Module):
    """BERT's language-model head: its own ``bias`` is its decoder's (one tensor, two names)."""

    def __init__(self) -> None:
        super().__init__()
        self.dense = torch.nn.Linear(32, 32)
        self.decoder = torch.nn.Linear(32, 50)
        self.bias = torch.nn.Parameter(torch.zeros(50))
        self.decoder.bias = self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(torch.tanh(self.dense(x)))


def test_a_tied_tensors_other_name_is_placed_with_it_in_every_map(tmp_path):
    """A map that places one name of a tied tensor places it (accelerate's own check asks for
    every name, and automap's maps give every name)."""
    from accelerate.utils import check_device_map

    from automap.accelerate_compat import dispatch_model, infer_auto_device_map

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), _TiedBiasHead()).eval()
    x = torch.randn(3, 16)
    with torch.no_grad():
        expected = model(x)
    inferred = infer_auto_device_map(model, max_memory={"cpu": 3000})
    check_device_map(model, inferred)
    assert "disk" in inferred.values()
    by_one_name = {"0": "cpu", "1.dense": "cpu", "1.decoder": "disk"}  # "1.bias" is "1.decoder.bias"
    dispatch_model(model, by_one_name, offload_dir=str(tmp_path))
    with torch.no_grad():
        assert torch.equal(model(x), expected)
    assert model[1].bias is model[1].decoder.bias


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_load_checkpoint_and_dispatch_at_a_half_dtype_converts_what_accelerate_converts(dtype, tmp_path):
    """The weights take ``dtype``; buffers the model computes (Llama's rotary ``inv_freq``)
    keep float32 in both: the logits are accelerate's to the bit."""
    real, folder = _saved(tmp_path, tiny_llama)
    got = {}
    for name in ("accelerate", "automap"):
        lib = importlib.import_module(name)
        model = lib.load_checkpoint_and_dispatch(
            _skeleton(lib, folder), folder, device_map={"": "cpu"}, dtype=dtype
        )
        assert model.model.rotary_emb.inv_freq.dtype == torch.float32, name
        assert model.lm_head.weight.dtype == dtype, name
        got[name] = logits_of(model, _ids())
    assert torch.equal(got["automap"], got["accelerate"])
