"""How long `import automap` takes beside `import torch`, each in fresh processes.

    python -m benchmarks.import_time --repeats 7

Three statements, each timed in its own fresh interpreter (wall time of `python -c STATEMENT`,
interpreter start included, so the figures compare as a user feels them), in rotation so that a
busy machine slows all three alike: `import torch`; `import automap` (the package: its names
come when first used); and `import automap; automap.plan` (the whole public surface, what a
script that plans imports). The target (issue 25) is the last within 1.2x of `import torch`.
Prints one line per statement, then one JSON object: medians in seconds and the ratios to torch.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

STATEMENTS = {
    "torch": "import torch",
    "automap": "import automap",
    "automap_api": "import automap; automap.plan",
}


def time_fresh(statement: str) -> float:
    """Seconds for a fresh ``python -c statement`` to finish."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", statement], check=True)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7, help="fresh processes per statement (default: 7)")
    args = parser.parse_args(argv)
    for statement in STATEMENTS.values():
        time_fresh(statement)  # warm the page cache: every run then reads the same files from memory
    runs: dict[str, list[float]] = {name: [] for name in STATEMENTS}
    for _ in range(args.repeats):
        for name, statement in STATEMENTS.items():
            runs[name].append(time_fresh(statement))
    result = {f"{name}_s": round(statistics.median(times), 3) for name, times in runs.items()}
    for name in ("automap", "automap_api"):
        result[f"{name}_vs_torch"] = round(result[f"{name}_s"] / result["torch_s"], 3)
    for name, statement in STATEMENTS.items():
        print(f"{statement:<32} median {result[name + '_s']:.3f} s over {args.repeats} fresh processes")
    print(json.dumps({"repeats": args.repeats, **result}))
    return result


if __name__ == "__main__":
    main()
