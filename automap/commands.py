"""The ``automap`` command's subcommands beside ``plan`` (``clean``, ``demo``, ``bench``,
``calibrate``): their arguments and what each runs; :mod:`automap.cli` parses and dispatches."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import warnings
from typing import Any, Callable, Iterator

from automap.errors import DeviceError, OffloadError
from automap.userfiles import check_output_path


class CleanPathError(OffloadError):
    """``automap clean DIR`` with a DIR that does not exist or is a file: a usage error."""


def add_commands(commands: Any, verbose: argparse.ArgumentParser) -> None:
    """Add the subcommands beside ``plan`` to ``commands`` (the parser's subparsers)."""
    clean = commands.add_parser(
        "clean",
        parents=[verbose],
        help="remove automap's offload stores from a folder (and nothing else)",
        description="Remove the offload stores (automap-store-* folders) that automap wrote under DIR and "
        "that no live process uses, and nothing else: files of yours beside or inside them, "
        "links and stores in use are left and named. Prints what it removed and the bytes freed.",
    )
    clean.add_argument(
        "dir",
        metavar="DIR",
        nargs="?",
        default="offload",
        help="the offload_dir a model was dispatched with, or one automap-store-* folder (default: offload)",
    )
    clean.add_argument("--quiet", action="store_true", help="print nothing")
    demo = commands.add_parser(
        "demo",
        parents=[verbose],
        help="plan, report and run ResNet-50 and a small Llama with part of them on disk",
        description="Plan, report and run ResNet-50 and a small Llama (random weights) with "
        "part of their weights on disk, and check the outputs equal the plain "
        "model's. What 'make demo' runs; about a minute on a laptop CPU. The "
        'Llama half needs transformers (pip install "automap[hf]").',
    )
    demo.add_argument(
        "--save",
        metavar="DIR",
        help="instead, write the docs' example model folders (small random-weight Hugging Face "
        "folders: DIR/llama, DIR/gptj) and exit; offline, seconds",
    )
    bench = commands.add_parser(
        "bench",
        parents=[verbose],
        help="compare automap's plans with accelerate's on hypothetical GPUs (seconds)",
        description="Plan a few real architectures on meta for hypothetical GPU sets with automap and with "
        "accelerate (get_balanced_memory + infer_auto_device_map, what device_map='auto' does) "
        "and compare bytes spilled off the GPUs and the busiest GPU's share of the FLOPs.",
    )
    bench.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    calibrate = commands.add_parser(
        "calibrate",
        parents=[verbose],
        help="measure this machine's speeds again (about 2 s) and record them",
        description="Measure the CPU's matmul rate per dtype and memory bandwidth, the disk's read rate (in "
        "the file system of --offload-dir) and each GPU's copy, memory and matmul rates, and "
        "record them where plans read them: $XDG_CACHE_HOME/automap/machine.json (~/.cache "
        "without it), or the file AUTOMAP_CALIBRATION names. Plans measure on first use by "
        "themselves; this refreshes the record (after a hardware or driver change, say).",
    )
    calibrate.add_argument(
        "--offload-dir",
        metavar="DIR",
        default=None,
        help="measure the disk holding this folder (default: the working directory)",
    )


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


def demo(args: argparse.Namespace) -> int:
    if args.save:
        from automap.demo import save_examples

        with libraries_quiet(not getattr(args, "verbose", False)):
            lines = save_examples(args.save)
        print("\n".join(lines))
        return 0
    from automap.demo import run_demo

    return 0 if run_demo() else 1


def clean(args: argparse.Namespace) -> int:
    if not os.path.lexists(args.dir):
        raise CleanPathError(
            f"{args.dir} does not exist; give the offload_dir a model was dispatched with, "
            "e.g. automap clean offload"
        )
    if not os.path.isdir(args.dir):
        raise CleanPathError(
            f"{args.dir} is a file, not a folder; give the offload_dir a model was "
            "dispatched with, e.g. automap clean offload"
        )
    from automap.offload import clean

    result = clean(args.dir)
    if not args.quiet:
        print(result.summary())
    return 0


def bench(args: argparse.Namespace) -> int:
    if args.json:
        check_output_path(args.json, "bench rows")
    from automap.bench import format_table, run_bench, runnable_cases, write_rows

    cases, skipped = runnable_cases()
    rows = run_bench(cases)
    print(format_table(rows))
    if skipped:
        print(
            f"skipped {', '.join(c.name for c in skipped)}: they need transformers, which is not installed; "
            'pip install "automap[hf]"'
        )
    if args.json:
        print(f"wrote {write_rows(rows, args.json)}")
    return 0


def calibrate(args: argparse.Namespace) -> int:
    from automap.machine import describe, machine_record, record_path

    path = record_path()
    if path is None:
        raise DeviceError(
            "measuring is off (AUTOMAP_CALIBRATION=off): plans use each kind's default speeds; "
            "unset AUTOMAP_CALIBRATION, or set it to a file to record the figures in"
        )
    record = machine_record(args.offload_dir, refresh=True)
    print(describe(record))
    print(f"recorded in {path}")
    return 0


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "clean": clean,
    "demo": demo,
    "bench": bench,
    "calibrate": calibrate,
}
