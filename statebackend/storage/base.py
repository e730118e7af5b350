"""The `Storage` base: a root URL plus a handful of primitives over relative paths.

Everything else in the library is built from these primitives; each scheme
(local.py, memory.py, s3.py) subclasses `Storage` and overrides only what its
filesystem does differently. The base implements each primitive over fsspec the
way an object store needs it; nothing here asks which scheme it runs on.

Contracts (every scheme; tests/statebackend/storage/test_storage.py checks them
on file://, memory:// and s3://):
- paths are relative to the root and checked by `safe_relpath`: absolute paths
  and ``..`` are refused, so nothing read from metadata can reach outside it;
- nothing follows a symbolic link below the root (only file:// has them, local.py
  refuses a path through one with UnsafePathError, `delete_many` reports it as a
  failure, listings leave symlinks out; tests: test_containment.py);
- `write_exclusive` is atomic and refuses to overwrite (FileExistsError);
  `write_atomic` replaces a file so that readers see the old or the new bytes;
- `put_file` / `get_file` stream in chunks and return (size, checksum) computed
  on the bytes that went through, so a checksum costs no second read;
- every backend failure becomes one StorageError line naming the URL and path.

What callers may ask about the scheme, instead of its name: `is_local` and
`local_path` (files are paths on this host), `remote` (each request is a network
round trip: overlap requests with threads), `process_local` (only this process
sees the files: Spark tasks elsewhere cannot).
"""

from __future__ import annotations

import copy
import os
import posixpath
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import IO, Any, TypeVar, cast, overload

import fsspec

from statebackend.errors import StorageError, UnsafePathError, UsageError
from statebackend.storage.checksums import (
    CHECKSUM_ALGORITHM,
    CRC_FUNCTIONS,
    crc_local_file,
    format_checksum,
)
from statebackend.storage.options import StorageOptions

CHUNK = 4 * 1024 * 1024
_T = TypeVar("_T")
_R = TypeVar("_R")


def safe_relpath(path: str, what: str = "path") -> str:
    """Normalise a relative '/'-path; refuse absolute paths and '..' segments."""
    if not isinstance(path, str) or not path:
        raise UnsafePathError(f"{what} {path!r} is empty or not a string")
    if path.startswith(("/", "\\")) or "://" in path or (len(path) > 1 and path[1] == ":"):
        raise UnsafePathError(
            f"{what} {path!r} is absolute; paths must be relative to the job root")
    parts = path.replace("\\", "/").split("/")
    if any(p == ".." for p in parts):
        raise UnsafePathError(f"{what} {path!r} escapes the job root ('..' is not allowed)")
    clean = [p for p in parts if p not in ("", ".")]
    if not clean:
        raise UnsafePathError(f"{what} {path!r} names no file")
    return "/".join(clean)


@dataclass(frozen=True)
class FileInfo:
    """One listing entry: path relative to the storage root, size, mtime (epoch s)."""

    path: str
    size: int
    mtime: float | None


class Listing(Mapping[str, FileInfo]):
    """The files under a folder by relative path, iterated in path order (``paths``).

    An object store lists sizes and mtimes with the names; on file:// each one is a
    stat more. So a listing may hold only the paths and read an entry's size and
    mtime on first access (then keep it): who looks at few entries pays for few
    (issue 14: GC plans over 90,000 files stat a few hundred). A file deleted between
    the listing and that first access stays in ``paths`` and ``in`` the listing but
    has no entry: ``listing[path]`` raises KeyError, `get` returns None, `items`
    and `values` skip it. ``stat`` is called only with listed paths.
    """

    def __init__(self, paths: list[str], infos: dict[str, FileInfo] | None = None,
                 stat: Callable[[str], FileInfo | None] | None = None) -> None:
        self.paths = paths                      # sorted
        self._infos = {} if infos is None else infos
        self._stat = stat
        self._names: frozenset[str] | None = None
        self._gone: set[str] = set()

    @property
    def names(self) -> frozenset[str]:
        """The listed paths as a set (built on first use)."""
        names = self._names
        if names is None:
            names = self._names = frozenset(self.paths)
        return names

    def __contains__(self, path: object) -> bool:
        return path in self.names

    def __getitem__(self, path: str) -> FileInfo:
        info = self._infos.get(path)
        if info is not None:
            return info
        if self._stat is None or path in self._gone or path not in self:
            raise KeyError(path)
        info = self._stat(path)
        if info is None:  # deleted since the listing
            self._gone.add(path)
            raise KeyError(path)
        self._infos[path] = info
        return info

    @overload
    def get(self, path: str, /) -> FileInfo | None: ...
    @overload
    def get(self, path: str, default: FileInfo | _T, /) -> FileInfo | _T: ...

    def get(self, path: str, default: object = None) -> object:
        try:
            return self[path]
        except KeyError:
            return default

    def __iter__(self) -> Iterator[str]:
        return iter(self.paths)

    def __len__(self) -> int:
        return len(self.paths)

    # a generator, not Mapping's view: a lazy listing stats each entry as it is reached
    def items(self) -> Iterator[tuple[str, FileInfo]]:  # type: ignore[override]
        get = self.get
        return ((p, info) for p in self.paths if (info := get(p)) is not None)

    def values(self) -> Iterator[FileInfo]:  # type: ignore[override]
        return (info for _, info in self.items())


class Storage:
    """Primitives over an fsspec filesystem rooted at ``url`` (see the module docstring).

    ``fs`` is the underlying fsspec filesystem: for the storage package and tests
    only; the rest of the library goes through the primitives.
    """

    scheme = ""
    is_local = False        # files are paths on this host's filesystem (`local_path`)
    remote = False          # each request is a network round trip
    process_local = False   # only this process sees the files

    def __init__(self, url: str, fs: fsspec.AbstractFileSystem, root: str,
                 options: Mapping[str, Any] | None = None) -> None:
        self.url = url
        self.fs = fs
        # The options this root was opened with (for executors: `open_storage(url, **options)`).
        self.options = options if isinstance(options, StorageOptions) else \
            StorageOptions(options)
        self.root = root.rstrip("/")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    # -- paths -------------------------------------------------------------
    def abspath(self, rel: str) -> str:
        """Absolute fsspec path of ``rel`` ("" is the root itself)."""
        return f"{self.root}/{safe_relpath(rel)}" if rel else self.root

    def relpath(self, absolute: str) -> str:
        absolute = absolute.rstrip("/")
        root = self.root.lstrip("/") if not absolute.startswith("/") else self.root
        if not absolute.startswith(root):
            raise StorageError(f"listing entry {absolute!r} lies outside the root {self.url}")
        return absolute[len(root):].lstrip("/")

    def url_of(self, rel: str) -> str:
        """The URL of ``rel`` under this root ("" is the root URL), for messages and links."""
        return f"{self.url.rstrip('/')}/{safe_relpath(rel)}" if rel else self.url

    def local_path(self, rel: str) -> str | None:
        """The path of ``rel`` on this host's filesystem, or None (not a local storage)."""
        return None

    # -- primitives -------------------------------------------------------
    def exists(self, rel: str) -> bool:
        with self._errors(rel):
            return cast(bool, self.fs.exists(self.abspath(rel)))  # fsspec is untyped

    def read_bytes(self, rel: str) -> bytes:
        with self._errors(rel):
            return cast(bytes, self.fs.cat_file(self.abspath(rel)))  # fsspec is untyped

    def read_bytes_if_exists(self, rel: str) -> bytes | None:
        """The file's bytes, or None if it does not exist (other failures raise)."""
        try:
            return self.read_bytes(rel)
        except StorageError as exc:
            if isinstance(exc.__cause__, FileNotFoundError):
                return None
            raise

    def read_many(self, rels: Iterable[str], threads: int = 16) -> Iterator[bytes | None]:
        """`read_bytes_if_exists` of each of ``rels``, in order (`map_requests`)."""
        return self.map_requests(self.read_bytes_if_exists, rels, threads)

    def map_requests(self, fn: Callable[[_T], _R], items: Iterable[_T],
                     threads: int = 16) -> Iterator[_R]:
        """``fn`` of each of ``items`` (each a request to this storage), results in order.

        A remote store overlaps up to ``threads`` requests; a local one runs them in this
        thread: a stat or a small read costs microseconds there, less than starting a
        thread, which under a busy GIL (subtasks in threads) takes milliseconds.
        """
        items = list(items)
        workers = max(1, min(threads, len(items))) if self.remote else 1
        if workers == 1:
            yield from map(fn, items)
            return
        pool = ThreadPoolExecutor(max_workers=workers)
        finished = False
        try:
            yield from pool.map(fn, items)
            finished = True
        finally:
            # Only a finished map waits for its workers. One its caller left (stopped
            # early, or raised) is closed by the garbage collector in whatever thread it
            # runs in, fsspec's event-loop thread among them, which a request still
            # running needs: waiting there would hang the process for good.
            pool.shutdown(wait=finished, cancel_futures=not finished)

    def attempt_requests(self, fn: Callable[[_T], _R], items: Iterable[_T],
                         threads: int = 16) -> list[tuple[_R | None, Exception | None]]:
        """`map_requests` that makes every request, whatever fails: per item, in order,
        (``fn``'s result, None) or (None, the exception it raised), for callers that
        report every failure and clean up after all of them."""
        def attempt(item: _T) -> tuple[_R | None, Exception | None]:
            try:
                return fn(item), None
            except Exception as exc:  # noqa: BLE001 - handed to the caller
                return None, exc

        return list(self.map_requests(attempt, items, threads))

    def write_bytes(self, rel: str, data: bytes) -> None:
        with self._reserved(len(data)), self._errors(rel):
            path = self.abspath(rel)
            self._make_parent(path)
            self.fs.pipe_file(path, data)

    def write_exclusive(self, rel: str, data: bytes) -> None:
        """Atomically create ``rel``; FileExistsError if it already exists."""
        raise NotImplementedError

    def write_atomic(self, rel: str, data: bytes) -> None:
        """Replace ``rel`` so that a reader sees the old bytes or the new ones, never
        half of them (a single PUT is atomic; local.py overrides)."""
        self.write_bytes(rel, data)

    @contextmanager
    def open_write(self, rel: str) -> Iterator[IO[bytes]]:
        """A binary file object writing ``rel`` (e.g. for a Parquet writer)."""
        path = self.abspath(rel)
        with self._errors(rel):
            self._make_parent(path)
            with self.fs.open(path, "wb") as fh:
                yield fh

    def put_file(self, local_path: str, rel: str) -> tuple[int, str]:
        """Upload a local file; return (size, checksum) of the bytes sent."""
        algorithm = CHECKSUM_ALGORITHM
        crc_of = CRC_FUNCTIONS[algorithm]
        crc = 0
        size = 0
        with self._reserved(os.path.getsize(local_path)), self._errors(rel):
            with open(local_path, "rb") as src, self.fs.open(self.abspath(rel), "wb") as dst:
                while chunk := src.read(CHUNK):
                    crc = crc_of(chunk, crc)
                    size += len(chunk)
                    dst.write(chunk)
        return size, format_checksum(algorithm, crc)

    def get_file(self, rel: str, local_path: str,
                 algorithm: str = CHECKSUM_ALGORITHM) -> tuple[int, str]:
        """Download to a local file; return (size, checksum) of the bytes received.

        Pass the algorithm of the recorded checksum (`checksum_algorithm`) to verify it.
        """
        with self._errors(rel):
            # The backend's own streaming download (one GET, no buffered-file cache),
            # then the checksum over the bytes that landed, read back from the page
            # cache: faster than a buffered read loop (bench/bench_state_backend.py).
            self.fs.get_file(self.abspath(rel), local_path)
        size, crc = crc_local_file(local_path, algorithm)
        return size, format_checksum(algorithm, crc)

    def copy(self, src_rel: str, dst_rel: str) -> None:
        with self._errors(src_rel):
            src = self.abspath(src_rel)
            with self._reserved(self.fs.size(src)):
                dst = self.abspath(dst_rel)
                self._make_parent(dst)
                self.fs.copy(src, dst)

    def copy_checked(self, src_rel: str, dst_rel: str,
                     algorithm: str = CHECKSUM_ALGORITHM) -> tuple[int, str]:
        """Copy a stored file; return (size, checksum) of the copy. Here: the copy
        (server-side where the backend has one), then one read of what landed; file://
        checksums the bytes while the kernel copies them (local.py)."""
        self.copy(src_rel, dst_rel)
        return self.checksum(dst_rel, algorithm)

    def checksum(self, rel: str, algorithm: str = CHECKSUM_ALGORITHM) -> tuple[int, str]:
        """(size, checksum) of a stored file, streamed."""
        crc_of = CRC_FUNCTIONS[algorithm]
        crc = 0
        size = 0
        with self._errors(rel), self.fs.open(self.abspath(rel), "rb") as src:
            while chunk := src.read(CHUNK):
                crc = crc_of(chunk, crc)
                size += len(chunk)
        return size, format_checksum(algorithm, crc)

    def info(self, rel: str) -> FileInfo | None:
        """Size and mtime of one file, or None if it does not exist."""
        try:
            with self._errors(rel):
                entry = self.fs.info(self.abspath(rel))
        except StorageError as exc:
            if isinstance(exc.__cause__, FileNotFoundError):
                return None
            raise
        return FileInfo(rel, int(entry.get("size") or 0), mtime_of(entry))

    def list_dir(self, rel: str = "") -> list[str]:
        """Names directly under ``rel`` (files and folders); empty if absent."""
        path = self.abspath(rel)
        with self._errors(rel or "/"):
            try:
                entries = self.fs.ls(path, detail=False)
            except FileNotFoundError:
                return []
        return sorted({posixpath.basename(e.rstrip("/")) for e in entries} - {""})

    def walk_files(self, rel: str = "") -> list[FileInfo]:
        """Every file under ``rel`` with size and mtime, in path order; empty if absent."""
        path = self.abspath(rel)
        with self._errors(rel or "/"):
            try:
                found = self.fs.find(path, detail=True)
            except FileNotFoundError:
                return []
        out = []
        for name, entry in found.items():
            if entry.get("type") == "directory":
                continue
            out.append(FileInfo(self.relpath(name), int(entry.get("size") or 0), mtime_of(entry)))
        return sorted(out, key=lambda f: f.path)

    def walk_listing(self, rel: str = "") -> Listing:
        """Every file under ``rel`` as a `Listing` (path order; empty if absent).

        Here (object stores) the listing carries every size and mtime; file://
        (local.py) lists names only and stats an entry when it is first looked at.
        """
        files = self.walk_files(rel)
        return Listing([f.path for f in files], {f.path: f for f in files})

    def glob(self, pattern: str) -> list[str]:
        """Relative paths matching a glob pattern under the root."""
        with self._errors(pattern):
            return sorted(self.relpath(p) for p in self.fs.glob(f"{self.root}/{pattern}"))

    def delete_many(self, rels: Iterable[str]) -> list[tuple[str, str]]:
        """Best-effort delete, one file at a time (s3.py batches). Returns failures."""
        failures: list[tuple[str, str]] = []
        for p in [self.abspath(r) for r in rels]:
            try:
                self.fs.rm_file(p)
            except FileNotFoundError:
                pass
            except Exception as exc:  # noqa: BLE001 - best effort, reported
                failures.append((self.relpath(p), str(exc)))
        return failures

    def delete_tree(self, rel: str) -> None:
        with self._errors(rel):
            try:
                self.fs.rm(self.abspath(rel), recursive=True)
            except FileNotFoundError:
                pass

    def remove_empty_dirs(self, rels: Iterable[str]) -> None:
        """Remove these folders where they are empty, deepest first (best effort,
        race-safe: a folder something was written to meanwhile stays). Object
        stores have no folders: nothing to do there."""

    def check_reachable(self) -> None:
        """Raise StorageError if the root cannot be listed (bad bucket, no server)."""
        with self._errors("/"):
            try:
                self.fs.ls(self.root, detail=False)
            except FileNotFoundError:
                pass  # a missing root folder is fine: it is created on write

    def invalidate_cache(self) -> None:
        """Forget cached listings (other processes wrote under this root)."""
        self.fs.invalidate_cache()

    # -- internals --------------------------------------------------------
    def _make_parent(self, path: str) -> None:
        """Create the folder of ``path`` where the filesystem needs one (local.py)."""

    @contextmanager
    def _reserved(self, nbytes: int) -> Iterator[None]:
        """Hold room for ``nbytes`` while writing (only memory.py has a maximum size)."""
        yield

    @contextmanager
    def _errors(self, rel: str) -> Iterator[None]:
        try:
            yield
        except (StorageError, UnsafePathError, FileExistsError):
            raise
        except FileNotFoundError as exc:
            raise StorageError(f"{self.url}: {rel} does not exist") from exc
        except PermissionError as exc:
            raise StorageError(f"{self.url}: permission denied for {rel}: {exc}") from exc
        except Exception as exc:  # noqa: BLE001 - every backend error becomes one line
            text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise StorageError(
                f"storage {self.url} is unreachable or failed on {rel}: {text}") from exc


def child_storage(storage: Storage, name: str) -> Storage:
    """The storage rooted at ``<root>/<name>`` (a job root); ``name`` must be one segment."""
    clean = safe_relpath(name, "job name")
    if "/" in clean:
        raise UsageError(f"job name {name!r} must not contain '/'")
    out = copy.copy(storage)  # the same class, filesystem, options (and memory quota)
    out.url = f"{storage.url.rstrip('/')}/{clean}"
    out.root = f"{storage.root}/{clean}"
    return out


def mtime_of(entry: Mapping[str, Any]) -> float | None:
    """The modification time of an fsspec listing entry, as epoch seconds."""
    for key in ("mtime", "LastModified", "created"):
        value = entry.get(key)
        if value is None:
            continue
        if hasattr(value, "timestamp"):
            return float(value.timestamp())
        try:
            return float(value)
        except (TypeError, ValueError):
            continue
    return None

