"""Interrupts (Ctrl-C, ``SIGTERM``, timers) during a public call: either the state before the call
or its complete result, never half of it. One handler per public call (:func:`public_call`),
held sections entered by a counter (:func:`deferred`), cleanups run to their end
(:func:`completed`), and one record per call of what it created, discarded on interrupt.
"""

from __future__ import annotations

import functools
import signal
import threading
from contextlib import contextmanager
from types import FrameType
from typing import Any, Callable, Iterator, TypeVar

# The signals a process gets from outside (a terminal, a timer, another process); the names a
# platform lacks are skipped.
_ASYNC = tuple(
    getattr(signal, n)
    for n in (
        "SIGINT",
        "SIGTERM",
        "SIGHUP",
        "SIGQUIT",
        "SIGALRM",
        "SIGVTALRM",
        "SIGPROF",
        "SIGUSR1",
        "SIGUSR2",
        "SIGCHLD",
        "SIGWINCH",
        "SIGPIPE",
        "SIGXCPU",
        "SIGXFSZ",
        "SIGTSTP",
        "SIGCONT",
        "SIGIO",
        "SIGURG",
    )
    if hasattr(signal, n)
)


class _Held:
    """The main thread's state: public calls open, their handlers' originals, held sections
    open, and the signals that came inside one."""

    def __init__(self) -> None:
        self.calls = 0
        self.originals: dict[int, Any] = {}
        self.sections = 0
        self.pending: list[tuple[int, FrameType | None]] = []


_held = _Held()
_depth = 0  # swapped-handler blocks open in the main thread (outside public calls)
F = TypeVar("F", bound=Callable[..., Any])


def _on_signal(signum: int, frame: FrameType | None) -> None:
    """The handler a public call installs: the original one now, or at the held section's end."""
    if _held.sections:
        _held.pending.append((signum, frame))
        return
    original = _held.originals.get(signum)
    if callable(original):
        original(signum, frame)


def _main() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextmanager
def public_call() -> Iterator[None]:
    """Inside, the asynchronous signals' Python handlers are the public call's (see the module
    docstring); as it ends they are put back (where nobody replaced them meanwhile) and a
    signal that came in a held section and was not delivered yet is delivered. Inside another
    public call, or outside the main thread, nothing changes."""
    if not _main() or _held.calls:
        yield
        return
    _held.calls += 1
    swapped: list[int] = []
    try:
        for number in _ASYNC:
            handler = signal.getsignal(number)
            if callable(handler) and handler is not _on_signal:
                _held.originals[number] = handler
                signal.signal(number, _on_signal)
                swapped.append(number)
        yield
    finally:
        came, _held.pending = _held.pending, []
        for number in swapped:
            if signal.getsignal(number) is _on_signal:
                signal.signal(number, _held.originals[number])
        originals, _held.originals = _held.originals, {}
        _held.calls -= 1
        _deliver(originals, came)


def public(function: F) -> F:
    """``function`` run under :func:`public_call` (a decorator for the public entry points)."""

    @functools.wraps(function)
    def call(*args: Any, **kwargs: Any) -> Any:
        with public_call():
            return function(*args, **kwargs)

    return call  # type: ignore[return-value]


@contextmanager
def deferred() -> Iterator[None]:
    """Hold back the Python handlers of signals (Ctrl-C, ``SIGTERM``, timers) until the block
    ends; each signal that came meanwhile is then handled, once, as the block ends (inside
    another block: as the outermost ends). The kernel may deliver a signal to any thread, and
    Python runs handlers in the main thread: they are held, not masked. Elsewhere than in the
    main thread nothing changes."""
    if not _main():
        yield
        return
    if _held.calls:
        _held.sections += 1  # the first statement: an interrupt from here on waits
        try:
            yield
        finally:
            came: list[tuple[int, FrameType | None]] = []
            if _held.sections == 1:
                came, _held.pending = _held.pending, []
            _held.sections -= 1
            _deliver(_held.originals, came)
        return
    with _swapped():
        yield


@contextmanager
def _swapped() -> Iterator[None]:
    """Outside a public call: the handlers swapped for the block (a handler that ran while they
    were being swapped, its exception, is held too)."""
    global _depth
    if _depth:
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
        if number not in seen and callable(handlers.get(number)):
            seen.add(number)
            handlers[number](number, frame)


def completed(cleanup: Callable[[], None]) -> None:
    """Run ``cleanup`` (which must be safe to run twice: hooks removed, attributes put back)
    to its end under :func:`deferred`. An interrupt that came before the section was entered,
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
