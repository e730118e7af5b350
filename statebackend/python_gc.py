"""Cheaper garbage collections while subtasks run in this process (`fewer_collections`).

A subtask allocates many short-lived objects (decoded JSON values, the job's lists, Arrow
conversions) and almost no reference cycles. CPython collects its youngest generation
every 700 net allocations and, every hundred of those, the whole heap: a full collection
traverses every object of the process, about 75,000 after the imports of `ckpt run` or
an Airflow task (20-25 ms each). Over four sessionization days that was 0.3 s of a
1.2 s series.

While any subtask of the process runs:

- the objects that existed before it are frozen (`gc.freeze`): collections skip them, so
  a full collection traverses only what the subtasks made;
- the youngest generation's threshold is ``CKPT_PYTHON_GC_THRESHOLD`` (default 2,000):
  cycles are still collected, a third as often. A much larger young generation (20,000)
  cost the keyed aggregation 10-15%: each collection then walks more objects that are
  no longer in the CPU's caches.

After the last subtask the objects are unfrozen and the process's own threshold comes
back. What the process chose stands: a higher threshold, collection turned off
(``gc.disable()`` or a threshold of 0), objects it froze itself (then nothing is
frozen here); ``CKPT_PYTHON_GC_THRESHOLD=0`` leaves the collector alone.

After a subtask failed, the next freeze first collects the whole heap: the failed
attempt's reference cycles (a traceback's frames holding its open state backend, and
with it the instance's RocksDB lock) would otherwise be frozen, alive, while a retry in
the same process (a reused Spark worker) opens the same instance.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from statebackend import settings


class _Held:
    """How many subtasks of this process run, and what to give back after the last."""

    lock = threading.Lock()
    active = 0
    threshold: tuple[int, int, int] | None = None
    froze = False
    failed = False  # a subtask failed since the last freeze: collect before the next


@contextmanager
def fewer_collections() -> Iterator[None]:
    """Run the body (a subtask) with the settings of the module docstring."""
    wanted = settings.count("CKPT_PYTHON_GC_THRESHOLD")
    with _Held.lock:
        if _Held.active == 0 and wanted and gc.isenabled():
            current = gc.get_threshold()
            if 0 < current[0] < wanted:
                _Held.threshold = current
                gc.set_threshold(wanted, *current[1:])
            if current[0] and gc.get_freeze_count() == 0:
                if _Held.failed:
                    gc.collect()
                    _Held.failed = False
                gc.freeze()
                _Held.froze = True
        _Held.active += 1
    try:
        yield
    except BaseException:
        _Held.failed = True
        raise
    finally:
        with _Held.lock:
            _Held.active -= 1
            if _Held.active == 0:
                _give_back()


def _give_back() -> None:
    if _Held.froze:
        gc.unfreeze()
        _Held.froze = False
    if _Held.threshold is not None:
        gc.set_threshold(*_Held.threshold)
        _Held.threshold = None
