"""What the read leases on mapped files cost (automap/offload/lease.py): a warm forward of a model
whose three of four layers are read in place from its checkpoint ("disk"), the files leased vs
not, and the time to take one lease.

Both models map the same checkpoint and are timed in interleaved rounds (shuffled order), so that
load from other processes hits both alike; the figure is the median per forward. One intra-op
thread (on a shared 2-core machine a second one spin-waits and the timings become noise). A lease
is taken once per file when it is mapped; a forward does nothing with it, so the ratio should be
1.0 within the noise.

    python -m benchmarks.lease_cost [--width 1024] [--rounds 15] [--out lease_cost.json]
"""

from __future__ import annotations

import argparse
import fcntl
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

import automap
from automap.offload import MappedFile, lease

DISK = {"0": "disk", "1": "disk", "2": "disk", "3": "cpu"}


def loaded(checkpoint: Path, width: int, leased: bool) -> nn.Module:
    """The model loaded with its first three layers read in place, with or without leases."""
    taken = lease.take
    lease.take = taken if leased else (lambda holder: "leases off for this measurement")
    try:
        with automap.empty_model():
            model = nn.Sequential(*[nn.Linear(width, width) for _ in range(4)]).eval()
        automap.load(model, checkpoint, DISK, quiet=True)
    finally:
        lease.take = taken
    return model


def lease_seconds(checkpoint: Path, count: int = 20) -> float:
    """Seconds to take one lease (a file mapped, its lease let go and taken again)."""
    files = [MappedFile(checkpoint) for _ in range(count)]
    for mapped in files:
        lease.drop(mapped)
        fcntl.fcntl(mapped.fd, lease.F_SETLEASE, fcntl.F_UNLCK)
    start = time.perf_counter()
    missing = [lease.take(mapped) for mapped in files]
    seconds = (time.perf_counter() - start) / count
    assert not any(missing), missing
    return seconds


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--forwards", type=int, default=30, help="forwards per round")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    checkpoint = Path(tempfile.mkdtemp()) / "model.safetensors"
    real = nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(4)])
    save_file({k: v.contiguous() for k, v in real.state_dict().items()}, checkpoint)
    models = {
        "unleased": loaded(checkpoint, args.width, False),
        "leased": loaded(checkpoint, args.width, True),
    }
    x = torch.randn(8, args.width)
    times: dict[str, list[float]] = {name: [] for name in models}
    with torch.no_grad():
        for name in [*models] * 3:  # warm: pages mapped in, hooks' first calls done
            models[name](x)
        for _ in range(args.rounds):
            for name in random.sample(list(models), len(models)):
                start = time.perf_counter()
                for _ in range(args.forwards):
                    models[name](x)
                times[name].append((time.perf_counter() - start) / args.forwards)
    result = {f"{name}_forward_ms": statistics.median(t) * 1e3 for name, t in times.items()}
    result["ratio"] = result["leased_forward_ms"] / result["unleased_forward_ms"]
    result["take_lease_us"] = lease_seconds(checkpoint) * 1e6
    print(
        f"warm forward: leased {result['leased_forward_ms']:.3f} ms, unleased {result['unleased_forward_ms']:.3f} "
        f"ms ({result['ratio']:.3f}x); taking a lease {result['take_lease_us']:.1f} us per file"
    )
    print(json.dumps(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
