"""Predicted vs measured forward and decode times on this machine, with nothing set by hand.

Each case plans a real architecture (random weights, built from a config) with ``automap.plan``
on this machine as automap measured it (the record in ``$XDG_CACHE_HOME/automap/machine.json``,
made on first use; ``--refresh`` measures again first), dispatches it as planned, and times
it warm: a forward (the planned batch and prompt) or one decode step (one token per sequence
fed the cache), the median of ``--runs`` runs. Each case runs in a fresh process (with
``--refresh`` measuring the machine first, right before it). Printed: predicted, measured, their
ratio, and the whole as JSON (``--json``).

    .venv/bin/python -m benchmarks.predict_time --runs 7 --json benchmarks/notes/predict-time.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

import automap
from automap.planning.decode import predict_decode
from automap.planning.predict import forward_seconds, memory
from automap.runtime.state import state_of


@dataclass(frozen=True)
class Case:
    name: str
    build: Callable[[], nn.Module]
    inputs: Callable[[], dict[str, torch.Tensor]]
    decode: bool = False
    max_length: int | None = None
    budget: dict[str, Any] | None = None  # max_memory; None: this machine's
    in_ram: float | None = None  # the share of the weights kept in RAM beside the run (the CPU budget)


def _llama(dtype: torch.dtype = torch.float32, hidden: int = 512, layers: int = 4) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=8192,
        max_position_embeddings=512,
    )
    return LlamaForCausalLM(config).to(dtype).eval()


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(
        GPT2Config(n_embd=768, n_layer=4, n_head=12, vocab_size=8192, n_positions=512)
    ).eval()


def _ids(batch: int, tokens: int) -> Callable[[], dict[str, torch.Tensor]]:
    return lambda: {
        "input_ids": torch.randint(0, 8192, (batch, tokens), generator=torch.Generator().manual_seed(0))
    }


CASES = (
    Case("llama-512 fp32 forward 1x128", _llama, _ids(1, 128)),
    Case("llama-512 bf16 forward 1x128", lambda: _llama(torch.bfloat16), _ids(1, 128)),
    Case("gpt2-768 fp32 forward 4x128", _gpt2, _ids(4, 128)),
    Case(
        "llama-1024 fp32 decode 1 token", lambda: _llama(hidden=1024), _ids(1, 32), decode=True, max_length=64
    ),
    Case("llama-512 fp32 forward 1x128, half on disk", _llama, _ids(1, 128), in_ram=0.5),
)


def median_seconds(run: Callable[[], Any], runs: int, before: Callable[[], None] = lambda: None) -> float:
    """The median of ``runs`` timed calls of ``run`` after a warm one (first-call allocations,
    page cache, oneDNN kernels), each after an untimed ``before``."""
    before()
    run()
    times = []
    for _ in range(runs):
        before()
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def decode_step(
    model: nn.Module, inputs: dict[str, torch.Tensor]
) -> tuple[Callable[[], Any], Callable[[], None]]:
    """One decode step: one token per sequence fed a copy of the prompt's cache; and what
    makes that copy before each step, untimed."""
    import copy

    with torch.no_grad():
        cache = model(**inputs, use_cache=True).past_key_values
    token = inputs["input_ids"][:, -1:]
    fresh: list[Any] = []

    def prepare() -> None:
        fresh[:] = [copy.deepcopy(cache)]

    def step() -> Any:
        with torch.no_grad():
            return model(input_ids=token, past_key_values=fresh.pop(), use_cache=True)

    return step, prepare


def forward_of(model: nn.Module, inputs: dict[str, torch.Tensor]) -> Callable[[], Any]:
    def forward() -> Any:
        with torch.no_grad():
            return model(**inputs)

    return forward


def _budget(case: Case, model: nn.Module, inputs: dict[str, torch.Tensor]) -> dict[str, Any] | None:
    """The case's max_memory: its own, or a CPU budget holding ``in_ram`` of the weights beside
    what the run itself needs (activations and the runtime's overhead, as the plan predicts)."""
    if case.in_ram is None:
        return case.budget
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    probe = automap.plan(model, max_memory={"cpu": 4 * weights}, example_inputs=inputs)
    cpu = next(m for m in memory(probe) if m.device == "cpu")
    return {"cpu": int(case.in_ram * weights) + cpu.peak_bytes - cpu.weights}


def run_case(case: Case, runs: int, offload_dir: Path) -> dict[str, Any]:
    model, inputs = case.build(), case.inputs()
    plan = automap.plan(
        model,
        max_memory=_budget(case, model, inputs),
        example_inputs=inputs,
        max_length=case.max_length,
        offload_dir=offload_dir,
    )
    if case.decode:
        prediction = predict_decode(plan)
        predicted = prediction.step_seconds if prediction is not None else float("nan")
        terms = {t.kind: t.seconds for t in prediction.terms} if prediction is not None else {}
    else:
        predicted = forward_seconds(plan)
        terms = {}
    automap.dispatch(model, plan, offload_dir=offload_dir)
    # Weights the plan puts on disk are read from it: their pages are dropped from the page
    # cache before each timed run (what a machine without the RAM to cache them sees). The
    # store just written is flushed first: the kernel keeps dirty pages whatever it is told.
    os.sync()
    evict = state_of(model).source.evict if "disk" in plan.placement else (lambda: None)
    warm = None
    try:
        run, prepare = (
            decode_step(model, inputs) if case.decode else (forward_of(model, inputs), lambda: None)
        )

        def before() -> None:
            prepare()
            evict()

        measured = median_seconds(run, runs, before=before)
        if "disk" in plan.placement:
            warm = median_seconds(run, runs, before=prepare)
    finally:
        automap.undispatch(model)
    cpu = next(d for d in plan.devices if d.name == "cpu")
    return {
        "case": case.name,
        "predicted_seconds": predicted,
        "predicted_terms": terms,
        "measured_seconds": measured,
        "warm_page_cache_seconds": warm,
        "ratio": measured / predicted,
        "devices": sorted(set(plan.placement)),
        "cpu_flops_per_second": cpu.flops_per_second,
        "cpu_memory_bytes_per_second": cpu.memory_bytes_per_second,
        "measured_figures": {d.name: list(d.measured) for d in plan.devices},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=7, help="timed runs per case (median)")
    parser.add_argument("--refresh", action="store_true", help="measure the machine again before each case")
    parser.add_argument("--only", default="", help="run the cases whose name contains this")
    parser.add_argument("--offload-dir", type=Path, default=Path("/tmp/automap-predict-time"))
    parser.add_argument("--json", type=Path, help="write the rows as JSON")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's own)")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # run this one case here, print its row
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)  # before the record is read: it is kept per thread count
    if args.case is not None:
        return _one_case(args)
    rows = []
    for case in CASES:
        if args.only not in case.name:
            continue
        # Each case in a fresh process, as a user's run: nothing of an earlier case's memory
        # (the allocator's state, the page cache it filled) weighs on it.
        command = [sys.executable, "-m", "benchmarks.predict_time", "--case", case.name, *_passed(args)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            print(done.stderr[-4000:], file=sys.stderr)
            return done.returncode
        row = json.loads(done.stdout.strip().splitlines()[-1])
        rows.append(row)
        print(
            f"{row['case']:<44} predicted {row['predicted_seconds'] * 1e3:8.2f} ms  measured "
            f"{row['measured_seconds'] * 1e3:8.2f} ms  measured/predicted {row['ratio']:.2f}",
            flush=True,
        )
    within = sum(1 for r in rows if abs(r["ratio"] - 1) <= 0.15)
    print(f"within 15 %: {within} of {len(rows)}")
    result = {
        "threads": args.threads or torch.get_num_threads(),
        "runs": args.runs,
        "rows": rows,
        "within_15_percent": within,
    }
    print(json.dumps(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


def _passed(args: argparse.Namespace) -> list[str]:
    """The options a case's process is given: the parent's own."""
    passed = ["--runs", str(args.runs), "--offload-dir", str(args.offload_dir)]
    if args.threads:
        passed += ["--threads", str(args.threads)]
    return passed + (["--refresh"] if args.refresh else [])


def _one_case(args: argparse.Namespace) -> int:
    """Measure the machine (``--refresh``: again, right before the case), run the case named
    ``args.case``, print its row as JSON on the last line."""
    from automap.machine import describe, machine_record

    record = machine_record(str(args.offload_dir.parent), refresh=args.refresh)
    print(describe(record) or "measuring is off (AUTOMAP_CALIBRATION=off): default speeds", file=sys.stderr)
    case = next(c for c in CASES if c.name == args.case)
    row = run_case(case, args.runs, args.offload_dir)
    row["machine"] = describe(record)
    print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
