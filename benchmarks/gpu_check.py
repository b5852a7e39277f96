"""``make gpu-check``: every GPU code path of automap in one command, in a few minutes.

    make gpu-check                          # on a machine with one or more CUDA GPUs
    make gpu-check DRY=1                    # the same steps on the CPU, small sizes (in make test)
    python -m benchmarks.gpu_check --out DIR --budget-seconds 420 [--dry-run] [--only h2d,load]

Steps, in this order (``benchmarks/gpu_steps.py`` holds each one):

- ``environment``: torch, CUDA, the GPUs, library versions;
- ``tests``: every ``cuda`` and ``multi_gpu`` test (pytest; multi-GPU ones skip on one GPU);
- ``transparency``: CNN, ViT, GPT-2 (tied), Llama, T5 with units on the GPU, in CPU RAM and on
  disk: outputs equal to the model on the GPU, ``generate`` identical;
- ``h2d``: bytes/s of each streamed unit's copy during forwards, beside pinned copies of the same
  sizes on the same GPU (target: >= 0.8 of that bound for units streamed from RAM);
- ``llama-stream25/50/75``, ``llama-disk``: a 2.7 GB bf16 Llama with 25/50/75 % streamed from
  CPU RAM, and with a part on disk: automap vs accelerate vs all on the GPU, one process each;
- ``load``: the checkpoint loaded to the GPU (all, and GPU + CPU + disk), automap vs accelerate;
- ``tutorial``: the model-parallel tutorial's experiment (1 GPU: both stages on it, the
  overhead alone; 2+ GPUs: the real comparison and its plot);
- ``moe``: Mixtral- and Qwen2-MoE-shaped models with their layers on disk, in CPU RAM, and only
  their routed experts in CPU RAM: outputs, ``generate``, bytes copied per forward
  (``benchmarks/gpu_moe.py``).

Each step runs in a forked process of its own, so a failure (a CUDA error, an OOM, a crash) is
reported in the JSON and the next step still runs; the parent never touches CUDA (and sets
``PYTORCH_NVML_BASED_CUDA_CHECK=1`` so no import does), which keeps forking safe. A global time
budget bounds the run: a step that would start with too little time left is "skipped: out of
time", and one still running when the budget ends is killed and reported so. A progress line is
printed per step; at the end ``gpu-check.json`` and ``gpu-check.txt`` are written under
``--out``. The exit status is 1 when a step failed, else 0.

In a dry run (``--dry-run``) each step runs its CPU equivalent at small sizes: the CPU executes,
and what a GPU would stream goes through the accelerator's transfer path on the CPU
(``StagedTransfer(source, HostCopyOps())``). It proves that the script and every step's code
still run; its figures are CPU figures.
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # run as a program: before anything imports torch
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # torch.cuda.is_available() without cuInit
    os.environ.setdefault("TQDM_DISABLE", "1")  # accelerate's per-tensor bars would drown the progress lines

import argparse  # noqa: E402 - after the variable above, before anything imports torch
import dataclasses  # noqa: E402
import json  # noqa: E402
import multiprocessing  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from functools import partial  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable  # noqa: E402

DEFAULT_OUT = Path("benchmarks/out/gpu-check")
DEFAULT_BUDGET_SECONDS = 420  # 7 minutes of steps; the whole command stays under 8


@dataclass(frozen=True)
class Step:
    """A step: its name, its function (``gpu_steps``), about how long it takes on a GPU (a step
    that would start with less time left is skipped), and the GPUs it needs."""

    name: str
    run: Callable[[Any], dict[str, Any]]
    seconds: float
    gpus: int = 0


def steps() -> list[Step]:
    from benchmarks import gpu_moe, gpu_steps as s

    llama = [Step(f"llama-{c}", partial(s.llama, config=c), 35) for c in s.LLAMA_CONFIGS]
    return [
        Step("environment", s.environment, 5),
        Step("tests", s.gpu_tests, 60),
        Step("transparency", s.transparency, 30),
        Step("h2d", s.h2d, 30),
        *llama,
        Step("load", s.load, 40),
        Step("tutorial", s.tutorial, 40),
        Step("moe", gpu_moe.moe, 40),
    ]


def preload() -> None:
    """Import what the steps use once, in the parent, so each forked step starts at once."""
    import accelerate  # noqa: F401
    import torch  # noqa: F401
    import torchvision.models  # noqa: F401
    import transformers.models.gpt2.modeling_gpt2  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401
    import transformers.models.t5.modeling_t5  # noqa: F401

    import automap.runtime  # noqa: F401
    import benchmarks.gpu_steps  # noqa: F401
    import benchmarks.offload  # noqa: F401
    import benchmarks.tutorial  # noqa: F401


# ------------------------------------------------------------------ running one step


def _child(step: Step, ctx: Any, pipe: Any) -> None:
    import torch

    from benchmarks.gpu_steps import CheckFailed

    if ctx.dry:
        torch.set_num_threads(1)  # small CPU ops: waking OpenMP threads costs more than they save
    try:
        result = {"status": "ok", "result": step.run(ctx)}
    except CheckFailed as exc:
        result = {"status": "failed", "error": str(exc)}
    except BaseException as exc:  # noqa: BLE001 - whatever broke, the parent reports it
        result = {
            "status": "failed",
            "error": f"{type(exc).__name__}: {exc}",
            "traceback": traceback.format_exc()[-3000:],
        }
    try:
        pipe.send(json.loads(json.dumps(result, default=str)))
    finally:
        pipe.close()


# What a forked child says when this process had initialised CUDA after all: then spawn.
POISONED_FORK = re.compile(
    r"re-initialize CUDA in forked|CUDA.*initiali[sz]ation (error|failed)|"
    r"initiali[sz]ation error.*CUDA",
    re.IGNORECASE,
)


def run_step(step: Step, ctx: Any, seconds_left: float, method: str = "fork") -> dict[str, Any]:
    """Run ``step`` in a child process (forked, or spawned: slower to start, but safe should
    this process have initialised CUDA after all), killed when ``seconds_left`` run out."""
    import torch

    fork = multiprocessing.get_context("spawn" if torch.cuda.is_initialized() else method)
    reader, writer = fork.Pipe(duplex=False)
    process = fork.Process(target=_child, args=(step, ctx, writer), name=f"gpu-check-{step.name}")
    process.start()
    writer.close()
    try:
        if reader.poll(max(seconds_left, 1)):
            return reader.recv()
        if process.is_alive():
            return {
                "status": "skipped",
                "error": f"skipped: out of time (killed at the {seconds_left:.0f} s left "
                "of the global budget)",
            }
        return {"status": "failed", "error": f"the step's process died (exit code {process.exitcode})"}
    except EOFError:
        process.join(5)
        return {"status": "failed", "error": f"the step's process died (exit code {process.exitcode})"}
    finally:
        if process.is_alive():
            process.kill()
        process.join()
        reader.close()


def headline(record: dict[str, Any]) -> str:
    if record["status"] == "ok":
        return record["result"].get("headline", "")
    return record.get("error", "").splitlines()[0][:300] if record.get("error") else ""


def run_all(chosen: list[Step], ctx: Any, budget: float) -> list[dict[str, Any]]:
    started = time.monotonic()
    records: list[dict[str, Any]] = []
    method = "fork"
    for number, step in enumerate(chosen, 1):
        left = budget - (time.monotonic() - started)
        if step.gpus > ctx.gpus and not ctx.dry:
            record = {
                "status": "skipped",
                "error": f"skipped: needs {step.gpus} GPUs, this machine has {ctx.gpus}",
            }
        elif left < step.seconds * (0.2 if ctx.dry else 1.0):
            record = {
                "status": "skipped",
                "error": f"skipped: out of time ({left:.0f} s left of the {budget:.0f} s "
                f"budget; the step takes about {step.seconds:.0f} s)",
            }
        else:
            print(f"[gpu-check] {number}/{len(chosen)} {step.name} ...", flush=True)
            begin = time.monotonic()
            record = run_step(step, ctx, left, method)
            if method == "fork" and record["status"] == "failed" and POISONED_FORK.search(record["error"]):
                method = "spawn"  # an import initialised CUDA in this process: this and later steps spawn
                print(
                    f"[gpu-check] {step.name}: CUDA unusable in a forked process; spawning the steps",
                    flush=True,
                )
                record = run_step(step, ctx, budget - (time.monotonic() - started), method)
            record["seconds"] = round(time.monotonic() - begin, 2)
        record = {"name": step.name, **record}
        records.append(record)
        print(
            f"[gpu-check] {number}/{len(chosen)} {step.name}: {record['status']} "
            f"({record.get('seconds', 0):.1f} s) {headline(record)}",
            flush=True,
        )
        if step.name == "environment" and record["status"] == "ok":
            ctx = dataclasses.replace(ctx, gpus=record["result"]["gpu_count"])
        elif step.name == "environment" and not ctx.dry:
            break  # no GPU (or no torch): nothing else can run
    return records


# ------------------------------------------------------------------ the report


def summary_text(report: dict[str, Any]) -> str:
    lines = [
        f"automap gpu-check ({report['mode']}): {'all steps passed' if report['ok'] else 'FAILED'} "
        f"in {report['wall_seconds']:.0f} s (budget {report['budget_seconds']:.0f} s)"
    ]
    width = max(len(r["name"]) for r in report["steps"])
    for record in report["steps"]:
        lines.append(
            f"  {record['name']:<{width}}  {record['status']:<7}  {record.get('seconds', 0):6.1f} s  "
            f"{headline(record)}"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--dry-run", action="store_true", help="the CPU equivalents at small sizes (no GPU needed)"
    )
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help="where gpu-check.json/.txt and plots go"
    )
    parser.add_argument(
        "--scratch",
        type=Path,
        help="checkpoints and offload folders (default: a temporary folder, removed at the end)",
    )
    parser.add_argument("--budget-seconds", type=float, default=DEFAULT_BUDGET_SECONDS)
    parser.add_argument("--only", help="comma-separated step names (environment always runs)")
    args = parser.parse_args(argv)
    from benchmarks.gpu_steps import Context

    chosen = steps()
    if args.only:
        wanted = {"environment", *args.only.split(",")}
        unknown = wanted - {s.name for s in chosen}
        if unknown:
            parser.error(f"unknown step(s) {sorted(unknown)}; the steps are {[s.name for s in chosen]}")
        chosen = [s for s in chosen if s.name in wanted]
    args.out.mkdir(parents=True, exist_ok=True)
    scratch = args.scratch or Path(tempfile.mkdtemp(prefix="automap-gpu-check-"))
    scratch.mkdir(parents=True, exist_ok=True)
    preload()
    started = time.monotonic()
    try:
        records = run_all(
            chosen,
            Context(dry=args.dry_run, out=args.out.resolve(), scratch=scratch.resolve()),
            args.budget_seconds,
        )
    finally:
        if args.scratch is None:
            shutil.rmtree(scratch, ignore_errors=True)
    report = {
        "mode": "dry run (CPU)" if args.dry_run else "GPU",
        "command": sys.argv,
        "budget_seconds": args.budget_seconds,
        "wall_seconds": time.monotonic() - started,
        "ok": all(r["status"] != "failed" for r in records),
        "steps": records,
    }
    (args.out / "gpu-check.json").write_text(json.dumps(report, indent=1, default=str))
    text = summary_text(report)
    (args.out / "gpu-check.txt").write_text(text)
    print(text, end="", flush=True)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
