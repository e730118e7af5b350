"""Progress of long work: a tiny protocol for the library, a display for the CLI.

Library functions that do long work (job runs, gc, retention, deep validation,
rescale) take an optional ``progress`` argument, any `ProgressSink`:
``phase(label, total=None, unit="")`` starts a phase (with the amount of work
when known), ``advance(n=1)`` counts work done in it. The default,
`NO_PROGRESS`, does nothing, so library callers that pass nothing pay nothing
and see nothing. The CLI creates one `Progress` per command and passes it; a
stream of work (the dump's parts of rows) it counts itself with
``progress.wrap(parts, size=len)``.

Where the output goes (always stderr, never stdout: stdout carries results):

- stderr is a terminal: rich's live display (spinner, phase, bar when the total
  is known, count, elapsed time). rich is already installed (an Airflow
  dependency) and refreshes from its own thread, so a phase without counts (a
  slow import, a Spark job) still shows time passing. The display is erased
  when the command ends.
- otherwise (a log, a pipe, CI): one line every ``CKPT_PROGRESS_INTERVAL``
  seconds (default 5), e.g. ``ckpt dump: rows: 12000/50000 (24%), 10 s``, and
  the final count of each counted phase that ends later than that. Work
  shorter than that prints nothing, so scripts of quick commands keep an
  empty stderr.
- ``CKPT_PROGRESS`` = ``auto`` (default), ``bar``, ``lines`` or ``off``.

Both variables are declared and checked in `statebackend.settings` (a bad value is a
one-line error of the command, like every other ``CKPT_*`` setting).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import IO, TYPE_CHECKING, Protocol, TypeVar

from statebackend import settings
from statebackend.errors import UsageError

if TYPE_CHECKING:  # rich only in bar mode
    import rich.progress

MODE_ENV = "CKPT_PROGRESS"
INTERVAL_ENV = "CKPT_PROGRESS_INTERVAL"
MODES = ("auto", "bar", "lines", "off")
DEFAULT_INTERVAL = 5.0
MIN_BEAT = 0.05  # seconds between two checks of the clock in lines mode (tiny intervals)
WRAP_BATCH = 256  # items between two updates of the display: rows can be millions

T = TypeVar("T")


class ProgressSink(Protocol):
    """What long library work reports to (`Progress` in the CLI; `NO_PROGRESS` by default)."""

    def phase(self, label: str, total: int | None = None, unit: str = "") -> None:
        """Start a phase named ``label``; ``total`` (of ``unit``) when the work is known."""

    def advance(self, n: int = 1) -> None:
        """``n`` more of the current phase's unit done."""


class NoProgress:
    """A `ProgressSink` that reports nothing (the library's default)."""

    def phase(self, label: str, total: int | None = None, unit: str = "") -> None:
        pass

    def advance(self, n: int = 1) -> None:
        pass


NO_PROGRESS: ProgressSink = NoProgress()


def reports(progress: ProgressSink) -> bool:
    """Whether ``progress`` shows anything: work done only to report it (polling Spark's
    status) is skipped for `NO_PROGRESS`."""
    return not isinstance(progress, NoProgress) and getattr(progress, "mode", "") != "off"


def choose_mode(stream: IO[str], requested: str | None = None) -> str:
    """"bar", "lines" or "off" for ``stream`` (``requested`` or env CKPT_PROGRESS)."""
    mode = (requested or settings.choice(MODE_ENV)).strip().lower()
    if mode not in MODES:
        raise UsageError(f"progress mode {mode!r} is unknown; use one of {list(MODES)}")
    if mode != "auto":
        return mode
    isatty = getattr(stream, "isatty", None)
    return "bar" if callable(isatty) and isatty() else "lines"


def env_interval() -> float:
    return settings.seconds(INTERVAL_ENV)


def format_line(command: str, label: str, done: int, total: int | None, unit: str,
                elapsed: float) -> str:
    """One progress line (lines mode), e.g. ``ckpt dump: rows: 120/500 (24%), 10 s``."""
    if total:
        count = f": {done}/{total}{' ' + unit if unit else ''} ({100 * done // total}%)"
    elif done or unit:
        count = f": {done}{' ' + unit if unit else ''}"
    else:
        count = "…"
    return f"ckpt {command}: {label}{count}, {elapsed:.0f} s"


class Progress:
    """Progress of one command; use as a context manager (closes the display)."""

    def __init__(self, command: str, *, stream: IO[str] | None = None, mode: str | None = None,
                 interval: float | None = None, clock: Callable[[], float] = time.monotonic,
                 thread: bool = True) -> None:
        self.command = command
        self.stream = stream if stream is not None else sys.stderr
        self.mode = choose_mode(self.stream, mode)
        self.interval = interval if interval is not None else env_interval()
        self.clock = clock
        self.label = ""
        self.unit = ""
        self.total: int | None = None
        self.done = 0
        self._lock = threading.Lock()
        self._started = clock()
        self._last_line = self._started
        self._last_state: tuple | None = None  # (label, done, total, unit) of the last line
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._live: rich.progress.Progress | None = None  # bar mode
        self._task: rich.progress.TaskID | None = None  # the bar's one task
        if self.mode == "bar":
            self._start_bar()
        elif self.mode == "lines" and thread:
            self._thread = threading.Thread(target=self._beat, name="ckpt-progress", daemon=True)
            self._thread.start()

    # -- what callers report --------------------------------------------------
    def phase(self, label: str, total: int | None = None, unit: str = "") -> None:
        """Start a new phase; ``total`` (of ``unit``) when the amount of work is known."""
        self._end_of_phase()
        with self._lock:
            self.label, self.total, self.unit, self.done = label, total, unit, 0
            if self._live is not None and self._task is not None:
                self._live.update(self._task, description=label, total=total, completed=0,
                                  count=self._count_text())
                if self._live.live.is_started:
                    self._live.refresh()  # show the new phase now, not at the next tick
                else:
                    self._live.start()  # first phase: no empty frame before it

    def advance(self, n: int = 1) -> None:
        with self._lock:
            self.done += n
            if self._live is not None and self._task is not None:
                self._live.update(self._task, advance=n, count=self._count_text())

    def wrap(self, items: Iterable[T], size: Callable[[T], int] | None = None
             ) -> Iterator[T]:
        """Yield ``items``, counting them in the current phase: one each, or ``size(item)``
        (an item that holds many)."""
        pending = 0
        for item in items:
            yield item
            pending += 1 if size is None else size(item)
            if pending >= WRAP_BATCH:
                self.advance(pending)
                pending = 0
        if pending:
            self.advance(pending)

    # -- lines mode -----------------------------------------------------------
    def tick(self) -> str | None:
        """Write a line if ``interval`` passed since the last one; returns it (tests)."""
        with self._lock:
            now = self.clock()
            if self.mode != "lines" or not self.label or now - self._last_line < self.interval:
                return None
            self._last_line = now
            self._last_state = (self.label, self.done, self.total, self.unit)
            line = format_line(self.command, self.label, self.done, self.total, self.unit,
                               now - self._started)
        self._write(line + "\n")
        return line

    def _end_of_phase(self) -> None:
        """Lines mode: a counted phase that ends once the command has run for an interval
        shows its final count (e.g. ``3/3 subtasks``), unless the last line showed it."""
        with self._lock:
            now = self.clock()
            state = (self.label, self.done, self.total, self.unit)
            if self.mode != "lines" or not self.label or not (self.total or self.done) \
                    or now - self._started < self.interval or state == self._last_state:
                return
            self._last_line, self._last_state = now, state
            line = format_line(self.command, self.label, self.done, self.total, self.unit,
                               now - self._started)
        self._write(line + "\n")

    def _beat(self) -> None:
        step = min(max(self.interval, MIN_BEAT), 1.0)
        while not self._stop.wait(step):
            self.tick()

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):
            self.mode = "off"  # stderr closed: progress is not worth an error

    # -- bar mode -------------------------------------------------------------
    def _count_text(self) -> str:
        if self.total:
            return f"{self.done}/{self.total} {self.unit}".rstrip()
        return f"{self.done} {self.unit}".rstrip() if self.done or self.unit else ""

    def _start_bar(self) -> None:
        import rich.progress as rp
        from rich.console import Console

        console = Console(file=self.stream, force_terminal=True)
        self._live = rp.Progress(
            rp.SpinnerColumn(), rp.TextColumn(f"ckpt {self.command}: {{task.description}}"),
            rp.BarColumn(), rp.TextColumn("{task.fields[count]}"), rp.TimeElapsedColumn(),
            # stdout carries results (dump --out -, --json): rich must not redirect it
            console=console, transient=True, redirect_stdout=False, redirect_stderr=False)
        self._task = self._live.add_task("", total=None, count="")

    # -- end ------------------------------------------------------------------
    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
            self._thread = None
        self._end_of_phase()
        if self._live is not None:
            live, self._live = self._live, None
            try:
                live.stop()
            except (OSError, ValueError):
                pass

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
