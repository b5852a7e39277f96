"""Numbers at the edges: every number a user gives is read here — sizes (``"10GiB"`` /
``"500MB"`` / ints, :func:`parse_size`) and every other count or rate (:func:`parse_number`:
speeds, bandwidths, batch, lengths, a plan JSON's fields) — and formatting them for people.

Inside automap every size is an ``int`` number of bytes; strings exist only here. A number is
refused, with the field named, when it is not a number (``"fast"``, a list, bytes, a bool), not
finite (``inf``, ``nan``, ``"1e300GB"``, ``10**400``), negative, or above the bound of its
quantity: :data:`MAX_BYTES`, :data:`MAX_RATE`, :data:`MAX_COUNT`. The bounds are far beyond any
machine, so no real value meets them; past them a value is a typo or an attack, and would
overflow the floats the planner computes with.
"""

from __future__ import annotations

import math
import numbers
import re

from automap.errors import AutomapError, SizeError

# 1 EiB: no device holds this many bytes (the largest GPU servers have a few TiB).
MAX_BYTES = 2**60
# 10**18 per second (an exa-FLOP/s, an exabyte/s): above any one device's compute or bandwidth.
MAX_RATE = 1e18
# A second per row or per op: a million times what any machine pays.
MAX_OP_SECONDS = 1.0
# Sequences, tokens, batch sizes, shape sizes and device indices: what an int32 index can count.
MAX_COUNT = 2**31


def shown(value: object) -> str:
    """``repr(value)`` short enough for a message (a huge int is not written out: Python
    refuses ints of over 4,300 digits as text)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"an integer of about {int(value.bit_length() * math.log10(2)) + 1} digits"
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - a user's object whose repr fails is still named by its type
        text = f"<{type(value).__name__}>"
    return text if len(text) <= 80 else text[:77] + "..."


def parse_number(
    value: object,
    field: str,
    *,
    integral: bool = False,
    minimum: float = 0,
    maximum: float = MAX_RATE,
    error: type[AutomapError] = SizeError,
    hint: str = "",
) -> float:
    """``value`` as a number for ``field``, checked: the one reader of every number a user gives.

    Args:
        value: an int or float (any ``numbers.Real``: numpy and torch scalars too, not bool).
        field: its name in messages (``"speeds['cpu']"``, ``"batch"``).
        integral: an ``int`` is required (a whole float such as ``2.0`` is not taken).
        minimum, maximum: the bounds, inclusive.
        error: the :class:`~automap.errors.AutomapError` subclass raised.
        hint: the fix, appended to the message (default: the bounds).

    Returns:
        ``value`` as an ``int`` (``integral``) or a ``float``.

    Raises:
        ``error``: not a number, not finite, not whole (``integral``), or out of bounds.

    Example:
        >>> parse_number(300e12, "speeds['cuda']")
        300000000000000.0
    """
    fix = hint or f"give a number from {_bound(minimum)} to {_bound(maximum)}"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise error(f"{field}={shown(value)} is a {type(value).__name__}, not a number; {fix}")
    if integral and not isinstance(value, numbers.Integral):
        raise error(f"{field}={shown(value)} is not a whole number; {fix}")
    if isinstance(value, numbers.Integral):
        number: float = int(value)
    else:
        number = float(value)
        if not math.isfinite(number):
            raise error(f"{field}={shown(value)} is not a finite number; {fix}")
    if number < minimum:
        kind = "negative" if number < 0 else "too small"
        raise error(f"{field}={shown(value)} is {kind}; {fix}")
    if number > maximum:
        raise error(f"{field}={shown(value)} is above {_bound(maximum)}; {fix}")
    return number


def _bound(value: float) -> str:
    return f"{value:,.0f}" if float(value).is_integer() and abs(value) < 1e16 else f"{value:g}"


# Decimal and binary suffixes, as transformers and accelerate read them ("GB" = 10**9,
# "GiB" = 2**30). Matching is case-insensitive so "10gib" works too.
_FACTORS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "pb": 10**15,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "pib": 2**50,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,
}
_SIZE = re.compile(r"^\s*(-?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | float | str, field: str = "size") -> int:
    """Return ``value`` as a whole number of bytes.

    Args:
        value: bytes as an int (or integral float), or a string such as ``"10GiB"``,
            ``"500MB"``, ``"1.5GB"``, ``"2048"``.
        field: what the size is, for messages (``"max_memory['cpu']"``).

    Returns:
        The size in bytes, rounded down (``"1.3KiB"`` is 1331).

    Raises:
        SizeError: the value is negative, not a number, not finite, above :data:`MAX_BYTES`,
            has an unknown suffix, or is a fraction without a unit (``0.5``: budgets are
            bytes, not shares of a device).

    Example:
        >>> parse_size("1.5GB")
        1500000000
    """
    fix = "write e.g. '10GiB', '500MB' or 1073741824"
    if isinstance(value, str):
        match = _SIZE.match(value) if len(value) <= 100 else None
        if match is None:
            raise SizeError(f"{field}: cannot read {shown(value)} as a size; {fix}")
        suffix = match.group(2).lower()
        if suffix not in _FACTORS:
            raise SizeError(
                f"{field}: unknown size unit {match.group(2)!r} in {value!r}; "
                "use B, KB, MB, GB, TB (powers of 10) or KiB, MiB, GiB, TiB (powers of 2)"
            )
        number, factor = float(match.group(1)), _FACTORS[suffix]
    else:
        number, factor = parse_number(value, field, minimum=-math.inf, maximum=math.inf, hint=fix), 1
    if isinstance(number, float) and not math.isfinite(number):
        raise SizeError(f"{field} {shown(value)} is not a finite number; {fix}")
    if number < 0:
        raise SizeError(f"{field} {shown(value)} is negative; memory budgets must be >= 0")
    if factor == 1 and isinstance(number, float) and not number.is_integer():
        raise SizeError(
            f"{field} {shown(value)} is not a whole number of bytes; a budget is bytes, "
            "not a share of the device: write e.g. '8GiB' or '500MB'"
        )
    if number * factor > MAX_BYTES:
        raise SizeError(
            f"{field} {shown(value)} is above 2**60 bytes (1 EiB), more than any machine has; {fix}"
        )
    return int(number * factor) if factor != 1 else int(number)


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
