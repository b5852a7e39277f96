"""Does the budget hold? The plan's predicted peak memory against the measured one, per case.

Each case builds a real architecture from a small config (random weights, seeded), saves it
(``save_pretrained``, or safetensors for torchvision) under a temporary folder, and in a fresh
interpreter loads it with ``automap.load(..., max_memory={"cpu": budget, "disk": ...})`` and runs
it: a forward, a greedy ``generate`` or a forward with grad in training mode. The process's
anonymous memory (``RssAnon``, sampled every millisecond on a thread) is measured above a
baseline taken after the imports, per phase: the load, then the run. Predicted: the plan's CPU
row (``memory(plan)``: weights, cache, staging, activations, overhead) for the run, and
``automap.loading.load_peak_bytes`` for the load.

Budgets: ``all`` (four times the weights: all in RAM); ``50%`` and ``20%``: that share of the
weights plus what the plan predicts the run needs beside them (activations, overhead, cache),
the rest on disk; ``tiny`` (8 MiB): too small for one forward, which the plan must refuse
(``RuntimeBudgetError``, with the numbers) before anything is loaded.

    python -m benchmarks.fit --json benchmarks/notes/fit.json      # all cases (a few minutes)
    python -m benchmarks.fit --quick                                # 6 cases

Acceptance (issue 35): measured within 10 % (or 32 MiB, whichever is larger) of predicted in
>= 90 % of the cases, for the run and for the load; measured <= max_memory in every case whose
plan said it fits.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from benchmarks.memwatch import MemWatch, read_status, run_fresh

MIB = 2**20
MARGIN_SHARE, MARGIN_BYTES = 0.10, 32 * MIB


@dataclass(frozen=True)
class Case:
    model: str
    mode: str  # forward | generate | train
    budget: str  # all | 50% | 20%

    @property
    def name(self) -> str:
        return f"{self.model} {self.mode} {self.budget}"


CASES = [
    Case(m, mode, b)
    for m, mode, b in [
        ("gpt2", "forward", "all"),
        ("gpt2", "forward", "50%"),
        ("gpt2", "forward", "20%"),
        ("gpt2", "generate", "50%"),
        ("gpt2", "train", "all"),
        ("llama", "forward", "all"),
        ("llama", "forward", "50%"),
        ("llama", "forward", "20%"),
        ("llama", "generate", "all"),
        ("llama", "generate", "20%"),
        ("llama", "train", "all"),
        ("llama-bf16", "forward", "all"),
        ("llama-bf16", "generate", "50%"),
        ("t5", "forward", "all"),
        ("t5", "forward", "50%"),
        ("mixtral", "forward", "all"),
        ("mixtral", "forward", "50%"),
        ("mixtral", "generate", "20%"),
        ("bert", "forward", "all"),
        ("bert", "train", "50%"),
        ("vit", "forward", "all"),
        ("vit", "forward", "20%"),
        ("resnet50", "forward", "all"),
        ("resnet50", "forward", "50%"),
        ("resnet50", "train", "all"),
        ("whisper", "forward", "all"),
        ("whisper", "forward", "50%"),
        ("llama", "forward", "tiny"),
        ("resnet50", "forward", "tiny"),
    ]
]
QUICK = [
    Case("gpt2", "forward", "50%"),
    Case("llama", "forward", "20%"),
    Case("llama", "generate", "all"),
    Case("mixtral", "forward", "50%"),
    Case("resnet50", "forward", "all"),
    Case("llama", "forward", "tiny"),
]

BATCH, TOKENS, NEW_TOKENS = 2, 128, 16


# ---------------------------------------------------------------------------------------- models


def _config(model: str) -> Any:
    import transformers as tf

    if model == "gpt2":
        return tf.GPT2Config(
            n_layer=6, n_embd=512, n_head=8, vocab_size=16000, n_positions=512, bos_token_id=0, eos_token_id=0
        )
    if model in ("llama", "llama-bf16"):
        config = tf.LlamaConfig(
            hidden_size=512,
            intermediate_size=1376,
            num_hidden_layers=6,
            num_attention_heads=8,
            num_key_value_heads=8,
            vocab_size=16000,
            max_position_embeddings=512,
            tie_word_embeddings=False,
            bos_token_id=0,
            eos_token_id=0,
        )
        config.dtype = "bfloat16" if model == "llama-bf16" else "float32"
        return config
    if model == "t5":
        return tf.T5Config(
            d_model=256,
            d_ff=1024,
            num_layers=4,
            num_decoder_layers=4,
            num_heads=4,
            d_kv=64,
            vocab_size=16000,
            decoder_start_token_id=0,
        )
    if model == "mixtral":
        return tf.MixtralConfig(
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=4,
            num_local_experts=8,
            num_experts_per_tok=2,
            vocab_size=8000,
            max_position_embeddings=512,
            tie_word_embeddings=False,
            bos_token_id=0,
            eos_token_id=0,
        )
    if model == "bert":
        return tf.BertConfig(
            hidden_size=256,
            num_hidden_layers=6,
            num_attention_heads=4,
            intermediate_size=1024,
            vocab_size=16000,
        )
    if model == "vit":
        return tf.ViTConfig(
            hidden_size=384,
            num_hidden_layers=6,
            num_attention_heads=6,
            intermediate_size=1536,
            image_size=224,
            patch_size=16,
        )
    if model == "whisper":
        return tf.WhisperConfig(
            d_model=256,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=1024,
            decoder_ffn_dim=1024,
            vocab_size=8000,
            num_mel_bins=80,
            max_source_positions=1500,
            max_target_positions=448,
            decoder_start_token_id=1,
            pad_token_id=0,
            eos_token_id=2,
            bos_token_id=1,
        )
    raise KeyError(model)


def _model_class(model: str) -> Callable[..., Any]:
    import transformers as tf

    return {
        "gpt2": tf.GPT2LMHeadModel,
        "llama": tf.LlamaForCausalLM,
        "llama-bf16": tf.LlamaForCausalLM,
        "t5": tf.T5ForConditionalGeneration,
        "mixtral": tf.MixtralForCausalLM,
        "bert": tf.BertForMaskedLM,
        "vit": tf.ViTForImageClassification,
        "whisper": tf.WhisperForConditionalGeneration,
    }[model]


def write_model(model: str, root: Path) -> Path:
    """The case's checkpoint: a Hugging Face folder, or a safetensors file for ResNet-50."""
    import torch

    folder = root / model
    if folder.exists():
        return folder
    torch.manual_seed(0)
    if model == "resnet50":
        import torchvision
        from safetensors.torch import save_file

        folder.mkdir(parents=True)
        state = torchvision.models.resnet50().state_dict()
        save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))
        return folder
    config = _config(model)
    built = _model_class(model)(config)
    if model == "llama-bf16":
        built = built.to(torch.bfloat16)
    built.save_pretrained(folder)
    return folder


def inputs(model: str, mode: str) -> Any:
    """The case's inputs: keyword arguments, or a tuple of positional ones (ResNet-50)."""
    import torch

    g = torch.Generator().manual_seed(1)
    if model == "resnet50":
        return (torch.randn(BATCH, 3, 224, 224, generator=g),)
    if model == "vit":
        return {"pixel_values": torch.randn(BATCH, 3, 224, 224, generator=g)}
    if model == "whisper":
        return {
            "input_features": torch.randn(BATCH, 80, 3000, generator=g),
            "decoder_input_ids": torch.ones(BATCH, 8, dtype=torch.long),
        }
    vocab = _config(model).vocab_size
    tokens = 16 if mode == "generate" else TOKENS
    ids = torch.randint(3, vocab, (BATCH, tokens), generator=g)
    if model == "t5":
        return {"input_ids": ids, "decoder_input_ids": ids[:, :32]}
    return {"input_ids": ids}


# ---------------------------------------------------------------------------------------- worker


def worker(case: Case, folder: Path, offload: Path) -> dict[str, Any]:

    import automap
    from automap.planning.predict import memory
    from automap.runtime.state import state_of

    automap.plan, automap.load, automap.RuntimeBudgetError  # noqa: B018 - import the whole surface now
    weights = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    example = inputs(case.model, case.mode)
    generate = dict(batch=BATCH, max_length=16 + NEW_TOKENS) if case.mode == "generate" else {}
    skeleton = _skeleton(case.model, folder)
    if case.mode == "train":
        skeleton.train()
    budget = _budget(case.budget, weights, skeleton, example, generate)
    max_memory = {"cpu": budget, "disk": 64 * weights}
    gc.collect()
    base = read_status()["RssAnon"]
    row: dict[str, Any] = {
        **asdict(case),
        "case": case.name,
        "weights_bytes": weights,
        "budget_bytes": budget,
    }
    try:
        with MemWatch(0.001) as load:
            model = automap.load(
                skeleton,
                folder,
                max_memory=max_memory,
                offload_dir=offload,
                quiet=True,
                example_inputs=example,
                **generate,
            )
    except automap.RuntimeBudgetError as exc:
        return {**row, "refused": str(exc)}
    plan = state_of(model).plan
    cpu = next(m for m in memory(plan) if m.device == "cpu")
    del skeleton
    gc.collect()
    after_load = read_status()["RssAnon"] - base
    with MemWatch(0.001) as run:
        _run(model, case.mode, example)
    return {
        **row,
        "refused": "",
        "predicted": cpu.as_dict(),
        "predicted_run_bytes": cpu.peak_bytes,
        "predicted_load_bytes": plan.load_peak_bytes,
        "plan_fits": cpu.fits,
        "weights_in_ram_bytes": cpu.weights,
        "measured_load_bytes": load.peak_anon_bytes - base,
        "after_load_bytes": after_load,
        "measured_run_bytes": run.peak_anon_bytes - base,
    }


def _budget(budget: str, weights: int, skeleton: Any, example: Any, generate: dict[str, int]) -> int:
    """``max_memory["cpu"]`` of a case: ``all``: four times the weights; ``N%``: N % of the weights
    plus what the plan predicts one run needs beside them (activations, overhead, cache), so
    that N % of the weights can stay in RAM; ``tiny``: 8 MiB, too small for one forward."""
    import automap
    from automap.planning.predict import memory

    if budget == "all":
        return 4 * weights
    if budget == "tiny":
        return 8 * MIB
    probe = automap.plan(skeleton, max_memory={"cpu": 4 * weights}, example_inputs=example, **generate)
    cpu = next(m for m in memory(probe) if m.device == "cpu")
    return int(weights * int(budget.rstrip("%")) / 100) + cpu.peak_bytes - cpu.weights


def _skeleton(model: str, folder: Path) -> Any:
    import automap

    if model == "resnet50":
        import torchvision

        with automap.empty_model():
            return torchvision.models.resnet50().eval()
    from automap.loading.hf import build_from_folder

    return build_from_folder(folder)


def _run(model: Any, mode: str, example: Any) -> None:
    import torch

    def call() -> Any:
        return model(*example) if isinstance(example, tuple) else model(**example)

    if mode == "generate":
        with torch.no_grad():
            model.generate(**example, max_length=16 + NEW_TOKENS, do_sample=False, min_length=16 + NEW_TOKENS)
    elif mode == "train":
        call()  # with grad: what autograd keeps for the backward stays alive until the output goes
    else:
        with torch.no_grad():
            call()


# ---------------------------------------------------------------------------------------- main


def within(predicted: int, measured: int) -> bool:
    return abs(measured - predicted) <= max(MARGIN_SHARE * predicted, MARGIN_BYTES)


def judged(row: dict[str, Any]) -> dict[str, Any]:
    if row["refused"]:
        return row
    run, load = row["predicted_run_bytes"], row["predicted_load_bytes"]
    return {
        **row,
        "run_ratio": row["measured_run_bytes"] / max(run, 1),
        "run_within": within(run, row["measured_run_bytes"]),
        "load_ratio": row["measured_load_bytes"] / max(load, 1),
        "load_within": within(load, row["measured_load_bytes"]),
        "under_budget": row["measured_run_bytes"] <= row["budget_bytes"]
        and row["measured_load_bytes"] <= row["budget_bytes"],
    }


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| case | budget | in RAM | predicted run | measured run | ratio | ok | predicted load | measured load "
        "| ratio | ok | <= budget |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["refused"]:
            lines.append(
                f"| {r['case']} | {r['budget_bytes'] / MIB:.0f} MiB | refused before loading: "
                f"{r['refused'][:90]}... |||||||||"
            )
            continue
        lines.append(
            f"| {r['case']} | {r['budget_bytes'] / MIB:.0f} MiB | {r['weights_in_ram_bytes'] / MIB:.0f} MiB "
            f"| {r['predicted_run_bytes'] / MIB:.1f} MiB | {r['measured_run_bytes'] / MIB:.1f} MiB "
            f"| {r['run_ratio']:.2f} | {'yes' if r['run_within'] else 'NO'} "
            f"| {r['predicted_load_bytes'] / MIB:.1f} MiB | {r['measured_load_bytes'] / MIB:.1f} MiB "
            f"| {r['load_ratio']:.2f} | {'yes' if r['load_within'] else 'NO'} "
            f"| {'yes' if r['under_budget'] or not r['plan_fits'] else 'NO'} |"
        )
    return "\n".join(lines)


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    ran = [r for r in rows if not r["refused"]]
    fits = [r for r in ran if r["plan_fits"]]
    return {
        "cases": len(rows),
        "refused": len(rows) - len(ran),
        "run_within": sum(r["run_within"] for r in ran),
        "load_within": sum(r["load_within"] for r in ran),
        "ran": len(ran),
        "plan_fits": len(fits),
        "over_budget_when_fits": [r["case"] for r in fits if not r["under_budget"]],
        "refusals_expected": [r["case"] for r in rows if r["budget"] == "tiny"],
        "refusals_unexpected": [r["case"] for r in rows if r["refused"] and r["budget"] != "tiny"],
        "not_refused_tiny": [r["case"] for r in ran if r["budget"] == "tiny"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="6 cases")
    parser.add_argument("--only", default="", help="cases whose name contains this")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--jobs", type=int, default=2, help="cases run at once (each in its own interpreter)")
    parser.add_argument(
        "--worker", nargs=4, metavar=("MODEL", "MODE", "BUDGET", "ROOT"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.worker:
        model, mode, budget, root = args.worker
        offload = Path(tempfile.mkdtemp(prefix="offload-", dir=root))
        try:
            print(json.dumps(worker(Case(model, mode, budget), Path(root) / model, offload)))
        finally:
            shutil.rmtree(offload, ignore_errors=True)
        return
    cases = [c for c in (QUICK if args.quick else CASES) if args.only in c.name]
    root = Path(tempfile.mkdtemp(prefix="automap-fit-"))

    def one(case: Case) -> dict[str, Any]:
        row = judged(run_fresh("benchmarks.fit", "--worker", case.model, case.mode, case.budget, str(root)))
        print(table([row]).splitlines()[-1], file=sys.stderr, flush=True)
        return row

    try:
        # The machine measured once before the cases (its first use here), not inside one's load.
        from automap.machine import machine_record

        machine_record(str(root))
        for model in dict.fromkeys(c.model for c in cases):
            write_model(model, root)
        with ThreadPoolExecutor(args.jobs) as pool:  # each case is a process of its own: its memory apart
            rows = list(pool.map(one, cases))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(table(rows))
    result = {
        "summary": summary(rows),
        "margin": {"share": MARGIN_SHARE, "bytes": MARGIN_BYTES},
        "rows": rows,
    }
    print(json.dumps(result["summary"]))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
