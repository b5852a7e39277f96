"""Sections that an interrupt must not split: a step whose effect and its record (a folder made
and remembered for cleanup, hooks attached and listed for removal) happen together or not at
all. Python runs a signal's handler (Ctrl-C's ``KeyboardInterrupt``) between any two bytecodes,
also right after a system call returned and before its result was stored; inside
:func:`deferred` the handlers wait, and run as the block ends, where the caller's cleanup sees
a consistent state. Only short, local work goes inside: no reads or writes of weights, which
would make Ctrl-C wait for them."""
from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from types import FrameType
from typing import Any, Iterator

_UNCATCHABLE = {signal.SIGKILL, signal.SIGSTOP}
_depth = 0  # deferred blocks open in the main thread


@contextmanager
def deferred() -> Iterator[None]:
    """Hold back the Python handlers of signals (Ctrl-C, ``SIGTERM``, timers) until the block
    ends; each signal that came meanwhile is then handled, once, as the block ends. The kernel
    may deliver a signal to any thread, and Python runs handlers in the main thread: they are
    swapped here, not masked. Elsewhere than in the main thread, and inside another block,
    nothing changes."""
    global _depth
    if threading.current_thread() is not threading.main_thread() or _depth:
        yield
        return
    handlers = {s: h for s in signal.valid_signals() - _UNCATCHABLE if callable(h := signal.getsignal(s))}
    came: list[tuple[int, FrameType | None]] = []

    def hold(signum: int, frame: FrameType | None) -> None:
        came.append((signum, frame))

    _depth += 1
    try:
        for number in handlers:
            signal.signal(number, hold)
        yield
    finally:
        _depth -= 1
        for number, handler in handlers.items():
            signal.signal(number, handler)
        _deliver(handlers, came)


def _deliver(handlers: dict[int, Any], came: list[tuple[int, FrameType | None]]) -> None:
    seen: set[int] = set()
    for number, frame in came:
        if number not in seen:
            seen.add(number)
            handlers[number](number, frame)
