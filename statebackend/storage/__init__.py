"""Checkpoint storage over fsspec: ``file://`` (default), ``memory://``, ``s3://``.

A `Storage` is a root URL plus a handful of primitives over paths *relative to
that root*; everything else in the library is built from them. Relative paths
are checked by `safe_relpath`: absolute paths and ``..`` are refused, so nothing
read from metadata can reach outside the root.

Contracts:
- `write_exclusive` is atomic and refuses to overwrite: temp file + hard link on
  a local FS, a conditional single PUT (If-None-Match) on S3, a locked check on
  memory. `_metadata` and leases are written with it.
- `put_file` / `get_file` stream in chunks and return (size, checksum) computed
  on the bytes that went through, so a checksum costs no second read.
- `memory://` has a maximum size (``?max_bytes=N``, N >= 1, default 512 MiB); a
  write that would exceed it raises StorageFullError naming the limit.
- Storage options (`open_storage(url, **options)`) are fsspec's: for s3, ``key``,
  ``secret``, ``token``, ``profile``, ``client_kwargs={"endpoint_url": ...,
  "region_name": ...}``, ``config_kwargs``... They travel with the `Storage`
  (`child_storage` keeps them) and to Spark executors inside task parameters.
  Without options, s3 reads the standard ``AWS_*`` variables of this process
  (s3fs's own behaviour; the endpoint from ``AWS_ENDPOINT_URL_S3`` /
  ``AWS_ENDPOINT_URL``), captured once as explicit options so executors elsewhere
  get the same. The library never writes credentials into the environment.
  local and memory roots take no options and ignore them, so one set serves a run
  whose checkpoints live on S3 and whose output is local.
- Nothing secret is logged: `StorageOptions`' repr shows secret names, not values.
"""

from __future__ import annotations

import mmap
import os
import posixpath
import threading
import uuid
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, urlsplit

import crc32c as _crc32c
import fsspec

from statebackend.errors import (
    MetadataError,
    StorageError,
    StorageFullError,
    UnsafePathError,
    UsageError,
)

CHUNK = 4 * 1024 * 1024
DEFAULT_MEMORY_MAX_BYTES = 512 * 1024 * 1024


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


def crc32_hex(value: int) -> str:
    return f"crc32:{value & 0xFFFFFFFF:08x}"


# Checksums are "<algorithm>:<8 hex digits>". New files get CRC32C (hardware
# accelerated, about 5x zlib's CRC32 here, and S3's own checksum family);
# references recorded with "crc32:" are still verified with CRC32.
CHECKSUM_ALGORITHM = "crc32c"
_CRC_FUNCTIONS: dict[str, Callable[..., int]] = {"crc32": zlib.crc32, "crc32c": _crc32c.crc32c}


def checksum_algorithm(checksum: str) -> str:
    """The algorithm named by a recorded checksum; MetadataError if unknown."""
    algorithm = checksum.split(":", 1)[0] if isinstance(checksum, str) else None
    if algorithm not in _CRC_FUNCTIONS:
        raise MetadataError(f"checksum {checksum!r} uses an unknown algorithm; "
                            f"known: {sorted(_CRC_FUNCTIONS)}")
    return algorithm


def format_checksum(algorithm: str, value: int) -> str:
    return f"{algorithm}:{value & 0xFFFFFFFF:08x}"


def checksum_of_bytes(data: bytes, algorithm: str = CHECKSUM_ALGORITHM) -> str:
    return format_checksum(algorithm, _CRC_FUNCTIONS[algorithm](data))


# Option names whose values are secrets (fsspec/s3fs and botocore spellings).
SECRET_OPTIONS = frozenset({"key", "secret", "token", "password", "aws_access_key_id",
                            "aws_secret_access_key", "aws_session_token", "session_token"})


class StorageOptions(Mapping[str, Any]):
    """Read-only fsspec options of a storage root whose repr never shows a secret.

    Pickled with task parameters to Spark executors (in the closure, not in row
    data or logs); ``repr`` and ``str`` show ``'***'`` for every secret value, so a
    logged task, config or storage names the options but leaks nothing.
    """

    __slots__ = ("_data",)

    def __init__(self, data: Mapping[str, Any] | None = None) -> None:
        self._data = dict(data or {})

    def __getitem__(self, name: str) -> Any:
        return self._data[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mapping) and dict(self._data) == dict(other)

    def __hash__(self) -> int:  # an immutable value (dataclass fields may hash it)
        return hash(tuple(sorted(self._data)))

    def __reduce__(self):
        return (StorageOptions, (self._data,))

    def __repr__(self) -> str:
        return f"StorageOptions({_redacted(self._data)!r})"

    __str__ = __repr__

    def to_dict(self) -> dict[str, Any]:
        """A plain (deep) copy for fsspec."""
        return {k: dict(v) if isinstance(v, Mapping) else v for k, v in self._data.items()}


def _redacted(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: "***" if k in SECRET_OPTIONS and v else _redacted(v)
                for k, v in value.items()}
    return value


@dataclass(frozen=True)
class FileInfo:
    """One listing entry: path relative to the storage root, size, mtime (epoch s)."""

    path: str
    size: int
    mtime: float | None


class Storage:
    """Primitives over an fsspec filesystem rooted at ``url``."""

    def __init__(self, url: str, fs: fsspec.AbstractFileSystem, root: str,
                 quota: _Quota | None = None,
                 options: Mapping[str, Any] | None = None) -> None:
        self.url = url
        self.fs = fs
        # The options this root was opened with (for executors: `open_storage(url, **options)`).
        self.options = options if isinstance(options, StorageOptions) else \
            StorageOptions(options)
        self.root = root.rstrip("/")
        self.protocol = _protocol_of(url)
        self._quota = quota
        self._lock = quota.lock if quota else threading.Lock()

    def __repr__(self) -> str:
        return f"Storage({self.url!r})"

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

    # -- primitives -------------------------------------------------------
    def exists(self, rel: str) -> bool:
        with self._errors(rel):
            return self.fs.exists(self.abspath(rel))

    def read_bytes(self, rel: str) -> bytes:
        with self._errors(rel):
            return self.fs.cat_file(self.abspath(rel))

    def read_bytes_if_exists(self, rel: str) -> bytes | None:
        """The file's bytes, or None if it does not exist (other failures raise)."""
        try:
            return self.read_bytes(rel)
        except StorageError as exc:
            if isinstance(exc.__cause__, FileNotFoundError):
                return None
            raise

    def write_bytes(self, rel: str, data: bytes) -> None:
        with self._reserved(len(data)), self._errors(rel):
            path = self.abspath(rel)
            if self.protocol == "file":
                self.fs.makedirs(posixpath.dirname(path), exist_ok=True)
            self.fs.pipe_file(path, data)

    def write_exclusive(self, rel: str, data: bytes) -> None:
        """Atomically create ``rel``; FileExistsError if it already exists."""
        path = self.abspath(rel)
        with self._reserved(len(data)), self._errors(rel):
            if self.protocol == "file":
                directory = posixpath.dirname(path)
                os.makedirs(directory, exist_ok=True)
                tmp = posixpath.join(
                    directory, f".{posixpath.basename(path)}.{uuid.uuid4().hex}.tmp")
                with open(tmp, "wb") as fh:
                    fh.write(data)
                    fh.flush()
                    os.fsync(fh.fileno())
                try:
                    os.link(tmp, path)  # atomic, and fails if the target exists
                finally:
                    os.unlink(tmp)
            elif self.protocol == "memory":
                with self._lock:
                    if self.fs.exists(path):
                        raise FileExistsError(path)
                    self.fs.pipe_file(path, data)
            else:
                self.fs.pipe_file(path, data, mode="create")

    def put_file(self, local_path: str, rel: str) -> tuple[int, str]:
        """Upload a local file; return (size, checksum) of the bytes sent."""
        algorithm = CHECKSUM_ALGORITHM
        crc_of = _CRC_FUNCTIONS[algorithm]
        crc = 0
        size = 0
        with self._reserved(os.path.getsize(local_path)), self._errors(rel):
            path = self.abspath(rel)
            if self.protocol == "file":
                self.fs.makedirs(posixpath.dirname(path), exist_ok=True)
                size, crc = _copy_local_file(local_path, path, algorithm)
                return size, format_checksum(algorithm, crc)
            with open(local_path, "rb") as src, self.fs.open(path, "wb") as dst:
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
            if self.protocol == "file":
                size, crc = _copy_local_file(self.abspath(rel), local_path, algorithm)
                return size, format_checksum(algorithm, crc)
            if self.protocol == "memory":
                # fsspec's memory FS hands every "rb" opener the same file object, so
                # concurrent streamed reads corrupt each other; take the bytes whole.
                data = self.fs.cat_file(self.abspath(rel))
                with open(local_path, "wb") as fh:
                    fh.write(data)
                return len(data), checksum_of_bytes(data, algorithm)
            # The backend's own streaming download (one GET, no buffered-file cache),
            # then the checksum over the bytes that landed, read back from the page
            # cache: faster than a buffered read loop (bench/bench_state_backend.py).
            self.fs.get_file(self.abspath(rel), local_path)
        size, crc = _crc_local_file(local_path, algorithm)
        return size, format_checksum(algorithm, crc)

    def copy(self, src_rel: str, dst_rel: str) -> None:
        with self._errors(src_rel):
            src = self.abspath(src_rel)
            with self._reserved(self.fs.size(src)):
                dst = self.abspath(dst_rel)
                if self.protocol == "file":
                    self.fs.makedirs(posixpath.dirname(dst), exist_ok=True)
                self.fs.copy(src, dst)

    def checksum(self, rel: str, algorithm: str = CHECKSUM_ALGORITHM) -> tuple[int, str]:
        """(size, checksum) of a stored file, streamed."""
        if self.protocol == "memory":  # shared file objects: see get_file
            data = self.read_bytes(rel)
            return len(data), checksum_of_bytes(data, algorithm)
        crc_of = _CRC_FUNCTIONS[algorithm]
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
        return FileInfo(rel, int(entry.get("size") or 0), _mtime_of(entry))

    def list_dir(self, rel: str = "") -> list[str]:
        """Names directly under ``rel`` (files and folders); empty if absent."""
        path = self.abspath(rel)
        with self._errors(rel or "/"):
            try:
                entries = self.fs.ls(path, detail=False)
            except FileNotFoundError:
                return []
        return sorted({posixpath.basename(e.rstrip("/")) for e in entries} - {""})

    def walk_files(self, rel: str) -> list[FileInfo]:
        """Every file under ``rel`` with size and mtime; empty if absent."""
        path = self.abspath(rel)
        with self._errors(rel):
            try:
                found = self.fs.find(path, detail=True)
            except FileNotFoundError:
                return []
        out = []
        for name, entry in found.items():
            if entry.get("type") == "directory":
                continue
            out.append(FileInfo(self.relpath(name), int(entry.get("size") or 0), _mtime_of(entry)))
        return sorted(out, key=lambda f: f.path)

    def glob(self, pattern: str) -> list[str]:
        """Relative paths matching a glob pattern under the root."""
        with self._errors(pattern):
            return sorted(self.relpath(p) for p in self.fs.glob(f"{self.root}/{pattern}"))

    def delete_many(self, rels: Iterable[str]) -> list[tuple[str, str]]:
        """Best-effort delete; S3 deletes go out in batches. Returns failures."""
        paths = [self.abspath(r) for r in rels]
        failures: list[tuple[str, str]] = []
        if not paths:
            return failures
        if self.protocol in ("s3", "s3a"):
            for i in range(0, len(paths), 1000):
                batch = paths[i : i + 1000]
                try:
                    self.fs.rm(batch)
                except FileNotFoundError:
                    pass
                except Exception as exc:  # noqa: BLE001 - best effort, reported
                    failures.extend((self.relpath(p), str(exc)) for p in batch)
            return failures
        for p in paths:
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

    def check_reachable(self) -> None:
        """Raise StorageError if the root cannot be listed (bad bucket, no server)."""
        with self._errors("/"):
            try:
                self.fs.ls(self.root, detail=False)
            except FileNotFoundError:
                if self.protocol in ("s3", "s3a"):
                    bucket = self.root.split("/", 1)[0]
                    if not self.fs.exists(bucket):
                        raise
                # a missing root folder on a local or memory FS is fine: it is created on write

    # -- internals --------------------------------------------------------
    def _reserve(self, nbytes: int) -> None:
        with self._reserved(nbytes):
            pass

    @contextmanager
    def _reserved(self, nbytes: int) -> Iterator[None]:
        """Check the quota and hold it while writing, so concurrent writers
        (parallel uploads) cannot together exceed the maximum size."""
        quota = self._quota
        if quota is None:
            yield
            return
        with quota.lock:
            used = quota.used(self.fs)
            if used + nbytes > quota.max_bytes:
                raise StorageFullError(
                    f"storage {quota.url} is full: writing {nbytes} bytes would exceed its "
                    f"maximum size of {quota.max_bytes} bytes ({used} in use; "
                    "raise it with ?max_bytes=N)"
                )
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


def _copy_local_file(src: str, dst: str, algorithm: str = CHECKSUM_ALGORITHM
                     ) -> tuple[int, int]:
    """Copy one local file; return (size, checksum value) of the bytes copied.

    The kernel copies (sendfile) while a second thread checksums the same bytes
    through a memory map of the page cache; both release the GIL, so the
    checksum costs little wall time on top of a plain copy.
    """
    crc_of = _CRC_FUNCTIONS[algorithm]
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        size = os.fstat(fin.fileno()).st_size
        if size == 0:
            return 0, 0
        with mmap.mmap(fin.fileno(), 0, access=mmap.ACCESS_READ) as view:
            result: list[int] = []
            checksummer = threading.Thread(target=lambda: result.append(crc_of(view)))
            checksummer.start()
            try:
                offset = 0
                while offset < size:
                    sent = os.sendfile(fout.fileno(), fin.fileno(), offset, size - offset)
                    if sent == 0:
                        raise OSError(f"{src} shrank while it was copied")
                    offset += sent
            finally:
                checksummer.join()
        return size, result[0]


def _crc_local_file(path: str, algorithm: str = CHECKSUM_ALGORITHM) -> tuple[int, int]:
    """(size, checksum value) of a local file, read through a memory map."""
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size == 0:
            return 0, 0
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as view:
            return size, _CRC_FUNCTIONS[algorithm](view)


def _protocol_of(url: str) -> str:
    scheme = urlsplit(url).scheme
    return scheme or "file"


def _mtime_of(entry: dict) -> float | None:
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


# Standard AWS variables read (never written) when an s3 root gets no options.
_ENV_OPTIONS = (("key", "AWS_ACCESS_KEY_ID"), ("secret", "AWS_SECRET_ACCESS_KEY"),
                ("token", "AWS_SESSION_TOKEN"))


def environment_s3_options(environ: Mapping[str, str] | None = None) -> dict:
    """The s3 options s3fs would take from this process's ``AWS_*`` variables, explicit.

    Captured on the driver so that executors on other hosts reach the same storage;
    without an access key nothing is captured and botocore's own chain (profile,
    instance role) applies wherever the storage is opened.
    """
    env = os.environ if environ is None else environ
    options: dict = {}
    if env.get("AWS_ACCESS_KEY_ID") and env.get("AWS_SECRET_ACCESS_KEY"):
        options = {name: env[var] for name, var in _ENV_OPTIONS if env.get(var)}
    endpoint = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
    if endpoint:
        options["client_kwargs"] = {"endpoint_url": endpoint}
    return options


def s3_storage_options(options: Mapping[str, Any] | None = None) -> dict:
    """fsspec s3 options: the library's settings, then ``options`` (or the environment's)."""
    given = dict(options) if options else environment_s3_options()
    merged: dict = {
        # Listings must be fresh: other processes (executors, other runs, the CLI)
        # commit checkpoints and upload files; a cached listing hides them.
        "use_listings_cache": False,
        "config_kwargs": {"connect_timeout": 5, "read_timeout": 60,
                          "retries": {"max_attempts": 3, "mode": "standard"}},
    }
    for name, value in given.items():
        if name in ("client_kwargs", "config_kwargs") and isinstance(value, Mapping):
            merged[name] = {**merged.get(name, {}), **value}
        else:
            merged[name] = value
    return merged


def open_storage(url: str, **options: Any) -> Storage:
    """Open a storage root. ``url`` is a path, file://, memory:// or s3:// URL.

    ``options`` are fsspec's for the scheme (s3: ``key``, ``secret``, ``token``,
    ``profile``, ``client_kwargs={"endpoint_url": ...}``, ...); without them s3
    reads the standard ``AWS_*`` variables. Local and memory roots ignore them.
    """
    if not url:
        raise UsageError("storage URL is empty")
    parts = urlsplit(url)
    protocol = parts.scheme or "file"
    if protocol == "file" or (len(protocol) == 1 and url[1:3] in (":\\", ":/")):
        path = parts.path if parts.scheme else url
        root = os.path.abspath(os.path.expanduser(path))
        return Storage(f"file://{root}", fsspec.filesystem("file"), root)
    if protocol == "memory":
        max_bytes = _memory_max_bytes(url, parse_qs(parts.query, keep_blank_values=True))
        root = "/" + (parts.netloc + parts.path).strip("/")
        quota = _Quota(url, root, max_bytes, threading.RLock())
        return Storage(url, fsspec.filesystem("memory"), root, quota)
    if protocol in ("s3", "s3a"):
        if not parts.netloc:
            raise UsageError(f"S3 storage URL {url!r} names no bucket")
        given = options or environment_s3_options()
        try:
            fs = fsspec.filesystem("s3", **s3_storage_options(given))
        except ImportError as exc:
            raise UsageError("s3:// storage needs the s3 extra: "
                             "pip install 'ckpt-lifecycle[s3]'") from exc
        except TypeError as exc:  # an option s3fs does not know
            raise UsageError(f"storage {url}: unknown storage option(s) {sorted(given)} "
                             f"({exc}); see s3fs.S3FileSystem for the names") from exc
        return Storage(url, fs, (parts.netloc + parts.path).rstrip("/"), options=given)
    raise UsageError(f"storage URL {url!r} has unsupported scheme {protocol!r}; "
                     "use file://, memory:// or s3://")


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


def child_storage(storage: Storage, name: str) -> Storage:
    """The storage rooted at ``<root>/<name>`` (a job root); ``name`` must be one segment."""
    clean = safe_relpath(name, "job name")
    if "/" in clean:
        raise UsageError(f"job name {name!r} must not contain '/'")
    return Storage(f"{storage.url.rstrip('/')}/{clean}", storage.fs, f"{storage.root}/{clean}",
                   storage._quota, storage.options)
