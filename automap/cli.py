"""The ``automap`` command (also ``python -m automap``): a thin layer over the library.

Exit codes: 0 success; 1 the library could not do it (the model does not fit, its forward
failed); 2 bad arguments. Every failure is one line on stderr, never a traceback.

The arguments are parsed and checked before torch is imported (``--help`` and a bad argument
answer at once); only then does a command import the library. The names offered here
(strategies, dtypes, figure formats) are the library's registries', which
``tests/api/test_cli.py`` checks they equal.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Iterator, NoReturn, Sequence

from automap.devices import parse_max_memory_text
from automap.errors import AutomapError, DeviceError, ReportError, SizeError, SpecError

# automap.planning.STRATEGIES, automap.specs.DTYPES and automap.report.figure.FORMATS, named
# without importing torch; tests/api/test_cli.py keeps them equal.
STRATEGY_NAMES = ("balanced", "auto", "balanced_low_0", "sequential")
DTYPE_NAMES = ("fp32", "float32", "fp16", "float16", "half", "bf16", "bfloat16", "fp8", "float8")
FIGURE_FORMATS = ("png", "svg", "pdf")

_PLAN_EXAMPLES = """\
SPEC names the model, built on the meta device (no weights, nothing downloaded):
  torchvision:resnet50        a torchvision model; --set gives its keyword arguments
  hf:llama                    a transformers family from its default config, with --set
                              overrides of config fields (hf:t5, hf:gpt2, hf:qwen2 and others;
                              hf: and folders need transformers: pip install "automap[hf]")
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
  automap plan torchvision:r3d_18 --input-shape 1x3x16x112x112 --max-memory cpu=1GB
"""


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (and exit code 2), not usage plus message."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def _verbose_option() -> argparse.ArgumentParser:
    """``-v``, accepted before or after the command (SUPPRESS: a command's default does not
    undo a ``-v`` given before it)."""
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                        help="log what the library does (to stderr)")
    return parent


def _parser() -> _Parser:
    verbose = _verbose_option()
    parser = _Parser(
        prog="automap", parents=[verbose],
        description="Plan where each part of a PyTorch model lives (GPUs, then CPU RAM, then disk), "
                    "see the plan as a table, JSON or picture, and run it there.",
        epilog="Run 'automap COMMAND --help' for each command's options.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    _add_plan(commands, verbose)
    commands.add_parser("demo", parents=[verbose],
                        help="plan, report and run ResNet-50 and a small Llama with part of them on disk",
                        description="Plan, report and run ResNet-50 and a small Llama (random weights) with "
                                    "part of their weights on disk, and check the outputs equal the plain "
                                    "model's. What 'make demo' runs; about a minute on a laptop CPU. The "
                                    "Llama half needs transformers (pip install \"automap[hf]\").")
    bench = commands.add_parser(
        "bench", parents=[verbose],
        help="compare automap's plans with accelerate's on hypothetical GPUs (seconds)",
        description="Plan a few real architectures on meta for hypothetical GPU sets with automap and with "
                    "accelerate (get_balanced_memory + infer_auto_device_map, what device_map='auto' does) "
                    "and compare bytes spilled off the GPUs and the busiest GPU's share of the FLOPs.")
    bench.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    calibrate = commands.add_parser(
        "calibrate", parents=[verbose], help="measure this machine's speeds again (about 2 s) and record them",
        description="Measure the CPU's matmul rate per dtype and memory bandwidth, the disk's read rate (in "
                    "the file system of --offload-dir) and each GPU's copy, memory and matmul rates, and "
                    "record them where plans read them: $XDG_CACHE_HOME/automap/machine.json (~/.cache "
                    "without it), or the file AUTOMAP_CALIBRATION names. Plans measure on first use by "
                    "themselves; this refreshes the record (after a hardware or driver change, say).")
    calibrate.add_argument("--offload-dir", metavar="DIR", default=None,
                           help="measure the disk holding this folder (default: the working directory)")
    return parser


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _add_plan(commands: Any, verbose: argparse.ArgumentParser) -> None:
    plan = commands.add_parser(
        "plan", parents=[verbose], help="plan a model (any size, on meta) and print/save the plan",
        description="Build SPEC on the meta device (no weights, nothing downloaded), profile it at\n"
                    "--batch x --seq-len (or on --input-shape / --example-inputs) and plan it for the\n"
                    "devices in --max-memory (with --max-length, for generate(): the KV cache reserved\n"
                    "where its layers live). Prints the report; --json and --figure save the plan.",
        epilog=_PLAN_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    plan.add_argument("spec", metavar="SPEC",
                      help="the model: torchvision:NAME, hf:FAMILY, hf:PATH, a model folder, module:factory")
    plan.add_argument("--set", dest="overrides", action="append", default=[], metavar="K=V,...",
                      help="config fields (hf) or keyword arguments (torchvision, factory); repeatable")
    plan.add_argument("--max-memory", metavar="DEV=SIZE,...",
                      help="device budgets, e.g. 0=20GiB,1=20GiB,cpu=64GiB,disk=500GiB (default: this machine)")
    plan.add_argument("--strategy", default="auto", choices=STRATEGY_NAMES,
                      help="how to spread units over the GPUs (default: auto)")
    plan.add_argument("--batch", type=_positive, default=1, metavar="N", help="example batch size (default: 1)")
    plan.add_argument("--seq-len", type=_positive, default=128, metavar="N",
                      help="example sequence length for token models (default: 128); the prompt with --max-length")
    inputs = plan.add_mutually_exclusive_group()
    inputs.add_argument("--input-shape", metavar="SHAPE,...",
                        help="the forward's inputs as float tensors of these shapes, e.g. 1x3x16x112x112 "
                             "(a video model); several positional inputs separated by commas. Replaces the "
                             "inputs guessed from --batch and --seq-len")
    inputs.add_argument("--example-inputs", metavar="MODULE:FUNCTION",
                        help="a function returning the forward's inputs (a tuple, a dict of keyword "
                             "arguments, or a tensor), called with meta as the default device")
    plan.add_argument("--max-length", type=_positive, default=None, metavar="N",
                      help="plan for generate(): --batch sequences grown to N tokens (prompt included); each "
                           "device keeps room for its layers' KV cache, and the report predicts tokens/s")
    plan.add_argument("--dtype", metavar="DTYPE", type=lambda t: t.strip().lower().removeprefix("torch."),
                      choices=DTYPE_NAMES,
                      help="dtype the model runs in: fp32, fp16, bf16, fp8 (default: a folder's checkpoint "
                           "dtypes, else the config's, else fp32)")
    plan.add_argument("--json", metavar="FILE", help="write the plan as JSON (docs/plan-schema.md)")
    plan.add_argument("--figure", metavar="FILE", help="draw the plan as a picture (.png, .svg or .pdf)")
    plan.add_argument("--quiet", action="store_true", help="print no report and no progress "
                                                           "(still writes --json/--figure)")


def parse_input_shapes(text: str) -> tuple[tuple[int, ...], ...]:
    """``"1x3x16x112x112,1x10"`` -> ``((1, 3, 16, 112, 112), (1, 10))``.

    Raises:
        SpecError: a shape is not sizes >= 1 joined by ``x``.
    """
    shapes = []
    for item in filter(None, (p.strip() for p in text.split(","))):
        sizes = item.lower().split("x")
        if not all(s.strip().isdigit() and int(s) > 0 for s in sizes):
            raise SpecError(f"--input-shape expects sizes >= 1 joined by 'x', got {item!r}; "
                            "e.g. --input-shape 1x3x224x224")
        shapes.append(tuple(int(s) for s in sizes))
    if not shapes:
        raise SpecError("--input-shape is empty; e.g. --input-shape 1x3x224x224")
    return tuple(shapes)


def _check_output(path: str, what: str, suffixes: Sequence[str] = ()) -> None:
    """Fail before minutes of work, not after: a known suffix, an existing folder."""
    target = Path(path)
    if suffixes and target.suffix.lower().lstrip(".") not in suffixes:
        raise ReportError(f"cannot draw a figure as {target.name!r}: the suffix must be one of "
                          f"{', '.join('.' + f for f in suffixes)}, e.g. plan.png")
    if not target.parent.is_dir():
        raise ReportError(f"cannot write the {what} to {str(target)!r}: folder {str(target.parent)!r} does "
                          "not exist; create it or choose another path")
    if target.is_dir():
        raise ReportError(f"cannot write the {what} to {str(target)!r}: it is a folder; name a file in it, "
                          f"e.g. {str(target / ('plan.' + (suffixes[0] if suffixes else 'json')))!r}")
    if not os.access(target.parent, os.W_OK | os.X_OK):
        raise ReportError(f"cannot write the {what} to {str(target)!r}: folder {str(target.parent)!r} is not "
                          "writable; choose another path")


def check_plan_args(args: argparse.Namespace) -> None:
    """Everything about ``automap plan``'s arguments that can be checked without torch; the
    parsed forms are kept on ``args`` (``max_memory``, ``shapes``).

    Raises:
        SizeError, DeviceError, SpecError, ReportError: the argument that is wrong, and why.
    """
    args.max_memory = parse_max_memory_text(args.max_memory) if args.max_memory is not None else None
    args.shapes = parse_input_shapes(args.input_shape) if args.input_shape is not None else None
    if args.json:
        _check_output(args.json, "plan JSON")
    if args.figure:
        _check_output(args.figure, "figure", FIGURE_FORMATS)


_USAGE_ERRORS = (SpecError, SizeError, DeviceError, ReportError)

# The library's errors name the fix in its own arguments; on the command line the fix is a flag.
# (pattern, replacement), applied in order to the message of an error the command prints.
_AS_FLAGS = (
    (r"dtype=torch\.(\w+)", r"--dtype \1"),
    (r"max_memory=\{'(\w+)': '([^']+)'(, \.\.\.)?\}", lambda m: f"--max-memory {m[1]}={m[2]}" + (",..." if m[3] else "")),
    (r"raise max_memory, free space where offload_dir points", "raise the budgets in --max-memory (disk= too)"),
    (r"free space where offload_dir points", "raise disk= in --max-memory"),
    (r"a smaller batch\b", "a smaller --batch"),
    (r"a shorter prompt in example_inputs", "a shorter prompt (--seq-len)"),
    (r"(?<![\w.-])max_memory(?!\w)", "--max-memory"),
    (r"(?<![\w.-])max_length(?!\w)", "--max-length"),
    (r"(?<![\w.-])example_inputs(?!\w)", "--example-inputs"),
)


def as_flags(message: str) -> str:
    """``message`` (a library error's) on one line, its fixes spelled as this command's flags:
    ``raise max_memory ... (dtype=torch.float16 ...)`` -> ``raise --max-memory ... (--dtype float16 ...)``."""
    text = " ".join(message.split())
    for pattern, replacement in _AS_FLAGS:
        text = re.sub(pattern, replacement, text)
    return text


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``automap`` command with ``argv`` (default: ``sys.argv[1:]``); return the exit code."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2), already printed
        return int(exc.code or 0)
    logging.basicConfig(level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING,
                        format="%(name)s: %(message)s")
    if args.command is None:
        parser.print_help()
        return 2
    try:
        if args.command == "plan":
            check_plan_args(args)
        return _COMMANDS[args.command](args)
    except AutomapError as exc:
        print(f"automap: error: {as_flags(str(exc))}", file=sys.stderr)
        return 2 if isinstance(exc, _USAGE_ERRORS) else 1
    except KeyboardInterrupt:
        print("automap: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `automap plan ... | head`: the reader left; stay quiet
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _plan(args: argparse.Namespace) -> int:
    from automap.progress import silenced, step
    from automap.report import figure, write_json
    from automap.spec_plan import plan_spec
    from automap.specs import input_tensors, load_example_inputs, parse_dtype, parse_overrides

    start = time.perf_counter()
    overrides = parse_overrides(args.overrides)
    inputs = (input_tensors(args.shapes) if args.shapes else
              load_example_inputs(args.example_inputs) if args.example_inputs else None)
    with silenced(args.quiet), libraries_quiet(not getattr(args, "verbose", False)), step(f"automap: planning {args.spec}"):
        result = plan_spec(
            args.spec, overrides, max_memory=args.max_memory, strategy=args.strategy, batch=args.batch,
            seq_len=args.seq_len, dtype=parse_dtype(args.dtype) if args.dtype else None,
            max_length=args.max_length, example_inputs=inputs)
    if not args.quiet:
        print(result.headline(time.perf_counter() - start) + "\n")
        print(result.plan.report())
    if args.json:
        print(f"wrote {write_json(result.plan, args.json)}")
    if args.figure:
        print(f"wrote {figure(result.plan, args.figure)}")
    return 0


# Libraries the command calls to build and trace a spec's model: what they warn about is how
# that model will run later (a fallback kernel, a head used alone, a future default), not the plan.
_LIBRARIES = ("torch", "torchvision", "transformers", "accelerate", "huggingface_hub")


@contextlib.contextmanager
def libraries_quiet(quiet: bool = True) -> Iterator[None]:
    """While inside (and ``quiet``), the warnings and log warnings of :data:`_LIBRARIES` are not
    shown; automap's own, and a factory module's, are. ``-v`` shows them all."""
    if not quiet:
        yield
        return
    loggers = [logging.getLogger(name) for name in _LIBRARIES]
    levels = [logger.level for logger in loggers]
    verbosity = os.environ.get("TRANSFORMERS_VERBOSITY")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module=rf"({'|'.join(_LIBRARIES)})(\.|$)")
        for logger in loggers:
            logger.setLevel(logging.ERROR)
        os.environ["TRANSFORMERS_VERBOSITY"] = "error"  # transformers sets its level as it is first imported
        try:
            yield
        finally:
            if verbosity is None:
                os.environ.pop("TRANSFORMERS_VERBOSITY", None)
            else:
                os.environ["TRANSFORMERS_VERBOSITY"] = verbosity
            for logger, level in zip(loggers, levels):
                logger.setLevel(level)


def _demo(args: argparse.Namespace) -> int:
    from automap.demo import run_demo

    return 0 if run_demo() else 1


def _bench(args: argparse.Namespace) -> int:
    if args.json:
        _check_output(args.json, "bench rows")
    from automap.bench import format_table, run_bench, runnable_cases, write_rows

    cases, skipped = runnable_cases()
    rows = run_bench(cases)
    print(format_table(rows))
    if skipped:
        print(f"skipped {', '.join(c.name for c in skipped)}: they need transformers, which is not installed; "
              'pip install "automap[hf]"')
    if args.json:
        print(f"wrote {write_rows(rows, args.json)}")
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    from automap.machine import describe, machine_record, record_path

    path = record_path()
    if path is None:
        raise DeviceError("measuring is off (AUTOMAP_CALIBRATION=off): plans use each kind's default speeds; "
                          "unset AUTOMAP_CALIBRATION, or set it to a file to record the figures in")
    record = machine_record(args.offload_dir, refresh=True)
    print(describe(record))
    print(f"recorded in {path}")
    return 0


_COMMANDS = {"plan": _plan, "demo": _demo, "bench": _bench, "calibrate": _calibrate}
