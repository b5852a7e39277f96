"""The ``automap`` command: a thin layer over the library."""
from __future__ import annotations

import argparse
import sys

from automap.errors import AutomapError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="automap",
        description="Plan where each part of a PyTorch model lives (GPUs, then CPU RAM, then disk) and run it there.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.add_parser("demo", help="plan, report and run ResNet-50 and a small Llama with part of them on disk")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "demo":
            from automap.demo import run_demo

            return 0 if run_demo() else 1
    except AutomapError as exc:
        print(f"automap: error: {exc}", file=sys.stderr)
        return 2
    parser.print_help()
    return 2
