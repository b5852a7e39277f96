"""The ``automap`` command (also ``python -m automap``): a thin layer over the library.

Exit codes: 0 success; 1 the library could not do it (the model does not fit, its forward
failed); 2 bad arguments. Every failure is one line on stderr, never a traceback.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from typing import Any, NoReturn, Sequence

from automap.errors import AutomapError, DeviceError, SizeError
from automap.planning import STRATEGIES

_PLAN_EXAMPLES = """\
SPEC names the model, built on the meta device (no weights, nothing downloaded):
  torchvision:resnet50        a torchvision model; --set gives its keyword arguments
  hf:llama                    a transformers family from its default config, with --set
                              overrides of config fields (hf:t5, hf:gpt2, hf:qwen2, ...)
  hf:/path/config.json        a local transformers config file (or its directory)
  path/to/model-folder        a Hugging Face folder (config.json and weights): tensor sizes
                              and dtypes from the checkpoint's headers, no weights read
  module.path:factory         a function returning an nn.Module (./module/path.py works)

--max-memory names the devices to plan for; they need not exist on this machine:
  0=80GiB,1=80GiB             two GPUs (GPU index = cuda:N) ...
  cpu=200GiB,disk=1TB         ... then CPU RAM, then disk (disk defaults to free space)
Without it, this machine's GPUs, free RAM and free disk are used.

examples:
  automap plan torchvision:resnet50 --max-memory 0=60MB,1=60MB,cpu=1GB
  automap plan hf:llama --set hidden_size=8192,intermediate_size=28672,num_hidden_layers=80,\\
num_attention_heads=64,num_key_value_heads=8 --max-memory 0=80GiB,1=80GiB,cpu=200GiB \\
      --dtype bf16 --json plan.json --figure plan.png
  automap plan hf:mistral --strategy balanced_low_0 --max-memory 0=24GiB,1=24GiB,2=24GiB
  automap plan ./Llama-3-8B --max-memory 0=16GiB,cpu=32GiB
"""


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (and exit code 2), not usage plus message."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def _parser() -> _Parser:
    parser = _Parser(
        prog="automap",
        description="Plan where each part of a PyTorch model lives (GPUs, then CPU RAM, then disk), "
                    "see the plan as a table, JSON or picture, and run it there.",
        epilog="Run 'automap COMMAND --help' for each command's options.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log what the library does (to stderr)")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_plan(commands)
    commands.add_parser("demo", help="plan, report and run ResNet-50 and a small Llama with part of them on disk",
                        description="Plan, report and run ResNet-50 and a small Llama (random weights) with "
                                    "part of their weights on disk, and check the outputs equal the plain "
                                    "model's. What 'make demo' runs; about a minute on a laptop CPU.")
    bench = commands.add_parser(
        "bench", help="compare automap's plans with accelerate's on hypothetical GPUs (seconds)",
        description="Plan a few real architectures on meta for hypothetical GPU sets with automap and with "
                    "accelerate (get_balanced_memory + infer_auto_device_map, what device_map='auto' does) "
                    "and compare bytes spilled off the GPUs and the busiest GPU's share of the FLOPs.")
    bench.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    return parser


def _add_plan(commands: Any) -> None:
    plan = commands.add_parser(
        "plan", help="plan a model (any size, on meta) and print/save the plan",
        description="Build SPEC on the meta device (no weights, nothing downloaded), profile it at\n"
                    "--batch x --seq-len and plan it for the devices in --max-memory (with\n"
                    "--max-length, for generate(): the KV cache reserved where its layers live).\n"
                    "Prints the report; --json and --figure save the plan.",
        epilog=_PLAN_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    plan.add_argument("spec", metavar="SPEC",
                      help="the model: torchvision:NAME, hf:FAMILY, hf:PATH, a model folder, module:factory")
    plan.add_argument("--set", dest="overrides", action="append", default=[], metavar="K=V,...",
                      help="config fields (hf) or keyword arguments (torchvision, factory); repeatable")
    plan.add_argument("--max-memory", metavar="DEV=SIZE,...",
                      help="device budgets, e.g. 0=20GiB,1=20GiB,cpu=64GiB,disk=500GiB (default: this machine)")
    plan.add_argument("--strategy", default="auto", choices=tuple(STRATEGIES),
                      help="how to spread units over the GPUs (default: auto)")
    plan.add_argument("--batch", type=int, default=1, metavar="N", help="example batch size (default: 1)")
    plan.add_argument("--seq-len", type=int, default=128, metavar="N",
                      help="example sequence length for token models (default: 128); the prompt with --max-length")
    plan.add_argument("--max-length", type=int, default=None, metavar="N",
                      help="plan for generate(): --batch sequences grown to N tokens (prompt included); each "
                           "device keeps room for its layers' KV cache, and the report predicts tokens/s")
    plan.add_argument("--dtype", metavar="DTYPE", help="dtype the model runs in: fp32, fp16, bf16, fp8 "
                                                       "(default: a folder's checkpoint dtypes, else the "
                                                       "config's, else fp32)")
    plan.add_argument("--json", metavar="FILE", help="write the plan as JSON (docs/plan-schema.md)")
    plan.add_argument("--figure", metavar="FILE", help="draw the plan as a picture (.png, .svg or .pdf)")
    plan.add_argument("--quiet", action="store_true", help="print no report (still writes --json/--figure)")


def _usage_errors() -> tuple[type[Exception], ...]:
    from automap.report import ReportError
    from automap.specs import SpecError

    return (SpecError, SizeError, DeviceError, ReportError)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``automap`` command with ``argv`` (default: ``sys.argv[1:]``); return the exit code."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2), already printed
        return int(exc.code or 0)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(name)s: %(message)s")
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return _COMMANDS[args.command](args)
    except AutomapError as exc:
        print(f"automap: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2 if isinstance(exc, _usage_errors()) else 1
    except KeyboardInterrupt:
        print("automap: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `automap plan ... | head`: the reader left; stay quiet
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _plan(args: argparse.Namespace) -> int:
    from automap.report import check_figure_path, check_json_path, figure, write_json
    from automap.specs import parse_dtype, parse_max_memory_arg, parse_overrides, plan_spec

    if args.json:
        check_json_path(args.json)  # fail before minutes of work, not after
    if args.figure:
        check_figure_path(args.figure)
    start = time.perf_counter()
    result = plan_spec(
        args.spec, parse_overrides(args.overrides),
        max_memory=parse_max_memory_arg(args.max_memory) if args.max_memory else None,
        strategy=args.strategy, batch=args.batch, seq_len=args.seq_len,
        dtype=parse_dtype(args.dtype) if args.dtype else None, max_length=args.max_length)
    if not args.quiet:
        print(result.headline(time.perf_counter() - start) + "\n")
        print(result.plan.report())
    if args.json:
        print(f"wrote {write_json(result.plan, args.json)}")
    if args.figure:
        print(f"wrote {figure(result.plan, args.figure)}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from automap.demo import run_demo

    return 0 if run_demo() else 1


def _bench(args: argparse.Namespace) -> int:
    from automap.bench import format_table, run_bench, write_rows

    rows = run_bench()
    print(format_table(rows))
    if args.json:
        print(f"wrote {write_rows(rows, args.json)}")
    return 0


_COMMANDS = {"plan": _plan, "demo": _demo, "bench": _bench}
