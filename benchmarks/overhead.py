"""Per-forward cost of the hooks: a model of 48 small units, plain vs automap vs accelerate.

On a CPU-only machine there is one device, so both libraries are made to hook every unit as if
each one sat on its own device (automap: ``dispatch_plan(..., always_hook=True)``;
accelerate: an ``AlignDevicesHook`` per unit, which is what ``dispatch_model`` installs when a
device map spans devices, plus ``io_same_device`` on the root). What is timed is then exactly
the hook machinery: walking the inputs, finding nothing to move, calling forward.

The three models share weights and are timed in interleaved rounds (shuffled order), so that
load from other processes hits all three alike; the figure is the median per forward. One
intra-op thread by default: on a shared 2-core machine a second OpenMP thread spin-waits
behind other processes and the timings become noise (``--threads 2`` to compare).

    python -m benchmarks.overhead [--width 512] [--batch 16] [--rounds 40] [--out overhead.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

UNITS = 48


class Block(nn.Module):
    """One placement unit: a linear layer and an activation, as in an MLP tower."""

    def __init__(self, width: int):
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.linear(x))


class Tower(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(UNITS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def with_automap(model: nn.Module) -> nn.Module:
    import automap
    from automap.runtime import dispatch_plan

    device_map = {f"blocks.{i}": "cpu" for i in range(UNITS)}
    return dispatch_plan(model, automap.plan(model, device_map), always_hook=True, output_device="cpu")


def with_accelerate(model: nn.Module) -> nn.Module:
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module

    for block in model.blocks:
        add_hook_to_module(block, AlignDevicesHook(execution_device=torch.device("cpu")))
    add_hook_to_module(model, AlignDevicesHook(io_same_device=True), append=True)
    return model


def timed(model: nn.Module, x: torch.Tensor, repeats: int) -> float:
    start = time.perf_counter()
    with torch.no_grad():
        for _ in range(repeats):
            model(x)
    return (time.perf_counter() - start) / repeats


def hooks_on(model: nn.Module) -> int:
    return sum(
        len(m._forward_pre_hooks) + len(m._forward_hooks) + ("_hf_hook" in m.__dict__)
        for m in model.modules()
    )


def run(width: int, batch: int, rounds: int, repeats: int) -> dict:
    torch.manual_seed(0)
    plain = Tower(width).eval()
    models = {
        "plain": plain,
        "automap": with_automap(copy.deepcopy(plain)),
        "accelerate": with_accelerate(copy.deepcopy(plain)),
    }
    x = torch.randn(batch, width)
    with torch.no_grad():
        expected = plain(x)
        for name, model in models.items():
            assert torch.equal(model(x), expected), name
            timed(model, x, repeats)  # warm-up
    samples: dict[str, list[float]] = {name: [] for name in models}
    order = list(models)
    for _ in range(rounds):
        random.shuffle(order)
        for name in order:
            samples[name].append(timed(models[name], x, repeats))
    median = {name: statistics.median(s) for name, s in samples.items()}
    return {
        "units": UNITS,
        "width": width,
        "batch": batch,
        "rounds": rounds,
        "repeats": repeats,
        "threads": torch.get_num_threads(),
        "hooks": {name: hooks_on(m) for name, m in models.items()},
        "median_forward_seconds": median,
        "automap_overhead": median["automap"] / median["plain"] - 1,
        "accelerate_overhead": median["accelerate"] / median["plain"] - 1,
        "automap_seconds_per_unit": (median["automap"] - median["plain"]) / UNITS,
        "accelerate_seconds_per_unit": (median["accelerate"] - median["plain"]) / UNITS,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    results = [
        run(args.width, args.batch, args.rounds, args.repeats),
        run(64, 1, args.rounds, args.repeats),
    ]  # tiny units: the hook cost laid bare
    text = json.dumps(results, indent=1)
    if args.out:
        args.out.write_text(text)
    sys.stdout.write(text + "\n")


if __name__ == "__main__":
    main()
