"""The prefetch alone, cold: every offloaded unit of ``benchmarks.offload``'s plan read through
its checkpoint source one unit after another (no compute), with the one-request path
(``MADV_WILLNEED`` + ``MADV_POPULATE_READ`` per tensor) and with :class:`ReadAhead` (merged
ranges, 16 MB chunks, 4 in flight), in alternating rounds; then the disk bound of the same bytes.

    python -m benchmarks.offload --root /tmp/automap-bench     # writes the checkpoint and plan
    python -m benchmarks.prefetch_rate --root /tmp/automap-bench --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from benchmarks.diskbound import disk_bound
from benchmarks.offload import CHECKPOINT, offloaded_ranges


def main(argv: list[str] | None = None) -> None:
    import automap
    from automap.offload import CheckpointSource, read_header

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path("/tmp/automap-bench"))
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    checkpoint, plan_path = args.root / CHECKPOINT, args.root / "plan-cpu.json"
    plan = automap.Plan.from_json(plan_path.read_text())
    stored = read_header(checkpoint).tensors
    units = [
        [n for n in u.tensors if n in stored] for u, p in zip(plan.units, plan.placements) if p.offloaded
    ]
    source = CheckpointSource({n: (checkpoint, n) for unit in units for n in unit})
    mapped = source.files[checkpoint.resolve()]
    seconds: dict[str, list[float]] = {"one request": [], "readahead": []}
    for _ in range(args.rounds):
        for kind, times in seconds.items():
            source.evict()
            start = time.perf_counter()
            for unit in units:
                mapped.advise(unit, True, source.reader if kind == "readahead" else None)
            times.append(time.perf_counter() - start)
    source.evict()  # pages mapped here would survive the bound's eviction
    bound = disk_bound(checkpoint, offloaded_ranges(args.root, plan_path))
    medians = {k: statistics.median(v) for k, v in seconds.items()}
    print(
        json.dumps(
            {
                "bytes": bound["bytes"],
                "units": len(units),
                "seconds": seconds,
                "median_seconds": medians,
                "bytes_per_second": {k: bound["bytes"] / m for k, m in medians.items()},
                "vs_disk_bound": {k: m / bound["bound_seconds"] for k, m in medians.items()},
                "disk_bound": bound,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
