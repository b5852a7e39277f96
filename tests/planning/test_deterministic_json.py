"""A plan is a pure function of its inputs: the same model, budgets and machine figures give a
byte-identical plan JSON in every process, whatever PYTHONHASHSEED, with a disk budget and
without one (the disk's free space then comes from the machine's record, not from the moment)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from conftest import pin_machine

ROOT = Path(__file__).resolve().parents[2]

# Built in each process from configs (random weights, seeded): a decoder planned for a
# generation, an encoder-decoder, and a SPEC planned by the command line; CPU RAM too small for
# the weights beside the run, so part of each goes to disk.
SCRIPT = r"""
import sys
from pathlib import Path
import torch, transformers, automap
from automap.cli import main
from tiny_configs import beside_the_run

out, store = Path(sys.argv[1]), Path(sys.argv[2])
torch.manual_seed(0)
gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
    n_embd=64, n_layer=4, n_head=4, vocab_size=256, n_positions=128, bos_token_id=0, eos_token_id=0)).eval()
t5 = transformers.T5ForConditionalGeneration(transformers.T5Config(
    d_model=64, d_ff=128, d_kv=16, num_layers=2, num_heads=4, vocab_size=256, decoder_start_token_id=0)).eval()
for name, model, kwargs in (("gpt2", gpt2, {"max_length": 64}), ("t5", t5, {})):
    cpu = beside_the_run(model, 200_000)
    for disk, budget in (("no-disk-budget", {"cpu": cpu}), ("disk-budget", {"cpu": cpu, "disk": "1GB"})):
        plan = automap.plan(model, max_memory=budget, offload_dir=store, **kwargs)
        (out / f"{name}-{disk}.json").write_text(plan.to_json())
for disk, budget in (("no-disk-budget", "cpu=2MB"), ("disk-budget", "cpu=2MB,disk=1GB")):
    spec = ["plan", "hf:llama", "--set", "hidden_size=64,intermediate_size=128,num_hidden_layers=3,"
            "num_attention_heads=4,num_key_value_heads=2,vocab_size=256", "--max-memory", budget,
            "--seq-len", "16", "--max-length", "32", "--quiet", "--json", str(out / f"cli-{disk}.json")]
    assert main(spec) == 0
"""


def test_plan_json_is_byte_identical_across_processes_and_hash_seeds(tmp_path, monkeypatch):
    record = tmp_path / "machine.json"
    pin_machine(record, monkeypatch, tmp_path)
    runs = []
    for seed in ("0", "1", "4242"):
        out = tmp_path / f"seed-{seed}"
        out.mkdir()
        env = {
            **os.environ,
            "PYTHONHASHSEED": seed,
            "AUTOMAP_CALIBRATION": str(record),
            "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}",
        }
        done = subprocess.run(
            [sys.executable, "-c", SCRIPT, str(out), str(tmp_path / "store")],
            capture_output=True,
            text=True,
            timeout=600,
            env=env,
            cwd=tmp_path,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        runs.append({p.name: p.read_bytes() for p in sorted(out.glob("*.json"))})
    assert len(runs[0]) == 6
    for name, text in runs[0].items():
        assert runs[1][name] == text and runs[2][name] == text, name
    assert b'"disk"' in runs[0]["gpt2-no-disk-budget.json"]
    assert any(b'"measured": [' in text for text in runs[0].values())
    assert b'"capacity_bytes": 1000000000' in runs[0]["gpt2-disk-budget.json"]


def test_offload_dir_is_recorded_the_same_however_it_is_named(tmp_path, monkeypatch):
    import torch

    import automap

    pin_machine(tmp_path / "machine.json", monkeypatch, tmp_path)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    monkeypatch.chdir(tmp_path)
    plans = [
        automap.plan(model, max_memory={"cpu": "20KB"}, offload_dir=d).to_json()
        for d in ("store", tmp_path / "store", Path("store"))
    ]
    assert plans[0] == plans[1] == plans[2]
