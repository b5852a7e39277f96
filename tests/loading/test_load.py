"""automap.load: real models saved as safetensors (single file, sharded with and without an
index) and as pickles, loaded into empty skeletons with part of them offloaded, give the
original model's outputs exactly; bad checkpoints fail with a CheckpointError and leave
nothing half-written behind."""

from __future__ import annotations

import importlib
import json
import os
import pickle
import sys

import pytest
import torch
from safetensors.torch import save_file, save_model

import automap
from automap.errors import CheckpointError, DeviceError, DispatchError, PlanError
from automap.loading.checkpoint import Checkpoint
from conftest import (
    assert_offloaded_in_files,
    file_backing,
    logits_of,
    store_dirs,
    tiny_gpt2,
    tiny_llama,
    tiny_t5,
    weight_bytes,
)
from tiny_configs import beside_the_run, part_on_disk


def _empty(model: torch.nn.Module) -> torch.nn.Module:
    """A skeleton of the same architecture and config as ``model``, built on meta."""
    with automap.empty_model():
        if hasattr(model, "config"):
            return type(model)(model.config).eval()
        import torchvision

        return torchvision.models.resnet50().eval()


def _meta_names(model: torch.nn.Module) -> list[str]:
    """Tensors without data of their own in RAM: on meta, or (offloaded) views of a file."""
    return [
        n
        for n, p in list(model.named_parameters()) + list(model.named_buffers())
        if p.device.type == "meta" or file_backing(p) is not None
    ]


def _files(folder) -> list[str]:
    return sorted(os.listdir(folder)) if os.path.exists(folder) else []


def _alternate_map(model: torch.nn.Module, ties: str = "cpu") -> dict[str, str]:
    """Every other unit on disk, and every unit holding a tied weight on ``ties``: a mixed
    placement that does not depend on the planner's budgets."""
    prof = automap.profile(model)
    tied = {n for group in prof.tie_groups for n in group}
    device_map = {}
    for i, unit in enumerate(prof.units):
        holds_tie = any(t.startswith(unit.name + ".") for t in tied)
        device_map[unit.name] = ties if holds_tie else "disk" if i % 2 else "cpu"
        device_map.update(dict.fromkeys(unit.loose, device_map[unit.name]))
    return device_map


def _llama_ids() -> torch.Tensor:
    return torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))


# ------------------------------------------------------------------ skeletons


def test_empty_model_puts_parameters_on_meta_and_computes_buffers():
    real = tiny_llama(layers=2)
    skeleton = _empty(real)
    assert all(p.device.type == "meta" for p in skeleton.parameters())
    inv_freq = dict(real.named_buffers())["model.rotary_emb.inv_freq"]
    assert torch.equal(dict(skeleton.named_buffers())["model.rotary_emb.inv_freq"], inv_freq)
    assert torch.nn.Linear(2, 2).weight.device.type == "cpu", "the patch must end with the block"


# ------------------------------------------------------------------ transparency


def _build(name: str) -> tuple[torch.nn.Module, dict]:
    """A real model with random weights and keyword inputs for its forward."""
    ids = _llama_ids()
    if name == "resnet50":
        import torchvision

        torch.manual_seed(0)
        return torchvision.models.resnet50().eval(), {"x": torch.randn(2, 3, 64, 64)}
    if name == "t5":
        return tiny_t5(layers=2), {"input_ids": ids, "decoder_input_ids": ids[:, :5]}
    return {"gpt2": tiny_gpt2, "llama": tiny_llama}[name](layers=4), {"input_ids": ids}


def _save(model: torch.nn.Module, fmt: str, folder) -> str:
    """Save ``model`` as one safetensors file, as three safetensors shards with an index, or
    as a pickled state dict (which keeps every tied name)."""
    folder.mkdir()
    if fmt == "bin":
        torch.save(model.state_dict(), folder / "pytorch_model.bin")
        return str(folder / "pytorch_model.bin")
    if fmt == "single":
        save_model(model, str(folder / "model.safetensors"))
        return str(folder / "model.safetensors")
    first_names = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        first_names.setdefault(id(tensor), (name, tensor.detach().contiguous()))
    items = list(first_names.values())
    weight_map = {}
    for i in range(3):
        file = f"model-{i + 1:05d}-of-00003.safetensors"
        part = dict(items[i::3])
        save_file(part, folder / file)
        weight_map.update(dict.fromkeys(part, file))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return str(folder)


def _output(model: torch.nn.Module, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        out = model(**inputs)
    return out if isinstance(out, torch.Tensor) else out.logits


@pytest.mark.parametrize("fmt", ["single", "sharded", "bin"])
@pytest.mark.parametrize("name", ["resnet50", "gpt2", "llama", "t5"])
def test_loaded_with_part_on_disk_gives_the_original_outputs(name, fmt, tmp_path):
    real, inputs = _build(name)
    expected = _output(real, inputs)
    source = _save(real, fmt, tmp_path / "ckpt")
    model = automap.load(_empty(real), source, _alternate_map(real), offload_dir=tmp_path / "off", quiet=True)
    assert _meta_names(model), "part of the model must stay offloaded"
    assert torch.equal(_output(model, inputs), expected)
    files = assert_offloaded_in_files(model)
    in_checkpoint = [n for n in files if n in real.state_dict()]
    in_place = [n for n in in_checkpoint if str(files[n]).startswith(os.path.realpath(tmp_path / "ckpt"))]
    # Offloaded safetensors are referenced in place; pickled ones are copied into the store.
    assert in_place == ([] if fmt == "bin" else in_checkpoint)


def test_resnet50_single_safetensors_with_part_on_disk_matches(resnet50, tmp_path):
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        expected = resnet50(x)
    save_file(resnet50.state_dict(), tmp_path / "resnet.safetensors")
    model = automap.load(
        _empty(resnet50),
        tmp_path / "resnet.safetensors",
        max_memory={"cpu": weight_bytes(resnet50) // 2},
        example_inputs=(x,),
        quiet=True,
    )
    assert _meta_names(model), "part of the model must stay offloaded"
    assert torch.equal(model.bn1.num_batches_tracked, resnet50.bn1.num_batches_tracked)
    with torch.no_grad():
        assert torch.equal(model(x), expected)


def test_llama_sharded_with_index_streams_offloaded_part_in_place(tmp_path):
    real = tiny_llama(layers=4)
    ids = _llama_ids()
    expected = logits_of(real, ids)
    real.save_pretrained(tmp_path / "ckpt", max_shard_size="100KB")
    assert (tmp_path / "ckpt" / "model.safetensors.index.json").exists()
    offload = tmp_path / "offload"
    device_map = {
        "model.embed_tokens": "cpu",
        "model.rotary_emb": "cpu",
        "model.layers.0": "cpu",
        "model.layers.1": "disk",
        "model.layers.2": "disk",
        "model.layers.3": "cpu",
        "model.norm": "disk",
        "lm_head": "disk",
    }
    model = automap.load(_empty(real), tmp_path / "ckpt", device_map, offload_dir=offload, quiet=True)
    assert file_backing(model.model.layers[1].mlp.up_proj.weight) is not None, (
        "offloaded weights stay out of RAM"
    )
    assert _meta_names(model)
    assert _files(offload) == [], "safetensors in the target dtype are referenced, never copied"
    assert torch.equal(logits_of(model, ids), expected)
    automap.undispatch(model)
    assert not _meta_names(model)
    assert torch.equal(logits_of(model, ids), expected)


def test_gpt2_tied_sharded_without_index_matches(tmp_path):
    real = tiny_gpt2(layers=4)
    ids = _llama_ids()
    expected = logits_of(real, ids)
    real.save_pretrained(tmp_path / "ckpt", max_shard_size="100KB")
    (tmp_path / "ckpt" / "model.safetensors.index.json").unlink()
    model = automap.load(_empty(real), tmp_path / "ckpt", _alternate_map(real), quiet=True)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert _meta_names(model)
    assert torch.equal(logits_of(model, ids), expected)


def test_gpt2_tied_embedding_streamed_from_disk_matches(tmp_path):
    real = tiny_gpt2(layers=2)
    ids = _llama_ids()
    expected = logits_of(real, ids)
    save_model(real, str(tmp_path / "gpt2.safetensors"))
    model = automap.load(
        _empty(real), tmp_path / "gpt2.safetensors", _alternate_map(real, ties="disk"), quiet=True
    )
    assert model.lm_head.weight is model.transformer.wte.weight
    assert file_backing(model.transformer.wte.weight) == (tmp_path / "gpt2.safetensors").resolve(), (
        "the tied embedding is streamed from disk"
    )
    assert torch.equal(logits_of(model, ids), expected)


def test_gpt2_bin_with_model_prefix_and_offload_writes_store(tmp_path):
    real = tiny_gpt2(layers=4)
    ids = _llama_ids()
    expected = logits_of(real, ids)
    wrapped = {f"model.{k}": v for k, v in real.state_dict().items()}  # as a training wrapper saves it
    torch.save(wrapped, tmp_path / "pytorch_model.bin")
    offload = tmp_path / "offload"
    model = automap.load(
        _empty(real), tmp_path / "pytorch_model.bin", _alternate_map(real), offload_dir=offload, quiet=True
    )
    assert model.lm_head.weight is model.transformer.wte.weight
    assert [p.name for p in store_dirs(offload)] and all(
        p.is_relative_to(offload) for p in set(assert_offloaded_in_files(model).values())
    ), "pickled tensors must be copied to the store"
    assert torch.equal(logits_of(model, ids), expected)


def test_dtype_converts_on_the_way_and_writes_offloaded_part(tmp_path):
    real = tiny_llama(layers=4)
    ids = _llama_ids()
    save_model(real, str(tmp_path / "llama.safetensors"))
    reference = tiny_llama(layers=4)
    for tensor in reference.state_dict(
        keep_vars=True
    ).values():  # the weights; the computed rotary inv_freq stays float32
        tensor.data = tensor.data.to(torch.bfloat16)
    expected = logits_of(reference, ids)
    offload = tmp_path / "offload"
    model = automap.load(
        _empty(real),
        tmp_path / "llama.safetensors",
        _alternate_map(real),
        offload_dir=offload,
        dtype=torch.bfloat16,
        quiet=True,
    )
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert store_dirs(offload) and all(
        p.is_relative_to(offload) for p in assert_offloaded_in_files(model).values()
    ), "converted tensors cannot be referenced in place"
    assert torch.equal(logits_of(model, ids), expected)


# ------------------------------------------------------------------ mismatches


def _mismatch(tmp_path, state: dict[str, torch.Tensor]) -> str:
    save_file(state, tmp_path / "bad.safetensors")
    with pytest.raises(CheckpointError) as info:
        automap.load(_empty(tiny_llama(layers=2)), tmp_path / "bad.safetensors", quiet=True)
    return str(info.value)


def test_missing_keys_are_counted_and_named(tmp_path):
    state = {k: v for k, v in tiny_llama(layers=2).state_dict().items() if ".mlp." not in k}
    message = _mismatch(tmp_path, state)
    assert (
        "6 tensor(s) of the model are missing" in message and "model.layers.0.mlp.gate_proj.weight" in message
    )


def test_unexpected_keys_are_counted_and_named(tmp_path):
    state = dict(tiny_llama(layers=2).state_dict())
    state["model.extra.weight"] = torch.zeros(2)
    message = _mismatch(tmp_path, state)
    assert "1 key(s) in it are not in the model" in message and "model.extra.weight" in message


def test_shape_mismatch_is_counted_and_named(tmp_path):
    state = dict(tiny_llama(layers=2).state_dict())
    state["model.norm.weight"] = torch.ones(65)
    message = _mismatch(tmp_path, state)
    assert (
        "1 tensor(s) have another shape" in message and "[65] in the checkpoint, [64] in the model" in message
    )


# ------------------------------------------------------------------ bad input


def _load_into_offload(tmp_path, path) -> None:
    model = tiny_llama(layers=2)
    automap.load(
        _empty(model),
        path,
        _alternate_map(model),
        offload_dir=tmp_path / "off",
        dtype=torch.bfloat16,
        quiet=True,
    )


def test_missing_path_is_a_checkpoint_error(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        _load_into_offload(tmp_path, tmp_path / "nope.safetensors")
    assert _files(tmp_path / "off") == []


def test_corrupted_header_is_a_checkpoint_error(tmp_path):
    save_model(tiny_llama(layers=2), str(tmp_path / "m.safetensors"))
    data = bytearray((tmp_path / "m.safetensors").read_bytes())
    data[8:20] = b"not json {{{"
    (tmp_path / "m.safetensors").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupted safetensors header"):
        _load_into_offload(tmp_path, tmp_path / "m.safetensors")
    assert _files(tmp_path / "off") == []


def test_truncated_shard_is_a_checkpoint_error(tmp_path):
    tiny_llama(layers=2).save_pretrained(tmp_path / "ckpt", max_shard_size="50KB")
    shard = sorted((tmp_path / "ckpt").glob("*.safetensors"))[-1]
    os.truncate(shard, shard.stat().st_size - 100)
    with pytest.raises(CheckpointError, match=f"{shard.name} is truncated"):
        _load_into_offload(tmp_path, tmp_path / "ckpt")
    assert _files(tmp_path / "off") == []


def test_truncated_or_foreign_pickle_is_a_checkpoint_error(tmp_path):
    torch.save(tiny_llama(layers=2).state_dict(), tmp_path / "m.bin")
    os.truncate(tmp_path / "m.bin", (tmp_path / "m.bin").stat().st_size - 200)
    (tmp_path / "notes.pt").write_bytes(b"not a checkpoint" * 10)
    for path in (tmp_path / "m.bin", tmp_path / "notes.pt"):
        with pytest.raises(CheckpointError, match="truncated or not a PyTorch checkpoint"):
            _load_into_offload(tmp_path, path)
    assert _files(tmp_path / "off") == []


def test_index_naming_missing_files_is_a_checkpoint_error(tmp_path):
    tiny_llama(layers=2).save_pretrained(tmp_path / "ckpt", max_shard_size="50KB")
    index = json.loads((tmp_path / "ckpt" / "model.safetensors.index.json").read_text())
    gone = sorted(set(index["weight_map"].values()))[0]
    (tmp_path / "ckpt" / gone).unlink()
    with pytest.raises(CheckpointError, match=f"names 1 file.*{gone}"):
        _load_into_offload(tmp_path, tmp_path / "ckpt")


class _Exploit:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_pickle_that_runs_code_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with open(tmp_path / "evil.bin", "wb") as f:
        torch.save({"weight": torch.zeros(2), "payload": _Exploit()}, f)
    with pytest.raises(
        CheckpointError, match="refused .*weights_only=True.*GLOBAL \\w+\\.system.*arbitrary code"
    ):
        _load_into_offload(tmp_path, tmp_path / "evil.bin")
    assert not (tmp_path / "pwned").exists()


def test_failure_while_writing_leaves_nothing_in_offload_dir(tmp_path, monkeypatch):
    real = tiny_llama(layers=4)
    save_model(real, str(tmp_path / "llama.safetensors"))
    (tmp_path / "off").mkdir()
    (tmp_path / "off" / "keep.txt").write_text("the user's file")
    reads = {"n": 0}
    original = Checkpoint.read

    def failing_read(self, key, dtype=None):
        reads["n"] += 1
        if reads["n"] == 30:
            raise CheckpointError(f"simulated failure reading {key}")
        return original(self, key, dtype)

    monkeypatch.setattr(Checkpoint, "read", failing_read)
    with pytest.raises(CheckpointError, match="simulated failure"):
        automap.load(
            _empty(real),
            tmp_path / "llama.safetensors",
            _alternate_map(real),
            offload_dir=tmp_path / "off",
            dtype=torch.bfloat16,
            quiet=True,
        )
    assert _files(tmp_path / "off") == ["keep.txt"]


def test_failed_dispatch_leaves_the_skeleton_as_it_was(tmp_path, monkeypatch):
    real = tiny_llama(layers=2)
    save_model(real, str(tmp_path / "llama.safetensors"))
    skeleton = _empty(real)
    before = dict(skeleton.named_parameters(remove_duplicate=False)) | dict(skeleton.named_buffers())

    def refuse(*args, **kwargs):
        raise DispatchError("simulated dispatch failure")

    monkeypatch.setattr(importlib.import_module("automap.loading.commit"), "dispatch_plan", refuse)
    with pytest.raises(DispatchError, match="simulated"):
        automap.load(
            skeleton,
            tmp_path / "llama.safetensors",
            _alternate_map(real),
            offload_dir=tmp_path / "off",
            quiet=True,
        )
    assert _files(tmp_path / "off") == []
    after = dict(skeleton.named_parameters(remove_duplicate=False)) | dict(skeleton.named_buffers())
    assert after.keys() == before.keys() and all(after[n] is before[n] for n in before)


def test_devices_missing_here_fail_before_reading(tmp_path, monkeypatch):
    real = tiny_llama(layers=2)
    save_model(real, str(tmp_path / "llama.safetensors"))
    monkeypatch.setattr(Checkpoint, "read", lambda *a, **k: pytest.fail("nothing may be read"))
    with pytest.raises(DeviceError, match="cuda:7"):
        automap.load(
            _empty(real),
            tmp_path / "llama.safetensors",
            max_memory={"cuda:7": "1GB", "cpu": "1GB"},
            quiet=True,
        )


# ------------------------------------------------------------------ progress and interop


def test_progress_bar_on_stderr_unless_quiet(tmp_path, capfd, monkeypatch):
    monkeypatch.setattr(importlib.import_module("automap.progress"), "DELAY_SECONDS", 0)
    monkeypatch.setattr(
        sys.stderr, "isatty", lambda: True
    )  # bars are for terminals (tests/report/test_progress.py)
    real = tiny_llama(layers=2)
    save_model(real, str(tmp_path / "m.safetensors"))
    automap.load(_empty(real), tmp_path / "m.safetensors", quiet=True)
    assert "tensors" not in capfd.readouterr().err
    automap.load(_empty(real), tmp_path / "m.safetensors")
    err = capfd.readouterr().err
    count = len(dict(real.named_parameters()) | dict(real.named_buffers()))
    assert "automap.load: 100%" in err and f"{count}/{count} tensors" in err


def _mixed_plan(model: torch.nn.Module, nbytes: int) -> automap.Plan:
    """The planner's own plan for the smallest CPU budget that keeps part of ``model`` in RAM
    (``nbytes`` times a fraction beside the run)."""
    for fraction in (0.5, 1, 1.5, 2, 3, 4):
        try:
            budget = {"cpu": beside_the_run(model, int(nbytes * fraction)), "disk": "1GB"}
            plan = automap.plan(model, max_memory=budget)
        except PlanError:
            continue
        if set(plan.device_map.values()) == {"cpu", "disk"}:
            return plan
    pytest.fail("no CPU budget gives a plan with both 'cpu' and 'disk'")


def test_plan_device_map_drives_transformers_from_pretrained(tmp_path):
    from transformers import LlamaForCausalLM

    real = tiny_llama(layers=4)
    real.save_pretrained(tmp_path / "ckpt")
    plan = _mixed_plan(_empty(real), weight_bytes(real))
    loaded = LlamaForCausalLM.from_pretrained(
        tmp_path / "ckpt", device_map=plan.device_map, offload_folder=str(tmp_path / "hf-offload")
    )
    assert loaded.hf_device_map == plan.device_map
    tensors = dict(loaded.named_parameters()) | dict(loaded.named_buffers())
    for unit, where in zip(plan.units, plan.placement):
        devices = {tensors[t].device.type for t in unit.tensors}
        assert devices == ({"meta"} if where == "disk" else {"cpu"}), unit.name


@pytest.mark.cuda
def test_llama_on_gpu_with_host_and_disk_offload_matches(tmp_path):
    real = tiny_llama(layers=4)
    ids = _llama_ids().to("cuda:0")
    save_model(real, str(tmp_path / "llama.safetensors"))
    expected = logits_of(real.to("cuda:0"), ids)
    device_map = {
        "model.embed_tokens": 0,
        "model.rotary_emb": 0,
        "model.layers.0": 0,
        "model.layers.1": "cpu",
        "model.layers.2": "disk",
        "model.layers.3": 0,
        "model.norm": 0,
        "lm_head": "cpu",
    }
    model = automap.load(_empty(real), tmp_path / "llama.safetensors", device_map, quiet=True)
    assert model.model.layers[0].mlp.up_proj.weight.device.type == "cuda"
    assert model.model.rotary_emb.inv_freq.device.type == "cuda"
    assert torch.equal(logits_of(model, ids).to("cuda:0"), expected)


# ------------------------------------------------------------------ what real saving leaves beside the weights


def test_an_index_file_given_as_the_checkpoint_reads_the_shards_it_names(tmp_path):
    real = tiny_llama(layers=2)
    ids = _llama_ids()
    expected = logits_of(real, ids)
    real.save_pretrained(tmp_path / "ckpt", max_shard_size="100KB")
    index = tmp_path / "ckpt" / "model.safetensors.index.json"
    model = automap.load(
        _empty(real), index, max_memory=part_on_disk(real), offload_dir=tmp_path / "off", quiet=True
    )
    assert torch.equal(logits_of(model, ids), expected)


def test_what_training_saves_beside_the_weights_is_not_read_as_weights(tmp_path):
    """transformers' Trainer writes training_args.bin (a pickle of its arguments, refused by a
    safe load) beside pytorch_model.bin; accelerate's save_state writes optimizer.bin."""
    real = tiny_gpt2(layers=2)
    ids = _llama_ids()
    expected = logits_of(real, ids)
    folder = tmp_path / "run"
    folder.mkdir()
    torch.save(real.state_dict(), folder / "pytorch_model.bin")
    for name in ("training_args.bin", "optimizer.bin", "scheduler.pt", "rng_state.pth"):
        with open(folder / name, "wb") as f:
            pickle.dump(_Arguments(), f)  # code a safe load will not run: read, it would refuse the folder
    model = automap.load(
        _empty(real), folder, max_memory=part_on_disk(real), offload_dir=tmp_path / "off", quiet=True
    )
    assert torch.equal(logits_of(model, ids), expected)


class _Arguments:
    """Stands in for transformers' TrainingArguments in a pickle."""


def test_a_batchnorm_checkpoint_without_num_batches_tracked_loads_as_torch_loads_it(tmp_path):
    """Files saved before BatchNorm counted its batches (old model-zoo .pth files) lack the
    count; torch's load_state_dict(strict=True) accepts them, and so does automap."""
    import torchvision

    torch.manual_seed(0)
    real = torchvision.models.resnet18(num_classes=10).eval()
    saved = {k: v for k, v in real.state_dict().items() if not k.endswith("num_batches_tracked")}
    torch.save(saved, tmp_path / "old.pth")
    plain = torchvision.models.resnet18(num_classes=10).eval()
    plain.load_state_dict(torch.load(tmp_path / "old.pth"), strict=True)
    with automap.empty_model():
        skeleton = torchvision.models.resnet18(num_classes=10).eval()
    model = automap.load(
        skeleton,
        tmp_path / "old.pth",
        max_memory=part_on_disk(real),
        offload_dir=tmp_path / "off",
        quiet=True,
    )
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        assert torch.equal(model(x), plain(x))
    assert all(
        torch.equal(b, plain.get_buffer(n))
        for n, b in model.named_buffers()
        if n.endswith("num_batches_tracked")
    )
