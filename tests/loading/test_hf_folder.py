"""Hugging Face folders in one call: ``automap.load(folder)`` builds the model its config.json
names and loads it (Llama, GPT-2 and T5 saved by ``save_pretrained`` as one safetensors file,
as shards with an index, and as a pickle), giving the plain model's logits; ``automap plan
folder`` plans from the config and the checkpoint's headers without reading a weight (peak RSS
measured in a subprocess); bad folders and calls fail with an AutomapError."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import automap
from automap.cli import main
from automap.errors import CheckpointError, DependencyError
from automap.spec_plan import plan_spec
from conftest import store_dirs, tiny_gpt2, tiny_llama, tiny_t5
from tiny_configs import beside_the_run, part_on_disk

ROOT = Path(__file__).resolve().parents[2]
BUILDERS = {"llama": tiny_llama, "gpt2": tiny_gpt2, "t5": tiny_t5}


def save(model: torch.nn.Module, folder: Path, fmt: str) -> Path:
    """``save_pretrained`` in one of three forms. transformers 5 dropped
    ``safe_serialization=False``; "bin" writes what it wrote: the same keys, in
    ``pytorch_model.bin``."""
    model.save_pretrained(folder, max_shard_size="100KB" if fmt == "sharded" else "50GB")
    if fmt == "bin":
        single = folder / "model.safetensors"
        torch.save(load_file(single), folder / "pytorch_model.bin")
        single.unlink()
    return folder


def _inputs(name: str) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(3))
    return {"input_ids": ids, "decoder_input_ids": ids[:, :6]} if name == "t5" else {"input_ids": ids}


@pytest.mark.parametrize("fmt", ["single", "sharded", "bin"])
@pytest.mark.parametrize("name", ["llama", "gpt2", "t5"])
def test_folder_loads_in_one_call_with_part_on_disk(name, fmt, tmp_path):
    real = BUILDERS[name]()
    folder = save(real, tmp_path / "model", fmt)
    inputs = _inputs(name)
    with torch.no_grad():
        expected = real(**inputs).logits
    model = automap.load(folder, max_memory=part_on_disk(real), offload_dir=tmp_path / "offload", quiet=True)
    assert type(model) is type(real) and not model.training
    placement = automap.placement(model)
    assert "disk" in placement.placement and "cpu" in placement.placement
    with torch.no_grad():
        assert torch.equal(model(**inputs).logits, expected)
    # safetensors in the model's dtype are read in place; a pickle is written to a store of automap's
    assert bool(store_dirs(tmp_path / "offload")) == (fmt == "bin")
    automap.undispatch(model)


def test_folder_dtype_builds_and_converts_and_config_dtype_is_the_default(tmp_path):
    real = tiny_llama(layers=2)
    folder = save(real, tmp_path / "model", "single")
    half = automap.load(folder, dtype=torch.bfloat16, max_memory={"cpu": "10GB"}, quiet=True)
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}
    config = json.loads((folder / "config.json").read_text())
    config["dtype"] = "float16"  # the config's dtype is what from_pretrained's dtype="auto" loads at
    (folder / "config.json").write_text(json.dumps(config))
    model = automap.load(folder, max_memory={"cpu": "10GB"}, quiet=True)
    assert {p.dtype for p in model.parameters()} == {torch.float16}
    assert torch.equal(model.lm_head.weight, real.lm_head.weight.to(torch.float16))


def test_folder_form_errors_name_the_fix(tmp_path, monkeypatch):
    real = tiny_gpt2(layers=1)
    folder = save(real, tmp_path / "model", "single")
    with pytest.raises(CheckpointError, match="no config.json"):
        automap.load(tmp_path)
    with pytest.raises(CheckpointError, match="not a folder"):
        automap.load(folder / "model.safetensors")
    with pytest.raises(CheckpointError, match="takes no second path"):
        automap.load(folder, folder)  # type: ignore[call-overload]
    with pytest.raises(CheckpointError, match="needs the checkpoint"):
        automap.load(real)  # type: ignore[call-overload]
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "architectures": ["MyOwnGPT"]}))
    with pytest.raises(CheckpointError, match="MyOwnGPT"):
        automap.load(folder)
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if it were not installed
    with pytest.raises(DependencyError, match="pip install transformers"):
        automap.load(folder)
    assert isinstance(DependencyError("x"), (automap.AutomapError, ImportError))


# ------------------------------------------------------------------ automap plan FOLDER


def test_plan_folder_counts_the_checkpoint_dtypes_not_the_config(capsys, tmp_path):
    real = tiny_llama(layers=2).to(torch.bfloat16)
    folder = save(real, tmp_path / "model", "sharded")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "dtype": "float32"}))
    result = plan_spec(str(folder), max_memory={"cpu": "1GB"})
    params = sum(u.param_bytes for u in result.plan.units)
    assert params == sum(p.numel() * 2 for p in real.parameters())  # bf16 as stored, not fp32 as configured
    cpu = beside_the_run(real, 100_000)  # part on disk
    budget = f"cpu={cpu},disk=1GB"
    code = main(["plan", str(folder), "--max-memory", budget, "--json", str(tmp_path / "p.json")])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "LlamaForCausalLM" in out and "at bfloat16" in out and "no weights read" in out and "disk" in out
    assert json.loads((tmp_path / "p.json").read_text())["devices"]


def test_plan_folder_refuses_set_and_mismatched_weights(capsys, tmp_path):
    folder = save(tiny_llama(layers=2), tmp_path / "model", "single")
    code = main(["plan", str(folder), "--set", "num_hidden_layers=4"])
    assert code == 2 and "--set changes the architecture" in capsys.readouterr().err
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "hidden_size": 128, "head_dim": 32}))
    code = main(["plan", str(folder)])
    err = capsys.readouterr().err
    assert code == 1 and "shape" in err and err.count("\n") == 1


_MEASURE = textwrap.dedent("""
    import contextlib, importlib, io, json, sys
    importlib.import_module(sys.argv[2])  # the modeling code, imported before the baseline: the plan needs it
    from automap.cli import main
    from benchmarks.memwatch import read_status

    if len(sys.argv) > 3:  # a tiny checkpoint of the same family: the code the plan runs is imported
        with contextlib.redirect_stdout(io.StringIO()):  # and warmed before the baseline, no weights of the big one
            main(["plan", sys.argv[3], "--max-memory", "cpu=100MB,disk=10GB"])

    def reset_peak():
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS

    reset_peak()
    base = read_status()["VmRSS"]
    report = io.StringIO()
    with contextlib.redirect_stdout(report):
        code = main(["plan", sys.argv[1], "--max-memory", "cpu=100MB,disk=10GB"])
    plan_growth = read_status()["VmHWM"] - base
    from safetensors.torch import load_file  # the control: reading the weights shows up
    reset_peak()
    base = read_status()["VmRSS"]
    files = sorted(__import__("pathlib").Path(sys.argv[1]).glob("*.safetensors"))
    weights = [t.clone() for f in files for t in load_file(f).values()]
    read_growth = read_status()["VmHWM"] - base
    print(json.dumps({"code": code, "plan": plan_growth, "read": read_growth, "report": report.getvalue()}))
""")


def measure_plan_rss(folder: Path, modeling: str, warm: Path | None = None) -> dict:
    """``automap plan folder`` in a fresh subprocess: its peak RSS growth ("plan"), the growth
    of reading the weights there as the control ("read"), the exit code and the report. ``warm``,
    a tiny checkpoint of the same family, is planned first so that the imports and caches that
    code path loads once per process are not counted as the big checkpoint's."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    args = [str(folder), modeling, *([str(warm)] if warm else [])]
    result = subprocess.run(
        [sys.executable, "-c", _MEASURE, *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    assert measured["code"] == 0 and "disk" in measured["report"] and "no weights read" in measured["report"]
    return measured


@pytest.mark.slow
def test_plan_folder_reads_no_weights_peak_rss_in_a_subprocess(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=512,
        intermediate_size=1376,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=8,
        vocab_size=32000,
        tie_word_embeddings=False,
    )
    folder = tmp_path / "llama"
    LlamaForCausalLM(config).save_pretrained(folder, max_shard_size="100MB")
    size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    assert size > 200e6
    measured = measure_plan_rss(folder, "transformers.models.llama.modeling_llama")
    assert measured["read"] > 0.9 * size, f"the control must see the weights read: {measured}"
    assert measured["plan"] < size / 5, (
        f"planning grew RSS by {measured['plan']:,} bytes for a {size:,}-byte checkpoint"
    )


def test_a_folder_with_keys_older_versions_saved_loads_as_from_pretrained_loads_it(tmp_path):
    """Llama-2-era checkpoints hold each layer's rotary ``inv_freq``, which today's model lacks:
    ``from_pretrained`` skips such keys with a warning, and so does the folder form; a
    skeleton given with its checkpoint stays strict, as ``load_state_dict`` is."""
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    real = tiny_llama(layers=2)
    folder = save(real, tmp_path / "old", "single")
    state = load_file(folder / "model.safetensors")
    for i in range(2):
        state[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = real.model.rotary_emb.inv_freq.clone()
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    ids = _inputs("llama")
    expected = LlamaForCausalLM.from_pretrained(folder).eval()(**ids).logits
    with pytest.warns(UserWarning, match="rotary_emb.inv_freq"):
        model = automap.load(folder, max_memory=part_on_disk(real), offload_dir=tmp_path / "off", quiet=True)
    with torch.no_grad():
        assert torch.equal(model(**ids).logits, expected)
    with automap.empty_model():
        skeleton = LlamaForCausalLM(real.config)
    with pytest.raises(CheckpointError, match="2 key\\(s\\) in it are not in the model"):
        automap.load(skeleton, folder / "model.safetensors", quiet=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", ["llama", "t5"])
def test_a_folder_at_a_half_dtype_is_what_from_pretrained_builds(name, dtype, tmp_path):
    """At float16 or bfloat16 ``from_pretrained`` keeps what the model computes at init in its
    own dtype (Llama's rotary ``inv_freq``: float32) and the modules the model keeps in float32
    (T5's ``wo`` at float16); the folder form reads each tensor in that dtype too, with part on
    disk, and gives the same logits."""
    from transformers import AutoModelForCausalLM, T5ForConditionalGeneration

    real = BUILDERS[name]()
    folder = save(real, tmp_path / name, "single")
    cls = T5ForConditionalGeneration if name == "t5" else AutoModelForCausalLM
    plain = cls.from_pretrained(folder, dtype=dtype).eval()
    model = automap.load(
        folder, dtype=dtype, max_memory=part_on_disk(real, dtype), offload_dir=tmp_path / "off", quiet=True
    )
    assert "disk" in automap.placement(model).placement
    state = {n: t.dtype for n, t in model.state_dict().items()}
    assert {n: t.dtype for n, t in plain.state_dict().items()} == state
    assert {n: b.dtype for n, b in model.named_buffers()} == {n: b.dtype for n, b in plain.named_buffers()}
    with torch.no_grad():
        assert torch.equal(model(**_inputs(name)).logits, plain(**_inputs(name)).logits)
