"""Memory sizes at the edges: parsing ``"10GiB"`` / ``"500MB"`` / ints, and formatting bytes.

Inside automap every size is an ``int`` number of bytes; strings exist only here.
"""
from __future__ import annotations

import re

from automap.errors import SizeError

# Decimal and binary suffixes, as transformers and accelerate read them ("GB" = 10**9,
# "GiB" = 2**30). Matching is case-insensitive so "10gib" works too.
_FACTORS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "pb": 10**15,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "pib": 2**50,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}
_SIZE = re.compile(r"^\s*(-?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | float | str) -> int:
    """Return ``value`` as a whole number of bytes.

    Args:
        value: bytes as an int (or integral float), or a string such as ``"10GiB"``,
            ``"500MB"``, ``"1.5GB"``, ``"2048"``.

    Returns:
        The size in bytes, rounded down (``"1.3KiB"`` is 1331).

    Raises:
        SizeError: the value is negative, not a number, has an unknown suffix, or is a
            fraction without a unit (``0.5``: budgets are bytes, not shares of a device).

    Example:
        >>> parse_size("1.5GB")
        1500000000
    """
    if isinstance(value, bool):
        raise SizeError(f"size {value!r} is a bool; give bytes as an int or a string like '10GiB'")
    if isinstance(value, (int, float)):
        number, factor = float(value), 1
    elif isinstance(value, str):
        match = _SIZE.match(value)
        if match is None:
            raise SizeError(f"cannot read {value!r} as a size; write e.g. '10GiB', '500MB' or 1073741824")
        suffix = match.group(2).lower()
        if suffix not in _FACTORS:
            raise SizeError(
                f"unknown size unit {match.group(2)!r} in {value!r}; "
                "use B, KB, MB, GB, TB (powers of 10) or KiB, MiB, GiB, TiB (powers of 2)"
            )
        number, factor = float(match.group(1)), _FACTORS[suffix]
    else:
        raise SizeError(f"size {value!r} has type {type(value).__name__}; give an int or a string like '10GiB'")
    if number != number or number in (float("inf"), float("-inf")):
        raise SizeError(f"size {value!r} is not a finite number")
    if number < 0:
        raise SizeError(f"size {value!r} is negative; memory budgets must be >= 0")
    if factor == 1 and not number.is_integer():
        raise SizeError(f"size {value!r} is not a whole number of bytes; a budget is bytes, not a share of "
                        "the device: write e.g. '8GiB' or '500MB'")
    return int(number * factor)


def format_bytes(n: int | float) -> str:
    """Return ``n`` bytes in a short human form with binary units, e.g. ``'1.50 GiB'``."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{int(size)} B" if unit == "B" else f"{size:.2f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


# ------------------------------------------------------------------ numbers for people
#
# Every number a report, a choice, a warning or the CLI shows goes through one of these: one
# function per quantity, three significant digits, thousands separated, never an exponent.


def format_number(value: float) -> str:
    """``value`` to three significant digits, without an exponent: ``1130.4`` -> ``'1,130'``,
    ``3.316`` -> ``'3.32'``, ``0.000123`` -> ``'0.000123'``, ``34.0`` -> ``'34'``."""
    if value != value or value in (float("inf"), float("-inf")):
        return "unbounded" if value > 0 else "-" if value != value else "-unbounded"
    if value == 0:
        return "0"
    rounded = float(f"{value:.3g}")
    if abs(rounded) >= 1000:
        return f"{rounded:,.0f}"
    decimals = max(0, 2 - _exponent(rounded))
    return f"{rounded:.{decimals}f}".rstrip("0").rstrip(".") if decimals else f"{rounded:.0f}"


def _exponent(value: float) -> int:
    """The power of ten of ``value``'s leading digit (``0.0123`` -> -2, ``123`` -> 2)."""
    return int(f"{value:e}".partition("e")[2])


def format_seconds(seconds: float) -> str:
    """A duration in the unit that reads best: ``3.316`` -> ``'3.32 s'``, ``0.0878`` ->
    ``'87.8 ms'``, ``4.92e-05`` -> ``'49.2 µs'``, ``754`` -> ``'12.6 min'``; under a nanosecond
    ``'<1 ns'``."""
    if seconds == 0:
        return "0 s"
    if seconds >= 3600:
        return f"{format_number(seconds / 3600)} h"
    if seconds >= 60:
        return f"{format_number(seconds / 60)} min"
    for scale, unit in ((1.0, "s"), (1e-3, "ms"), (1e-6, "µs"), (1e-9, "ns")):
        if seconds >= scale:
            return f"{format_number(seconds / scale)} {unit}"
    return "<1 ns"


def format_rate(per_second: float, what: str) -> str:
    """A rate: ``1130.4, "tokens"`` -> ``'1,130 tokens/s'``, ``0.118`` -> ``'0.118 tokens/s'``."""
    return f"{format_number(per_second)} {what}/s"


def format_flops(flops: float, per_second: bool = False) -> str:
    """Floating-point operations with decimal prefixes, as FLOPs are quoted: ``1.25e12`` ->
    ``'1.25 TFLOP'`` (``'1.25 TFLOP/s'`` with ``per_second``)."""
    unit = "FLOP/s" if per_second else "FLOP"
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(flops) >= scale:
            return f"{format_number(flops / scale)} {prefix}{unit}"
    return f"{format_number(flops)} {unit}"
