"""Progress on the terminal for work that takes more than a second: a tqdm bar on stderr, only
on a terminal, only after :data:`DELAY_SECONDS`, never under ``quiet``.
"""

from __future__ import annotations

import sys
import threading
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Iterator

DELAY_SECONDS = 1.0
_REFRESH_SECONDS = 0.5
_silenced: ContextVar[bool] = ContextVar("automap_progress_silenced", default=False)
_active: ContextVar[Any] = ContextVar("automap_progress_step", default=None)


def shown(quiet: bool = False) -> bool:
    """Whether a bar would be drawn now: stderr is a terminal, and nobody asked for quiet."""
    isatty = getattr(sys.stderr, "isatty", None)
    return not quiet and not _silenced.get() and bool(isatty and isatty())


@contextmanager
def silenced(quiet: bool = True) -> Iterator[None]:
    """No progress from the calls inside (when ``quiet``)."""
    token = _silenced.set(_silenced.get() or quiet)
    try:
        yield
    finally:
        _silenced.reset(token)


def bar(total: int | None, desc: str, *, unit: str = "it", quiet: bool = False, **options: Any) -> Any:
    """A ``tqdm`` bar for ``total`` units of work (bytes: ``unit="B"``), drawn by the rule above;
    use it as a context manager and call ``update(n)``."""
    from tqdm import tqdm

    if unit == "B":
        options = {"unit_scale": True, "unit_divisor": 1024, **options}
    options.setdefault("leave", True)  # a count's last line stays (what was done, how fast)
    return tqdm(
        total=total,
        desc=desc,
        unit=unit,
        file=sys.stderr,
        delay=DELAY_SECONDS,
        disable=not shown(quiet),
        dynamic_ncols=True,
        **options,
    )


@contextmanager
def step(desc: str, *, quiet: bool = False) -> Iterator[None]:
    """Show ``desc`` and the seconds it has run while the block runs longer than a second."""
    outer = _active.get()
    if outer is not None:  # one line per long step: the outer bar says what runs now
        previous = outer.desc
        outer.set_description_str(desc, refresh=False)
        try:
            yield
        finally:
            outer.set_description_str(previous, refresh=False)
        return
    if not shown(quiet):
        yield
        return
    with bar(None, desc, bar_format="{desc}: {elapsed}", leave=False) as timer:  # a step leaves no line
        token = _active.set(timer)
        done = threading.Event()
        ticker = threading.Thread(target=_tick, args=(timer, done), name="automap-progress", daemon=True)
        ticker.start()
        try:
            yield
        finally:
            done.set()
            ticker.join()
            _active.reset(token)


def _tick(timer: Any, done: threading.Event) -> None:
    """Redraw the elapsed time twice a second (tqdm itself waits for an update that a step
    without counts never makes); the bar appears after its delay like any other."""
    while not done.wait(_REFRESH_SECONDS):
        timer.update(0)  # redraws once the delay has passed
