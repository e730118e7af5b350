"""``file://`` storage: a folder on this host's filesystem.

Differs from the object-store base in what a local filesystem needs and allows:
folders are created before writing; `write_exclusive` writes a temp file and
hard-links it (atomic, fails if the target exists); `write_atomic` is temp +
rename; a copy is a hard link of the open source when the filesystem allows one
(stored files are never changed once written, and a write through either name
replaces the file instead of changing the bytes both share: `_unshare`), else the
kernel's copy (sendfile) with the checksum computed beside it; listings use
``os.scandir`` (fsspec's local find costs a stat and path normalisation per entry:
seconds at 100,000 files), and `walk_listing`
lists names only, stating a file when its size or mtime is first asked for.

Containment (issue 20): nothing here reads, writes, copies, deletes, stats or
lists through a symbolic link below the storage root. The rule is that **no
symlink below the root is followed, wherever it points**, inside the root too:
lifecycle commands decide what they may delete from the layout's names, so a
path must be what its name says (a ``chk-1/0 -> ../savepoints/sp/0`` link would
let retention delete a savepoint's files). The root itself may be a symlink or
lie under one: it is resolved once, when the storage is opened
(``os.path.realpath``), and a job's storage (`child_storage`) is checked against
the root it was opened from, so a symlinked job folder is refused like any
other. To put a job on another disk, open a root there.

How: a primitive opens the folders of its path one by one from the resolved
root with ``O_DIRECTORY | O_NOFOLLOW`` (each distinct folder once per call: a
delete of 1,000 files in one folder opens that folder once) and works on the
last one through its descriptor (``openat``, ``unlinkat``, ``linkat``,
``renameat``). Files are opened with ``O_NOFOLLOW`` and ``O_NONBLOCK`` (a FIFO
cannot block a read), and anything but a regular file is refused. So a folder
swapped for a symlink while a call runs is not followed either.

- A path through a symlink, or naming one, raises UnsafePathError naming the
  URL, the path and the link; `exists` and `info` too (a symlink is never
  reported as a file, nor as a missing one).
- `delete_many` (best effort) reports a path under a symlinked folder as a
  failure with that message and deletes nothing behind the link. A path that
  *is* a symlink is unlinked itself: the link is an entry of the root, its
  target is not touched. `delete_tree` unlinks the symlinks it meets at any
  depth and never descends into one (fd-based ``shutil.rmtree``); on a path
  under a symlinked folder it raises. `remove_empty_dirs` skips symlinks.
- Listings (`list_dir`, `walk_files`, `walk_listing`, `glob`) leave symlinks
  out and never descend into a symlinked folder (nor list FIFOs, sockets or
  devices); listing a folder through a symlink raises. The size and mtime that
  `walk_listing` reads lazily are stated without following the file, in a
  folder checked once per listing with ``realpath`` against the root.
- `local_path` hands out a path only when no folder on it, and not the path
  itself, is a symlink (at the time of the call: the caller uses the path).
"""

from __future__ import annotations

import errno
import os
import posixpath
import re
import shutil
import stat
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from operator import attrgetter
from typing import IO, Any, Literal, TypeAlias, overload

import fsspec

from statebackend.errors import StorageError, UnsafePathError
from statebackend.storage.base import FileInfo, Listing, Storage, safe_relpath
from statebackend.storage.checksums import (
    CHECKSUM_ALGORITHM,
    copy_open_file,
    crc_open_file,
    format_checksum,
)

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | _CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | _CLOEXEC
_WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_NONBLOCK | _CLOEXEC
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _CLOEXEC
_MAGIC = re.compile(r"[*?\[]")

Parts: TypeAlias = tuple[str, ...]



@dataclass(slots=True)
class _Frame:
    """One folder of `LocalStorage._scan`'s depth-first walk."""

    prefix: str             # its path below the root, with a trailing "/" ("" at the top)
    fd: int                 # its descriptor
    owned: bool             # the walk opened it (and closes it)
    subfolders: list[str] | None = None  # still to visit (None: not listed yet)


class _Folders:
    """Descriptors of the folders one call uses: each opened once, from its parent,
    with O_NOFOLLOW (never through a symlink), all closed when the call ends.

    Parts are the path's segments below the root the storage was opened at. A folder
    found to be a symlink is remembered, so 1,000 paths under it cost one look, and a
    path is opened from its deepest folder already open.
    """

    def __init__(self, storage: LocalStorage) -> None:
        self.storage = storage
        self.fds: dict[Parts, int] = {}
        self.links: dict[Parts, tuple[Parts, str]] = {}

    def __enter__(self) -> _Folders:
        return self

    def __exit__(self, *exc: object) -> None:
        fds, self.fds = self.fds, {}
        for fd in fds.values():
            os.close(fd)

    def keep_only(self, parts: Parts) -> None:
        """Close every folder that is not above ``parts``."""
        for held in [p for p in self.fds if p != parts[:len(p)]]:
            os.close(self.fds.pop(held))

    def fd(self, parts: Parts, rel: str, create: bool = False) -> int:
        """The descriptor of folder ``parts``; FileNotFoundError when it is missing
        (unless ``create``), NotADirectoryError when it is a file, UnsafePathError
        (naming ``rel``) when it or a folder above it is a symlink."""
        fd = self.fds.get(parts)
        if fd is not None:
            return fd
        depth = len(parts)
        while depth and parts[:depth] not in self.fds:
            link = self.links.get(parts[:depth])
            if link is not None:
                raise self.storage.link_error(rel, *link)
            depth -= 1
        if depth == 0 and () not in self.fds:
            self.fds[()] = self.storage.open_root(create)
        for i in range(depth, len(parts)):
            here = parts[:i + 1]
            try:
                self.fds[here] = self._open_child(self.fds[parts[:i]], here, create)
            except _Link as found:
                self.links[here] = (found.parts, found.target)
                raise self.storage.link_error(rel, found.parts, found.target) from None
        return self.fds[parts]

    @staticmethod
    def _open_child(parent: int, parts: Parts, create: bool) -> int:
        name = parts[-1]
        try:
            return os.open(name, _DIR_FLAGS, dir_fd=parent)
        except FileNotFoundError:
            if not create:
                raise
            try:
                os.mkdir(name, dir_fd=parent)
            except FileExistsError:
                pass  # made meanwhile by another writer
        except OSError as exc:
            if exc.errno in (errno.ENOTDIR, errno.ELOOP):
                _raise_if_link(parent, parts)
            raise
        try:
            return os.open(name, _DIR_FLAGS, dir_fd=parent)
        except OSError as exc:
            if exc.errno in (errno.ENOTDIR, errno.ELOOP):
                _raise_if_link(parent, parts)
            raise


def _unshare(folder: int, name: str) -> None:
    """Unlink ``name`` (in the folder descriptor ``folder``) when it is a regular file
    that shares its bytes with another name (a hard link `LocalStorage.copy` made), so
    the write that follows creates a new file instead of changing the other name's
    bytes (a savepoint's copy of a checkpoint file, say)."""
    try:
        st = os.stat(name, dir_fd=folder, follow_symlinks=False)
    except (FileNotFoundError, NotADirectoryError):
        return
    if stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
        os.unlink(name, dir_fd=folder)


class _Link(Exception):  # noqa: N818 - internal signal, never leaves this module
    """A symlink found at ``parts`` (pointing to ``target``)."""

    def __init__(self, parts: Parts, target: str) -> None:
        super().__init__(parts, target)
        self.parts = parts
        self.target = target


def _raise_if_link(folder: int, parts: Parts) -> None:
    """Raise _Link when entry ``parts[-1]`` of ``folder`` is a symlink."""
    try:
        st = os.stat(parts[-1], dir_fd=folder, follow_symlinks=False)
    except OSError:
        return
    if stat.S_ISLNK(st.st_mode):
        try:
            target = os.readlink(parts[-1], dir_fd=folder)
        except OSError:
            target = "?"
        raise _Link(parts, target)


class LocalStorage(Storage):
    scheme = "file"
    is_local = True

    def __init__(self, url: str, fs: fsspec.AbstractFileSystem, root: str,
                 options: Any = None) -> None:
        super().__init__(url, fs, root, options)
        # What containment is checked against, kept by `child_storage`'s copies: the
        # root as opened (its path may hold symlinks) and that path resolved, once.
        self._top = self.root  # "" for "/", as `root`
        self._real_top = os.path.realpath(self.root or "/").rstrip("/")

    # -- containment ---------------------------------------------------------
    def _parts(self, rel: str) -> Parts:
        """Segments of ``rel`` ("" is this storage's root) below the opened root."""
        below = self.root[len(self._top) + 1:]
        clean = safe_relpath(rel) if rel else ""
        both = f"{below}/{clean}" if below and clean else below or clean
        return tuple(both.split("/")) if both else ()

    def open_root(self, create: bool) -> int:
        """A descriptor of the resolved root (made first when ``create``)."""
        try:
            return os.open(self._real_top or "/", _DIR_FLAGS)
        except FileNotFoundError:
            if not create:
                raise
            os.makedirs(self._real_top, exist_ok=True)
        except OSError as exc:
            if exc.errno in (errno.ENOTDIR, errno.ELOOP):
                raise UnsafePathError(
                    f"{self.url}: storage root {self._real_top or '/'} is no longer a folder (it "
                    "became a file or a symbolic link after the storage was opened)") from exc
            raise
        return os.open(self._real_top or "/", _DIR_FLAGS)

    def link_error(self, rel: str, link: Parts, target: str) -> UnsafePathError:
        """The refusal of ``rel`` because ``link`` (segments below the opened root) is a
        symlink: names the URL, the path and the link."""
        reason = (f"{self._top}/{'/'.join(link)} is a symbolic link (to {target}); file:// "
                  "storage never follows a symlink below its root (replace the link by the "
                  "files themselves)")
        error = UnsafePathError(f"{self.url}: refused {rel or '/'}: {reason}")
        error.reason = reason  # type: ignore[attr-defined]  # delete_many's failure text
        return error

    def _final(self, folders: _Folders, rel: str, create: bool = False) -> tuple[int, str]:
        """(descriptor of the folder holding ``rel``, its last segment). Folders of the
        call that are not above ``rel`` are closed: a call over many paths holds as many
        descriptors as one path is deep."""
        parts = self._parts(rel)
        if not parts:
            raise UnsafePathError(f"{self.url}: the path {rel!r} names the storage root, "
                                  "not a file")
        folders.keep_only(parts)
        return folders.fd(parts[:-1], rel, create), parts[-1]

    def _refuse_if_link(self, folder: int, name: str, rel: str) -> os.stat_result:
        """lstat of ``name``; UnsafePathError when it is a symlink."""
        st = os.stat(name, dir_fd=folder, follow_symlinks=False)
        if stat.S_ISLNK(st.st_mode):
            raise self._link_at(folder, name, rel)
        return st

    def _link_at(self, folder: int, name: str, rel: str) -> UnsafePathError:
        try:
            target = os.readlink(name, dir_fd=folder)
        except OSError:
            target = "?"
        return self.link_error(rel, self._parts(rel), target)

    def _open_file(self, rel: str, flags: int, create: bool = False) -> int:
        """A descriptor of regular file ``rel``, opened without following a symlink."""
        with _Folders(self) as folders:
            return self._open_in(folders, rel, flags, create)

    def _open_in(self, folders: _Folders, rel: str, flags: int, create: bool = False) -> int:
        """`_open_file` from the folder descriptors of one call."""
        folder, name = self._final(folders, rel, create)
        if flags & os.O_TRUNC:
            _unshare(folder, name)
        try:
            fd = os.open(name, flags, 0o666, dir_fd=folder)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise self._link_at(folder, name, rel) from None
            raise
        try:
            mode = os.fstat(fd).st_mode
            if stat.S_ISDIR(mode):
                raise IsADirectoryError(errno.EISDIR, "is a folder, not a file", rel)
            if not stat.S_ISREG(mode):
                raise StorageError(f"{self.url}: refused {rel}: not a regular file (a FIFO, "
                                   "socket or device); storage holds regular files only")
        except BaseException:
            os.close(fd)
            raise
        return fd

    # -- paths ---------------------------------------------------------------
    def local_path(self, rel: str) -> str:
        path = self.abspath(rel)
        parts = self._parts(rel)
        if parts:
            with self._errors(rel or "/"), _Folders(self) as folders:
                try:
                    self._refuse_if_link(folders.fd(parts[:-1], rel), parts[-1], rel)
                except (FileNotFoundError, NotADirectoryError):
                    pass  # nothing there yet: the caller creates it
        return path

    # -- primitives ------------------------------------------------------------
    def exists(self, rel: str) -> bool:
        parts = self._parts(rel)
        with self._errors(rel or "/"), _Folders(self) as folders:
            try:
                if not parts:
                    folders.fd((), rel)
                    return True
                self._refuse_if_link(folders.fd(parts[:-1], rel), parts[-1], rel)
            except (FileNotFoundError, NotADirectoryError):
                return False
        return True

    def read_bytes(self, rel: str) -> bytes:
        with self._errors(rel):
            with open(self._open_file(rel, _READ_FLAGS), "rb") as fh:
                return fh.read()

    def read_many(self, rels: Iterable[str], threads: int = 16) -> Iterator[bytes | None]:
        """Each folder on the way is opened once for consecutive paths under it (10,000
        records in as many folders: a descriptor per record, not one per segment)."""
        with _Folders(self) as folders:
            for rel in rels:
                data: bytes | None = None
                with self._errors(rel):
                    try:
                        fd = self._open_in(folders, rel, _READ_FLAGS)
                    except FileNotFoundError:
                        pass  # (as read_bytes_if_exists)
                    else:
                        with open(fd, "rb", buffering=0) as fh:
                            data = fh.readall()
                yield data

    def write_bytes(self, rel: str, data: bytes) -> None:
        with self._errors(rel):
            with open(self._open_file(rel, _WRITE_FLAGS, create=True), "wb") as fh:
                fh.write(data)

    def write_exclusive(self, rel: str, data: bytes) -> None:
        with self._errors(rel), _Folders(self) as folders:
            folder, name = self._final(folders, rel, create=True)
            tmp = self._write_temp(folder, name, data, sync=True)
            try:
                os.link(tmp, name, src_dir_fd=folder, dst_dir_fd=folder,
                        follow_symlinks=False)  # atomic, and fails if the target exists
            except FileExistsError as exists:
                try:
                    self._refuse_if_link(folder, name, rel)  # a symlink there: say so
                except FileNotFoundError:
                    # removed since the link failed (a racing taker's claim): it existed,
                    # and that is what the caller must hear
                    raise exists from None
                raise
            finally:
                os.unlink(tmp, dir_fd=folder)

    def write_atomic(self, rel: str, data: bytes) -> None:
        with self._errors(rel), _Folders(self) as folders:
            folder, name = self._final(folders, rel, create=True)
            tmp = self._write_temp(folder, name, data, sync=False)
            try:
                try:
                    self._refuse_if_link(folder, name, rel)
                except FileNotFoundError:
                    pass
                # rename replaces the entry itself: never what a link there points to
                os.replace(tmp, name, src_dir_fd=folder, dst_dir_fd=folder)
            except BaseException:
                os.unlink(tmp, dir_fd=folder)
                raise

    @staticmethod
    def _write_temp(folder: int, name: str, data: bytes, sync: bool) -> str:
        # a dot name that is not *.json: never read as a lease or record meanwhile
        tmp = f".{name}.{uuid.uuid4().hex}.tmp"
        fd = os.open(tmp, _CREATE_FLAGS, 0o666, dir_fd=folder)
        try:
            with open(fd, "wb") as fh:
                fh.write(data)
                if sync:
                    fh.flush()
                    os.fsync(fh.fileno())
        except BaseException:
            os.unlink(tmp, dir_fd=folder)
            raise
        return tmp

    @contextmanager
    def open_write(self, rel: str) -> Iterator[IO[bytes]]:
        with self._errors(rel):
            fh = open(self._open_file(rel, _WRITE_FLAGS, create=True), "wb")  # noqa: SIM115
        with fh, self._errors(rel):
            yield fh

    def put_file(self, local_path: str, rel: str) -> tuple[int, str]:
        with self._errors(rel), open(local_path, "rb") as src:
            with open(self._open_file(rel, _WRITE_FLAGS, create=True), "wb") as dst:
                size, crc = copy_open_file(src.fileno(), dst.fileno(), CHECKSUM_ALGORITHM,
                                           local_path)
        return size, format_checksum(CHECKSUM_ALGORITHM, crc)

    def get_file(self, rel: str, local_path: str,
                 algorithm: str = CHECKSUM_ALGORITHM) -> tuple[int, str]:
        with self._errors(rel), open(self._open_file(rel, _READ_FLAGS), "rb") as src:
            with open(local_path, "wb") as dst:
                size, crc = copy_open_file(src.fileno(), dst.fileno(), algorithm, rel)
        return size, format_checksum(algorithm, crc)

    def copy(self, src_rel: str, dst_rel: str) -> None:
        self._copy(src_rel, dst_rel, None)

    def copy_checked(self, src_rel: str, dst_rel: str,
                     algorithm: str = CHECKSUM_ALGORITHM) -> tuple[int, str]:
        # One pass: the checksum of the bytes the kernel copies (as uploads do), no
        # second read of the copy.
        size, crc = self._copy(src_rel, dst_rel, algorithm)
        return size, format_checksum(algorithm, crc)

    def _copy(self, src_rel: str, dst_rel: str, algorithm: str | None) -> tuple[int, int]:
        with self._errors(src_rel), open(self._open_file(src_rel, _READ_FLAGS), "rb") as src:
            if self._link_open(src.fileno(), dst_rel):
                # the checksum of the shared bytes: a damaged source is still found
                return crc_open_file(src.fileno(), algorithm) if algorithm \
                    else (os.fstat(src.fileno()).st_size, 0)
            with self._errors(dst_rel), \
                    open(self._open_file(dst_rel, _WRITE_FLAGS, create=True), "wb") as dst:
                return copy_open_file(src.fileno(), dst.fileno(), algorithm, src_rel)

    def _link_open(self, fd: int, dst_rel: str) -> bool:
        """Hard-link the open file ``fd`` as ``dst_rel`` (the file opened, not a name
        that may have become a symlink since: linkat through ``/proc/self/fd``, the way
        open(2) links an O_TMPFILE); False when the filesystem refuses (``dst_rel``
        exists, another device, no hard links, no /proc): the caller copies instead."""
        with self._errors(dst_rel), _Folders(self) as folders:
            folder, name = self._final(folders, dst_rel, create=True)
            try:
                os.link(f"/proc/self/fd/{fd}", name, dst_dir_fd=folder, follow_symlinks=True)
            except OSError:
                return False
        return True

    def checksum(self, rel: str, algorithm: str = CHECKSUM_ALGORITHM) -> tuple[int, str]:
        with self._errors(rel), open(self._open_file(rel, _READ_FLAGS), "rb") as fh:
            size, crc = crc_open_file(fh.fileno(), algorithm)
        return size, format_checksum(algorithm, crc)

    def info(self, rel: str) -> FileInfo | None:
        parts = self._parts(rel)
        with self._errors(rel or "/"), _Folders(self) as folders:
            try:
                if parts:
                    st = self._refuse_if_link(folders.fd(parts[:-1], rel), parts[-1], rel)
                else:
                    st = os.fstat(folders.fd((), rel))
            except (FileNotFoundError, NotADirectoryError):
                return None
        return FileInfo(rel, st.st_size, st.st_mtime)

    def list_dir(self, rel: str = "") -> list[str]:
        """Names directly under ``rel``, symlinks left out."""
        parts = self._parts(rel)
        with self._errors(rel or "/"), _Folders(self) as folders:
            try:
                fd = folders.fd(parts, rel)
            except FileNotFoundError:
                return []
            except NotADirectoryError:
                return [parts[-1]]  # a regular file (a symlink raised above)
            with os.scandir(fd) as it:
                return sorted(e.name for e in it if not e.is_symlink())

    def walk_files(self, rel: str = "") -> list[FileInfo]:
        out = self._scan(rel, stat=True)
        out.sort(key=_path_of)
        return out

    def walk_listing(self, rel: str = "") -> Listing:
        """Names only (``os.scandir`` without a stat per file): sizes and mtimes are
        read on first access."""
        paths = self._scan(rel, stat=False)
        paths.sort()
        return Listing(paths, stat=self._listed_stat())

    def glob(self, pattern: str) -> list[str]:
        """Files, and the folders above them, matching ``pattern`` (``*`` and ``?``
        within a segment, ``**`` across segments, ``[...]``), from a listing of the
        pattern's literal folder: symlinks are neither matched nor followed."""
        segments = safe_relpath(pattern, "glob pattern").split("/")
        literal = 0
        while literal < len(segments) and not _MAGIC.search(segments[literal]):
            literal += 1
        if literal == len(segments):
            path = "/".join(segments)
            return [path] if self.exists(path) else []
        base = "/".join(segments[:literal])
        regex = re.compile(_glob_regex("/".join(segments)))
        found: set[str] = set()
        for path in self._scan(base, stat=False):
            found.add(path)
            folder = posixpath.dirname(path)
            while len(folder) > len(base) and folder not in found:
                found.add(folder)
                folder = posixpath.dirname(folder)
        return sorted(p for p in found if regex.fullmatch(p))

    @overload
    def _scan(self, rel: str, stat: Literal[True]) -> list[FileInfo]: ...
    @overload
    def _scan(self, rel: str, stat: Literal[False]) -> list[str]: ...

    def _scan(self, rel: str, stat: bool) -> list[FileInfo] | list[str]:
        """Every regular file under ``rel``: FileInfo with ``stat``, else its path.

        Depth first through folder descriptors (as many open as the tree is deep);
        symlinks are skipped, never followed, and so are FIFOs, sockets and devices.
        """
        parts = self._parts(rel)
        out: list[Any] = []  # FileInfo with ``stat``, else str (the overloads)
        append = out.append
        top_prefix = f"{safe_relpath(rel)}/" if rel else ""
        with _Folders(self) as folders:
            with self._errors(rel or "/"):
                try:
                    top = folders.fd(parts, rel)
                except FileNotFoundError:
                    return out
                except NotADirectoryError:  # ``rel`` names a file: that file alone
                    info = self.info(rel)
                    if info is not None:
                        append(info if stat else info.path)
                    return out
            stack = [_Frame(top_prefix, top, False)]
            try:
                while stack:
                    frame = stack[-1]
                    prefix, fd = frame.prefix, frame.fd
                    if frame.subfolders is None:
                        frame.subfolders = self._list_folder(prefix, fd, stat, append)
                    if frame.subfolders:
                        name = frame.subfolders.pop()
                        try:
                            child = os.open(name, _DIR_FLAGS, dir_fd=fd)
                        except OSError as exc:
                            if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
                                continue  # gone, or swapped for a file or a symlink
                            raise StorageError(f"{self.url}: cannot list {prefix}{name}: "
                                               f"{exc}") from exc
                        stack.append(_Frame(f"{prefix}{name}/", child, True))
                    else:
                        stack.pop()
                        if frame.owned:
                            os.close(fd)
            finally:
                for frame in stack:
                    if frame.owned:
                        os.close(frame.fd)
        return out

    def _list_folder(self, prefix: str, fd: int, stat: bool,
                     append: Callable[[Any], None]) -> list[str]:
        """Append the regular files of one folder; return its subfolders' names."""
        folders: list[str] = []
        try:
            with os.scandir(fd) as it:
                for e in it:
                    if e.is_dir(follow_symlinks=False):
                        folders.append(e.name)
                    elif not e.is_file(follow_symlinks=False):
                        continue  # a symlink, FIFO, socket or device: never listed
                    elif not stat:
                        append(prefix + e.name)
                    else:
                        try:
                            st = e.stat(follow_symlinks=False)
                        except FileNotFoundError:
                            continue  # deleted since the folder was read
                        append(FileInfo(prefix + e.name, st.st_size, st.st_mtime))
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise StorageError(f"{self.url}: cannot list {prefix or '/'}: {exc}") from exc
        return folders

    def _listed_stat(self) -> Callable[[str], FileInfo | None]:
        """The size-and-mtime reader of one listing: each folder is checked once (the
        root against its ``realpath``, a folder below it by one ``lstat`` once its
        parent is known real), each file stated without following it."""
        real_folders: dict[str, bool] = {}
        root = self.root
        below = root[len(self._top):]
        real_root = self._real_top + below

        def is_real(folder: str) -> bool:
            real = real_folders.get(folder)
            if real is None:
                if not folder:
                    real = os.path.realpath(root) == real_root
                else:
                    parent = folder.rpartition("/")[0]
                    try:
                        real = is_real(parent) and stat.S_ISDIR(
                            os.lstat(f"{root}/{folder}").st_mode)
                    except (FileNotFoundError, NotADirectoryError):
                        real = False
                real_folders[folder] = real
            return real

        def stat_listed(rel: str) -> FileInfo | None:
            if not is_real(rel.rpartition("/")[0]):
                return None  # swapped for a symlink since it was listed: not a file here
            try:
                st = os.stat(f"{root}/{rel}", follow_symlinks=False)
            except (FileNotFoundError, NotADirectoryError):
                return None
            except OSError as exc:
                raise StorageError(f"{self.url}: cannot stat {rel}: {exc}") from exc
            if not stat.S_ISREG(st.st_mode):
                return None
            return FileInfo(rel, st.st_size, st.st_mtime)

        return stat_listed

    def delete_many(self, rels: Iterable[str]) -> list[tuple[str, str]]:
        """Best-effort delete; consecutive paths in one folder share its lookup. A path
        under a symlinked folder is a failure (nothing behind the link is touched); a path
        that is a symlink loses the link, not its target."""
        wanted = [safe_relpath(r) for r in rels]  # refuse bad paths before deleting any
        failures: list[tuple[str, str]] = []
        with _Folders(self) as folders:
            for rel in wanted:
                try:
                    fd, name = self._final(folders, rel)
                    os.unlink(name, dir_fd=fd)
                except (FileNotFoundError, NotADirectoryError):
                    pass  # gone already (or its folder is a file: never there)
                except UnsafePathError as exc:
                    failures.append((rel, f"not deleted: {getattr(exc, 'reason', exc)}"))
                except Exception as exc:  # noqa: BLE001 - best effort, reported
                    failures.append((rel, str(exc)))
        return failures

    def delete_tree(self, rel: str) -> None:
        with self._errors(rel or "/"), _Folders(self) as folders:
            parts = self._parts(rel)
            if not parts:
                shutil.rmtree(self._real_top or "/", onerror=_ignore_vanished)
                return
            try:
                folder = folders.fd(parts[:-1], rel)
                st = os.stat(parts[-1], dir_fd=folder, follow_symlinks=False)
            except (FileNotFoundError, NotADirectoryError):
                return
            if stat.S_ISDIR(st.st_mode):
                # fd-based on Linux (avoids_symlink_attacks): unlinks nested symlinks
                shutil.rmtree(parts[-1], dir_fd=folder, onerror=_ignore_vanished)
            else:
                try:
                    os.unlink(parts[-1], dir_fd=folder)  # a file, or a symlink itself
                except FileNotFoundError:
                    pass

    def remove_empty_dirs(self, rels: Iterable[str]) -> None:
        with _Folders(self) as folders:
            for rel in sorted(set(rels), key=lambda d: d.count("/"), reverse=True):
                try:
                    folder, name = self._final(folders, rel)
                    # refuses a non-empty folder (race-safe) and a symlink (ENOTDIR)
                    os.rmdir(name, dir_fd=folder)
                except (OSError, ValueError, UnsafePathError):
                    pass

    def check_reachable(self) -> None:
        with self._errors("/"), _Folders(self) as folders:
            try:
                folders.fd(self._parts(""), "")
            except FileNotFoundError:
                pass  # a missing root folder is fine: it is created on write
            except NotADirectoryError as exc:
                raise StorageError(f"storage root {self.url} is a file, not a folder; "
                                   "check --storage") from exc


def _ignore_vanished(func: Callable[..., object], path: str,
                     exc_info: tuple[type[BaseException], BaseException, object]) -> None:
    """rmtree's error handler: an entry deleted meanwhile is fine, the rest raises."""
    if not isinstance(exc_info[1], FileNotFoundError):
        raise exc_info[1]


def _glob_regex(pattern: str) -> str:
    out: list[str] = []
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif c == "*":
            out.append("[^/]*")
            i += 1
        elif c == "?":
            out.append("[^/]")
            i += 1
        elif c == "[" and (end := pattern.find("]", i + 2)) > 0:
            body = pattern[i + 1:end]
            if body.startswith("!"):
                body = "^" + body[1:]
            out.append("[" + body.replace("\\", "\\\\") + "]")
            i = end + 1
        else:
            out.append(re.escape(c))
            i += 1
    return "".join(out)


def open_local(url: str, path: str) -> LocalStorage:
    root = os.path.abspath(os.path.expanduser(path))
    return LocalStorage(f"file://{root}", fsspec.filesystem("file"), root)


_path_of = attrgetter("path")
