"""Worker processes for the local engine's CPU-bound Python work, started once per process.

Threads of one process share one GIL. Most of what a local rescale computes is RocksDB
handing every key and value over as a Python object (rescale's exports), so its
threads use one core however many there are. `worker_pool()` gives this process's pool
of worker processes, one per core, with the ``submit`` / `Future` interface of
``concurrent.futures``, for work that would otherwise queue on the GIL.

- **Started once, kept while used.** A worker starts at the pool's first use that
  needs it: a process's first use pays the start (about 0.3 s: a Python and the work's
  imports, the workers in parallel), later uses none. A worker idle for
  ``IDLE_SECONDS`` exits (each holds about 100 MB: a notebook that rescaled once should
  not keep them; loky's reusable executor does the same), and a later use starts it
  again. A worker that died (killed, out of memory) fails its work in one line naming
  its exit code and is replaced at the next use. A worker exits when this process
  closes its pipe (at exit, or when this process dies).
- **A fresh interpreter** (this Python running `_serve_parent`), neither fork
  nor multiprocessing: a fork would copy this process without its threads, RocksDB's
  background threads among them (a flush in the child would wait for a thread that
  does not exist), and multiprocessing's spawn and forkserver run this process's
  ``__main__`` again in every worker (a user's unguarded script would run twice).
- **The pipe carries JSON between this process and its own workers only** (no pickle:
  nothing a worker reads can run code): the function by module and name, a
  module-level function of this process's code, and its arguments (task specs the
  driver built, as JSON; never anything read from storage), then the result or the
  error (its type's name and one-line text: a `statebackend.errors` type is raised
  again as itself, any other as RuntimeError). Credentials travel inside the specs as
  storage options, never through the environment or the command line. A worker's
  stdout goes to its stderr: prints cannot corrupt the pipe.
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import queue
import struct
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import IO, Any

from statebackend import errors

_HEADER = struct.Struct("<Q")  # the length of the JSON that follows
IDLE_SECONDS = 300.0  # a worker process waiting this long for work exits (module doc)


class WorkerDiedError(RuntimeError):
    """A worker process exited while it ran a piece of work."""


class WorkerPool:
    """Worker processes taking work from one queue (module doc)."""

    def __init__(self, workers: int, idle_seconds: float = IDLE_SECONDS) -> None:
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        # one thread per worker process, feeding it: both end together
        self._threads: list[threading.Thread] = []
        self._idle = 0
        self._closed = False
        self.max_workers = max(1, workers)
        self.idle_seconds = idle_seconds

    def submit(self, fn: Callable[..., Any], /, *args: Any) -> Future:
        """Run ``fn(*args)`` in a worker process; its result or error arrives in the Future.
        ``fn`` must be a module-level function, its arguments and result JSON values."""
        future: Future = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("the worker pool is closed")
            self._work.put((future, fn, args))
            if self._idle:
                self._idle -= 1
            elif len(self._threads) < self.max_workers:
                self._add_thread(None)
        return future

    def _add_thread(self, worker: _Worker | None) -> None:
        thread = threading.Thread(target=self._serve, args=(worker,), daemon=True,
                                  name="ckpt-worker-process")
        self._threads.append(thread)
        thread.start()

    def start(self, preload: tuple[str, ...] = ()) -> None:
        """Start every worker now, each importing ``preload`` (the work's modules), so
        that the first use pays no start: for a long-lived process that will use the
        pool (a notebook, a bench)."""
        with self._lock:
            while len(self._threads) < self.max_workers:
                self._add_thread(_Worker(preload))
                self._idle += 1

    def started(self) -> bool:
        """Whether a worker runs already (a use then pays no start, or less)."""
        with self._lock:
            return bool(self._threads)

    def close(self) -> None:
        """Stop taking work; each worker process exits once its pipe closes."""
        with self._lock:
            self._closed = True
            for _ in self._threads:
                self._work.put(None)

    def _serve(self, worker: _Worker | None) -> None:
        """One worker process and the thread that feeds it, one piece at a time, until
        the pool closes or no work came for ``idle_seconds``."""
        while True:
            try:
                item = self._work.get(timeout=self.idle_seconds)
            except queue.Empty:
                if self._left_idle():
                    break
                continue
            if item is None:
                break
            future, fn, args = item
            if future.set_running_or_notify_cancel():
                if worker is None or not worker.alive():
                    worker = _Worker((fn.__module__,))
                try:
                    future.set_result(worker.run(fn, args))
                except BaseException as exc:  # noqa: BLE001 - handed to the Future's owner
                    future.set_exception(exc)
            with self._lock:
                self._idle += 1
        if worker is not None:
            worker.stop()

    def _left_idle(self) -> bool:
        """Whether this idle thread leaves (with its worker process): only while no work
        waits, under the lock `submit` queues work with, so no work is left unserved."""
        with self._lock:
            if not self._work.empty():
                return False
            self._idle -= 1
            self._threads.remove(threading.current_thread())
            return True


class _Worker:
    """One worker process: this Python running `_serve_parent` on two pipes."""

    def __init__(self, preload: tuple[str, ...]) -> None:
        package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        self.process = subprocess.Popen(
            [sys.executable, "-c", f"import sys; sys.path.insert(0, {package_root!r}); "
                                   f"from {__name__} import _serve_parent; _serve_parent()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        # This process's import path first (a bench or a test may have extended it): the
        # worker imports the work's modules from the same places.
        assert self.process.stdin is not None
        _send(self.process.stdin, {"path": list(sys.path), "preload": list(preload)})

    def alive(self) -> bool:
        return self.process.poll() is None

    def run(self, fn: Callable[..., Any], args: tuple) -> Any:
        assert self.process.stdin is not None and self.process.stdout is not None
        try:
            _send(self.process.stdin, {"module": fn.__module__, "name": fn.__qualname__,
                                       "args": list(args)})
            answer = _receive(self.process.stdout)
        except (EOFError, OSError) as exc:
            code = self.process.wait()
            raise WorkerDiedError(f"worker process {self.process.pid} exited with code {code} "
                                  f"while it ran {fn.__qualname__}") from exc
        if "error" not in answer:
            return answer["result"]
        raise _rebuilt(answer["error"])

    def stop(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        self.process.wait()


def _send(stream: IO[bytes], obj: object) -> None:
    _send_bytes(stream, json.dumps(obj).encode())


def _send_bytes(stream: IO[bytes], data: bytes) -> None:
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def _receive(stream: IO[bytes]) -> Any:
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        raise EOFError("the pipe closed")
    (size,) = _HEADER.unpack(header)
    data = stream.read(size)
    if len(data) < size:
        raise EOFError("the pipe closed")
    return json.loads(data)


_pool_lock = threading.Lock()
_pool: WorkerPool | None = None


def worker_pool() -> WorkerPool:
    """This process's pool, one worker process per core (module doc)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = WorkerPool(os.cpu_count() or 1)
            atexit.register(_pool.close)
        return _pool


def _serve_parent() -> None:
    """A worker's loop: run what arrives on stdin, answer on the original stdout."""
    answers = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # prints of the work go to stderr, never into the pipe
    requests = sys.stdin.buffer
    try:
        first = _receive(requests)
        sys.path[:] = first["path"]
        for module in first["preload"]:
            importlib.import_module(module)
        while True:
            work = _receive(requests)
            try:
                fn = getattr(importlib.import_module(work["module"]), work["name"])
                answer = json.dumps({"result": fn(*work["args"])}).encode()
            except BaseException as exc:  # noqa: BLE001 - sent back to the caller
                answer = json.dumps({"error": {"type": type(exc).__name__,
                                               "message": " ".join(str(exc).split())}}).encode()
            _send_bytes(answers, answer)
    except EOFError:
        return


def _rebuilt(error: dict[str, str]) -> Exception:
    """A worker's error here: a `statebackend.errors` type as itself, else RuntimeError."""
    kind = getattr(errors, error["type"], None)
    if isinstance(kind, type) and issubclass(kind, errors.CkptError):
        return kind(error["message"])
    return RuntimeError(f"{error['type']}: {error['message']}" if error["message"]
                        else error["type"])
