"""The ``automap`` command (also ``python -m automap``): a thin layer over the library.

Exit codes: 0 success; 1 the library could not do it (the model does not fit, its forward
failed), or an internal error (a bug: one line asking for a report; ``--debug`` prints its
traceback); 2 bad arguments, or a bad config file they name. Every failure is one line on stderr, never
a traceback.

The arguments are parsed and checked before torch is imported (``--help`` and a bad argument
answer at once); only then does a command import the library. The names offered here
(strategies, dtypes, figure formats) are the library's registries', which
``tests/api/test_cli.py`` checks they equal.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
import time
import traceback
from typing import Any, NoReturn, Sequence

from automap.commands import COMMANDS, CleanPathError, add_commands, libraries_quiet
from automap.devices import parse_max_memory_text
from automap.errors import AutomapError, DeviceError, ReportError, SizeError, SpecError
from automap.presets import check_not_hub_id, preset_lines
from automap.sizes import MAX_COUNT, parse_number, shown
from automap.userfiles import check_output_path

# automap.planning.STRATEGIES, automap.specs.DTYPES and automap.report.figure.FORMATS, named
# without importing torch; tests/api/test_cli.py keeps them equal.
STRATEGY_NAMES = ("balanced", "auto", "balanced_low_0", "sequential")
DTYPE_NAMES = ("fp32", "float32", "fp16", "float16", "half", "bf16", "bfloat16", "fp8", "float8")
FIGURE_FORMATS = ("png", "svg", "pdf")
# automap.planning.model.EXPORTERS as automap.report.export registers them (tests/api/test_cli.py).
EMIT_ENGINES = ("accelerate", "split_spec", "torchtitan", "vllm", "llama.cpp")

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
  llama-3-70b                 a preset: the shape of a popular model, offline (--list-presets)
automap never downloads: for a hub id, download the folder with the hub's client
(hf download ORG/NAME --local-dir ./NAME) and pass ./NAME.

--max-memory names the devices to plan for; they need not exist on this machine:
  0=80GiB,1=80GiB             two GPUs (GPU index = cuda:N) ...
  cpu=200GiB,disk=1TB         ... then CPU RAM, then disk (disk defaults to free space)
Without it, this machine's GPUs, free RAM and free disk are used.

examples:
  automap plan llama-3-70b --max-memory 0=24GiB,cpu=64GiB
  automap plan torchvision:resnet50 --max-memory 0=60MB,1=60MB,cpu=1GB
  automap plan hf:llama --set hidden_size=8192,intermediate_size=28672,num_hidden_layers=80,\\
num_attention_heads=64,num_key_value_heads=8 --max-memory 0=80GiB,1=80GiB,cpu=200GiB \\
      --dtype bf16 --json plan.json --figure plan.png
  automap plan hf:mistral --strategy balanced_low_0 --max-memory 0=24GiB,1=24GiB,2=24GiB
  automap plan ./Llama-3-8B --max-memory 0=16GiB,cpu=32GiB
  automap plan torchvision:r3d_18 --input-shape 1x3x16x112x112 --max-memory cpu=1GB
"""


class _Version(argparse.Action):
    """``--version``: the installed version, read only when asked (no metadata read, no torch)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any):
        super().__init__(
            option_strings, dest, nargs=0, default=argparse.SUPPRESS, help="print automap's version and exit"
        )

    def __call__(self, parser: argparse.ArgumentParser, *args: Any) -> NoReturn:
        from automap.version import installed_version

        print(f"automap {installed_version()}")
        parser.exit(0)


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (and exit code 2), not usage plus message."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def _verbose_option() -> argparse.ArgumentParser:
    """``-v``, accepted before or after the command (SUPPRESS: a command's default does not
    undo a ``-v`` given before it)."""
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        default=argparse.SUPPRESS,
        help="log what the library does (to stderr)",
    )
    parent.add_argument(
        "--debug",
        action="store_true",
        default=argparse.SUPPRESS,
        help="on an internal error, print its traceback (for a bug report)",
    )
    return parent


def _parser() -> _Parser:
    verbose = _verbose_option()
    parser = _Parser(
        prog="automap",
        parents=[verbose],
        description="Plan where each part of a PyTorch model lives (GPUs, then CPU RAM, then disk), "
        "see the plan as a table, JSON or picture, and run it there.",
        epilog="Run 'automap COMMAND --help' for each command's options.",
    )
    parser.add_argument("--version", action=_Version)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    _add_plan(commands, verbose)
    add_commands(commands, verbose)
    return parser


def _count(minimum: int) -> Any:
    """An argparse type: a whole number from ``minimum`` to ``MAX_COUNT``, read by the one
    reader of numbers (:func:`automap.sizes.parse_number`)."""

    def parse(text: str) -> int:
        digits = text.strip()
        if not (digits.isascii() and digits.lstrip("-").isdigit()) or len(digits) > 4000:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text[:40]!r}")
        try:
            return int(
                parse_number(
                    int(digits), "value", integral=True, minimum=minimum, maximum=MAX_COUNT, error=SpecError
                )
            )
        except SpecError:
            raise argparse.ArgumentTypeError(
                f"must be between {minimum} and {MAX_COUNT:,}, got {shown(int(digits))}"
            ) from None

    return parse


_positive = _count(1)


def _add_plan(commands: Any, verbose: argparse.ArgumentParser) -> None:
    plan = commands.add_parser(
        "plan",
        parents=[verbose],
        help="plan a model (any size, on meta) and print/save the plan",
        description="Build SPEC on the meta device (no weights, nothing downloaded), profile it at\n"
        "--batch x --seq-len (or on --input-shape / --example-inputs) and plan it for the\n"
        "devices in --max-memory (with --max-length, for generate(): the KV cache reserved\n"
        "where its layers live). Prints the report; --json and --figure save the plan.",
        epilog=_PLAN_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    plan.add_argument(
        "spec",
        metavar="SPEC",
        nargs="?",
        help="the model: torchvision:NAME, hf:FAMILY, hf:PATH, a model folder, module:factory, "
        "or a preset (--list-presets)",
    )
    plan.add_argument(
        "--list-presets",
        action="store_true",
        help="list the presets (shapes of popular models, planned offline) and exit",
    )
    plan.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="K=V,...",
        help="config fields (hf) or keyword arguments (torchvision, factory); repeatable",
    )
    plan.add_argument(
        "--max-memory",
        metavar="DEV=SIZE,...",
        help="device budgets, e.g. 0=20GiB,1=20GiB,cpu=64GiB,disk=500GiB (default: this machine)",
    )
    plan.add_argument(
        "--strategy",
        default="auto",
        choices=STRATEGY_NAMES,
        help="how to spread units over the GPUs (default: auto)",
    )
    plan.add_argument(
        "--batch", type=_positive, default=1, metavar="N", help="example batch size (default: 1)"
    )
    plan.add_argument(
        "--seq-len",
        type=_positive,
        default=128,
        metavar="N",
        help="example sequence length for token models (default: 128); the prompt with --max-length",
    )
    inputs = plan.add_mutually_exclusive_group()
    inputs.add_argument(
        "--input-shape",
        metavar="SHAPE,...",
        help="the forward's inputs as float tensors of these shapes, e.g. 1x3x16x112x112 "
        "(a video model); several positional inputs separated by commas. Replaces the "
        "inputs guessed from --batch and --seq-len",
    )
    inputs.add_argument(
        "--example-inputs",
        metavar="MODULE:FUNCTION",
        help="a function returning the forward's inputs (a tuple, a dict of keyword "
        "arguments, or a tensor), called with meta as the default device",
    )
    plan.add_argument(
        "--max-length",
        type=_count(2),
        default=None,
        metavar="N",
        help="plan for generate(): --batch sequences grown to N tokens (prompt included); each "
        "device keeps room for its layers' KV cache, and the report predicts tokens/s",
    )
    plan.add_argument(
        "--dtype",
        metavar="DTYPE",
        type=lambda t: t.strip().lower().removeprefix("torch."),
        choices=DTYPE_NAMES,
        help="dtype the model runs in: fp32, fp16, bf16, fp8 (default: a folder's checkpoint "
        "dtypes, else the config's, else fp32)",
    )
    _add_outputs(plan)


def _add_outputs(plan: argparse.ArgumentParser) -> None:
    plan.add_argument("--json", metavar="FILE", help="write the plan as JSON (docs/plan-schema.md)")
    plan.add_argument("--figure", metavar="FILE", help="draw the plan as a picture (.png, .svg or .pdf)")
    plan.add_argument(
        "--quiet",
        action="store_true",
        help="print nothing: no report, no progress, no 'wrote' lines (still writes --json/--figure); "
        "errors still show",
    )
    plan.add_argument(
        "--emit",
        choices=EMIT_ENGINES,
        metavar="ENGINE",
        help=f"print the plan as another engine "
        f"takes it ({', '.join(EMIT_ENGINES)}; docs/export.md) instead of the report",
    )
    plan.add_argument(
        "--gguf-arch", metavar="ARCH", help="--emit llama.cpp: the GGUF architecture (default: model_type)"
    )


def parse_input_shapes(text: str) -> tuple[tuple[int, ...], ...]:
    """``"1x3x16x112x112,1x10"`` -> ``((1, 3, 16, 112, 112), (1, 10))``.

    Raises:
        SpecError: a shape is not sizes >= 1 joined by ``x``.
    """
    shapes = []
    for item in filter(None, (p.strip() for p in text.split(","))):
        sizes = item.lower().split("x")
        if not all(
            s.strip().isascii() and s.strip().isdigit() and len(s.strip()) <= 12 and 0 < int(s) <= MAX_COUNT
            for s in sizes
        ):
            raise SpecError(
                f"--input-shape expects sizes from 1 to {MAX_COUNT:,} joined by 'x', "
                f"got {item[:40]!r}; "
                "e.g. --input-shape 1x3x224x224"
            )
        shapes.append(tuple(int(s) for s in sizes))
    if not shapes:
        raise SpecError("--input-shape is empty; e.g. --input-shape 1x3x224x224")
    return tuple(shapes)


def check_plan_args(args: argparse.Namespace) -> None:
    """Everything about ``automap plan``'s arguments that can be checked without torch; the
    parsed forms are kept on ``args`` (``max_memory``, ``shapes``).

    Raises:
        SizeError, DeviceError, SpecError, ReportError: the argument that is wrong, and why.
    """
    check_not_hub_id(args.spec)
    args.max_memory = parse_max_memory_text(args.max_memory) if args.max_memory is not None else None
    args.shapes = parse_input_shapes(args.input_shape) if args.input_shape is not None else None
    if args.json:
        check_output_path(args.json, "plan JSON")
    if args.figure:
        check_output_path(args.figure, "figure", FIGURE_FORMATS)


# Bad input: arguments, and the files they name (a SPEC's config: a SpecError).
_USAGE_ERRORS = (SpecError, SizeError, DeviceError, ReportError)


# The library's errors name the fix in its own arguments; printed here, the message stays the
# library's word for word and is followed by the flags those arguments are on this command.
def flags_of(parser: argparse.ArgumentParser) -> dict[str, str]:
    """``{argument name: flag}`` for each flag of ``parser``'s subcommands, named by the
    argument it fills (its ``dest``: ``max_memory`` -> ``--max-memory``)."""
    found: dict[str, str] = {}
    commands = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    for sub in [p for action in commands for p in action.choices.values()]:
        for action in sub._actions:
            long = [o for o in action.option_strings if o.startswith("--")]
            if long and action.dest not in ("help", "verbose", "debug"):
                found.setdefault(action.dest, long[0])
    return found


def with_flags(message: str, flags: dict[str, str]) -> str:
    """``message`` (a library error's) on one line, unchanged, then the flags of the arguments
    it names: ``... raise max_memory['cpu'] ... (on the command line: max_memory is --max-memory)``."""
    text = " ".join(message.split())
    named = [n for n in flags if re.search(rf"(?<![\w.-]){re.escape(n)}(?!\w)", text)]
    if not named:
        return text
    return f"{text} (on the command line: {', '.join(f'{n} is {flags[n]}' for n in named)})"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``automap`` command with ``argv`` (default: ``sys.argv[1:]``); return the exit code."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2), already printed
        return int(exc.code or 0)
    logging.basicConfig(
        level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING,
        format="%(name)s: %(message)s",
    )
    if args.command is None:
        parser.print_help()
        return 2
    if args.command == "plan" and args.list_presets:
        print(
            "\n".join(
                [
                    "presets: the shapes of popular models, random weights, planned offline "
                    "(automap plan NAME; --set changes a field)",
                    *preset_lines(),
                ]
            )
        )
        return 0
    if args.command == "plan" and args.spec is None:
        print(
            "automap plan: error: the following arguments are required: SPEC (see 'automap plan --help'; "
            "presets: automap plan --list-presets)",
            file=sys.stderr,
        )
        return 2
    try:
        if args.command == "plan":
            check_plan_args(args)
        return _COMMANDS[args.command](args)
    except AutomapError as exc:
        print(f"automap: error: {with_flags(str(exc), flags_of(parser))}", file=sys.stderr)
        return 2 if isinstance(exc, (*_USAGE_ERRORS, CleanPathError)) else 1
    except KeyboardInterrupt:
        print("automap: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `automap plan ... | head`: the reader left; stay quiet
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except Exception as exc:  # noqa: BLE001 - a bug of automap's: one line, the traceback on --debug
        return internal_error(exc, getattr(args, "debug", False))


def internal_error(exc: BaseException, debug: bool) -> int:
    """Report an exception automap did not expect (a bug): one line naming it and how to report
    it, or with ``debug`` its traceback too. Returns the exit code, 1."""
    if debug:
        traceback.print_exception(exc, file=sys.stderr)
    reason = " ".join(f"{type(exc).__name__}: {exc}".split())
    reason = reason if len(reason) <= 300 else reason[:297] + "..."
    print(
        f"automap: internal error: {reason}; please report it with the output of the same command "
        "run with --debug",
        file=sys.stderr,
    )
    return 1


def _plan(args: argparse.Namespace) -> int:
    from automap.progress import silenced, step
    from automap.report import figure, write_json
    from automap.spec_plan import plan_spec
    from automap.specs import input_tensors, load_example_inputs, parse_dtype, parse_overrides

    start = time.perf_counter()
    overrides = parse_overrides(args.overrides)
    inputs = (
        input_tensors(args.shapes)
        if args.shapes
        else load_example_inputs(args.example_inputs)
        if args.example_inputs
        else None
    )
    with (
        silenced(args.quiet),
        libraries_quiet(not getattr(args, "verbose", False)),
        step(f"automap: planning {args.spec}"),
    ):
        result = plan_spec(
            args.spec,
            overrides,
            max_memory=args.max_memory,
            strategy=args.strategy,
            batch=args.batch,
            seq_len=args.seq_len,
            dtype=parse_dtype(args.dtype) if args.dtype else None,
            max_length=args.max_length,
            example_inputs=inputs,
        )
    if args.emit:
        print(_emitted(result, args))
    elif not args.quiet:
        print(result.headline(time.perf_counter() - start) + "\n")
        print(result.plan.report())
    for path, write in ((args.json, write_json), (args.figure, figure)):
        if path:
            written = write(result.plan, path)
            if not args.quiet:
                print(f"wrote {written}")
    return 0


def _emitted(result: Any, args: argparse.Namespace) -> str:
    """``--emit ENGINE``: the plan as that engine takes it (llama.cpp: for the model's architecture)."""
    from automap.report.export import render

    if args.emit != "llama.cpp":
        return render(result.plan, args.emit)
    arch = args.gguf_arch or getattr(getattr(result.built.model, "config", None), "model_type", None)
    if not arch:
        raise SpecError("--emit llama.cpp needs the model's GGUF architecture: give --gguf-arch (e.g. llama)")
    return render(result.plan, args.emit, arch=arch)


# Libraries the command calls to build and trace a spec's model: what they warn about is how
# that model will run later (a fallback kernel, a head used alone, a future default), not the plan.
_COMMANDS = {"plan": _plan, **COMMANDS}
