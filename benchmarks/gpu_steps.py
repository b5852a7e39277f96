"""The steps of ``make gpu-check`` (:mod:`benchmarks.gpu_check` runs each in a process of its
own and collects what it returns). Every step takes a :class:`Context` and returns a dict with a
one-line ``headline``; a step that finds something wrong raises :class:`CheckFailed`.

On a GPU each step does the real thing on ``cuda:0``; in a dry run (``ctx.dry``) the same code
runs on the CPU at small sizes, with the accelerator's transfer path — device copies swapped in
for each streamed unit — run by ``StagedTransfer(source, HostCopyOps())``.
"""

from __future__ import annotations

import copy
import gc
import json
import re
import statistics
import time
import xml.etree.ElementTree as ET
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import nn

import automap
from automap.offload import CudaOps, DeviceOps, HostCopyOps, StagedTransfer, WeightSource
from automap.runtime import dispatch_plan, state_of
from automap.sizes import format_bytes

ROOT = Path(__file__).resolve().parents[1]
GB = 1e9


class CheckFailed(Exception):
    """What a step found wrong, said in one message (the JSON's ``error``)."""


@dataclass(frozen=True)
class Context:
    """What every step knows: the mode, where to write, and the machine's GPUs."""

    dry: bool
    out: Path
    scratch: Path
    gpus: int = 0

    @property
    def device(self) -> torch.device:
        return torch.device("cpu" if self.dry else "cuda:0")

    def sync(self) -> None:
        if not self.dry:
            torch.cuda.synchronize()


def staged_on_host(source: WeightSource, device: torch.device, buffers: int | None = None) -> StagedTransfer:
    """The dry run's transfer: the accelerator path (copies swapped in per unit) on the CPU."""
    return StagedTransfer(source, HostCopyOps())


# ------------------------------------------------------------------ environment


def environment(ctx: Context) -> dict[str, Any]:
    import platform

    import accelerate
    import psutil
    import torchvision
    import transformers

    gpus = (
        [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if torch.cuda.is_available()
        else []
    )
    if not ctx.dry and not gpus:
        raise CheckFailed(
            "no CUDA GPU is visible to torch (torch.cuda.is_available() is False); "
            "run `make gpu-check DRY=1` on a machine without one"
        )
    found = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "accelerate": accelerate.__version__,
        "torchvision": torchvision.__version__,
        "gpus": gpus,
        "gpu_count": len(gpus),
        "cpu_cores": psutil.cpu_count(logical=True),
        "ram_bytes": psutil.virtual_memory().total,
    }
    if gpus:
        free, total = torch.cuda.mem_get_info(0)
        found.update(gpu_memory_bytes=total, gpu_free_bytes=free)
    found["headline"] = (
        f"{len(gpus)} GPU(s) {', '.join(gpus) or '-'}; torch {torch.__version__}, "
        f"transformers {transformers.__version__}, accelerate {accelerate.__version__}"
    )
    return found


# ------------------------------------------------------------------ the cuda / multi_gpu tests


def gpu_test_files() -> list[str]:
    """Test files that hold ``cuda`` or ``multi_gpu`` tests (only those are collected)."""
    marked = re.compile(r"mark\.(cuda|multi_gpu)\b")
    return sorted(
        str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py") if marked.search(p.read_text())
    )


def gpu_tests(ctx: Context) -> dict[str, Any]:
    """pytest on the GPU tests, in this (forked) process: torch and transformers are imported
    already. Its output goes to ``pytest-gpu.log``, its results to ``pytest-gpu.xml``."""
    import os
    from contextlib import redirect_stderr, redirect_stdout

    import pytest

    report, log = ctx.out / "pytest-gpu.xml", ctx.out / "pytest-gpu.log"
    flags = [
        "-q",
        "-rs",
        "-p",
        "no:cacheprovider",
        "-m",
        "cuda or multi_gpu",
        f"--junitxml={report}",
        f"--rootdir={ROOT}",
        *gpu_test_files(),
    ]
    os.chdir(ROOT)
    with open(log, "w") as out, redirect_stdout(out), redirect_stderr(out):
        code = int(pytest.main(flags))
    if not report.exists():
        raise CheckFailed(f"pytest wrote no report (exit {code}): {log.read_text()[-800:]}")
    found = junit_summary(report)
    found["exit_code"] = code
    bad = found["failed"] + found["errors"]
    if bad or code not in (0, 5):
        raise CheckFailed(f"{len(bad)} GPU test(s) failed: " + "; ".join(f"{n}: {m}" for n, m in bad[:5]))
    if ctx.gpus and not found["passed"]:
        raise CheckFailed("a GPU is present but no GPU test ran: " + json.dumps(found["skip_reasons"]))
    found["headline"] = (
        f"{len(found['passed'])} passed, {len(found['skipped'])} skipped "
        f"({'; '.join(found['skip_reasons']) or 'none'}), 0 failed"
    )
    return found


def junit_summary(path: Path) -> dict[str, Any]:
    passed, skipped, failed, errors = [], [], [], []
    reasons: dict[str, int] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        outcome = {child.tag: child for child in case}
        if "failure" in outcome:
            failed.append((name, (outcome["failure"].get("message") or "")[:300]))
        elif "error" in outcome:
            errors.append((name, (outcome["error"].get("message") or "")[:300]))
        elif "skipped" in outcome:
            skipped.append(name)
            reason = outcome["skipped"].get("message") or ""
            reasons[reason] = reasons.get(reason, 0) + 1
        else:
            passed.append(name)
    return {
        "passed": passed,
        "skipped": skipped,
        "failed": failed,
        "errors": errors,
        "skip_reasons": [f"{n} x {r}" for r, n in reasons.items()],
    }


# ------------------------------------------------------------------ transparency, five architectures


@dataclass
class Arch:
    """A model to check, its forward inputs, how to read its output, and ``generate`` options."""

    model: nn.Module
    inputs: dict[str, torch.Tensor] | tuple[torch.Tensor, ...]
    output: Callable[[Any], torch.Tensor]
    generate: dict[str, Any] | None = None


def _lm(config_class: str, model_class: str, **sizes: Any) -> nn.Module:
    import transformers

    config = getattr(transformers, config_class)(**sizes)
    torch.manual_seed(0)
    return getattr(transformers, model_class)(config).eval()


def architectures(dry: bool) -> dict[str, Arch]:
    """CNN, ViT, GPT-2 (tied embeddings), Llama, T5 — small configs in a dry run."""
    import torchvision

    torch.manual_seed(0)
    image = 64 if dry else 160
    vocab = 256 if dry else 4096
    ids = torch.randint(1, vocab, (2, 8), generator=torch.Generator().manual_seed(1))
    gen = {
        "input_ids": ids[:1],
        "attention_mask": torch.ones_like(ids[:1]),
        "max_new_tokens": 8 if dry else 16,
        "do_sample": False,
        "pad_token_id": 0,
    }
    gen["min_new_tokens"] = gen["max_new_tokens"]
    hidden, layers = (64, 4) if dry else (256, 8)
    logits = lambda out: out.logits  # noqa: E731 - a one-line reader
    vit = (
        torchvision.models.VisionTransformer(
            image_size=32, patch_size=8, num_layers=4, num_heads=4, hidden_dim=64, mlp_dim=128
        )
        if dry
        else torchvision.models.vit_b_16()
    )
    return {
        "cnn": Arch(
            (torchvision.models.resnet18() if dry else torchvision.models.resnet50()).eval(),
            (torch.randn(2, 3, image, image),),
            lambda out: out,
        ),
        "vit": Arch(
            vit.eval(), (torch.randn(2, 3, 32 if dry else 224, 32 if dry else 224),), lambda out: out
        ),
        "gpt2": Arch(
            _lm(
                "GPT2Config",
                "GPT2LMHeadModel",
                n_embd=hidden,
                n_layer=layers,
                n_head=4,
                vocab_size=vocab,
                n_positions=128,
                bos_token_id=0,
                eos_token_id=0,
            ),
            {"input_ids": ids},
            logits,
            gen,
        ),
        "llama": Arch(
            _lm(
                "LlamaConfig",
                "LlamaForCausalLM",
                hidden_size=hidden,
                intermediate_size=2 * hidden,
                num_hidden_layers=layers,
                num_attention_heads=4,
                num_key_value_heads=2,
                vocab_size=vocab,
                max_position_embeddings=128,
            ),
            {"input_ids": ids},
            logits,
            gen,
        ),
        "t5": Arch(
            _lm(
                "T5Config",
                "T5ForConditionalGeneration",
                d_model=hidden,
                d_ff=2 * hidden,
                d_kv=16,
                num_layers=layers // 2,
                num_heads=4,
                vocab_size=vocab,
                decoder_start_token_id=0,
            ),
            {"input_ids": ids, "decoder_input_ids": ids[:, :3]},
            logits,
            {k: v for k, v in gen.items() if k != "pad_token_id"},
        ),
    }


def three_tiers(model: nn.Module, inputs: Any, dry: bool) -> dict[str, Any]:
    """A device map over the model's units, in execution order, cycling GPU, CPU RAM, disk
    (tied units share the first one's tier; tensors of no unit, like ViT's class token, stay
    resident). In a dry run the CPU executes: its "GPU" units are resident on the CPU, and its
    "CPU" units go to disk, streamed like the rest."""
    prof = automap.profile(model, inputs)
    tiers = ("cpu", "disk", "disk") if dry else (0, "cpu", "disk")
    order = {u.name: i for i, u in enumerate(prof.units)}
    owner = {t: u.name for u in reversed(prof.units) for t in u.tensors}  # a tensor's first unit
    lead = {}
    for group in prof.tie_groups:
        units = [owner[t] for t in group if t in owner]
        lead.update({u: min(units, key=order.__getitem__) for u in units})
    return {"": tiers[0], **{u.name: tiers[order[lead.get(u.name, u.name)] % 3] for u in prof.units}}


def _on(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: _on(v, device) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(_on(v, device) for v in value)
    return value


def _forward(model: nn.Module, arch: Arch, device: torch.device) -> torch.Tensor:
    inputs = _on(arch.inputs, device)
    with torch.no_grad():
        out = model(**inputs) if isinstance(inputs, dict) else model(*inputs)
    return arch.output(out).float().cpu()


def _generate(model: nn.Module, arch: Arch, device: torch.device) -> torch.Tensor | None:
    if arch.generate is None:
        return None
    with torch.no_grad():
        return model.generate(**_on(arch.generate, device)).cpu()


def check_architecture(ctx: Context, name: str, arch: Arch) -> dict[str, Any]:
    plain = copy.deepcopy(arch.model).to(ctx.device)
    expected, tokens = _forward(plain, arch, ctx.device), _generate(plain, arch, ctx.device)
    del plain
    device_map = three_tiers(arch.model, arch.inputs, ctx.dry)
    model = arch.model
    plan = automap.plan(model, device_map, example_inputs=arch.inputs)
    if ctx.dry:
        dispatch_plan(model, plan, offload_dir=ctx.scratch / f"transparency-{name}", transfer=staged_on_host)
    else:
        automap.dispatch(model, plan, offload_dir=ctx.scratch / f"transparency-{name}")
    try:
        got, got_tokens = _forward(model, arch, ctx.device), _generate(model, arch, ctx.device)
        counts = {str(d): list(plan.placement).count(d) for d in dict.fromkeys(plan.placement)}
        streamed = len(state_of(model).groups)
    finally:
        automap.undispatch(model)
    diff = (got - expected).abs().max().item()
    found = {
        "units": counts,
        "streamed_units": streamed,
        "max_abs_diff": diff,
        "outputs_match": bool(torch.allclose(got, expected, rtol=1e-4, atol=1e-5)),
        "generate_identical": None if tokens is None else bool(torch.equal(got_tokens, tokens)),
    }
    found["ok"] = found["outputs_match"] and found["generate_identical"] is not False and streamed > 0
    return found


def transparency(ctx: Context) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name, arch in architectures(ctx.dry).items():
        start = time.perf_counter()
        try:
            results[name] = check_architecture(ctx, name, arch)
        except Exception as exc:  # noqa: BLE001 - one architecture failing must not hide the others
            results[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:600]}
        results[name]["seconds"] = round(time.perf_counter() - start, 2)
        gc.collect()
    bad = [n for n, r in results.items() if not r["ok"]]
    if bad:
        raise CheckFailed("not transparent: " + "; ".join(f"{n}: {results[n]}" for n in bad))
    worst = max(r["max_abs_diff"] for r in results.values())
    return {
        "architectures": results,
        "headline": f"{len(results)} architectures on {'cpu + disk' if ctx.dry else 'cuda:0 + cpu + disk'}: "
        f"outputs match (max |diff| {worst:.1e}), generate identical",
    }


# ------------------------------------------------------------------ H2D streaming vs pinned copies


@dataclass
class Timing:
    """One unit's copy as the transfer ran it: from entering the side stream (staging included)
    to the host having synchronized on its event."""

    staged: bool
    sizes: list[int] = field(default_factory=list)
    seconds: float = 0.0


class TimedOps:
    """A :class:`~automap.offload.DeviceOps` that times each unit's copy and delegates the rest."""

    def __init__(self, ops: DeviceOps):
        self.ops = ops
        self.timings: list[Timing] = []
        self._staging_address: int | None = None
        self._now: Timing | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.ops, name)

    @contextmanager
    def on_stream(self, stream: Any) -> Iterator[Any]:
        self._now = Timing(staged=False)
        start = time.perf_counter()
        with self.ops.on_stream(stream) as entered:
            yield entered
        self._now.seconds = time.perf_counter() - start
        self.timings.append(self._now)

    def pinned(self, nbytes: int) -> torch.Tensor:
        buffer = self.ops.pinned(nbytes)
        self._staging_address = buffer.untyped_storage().data_ptr()
        return buffer

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if self._now is not None:
            self._now.sizes.append(src.nbytes)
            self._now.staged |= src.untyped_storage().data_ptr() == self._staging_address
        self.ops.copy(dst, src)


def copy_bound(ctx: Context, sizes: list[int], repeats: int = 5) -> float:
    """Bytes/s of copying tensors of ``sizes`` from pinned host memory to the device (one
    stream, non-blocking, synchronized at the end): the physical limit for that unit shape."""
    host = [torch.empty(n, dtype=torch.uint8, pin_memory=not ctx.dry) for n in sizes]
    dev = [torch.empty(n, dtype=torch.uint8, device=ctx.device) for n in sizes]
    seconds = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        for d, h in zip(dev, host):
            d.copy_(h, non_blocking=True)
        ctx.sync()
        seconds.append(time.perf_counter() - start)
    return sum(sizes) / statistics.median(seconds[1:])


def h2d(ctx: Context) -> dict[str, Any]:
    """Stream the bf16 Llama's layers (alternately from pinned RAM and from its checkpoint on
    disk) during forwards, timing every unit's copy, against pinned copies of the same sizes."""
    from benchmarks.offload import setup_automap, time_forwards

    root = llama_checkpoint(ctx)
    layers, hidden = llama_sizes(ctx)
    resident = "cpu" if ctx.dry else 0
    device_map: dict[str, Any] = {
        n: resident
        for n in ("model.embed_tokens", "model.rotary_emb", "model.norm", "lm_head", "model.layers.0")
    }
    device_map.update(
        {f"model.layers.{i}": ("cpu" if i % 2 and not ctx.dry else "disk") for i in range(1, layers)}
    )
    write_plan(ctx, root, device_map)
    ops: list[TimedOps] = []

    def timed(source: WeightSource, device: torch.device, buffers: int | None = None) -> StagedTransfer:
        ops.append(TimedOps(HostCopyOps() if ctx.dry else CudaOps(device)))
        return StagedTransfer(source, ops[-1])

    model, _ = setup_automap(root, layers, hidden, "cpu" if ctx.dry else "cuda", transfer=timed)
    try:
        time_forwards(model, "cpu" if ctx.dry else "cuda", 1)  # allocates the staging buffer
        ops[0].timings.clear()
        seconds = [wall for wall, _ in time_forwards(model, "cpu" if ctx.dry else "cuda", 5)]
        timings = list(ops[0].timings)
        pinned_bytes = state_of(model).stats().pinned_bytes
    finally:
        automap.undispatch(model)
    found: dict[str, Any] = {
        "forward_median_seconds": statistics.median(seconds),
        "pinned_host_bytes": pinned_bytes,
    }
    for kind, staged in (("from_ram", False), ("from_disk", True)):
        mine = [t for t in timings if t.staged == staged and t.sizes]
        if mine:
            achieved = sum(sum(t.sizes) for t in mine) / sum(t.seconds for t in mine)
            bound = copy_bound(ctx, max((t.sizes for t in mine), key=sum))
            found[kind] = {
                "units_copied": len(mine),
                "unit_bytes": max(sum(t.sizes) for t in mine),
                "achieved_bytes_per_second": achieved,
                "pinned_copy_bytes_per_second": bound,
                "fraction_of_bound": achieved / bound,
            }
    key = "from_disk" if ctx.dry else "from_ram"
    if key not in found:
        raise CheckFailed(f"no unit was streamed {key.replace('_', ' ')}: {device_map}")
    found["target"] = "units streamed from pinned RAM reach >= 0.8 of the pinned-copy bound"
    found["target_met"] = None if ctx.dry else found[key]["fraction_of_bound"] >= 0.8
    parts = [
        f"{k.replace('_', ' ')}: {v['achieved_bytes_per_second'] / GB:.2f} GB/s = "
        f"{v['fraction_of_bound']:.2f}x the pinned-copy bound"
        for k, v in found.items()
        if isinstance(v, dict) and "fraction_of_bound" in v
    ]
    found["headline"] = "; ".join(parts) + (" (host copies: a dry run)" if ctx.dry else "")
    return found


def write_plan(
    ctx: Context,
    root: Path,
    device_map: dict[str, Any] | None = None,
    max_memory: dict[Any, int] | None = None,
) -> automap.Plan:
    """Plan the checkpoint's skeleton from a device map or a budget, where the setups of
    :mod:`benchmarks.offload` read it."""
    from benchmarks.offload import make_plan

    layers, hidden = llama_sizes(ctx)
    device = "cpu" if ctx.dry else "cuda"
    if device_map is None:
        return automap.Plan.from_json(make_plan(root, layers, hidden, 0.0, device, max_memory).read_text())
    from transformers import LlamaForCausalLM

    from benchmarks.offload import TOKENS, checkpoint_dtype, in_dtype, llama_config

    with torch.device("meta"):
        skeleton = in_dtype(LlamaForCausalLM(llama_config(layers, hidden)), checkpoint_dtype(root))
    plan = automap.plan(
        skeleton, device_map, example_inputs={"input_ids": torch.zeros(1, TOKENS, dtype=torch.long)}
    )
    (root / f"plan-{device}.json").write_text(plan.to_json())
    return plan


# ------------------------------------------------------------------ a Llama of a few GB: automap vs accelerate vs resident

LLAMA_CONFIGS = {
    # name: (share of the model streamed from CPU RAM, share on disk) the budgets aim at
    "stream25": (0.25, 0.0),
    "stream50": (0.5, 0.0),
    "stream75": (0.75, 0.0),
    "disk": (0.25, 0.25),
}


def llama_sizes(ctx: Context) -> tuple[int, int]:
    """(layers, hidden): 2.7 GB in bf16 on a GPU; a few MB on the CPU."""
    return (3, 128) if ctx.dry else (24, 2048)


def llama_checkpoint(ctx: Context) -> Path:
    from benchmarks.offload import build_checkpoint

    root = ctx.scratch / "llama-bf16"
    build_checkpoint(root, *llama_sizes(ctx), dtype="bfloat16")
    return root


def llama_budget(ctx: Context, root: Path, config: str) -> dict[Any, int]:
    from benchmarks.offload import CHECKPOINT

    ram, disk = LLAMA_CONFIGS[config]
    size = (root / CHECKPOINT).stat().st_size
    embedding = 32000 * llama_sizes(ctx)[1] * 2
    if ctx.dry:  # the CPU executes: what a GPU streams from RAM or disk comes from disk. The
        # embeddings are most of this tiny model: the budget takes the share of its layers.
        return {"cpu": int(size - (ram + disk) * (size - 2 * embedding))}
    # The planner keeps room on the GPU for the largest streamed unit (the 131 MB lm_head).
    return {0: int(size * (1 - ram - disk)) + embedding, "cpu": int(size * ram) + (size if not disk else 0)}


def llama(ctx: Context, config: str) -> dict[str, Any]:
    from benchmarks.offload import TOKENS, SETUPS, interleaved, setup_automap

    root = llama_checkpoint(ctx)
    layers, hidden = llama_sizes(ctx)
    device = "cpu" if ctx.dry else "cuda"
    plan = write_plan(ctx, root, max_memory=llama_budget(ctx, root, config))
    total = sum(u.weight_bytes for u in plan.units)
    shares = {
        d: sum(u.weight_bytes for u, p in zip(plan.units, plan.placement) if p == d) / total
        for d in dict.fromkeys(plan.placement)
    }
    setups = dict(SETUPS)
    if ctx.dry:
        setups["automap"] = lambda *a: setup_automap(*a, transfer=staged_on_host)
    timing = interleaved(root, layers, hidden, device, runs=3 if ctx.dry else 7, setups=setups)
    wall = timing["median_forward_seconds"]
    return {
        "model_bytes": total,
        "shares": shares,
        "tokens": TOKENS,
        **timing,
        "headline": f"{format_bytes(total)} bf16, "
        + ", ".join(f"{v:.0%} {k}" for k, v in shares.items())
        + f": automap {wall['automap'] * 1e3:.1f} ms = {timing['automap_vs_ram']:.2f}x resident, "
        f"{timing['automap_vs_accelerate']:.2f}x accelerate ({wall['accelerate'] * 1e3:.1f} ms)",
    }


# ------------------------------------------------------------------ loading to the GPU


def load(ctx: Context) -> dict[str, Any]:
    """The bf16 checkpoint loaded by automap and by accelerate with one device map (all on the
    GPU, then GPU + CPU + disk), interleaved; both loaded models must give the same logits."""
    from accelerate import init_empty_weights, load_checkpoint_and_dispatch
    from transformers import LlamaForCausalLM

    from benchmarks.offload import CHECKPOINT, checkpoint_dtype, in_dtype, llama_config

    root = llama_checkpoint(ctx)
    layers, hidden = llama_sizes(ctx)
    dtype = checkpoint_dtype(root)
    size = (root / CHECKPOINT).stat().st_size
    maps = {
        "resident": {"cpu": 2 * size} if ctx.dry else {0: 2 * size},
        "mixed": llama_budget(ctx, root, "disk"),
    }
    ids = torch.randint(0, 32000, (1, 16), generator=torch.Generator().manual_seed(3)).to(ctx.device)
    found: dict[str, Any] = {}
    for label, budget in maps.items():
        device_map = write_plan(ctx, root, max_memory=budget).device_map
        seconds: dict[str, list[float]] = {"automap": [], "accelerate": []}
        logits = {}
        for _ in range(1 if ctx.dry else 2):
            for tool in seconds:
                start = time.perf_counter()
                if tool == "automap":
                    with automap.empty_model():
                        model = in_dtype(LlamaForCausalLM(llama_config(layers, hidden)).eval(), dtype)
                    automap.load(
                        model,
                        root / CHECKPOINT,
                        device_map,
                        offload_dir=ctx.scratch / "load-automap",
                        quiet=True,
                    )
                else:
                    with init_empty_weights():
                        model = in_dtype(LlamaForCausalLM(llama_config(layers, hidden)).eval(), dtype)
                    model = load_checkpoint_and_dispatch(
                        model,
                        str(root / CHECKPOINT),
                        device_map=device_map,
                        offload_folder=str(ctx.scratch / "load-accelerate"),
                    )
                ctx.sync()
                seconds[tool].append(time.perf_counter() - start)
                with torch.no_grad():
                    logits[tool] = model(ids).logits.float().cpu()
                if tool == "automap" and state_of(model) is not None:
                    automap.undispatch(model)
                del model
                gc.collect()
                if not ctx.dry:
                    torch.cuda.empty_cache()
        diff = (logits["automap"] - logits["accelerate"]).abs().max().item()
        median = {t: statistics.median(s) for t, s in seconds.items()}
        found[label] = {
            "seconds": seconds,
            "median_seconds": median,
            "automap_vs_accelerate": median["automap"] / median["accelerate"],
            "logits_max_abs_diff": diff,
        }
        if not torch.allclose(logits["automap"], logits["accelerate"], rtol=1e-2, atol=1e-2):
            raise CheckFailed(
                f"{label}: automap's and accelerate's loaded models disagree (max |diff| {diff})"
            )
    found["note"] = "GPU loads copy each tensor from its (pageable) file mapping: no pinned staging yet"
    found["headline"] = "; ".join(
        f"{k}: automap {v['median_seconds']['automap']:.2f} s = {v['automap_vs_accelerate']:.2f}x accelerate"
        for k, v in found.items()
        if isinstance(v, dict)
    )
    return found


# ------------------------------------------------------------------ the tutorial's pipeline experiment


def tutorial(ctx: Context) -> dict[str, Any]:
    from benchmarks import tutorial as bench

    flags = ["--out", str(ctx.out / "tutorial")]
    if ctx.dry:
        flags += [
            "--setup",
            "cpu",
            "--batch",
            "4",
            "--image",
            "32",
            "--repeats",
            "1",
            "--batches",
            "1",
            "--split-sizes",
            "2",
        ]
    else:
        flags += ["--repeats", "3", "--split-sizes", "5,10,20,40"]
    result = bench.main(flags)
    rows = result["rows"]
    return {
        "setup": result["setup"]["name"],
        "rows": [{k: r[k] for k in ("label", "mean", "std", "vs_one_device")} for r in rows],
        "files": ["tutorial.json", "tutorial.png"],
        "headline": f"{result['setup']['name']}: "
        + ", ".join(f"{r['label']} {r['mean']:.3f} s ({100 * r['vs_one_device']:+.0f}%)" for r in rows),
    }
