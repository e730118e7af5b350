"""``memory://`` storage: fsspec's in-process filesystem, with a maximum size.

For tests and demos: only this process sees it. ``?max_bytes=N`` (N >= 1,
default 512 MiB) bounds it; a write that would exceed it raises
StorageFullError naming the limit. fsspec's memory filesystem hands every
``"rb"`` opener the same file object, so concurrent streamed reads would corrupt
each other: reads here take the bytes whole.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import fsspec

from statebackend.errors import StorageFullError, UsageError
from statebackend.storage.base import Storage
from statebackend.storage.checksums import CHECKSUM_ALGORITHM, checksum_of_bytes

DEFAULT_MEMORY_MAX_BYTES = 512 * 1024 * 1024


@dataclass
class _Quota:
    """Maximum size of a memory:// root; usage is measured at each write."""

    url: str
    root: str
    max_bytes: int
    lock: threading.RLock  # re-entered by write_exclusive's existence check

    def used(self, fs: fsspec.AbstractFileSystem) -> int:
        try:
            found = fs.find(self.root, detail=True)
        except FileNotFoundError:
            return 0
        return sum(int(v.get("size") or 0) for v in found.values() if v.get("type") != "directory")


class MemoryStorage(Storage):
    scheme = "memory"
    process_local = True

    def __init__(self, url: str, fs: fsspec.AbstractFileSystem, root: str,
                 quota: _Quota) -> None:
        super().__init__(url, fs, root)
        self._quota = quota

    def write_exclusive(self, rel: str, data: bytes) -> None:
        path = self.abspath(rel)
        with self._reserved(len(data)), self._errors(rel), self._quota.lock:
            if self.fs.exists(path):
                raise FileExistsError(path)
            self.fs.pipe_file(path, data)

    def get_file(self, rel: str, local_path: str,
                 algorithm: str = CHECKSUM_ALGORITHM) -> tuple[int, str]:
        data = self.read_bytes(rel)
        with open(local_path, "wb") as fh:
            fh.write(data)
        return len(data), checksum_of_bytes(data, algorithm)

    def checksum(self, rel: str, algorithm: str = CHECKSUM_ALGORITHM) -> tuple[int, str]:
        data = self.read_bytes(rel)
        return len(data), checksum_of_bytes(data, algorithm)

    def remove_empty_dirs(self, rels: Iterable[str]) -> None:
        for rel in sorted(set(rels), key=lambda d: d.count("/"), reverse=True):
            try:
                self.fs.rmdir(self.abspath(rel))  # refuses a non-empty folder: race-safe
            except Exception:  # noqa: BLE001 - pruning is cosmetic
                pass

    @contextmanager
    def _reserved(self, nbytes: int) -> Iterator[None]:
        """Check the quota and hold it while writing, so concurrent writers
        (parallel uploads) cannot together exceed the maximum size."""
        quota = self._quota
        with quota.lock:
            used = quota.used(self.fs)
            if used + nbytes > quota.max_bytes:
                raise StorageFullError(
                    f"storage {quota.url} is full: writing {nbytes} bytes would exceed its "
                    f"maximum size of {quota.max_bytes} bytes ({used} in use; "
                    "raise it with ?max_bytes=N)"
                )
            yield


def open_memory(url: str, netloc: str, path: str, query: dict[str, list[str]]) -> MemoryStorage:
    max_bytes = _memory_max_bytes(url, query)
    root = "/" + (netloc + path).strip("/")
    return MemoryStorage(url, fsspec.filesystem("memory"), root,
                         _Quota(url, root, max_bytes, threading.RLock()))


def _memory_max_bytes(url: str, query: dict[str, list[str]]) -> int:
    """``?max_bytes=N``: a positive integer in plain digits (no sign, no ``1e6``, no
    ``1_000``); a limit of 0 or less would refuse every write, or none."""
    values = query.get("max_bytes")
    if values is None:
        return DEFAULT_MEMORY_MAX_BYTES
    text = values[-1].strip()
    if len(values) != 1 or not text.isascii() or not text.isdigit() or int(text) < 1:
        raise UsageError(f"memory storage {url}: max_bytes must be an integer >= 1 "
                         f"(bytes), got {', '.join(map(repr, values))}")
    return int(text)



