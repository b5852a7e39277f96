"""Sections that an interrupt must not split: a step whose effect and its record (a folder made
and remembered for cleanup, hooks attached and listed for removal) happen together or not at
all, and cleanups that must run to their end. Python runs a signal's handler (Ctrl-C's
``KeyboardInterrupt``) between any two bytecodes, also right after a system call returned and
before its result was stored; inside :func:`deferred` the handlers wait, and run as the block
ends, where the caller's cleanup sees a consistent state. Only short, local work goes inside:
no reads or writes of weights, which would make Ctrl-C wait for them."""
from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from types import FrameType
from typing import Any, Callable, Iterator

# The signals a process gets from outside (a terminal, a timer, another process); the names a
# platform lacks are skipped.
_ASYNC = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGALRM", "SIGVTALRM",
                                            "SIGPROF", "SIGUSR1", "SIGUSR2", "SIGCHLD", "SIGWINCH", "SIGPIPE",
                                            "SIGXCPU", "SIGXFSZ", "SIGTSTP", "SIGCONT", "SIGIO", "SIGURG")
               if hasattr(signal, n))
_depth = 0  # deferred blocks open in the main thread


@contextmanager
def deferred() -> Iterator[None]:
    """Hold back the Python handlers of signals (Ctrl-C, ``SIGTERM``, timers) until the block
    ends; each signal that came meanwhile is then handled, once, as the block ends. The kernel
    may deliver a signal to any thread, and Python runs handlers in the main thread: they are
    swapped here, not masked. A handler that ran while they were being swapped (its exception)
    is held too. Elsewhere than in the main thread, and inside another block, nothing changes."""
    global _depth
    if threading.current_thread() is not threading.main_thread() or _depth:
        yield
        return
    came: list[tuple[int, FrameType | None]] = []
    handlers: dict[int, Any] = {}
    early: BaseException | None = None
    _depth += 1
    try:
        try:
            for number in _ASYNC:
                handler = signal.getsignal(number)
                if callable(handler):
                    handlers[number] = handler
                    signal.signal(number, lambda signum, frame: came.append((signum, frame)))
        except BaseException as exc:  # a handler that ran before it was swapped: raised after the block
            early = exc
        yield
    finally:
        _depth -= 1
        for number, handler in handlers.items():
            signal.signal(number, handler)
        if early is not None:
            raise early
        _deliver(handlers, came)


def _deliver(handlers: dict[int, Any], came: list[tuple[int, FrameType | None]]) -> None:
    seen: set[int] = set()
    for number, frame in came:
        if number not in seen:
            seen.add(number)
            handlers[number](number, frame)


def completed(cleanup: Callable[[], None]) -> None:
    """Run ``cleanup`` (which must be safe to run twice: hooks removed, attributes put back)
    to its end under :func:`deferred`. An interrupt that came before the handlers were held,
    and cut it short, runs it again; the interrupt is raised once it has finished. An
    ``Exception`` from the cleanup itself is raised as it is."""
    pending: BaseException | None = None
    while True:
        try:
            with deferred():
                cleanup()
            break
        except Exception:
            raise
        except BaseException as exc:  # KeyboardInterrupt, SystemExit from a handler
            pending = pending or exc
    if pending is not None:
        raise pending
