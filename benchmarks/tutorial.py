"""The model-parallel tutorial's experiment, generalised: ResNet-50 training on one device, as
automap model-parallel (a two-stage plan, whole batches) and automap pipelined (micro-batches,
a ``split_size`` sweep plus ``chunks="auto"``).

    .venv/bin/python -m benchmarks.tutorial                      # sizes chosen from the hardware
    .venv/bin/python -m benchmarks.tutorial --repeats 5 --out benchmarks/out/tutorial

What runs where:
- two or more GPUs: stages on cuda:0 and cuda:1, the tutorial's sizes (batch 120, 128x128,
  3 batches per run, 10 runs, split sizes 1..60); the model is ``automap.dispatch``-ed;
- one GPU: both stages on cuda:0, tutorial sizes, 5 runs: nothing runs in parallel, so this
  measures what splitting and micro-batching cost (``--setup gpu-cpu`` puts the second stage on
  the CPU instead; the plan then gives it work in proportion to its speed, so it gets little);
- no GPU: two CPU stages at small sizes (batch 8, 32x32, 2 batches, 3 runs), one intra-op
  thread each (with two OpenMP threads on a busy 2-core machine a step is ~10x slower). The
  stages then share the machine's cores: this exercises the code and measures the pipeline's
  overhead; a speed-up here only means two worker threads used two cores.

Each configuration has its own copy of the model and trains one untimed batch first (allocator
and cuDNN warm-up); then ``--repeats`` rounds each time one run of ``--batches`` training steps
per configuration, round-robin, with ``time.perf_counter`` (CUDA synchronised at the end of
each run). The JSON has every run's seconds, mean, std, median; the PNG is the
tutorial's bar chart with +-std error bars.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

import automap
from automap.devices import DEFAULT_FLOPS, detect_devices
from automap.distributed import FREE_LINK_BYTES_PER_SECOND
from automap.pipelining import chunks_for_split_size, plan_stages
from automap.planning import Plan, make_plan
from automap.report.figure import bar_chart

log = logging.getLogger("benchmarks.tutorial")
NUM_CLASSES = 1000


@dataclass(frozen=True)
class Setup:
    """The hardware a run uses and the sizes that suit it."""

    name: str
    single: str  # the one-device baseline
    stages: dict[str, str]  # plan device -> real device
    dispatch: bool  # dispatch the model (real GPUs) or place it with pipeline(devices=...)
    batch: int
    image: int
    batches: int
    repeats: int
    split_sizes: tuple[int, ...]
    second_speed: float  # FLOP/s the plan assumes for the second stage's device


SETUPS = ("auto", "two-gpus", "one-gpu", "gpu-cpu", "cpu")


def detect_setup(kind: str = "auto") -> Setup:
    """The setup named ``kind`` (one of :data:`SETUPS`); ``auto``: two GPUs when there are,
    else both stages on the one GPU (the pipeline's overhead alone), else two CPU stages."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if kind == "auto":
        kind = "two-gpus" if gpus >= 2 else "one-gpu" if gpus == 1 else "cpu"
    tutorial = dict(batch=120, image=128, batches=3, split_sizes=(1, 3, 5, 8, 10, 12, 20, 40, 60))
    if kind == "two-gpus":
        return Setup(
            "2 GPUs",
            "cuda:0",
            {"cuda:0": "cuda:0", "cuda:1": "cuda:1"},
            True,
            repeats=10,
            second_speed=DEFAULT_FLOPS["cuda"],
            **tutorial,
        )
    if kind == "one-gpu":
        return Setup(
            "1 GPU, both stages on it",
            "cuda:0",
            {"cuda:0": "cuda:0", "cuda:1": "cuda:0"},
            False,
            repeats=5,
            second_speed=DEFAULT_FLOPS["cuda"],
            **tutorial,
        )
    if kind == "gpu-cpu":
        return Setup(
            "1 GPU + CPU",
            "cuda:0",
            {"cuda:0": "cuda:0", "cuda:1": "cpu"},
            False,
            repeats=5,
            second_speed=DEFAULT_FLOPS["cpu"],
            **tutorial,
        )
    return Setup(
        "CPU only",
        "cpu",
        {"cuda:0": "cpu", "cuda:1": "cpu"},
        False,
        batch=8,
        image=32,
        batches=2,
        repeats=3,
        split_sizes=(4, 2),
        second_speed=DEFAULT_FLOPS["cuda"],
    )


def hardware() -> dict[str, Any]:
    import psutil

    gpus = (
        [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if torch.cuda.is_available()
        else []
    )
    return {
        "cpu": _cpu_name(),
        "cpu_cores": psutil.cpu_count(logical=True),
        "ram_bytes": psutil.virtual_memory().total,
        "gpus": gpus,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
    }


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def resnet50() -> nn.Module:
    import torchvision

    torch.manual_seed(0)
    return torchvision.models.resnet50(num_classes=NUM_CLASSES)


def two_stage_plan(model: nn.Module, setup: Setup) -> Plan:
    """A compute-balanced plan over two hypothetical GPUs, the second as fast as the real
    second stage (links free: the pipeline overlaps transfers with compute)."""
    prof = automap.profile(model, (torch.zeros(2, 3, setup.image, setup.image),))  # BatchNorm needs 2
    room = 4 * prof.total_bytes
    devices = detect_devices(
        {0: room, 1: room}, speeds={"cuda:1": setup.second_speed}, links={"cuda": FREE_LINK_BYTES_PER_SECOND}
    )
    plan = make_plan(prof, devices, "balanced")
    if len(plan_stages(plan)) != 2:
        raise SystemExit(f"the plan has {len(plan_stages(plan))} stage(s), not 2:\n{plan.report()}")
    return plan


# ------------------------------------------------------------------ timing


def train(model: nn.Module, setup: Setup, first: torch.device, batches: int) -> None:
    """The tutorial's ``train``: MSE against one-hot labels, SGD, ``batches`` steps."""
    model.train(True)
    loss_fn = nn.MSELoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.001)
    one_hot = torch.randint(0, NUM_CLASSES, (setup.batch, 1))
    for _ in range(batches):
        inputs = torch.randn(setup.batch, 3, setup.image, setup.image)
        labels = torch.zeros(setup.batch, NUM_CLASSES).scatter_(1, one_hot, 1)
        optimizer.zero_grad()
        outputs = model(inputs.to(first))
        loss_fn(outputs, labels.to(outputs.device)).backward()
        optimizer.step()
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            torch.cuda.synchronize(i)


@dataclass
class Config:
    """One bar of the chart: a model ready to train, and what to record about it."""

    label: str
    model: nn.Module
    first: torch.device
    extra: dict[str, Any]
    seconds: list[float] = field(default_factory=list)

    def row(self) -> dict[str, Any]:
        s = self.seconds
        return {
            "label": self.label,
            **self.extra,
            "seconds": s,
            "mean": statistics.fmean(s),
            "std": statistics.pstdev(s),
            "median": statistics.median(s),
        }


def configs(setup: Setup) -> tuple[list[Config], Plan]:
    """Every configuration, each on its own copy of the model (pipelines cannot share one)."""
    found = [
        Config(
            f"one device ({setup.single})",
            resnet50().to(setup.single),
            torch.device(setup.single),
            {"kind": "single"},
        )
    ]
    plan = two_stage_plan(resnet50(), setup)
    first = torch.device(setup.stages["cuda:0"])
    devices = None if setup.dispatch else setup.stages
    if setup.dispatch:
        found.append(
            Config(
                "automap model parallel",
                automap.dispatch(resnet50(), plan),
                first,
                {"kind": "model_parallel", "chunks": 1},
            )
        )
    else:
        found.append(
            Config(
                "automap model parallel",
                automap.pipeline(resnet50(), plan, chunks=1, devices=devices),
                first,
                {"kind": "model_parallel", "chunks": 1},
            )
        )
    for split in setup.split_sizes:
        chunks = chunks_for_split_size(setup.batch, split)
        model = automap.dispatch(resnet50(), plan) if setup.dispatch else resnet50()
        found.append(
            Config(
                f"pipelined split {split}",
                automap.pipeline(model, plan, chunks=chunks, devices=devices),
                first,
                {"kind": "pipelined", "split_size": split, "chunks": chunks},
            )
        )
    model = automap.dispatch(resnet50(), plan) if setup.dispatch else resnet50()
    auto = automap.pipeline(model, plan, chunks="auto", devices=devices)
    chunks = auto.resolve_chunks((torch.zeros(setup.batch, 3, setup.image, setup.image),), {})
    found.append(Config(f"pipelined auto ({chunks})", auto, first, {"kind": "auto", "chunks": chunks}))
    return found, plan


def run_all(setup: Setup) -> dict[str, Any]:
    """Warm every configuration up, then time them round-robin: drifting load (other jobs,
    clocks) then hits every configuration alike instead of the ones that happen to run late."""
    found, plan = configs(setup)
    stages = [
        {"device": s.device, "runs_on": setup.stages[s.device], "units": list(s.units)}
        for s in plan_stages(plan)
    ]
    log.info("plan: %s", "; ".join(f"{s['runs_on']}: {s['units'][0]}..{s['units'][-1]}" for s in stages))
    for config in found:
        train(config.model, setup, config.first, batches=1)
    for _ in range(setup.repeats):
        for config in found:
            start = time.perf_counter()
            train(config.model, setup, config.first, setup.batches)
            config.seconds.append(time.perf_counter() - start)
    rows = [config.row() for config in found]
    for row in rows:
        row["vs_one_device"] = (row["mean"] - rows[0]["mean"]) / rows[0]["mean"]
        log.info(
            "%-28s mean %.3f s  std %.3f  median %.3f  (%+.0f%%)",
            row["label"],
            row["mean"],
            row["std"],
            row["median"],
            100 * row["vs_one_device"],
        )
    return {"stages": stages, "rows": rows}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/out/tutorial", help="path stem for .json and .png")
    parser.add_argument("--setup", choices=SETUPS, default="auto", help="where the two stages run")
    parser.add_argument("--repeats", type=int, help="timed runs per configuration")
    parser.add_argument("--batches", type=int, help="training steps per timed run")
    parser.add_argument("--batch", type=int, help="samples per batch")
    parser.add_argument("--image", type=int, help="image side in pixels")
    parser.add_argument(
        "--threads", type=int, help="torch intra-op threads (default: torch's, or 1 on CPU-only machines)"
    )
    parser.add_argument(
        "--split-sizes",
        type=lambda s: tuple(int(x) for x in s.split(",")),
        help="comma-separated micro-batch sizes, e.g. 4,2",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("automap.pipelining").setLevel(logging.ERROR)  # the BatchNorm note, once per config
    setup = detect_setup(args.setup)
    overrides = {
        k: v
        for k, v in {
            "repeats": args.repeats,
            "batch": args.batch,
            "image": args.image,
            "batches": args.batches,
            "split_sizes": args.split_sizes,
        }.items()
        if v is not None
    }
    setup = replace(setup, **overrides)
    threads = args.threads or (1 if setup.single == "cpu" else None)
    if threads:
        torch.set_num_threads(threads)
    started = time.perf_counter()
    found = run_all(setup)
    result = {
        "benchmark": "tutorial",
        "setup": asdict(setup),
        "hardware": hardware(),
        **found,
        "wall_seconds": time.perf_counter() - started,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = found["rows"]
    bar_chart(
        [r["mean"] for r in rows],
        [r["std"] for r in rows],
        [r["label"] for r in rows],
        out.with_suffix(".png"),
        f"ResNet-50 training, {setup.batches} batches (s)",
        title=f"{setup.name}: batch {setup.batch}, {setup.image}x{setup.image}, {setup.repeats} runs "
        f"({', '.join(result['hardware']['gpus']) or result['hardware']['cpu']})",
    )
    out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    log.info(
        "wrote %s and %s in %.0f s", out.with_suffix(".json"), out.with_suffix(".png"), result["wall_seconds"]
    )
    return result


if __name__ == "__main__":
    main()
