"""Subtasks in this process's threads: the local engine's runner, for job runs and rescale.

`run_in_threads` runs ``run_one(i)`` for every subtask ``i`` in a pool of threads (the
work is RocksDB, Arrow and file I/O, which release the GIL) and returns the results in
subtask order. The first failure stops the subtasks not started yet; the started ones
finish first (each removes its own uploads when it fails, so the caller's discard
never races an upload); then one `TaskFailedError` line names the lowest failed
subtask and its error. Spark tasks are the other runner
(`statebackend.spark.dispatch.run_tasks`); inside one, `named_failure` gives its failure
the same line.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from typing import TypeVar

from statebackend.errors import CkptError, TaskFailedError
from statebackend.progress import NO_PROGRESS, ProgressSink

R = TypeVar("R")


def run_in_threads(count: int, run_one: Callable[[int], R], *, workers: int,
                   progress: ProgressSink = NO_PROGRESS, word: str = "subtask") -> list[R]:
    """``[run_one(0), ..., run_one(count - 1)]``, ``workers`` at a time (module doc);
    ``progress`` advances once per subtask done; ``word`` names a subtask in the error."""
    if count <= 0:
        return []
    with ThreadPoolExecutor(max(1, min(workers, count)),
                            thread_name_prefix="ckpt-subtask") as pool:
        futures: dict[Future, int] = {pool.submit(run_one, i): i for i in range(count)}
        results: dict[int, R] = {}
        failed: Future | None = None
        pending: set[Future] = set(futures)
        while pending:
            done, pending = wait(pending, return_when=FIRST_EXCEPTION)
            for f in done:
                if f.cancelled():
                    continue
                if f.exception() is None:
                    results[futures[f]] = f.result()
                    progress.advance()
                elif failed is None or futures[f] < futures[failed]:
                    failed = f
            if failed is not None:
                # not started: nothing to undo; the started ones finish first
                pending = {f for f in pending if not f.cancel()}
    if failed is not None:
        exc = failed.exception()
        raise _named(word, futures[failed], exc) from exc
    return [results[i] for i in range(count)]


@contextmanager
def named_failure(word: str, index: int) -> Iterator[None]:
    """In a Spark task: its failure becomes the `TaskFailedError` line `run_in_threads`
    raises (``word index: error``); `statebackend.spark.dispatch.root_cause` keeps it."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - any failure of the task, named once
        raise _named(word, index, exc) from exc


def _named(word: str, index: int, exc: BaseException | None) -> TaskFailedError:
    return TaskFailedError(f"{word} {index}: {one_line(exc)}")


def one_line(exc: BaseException | None) -> str:
    """An error as one line: a `CkptError`'s own text, else ``Type: message``."""
    if isinstance(exc, CkptError):
        return str(exc)
    text = " ".join(str(exc).split()) if exc is not None else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
