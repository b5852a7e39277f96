"""The predicted peak memory of a run against the measured one, in a fresh interpreter per model
(real checkpoints saved under tmp_path, loaded with a CPU budget, run once): the budget holds and
the prediction is near. benchmarks/fit.py measures the same over 29 cases with a 10 % margin;
this keeps a generous one, as other processes share the machine."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

MiB = 2**20

WORKER = textwrap.dedent("""
    import gc, json, sys, threading, time
    from pathlib import Path
    import torch
    import automap
    from automap.planning.predict import memory
    from automap.runtime.state import state_of

    def anon():
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) * 1024 for l in f if l.startswith("RssAnon:"))

    class Peak:
        def __enter__(self):
            self.peak, self.stop = anon(), threading.Event()
            self.thread = threading.Thread(target=self.run, daemon=True)
            self.thread.start()
            return self
        def run(self):
            while not self.stop.is_set():
                self.peak = max(self.peak, anon())
                time.sleep(0.001)
        def __exit__(self, *exc):
            self.stop.set()
            self.thread.join()
            self.peak = max(self.peak, anon())

    kind, folder, share = sys.argv[1], Path(sys.argv[2]), float(sys.argv[3])
    weights = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    if kind == "resnet":
        import torchvision
        with automap.empty_model():
            skeleton = torchvision.models.resnet18().eval()
        example = (torch.randn(2, 3, 224, 224),)
    else:
        from automap.loading.hf import build_from_folder
        skeleton = build_from_folder(folder)
        example = {"input_ids": torch.randint(0, 8000, (2, 128))}
    probe = automap.plan(skeleton, max_memory={"cpu": 4 * weights}, example_inputs=example)
    run = next(m for m in memory(probe) if m.device == "cpu")
    budget = int(share * weights) + run.peak_bytes - run.weights
    automap.plan, automap.load  # the whole surface imported before the baseline
    gc.collect()
    base = anon()
    with Peak() as load:
        model = automap.load(skeleton, folder, max_memory={"cpu": budget, "disk": 64 * weights},
                             offload_dir=folder.parent / "off", quiet=True, example_inputs=example)
    plan = state_of(model).plan
    cpu = next(m for m in memory(plan) if m.device == "cpu")
    with Peak() as forward, torch.no_grad():
        model(*example) if isinstance(example, tuple) else model(**example)
    print(json.dumps({"budget": budget, "fits": cpu.fits, "predicted": cpu.peak_bytes, "in_ram": cpu.weights,
                      "weights": weights, "measured": forward.peak - base, "load_predicted": plan.load_peak_bytes,
                      "load_measured": load.peak - base}))
""")


def save(kind: str, folder: Path) -> None:
    import torch

    torch.manual_seed(0)
    if kind == "resnet":
        import torchvision
        from safetensors.torch import save_file

        folder.mkdir()
        save_file(
            {k: v.contiguous() for k, v in torchvision.models.resnet18().state_dict().items()},
            str(folder / "model.safetensors"),
        )
        return
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=8000,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).save_pretrained(folder)


@pytest.mark.parametrize("kind, share", [("llama", 0.3), ("resnet", 1.0)])
def test_the_run_stays_within_the_budget_and_near_the_prediction(tmp_path, kind, share):
    folder = tmp_path / kind
    save(kind, folder)
    done = subprocess.run(
        [sys.executable, "-c", WORKER, kind, str(folder), str(share)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads(done.stdout.strip().splitlines()[-1])
    assert r["fits"]
    assert 0 < r["in_ram"] <= share * r["weights"] + 1 * MiB  # the room beside the run holds the share asked
    assert r["measured"] <= r["budget"], r
    for predicted, measured in [(r["predicted"], r["measured"]), (r["load_predicted"], r["load_measured"])]:
        margin = max(0.25 * predicted, 32 * MiB)
        assert measured <= predicted + margin, r  # under-predicted: the budget's promise at risk
        # Over-predicted wastes room but keeps the promise: the runtime's own bytes (the allocator's
        # retention after a load) vary by a few MiB between runs, and ResNet-18 sits 30 MiB under its
        # prediction (benchmarks/notes/fit.md): a wider band on this side, not a flaky edge.
        assert measured >= predicted - margin - 0.1 * predicted, r
