"""Fewer garbage collections while subtasks run in this process (`fewer_collections`).

A subtask allocates many short-lived objects (decoded JSON values, the job's lists, Arrow
conversions) and almost no reference cycles. CPython collects its youngest generation
every 700 net allocations and, every hundred of those, the whole heap, which traverses
every object of the process: `ckpt run` or an Airflow task holds about 75,000 after its
imports, 20-25 ms a full collection. That was a fifth of a sessionization run.

While any subtask runs, the youngest generation's threshold is
``CKPT_PYTHON_GC_THRESHOLD`` (default 20,000): cycles are still collected, about 30
times less often. The process's own threshold comes back when the last subtask in it
ends. A higher threshold of its own is kept; a process that turned collection off
(``gc.disable()`` or a threshold of 0) stays so; ``CKPT_PYTHON_GC_THRESHOLD=0`` leaves
the settings alone.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from statebackend import settings


class _Raised:
    """How many subtasks of this process run, and the threshold to give back."""

    lock = threading.Lock()
    active = 0
    saved: tuple[int, int, int] | None = None


@contextmanager
def fewer_collections() -> Iterator[None]:
    """Run the body (a subtask) with the raised threshold (module docstring)."""
    wanted = settings.count("CKPT_PYTHON_GC_THRESHOLD")
    with _Raised.lock:
        if _Raised.active == 0:
            current = gc.get_threshold()
            if wanted and gc.isenabled() and 0 < current[0] < wanted:
                _Raised.saved = current
                gc.set_threshold(wanted, *current[1:])
        _Raised.active += 1
    try:
        yield
    finally:
        with _Raised.lock:
            _Raised.active -= 1
            if _Raised.active == 0 and _Raised.saved is not None:
                gc.set_threshold(*_Raised.saved)
                _Raised.saved = None
