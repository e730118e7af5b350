"""Storage contract suite: the same tests on file://, memory:// and s3:// (moto server)."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
import uuid
import zlib
from concurrent.futures import ThreadPoolExecutor

import pytest
from fsspec.asyn import get_loop, sync

from statebackend.errors import StorageError, StorageFullError, UnsafePathError, UsageError
from statebackend.storage import (
    checksum_of_bytes,
    child_storage,
    crc32_hex,
    open_storage,
    safe_relpath,
)
from statebackend.storage.checksums import THREADED_CHECKSUM_BYTES
from statebackend.storage.local import LocalStorage
from statebackend.storage.memory import MemoryStorage
from statebackend.storage.s3 import S3Storage
from tests.conftest import S3_BUCKET


@pytest.fixture
def storage(storage_url):
    return open_storage(storage_url)


def test_write_read_exists(storage):
    assert not storage.exists("a/b.bin")
    storage.write_bytes("a/b.bin", b"hello")
    assert storage.exists("a/b.bin")
    assert storage.read_bytes("a/b.bin") == b"hello"
    storage.write_bytes("a/b.bin", b"replaced")  # plain writes may overwrite
    assert storage.read_bytes("a/b.bin") == b"replaced"
    info = storage.info("a/b.bin")
    assert info.path == "a/b.bin" and info.size == 8
    assert storage.info("a/missing") is None


def test_read_many_reads_in_order_with_none_for_missing(storage):
    paths = [f"chk-{i}/_metadata" for i in (3, 1, 2)] + ["chk-1/0/s/OPTIONS", "chk-9/_metadata"]
    for i, path in enumerate(paths[:4]):
        storage.write_bytes(path, f"record {i}".encode() * (i + 1))
    assert list(storage.read_many(paths)) == [
        b"record 0", b"record 1" * 2, b"record 2" * 3, b"record 3" * 4, None]
    assert list(storage.read_many([])) == []
    with pytest.raises(UnsafePathError):
        list(storage.read_many(["../outside"]))


def test_map_requests_overlaps_only_on_remote_stores(storage):
    """Results in order on every scheme; a remote store's requests overlap in threads, a
    local one's run in the caller's thread (no pool to start under a busy GIL)."""
    threads: set[int] = set()
    lock = threading.Lock()

    def request(i: int) -> int:
        with lock:
            threads.add(threading.get_ident())
        time.sleep(0.01)  # a request takes a while: overlapping shows
        return i * i

    assert list(storage.map_requests(request, range(12), threads=4)) == [
        i * i for i in range(12)]
    if storage.remote:
        assert len(threads) > 1 and threading.get_ident() not in threads
    else:
        assert threads == {threading.get_ident()}


def test_an_abandoned_map_closed_in_fsspecs_event_loop_does_not_wait_for_its_requests(
        s3_server):
    """A map its caller left (stopped early, or raised) is closed by the garbage
    collector in whatever thread it runs in. Closed in fsspec's event-loop thread, as it
    once was in the chaos test (which then hung for good), it must not wait for its
    requests still running: they need that thread."""
    storage = open_storage(f"s3://{S3_BUCKET}/{uuid.uuid4().hex}")
    loop = get_loop()
    finished: list[int] = []

    def request(i: int) -> int:
        if i:
            try:  # an S3 request's shape: it waits for the event loop to run it
                sync(loop, asyncio.sleep, 2, timeout=5)
            finally:
                finished.append(i)
        return i

    results = storage.map_requests(request, range(3), threads=3)
    assert next(results) == 0

    async def close() -> None:
        results.close()

    sync(loop, close, timeout=30)  # (before the fix: 5 s, until the requests timed out)
    assert finished == []  # closing left the two running requests alone


def test_attempt_requests_makes_every_request_and_hands_back_each_failure(storage):
    """Uploads, downloads and savepoint copies report every failure and clean up after
    all of them: each request runs whatever failed before it, results in order."""
    storage.write_bytes("a/present", b"here")
    paths = ["a/present", "a/missing-1", "a/present", "a/missing-2"]
    outcomes = storage.attempt_requests(storage.read_bytes, paths, threads=4)
    assert [r for r, _ in outcomes] == [b"here", None, b"here", None]
    errors = [e for _, e in outcomes]
    assert errors[0] is None and errors[2] is None
    assert [type(e) for e in errors[1::2]] == [StorageError, StorageError]
    assert "missing-1" in str(errors[1]) and "missing-2" in str(errors[3])


def test_read_missing_is_storage_error(storage):
    with pytest.raises(StorageError, match="missing.bin does not exist") as err:
        storage.read_bytes("x/missing.bin")
    assert isinstance(err.value.__cause__, FileNotFoundError)


def test_write_exclusive_refuses_overwrite(storage):
    storage.write_exclusive("chk-1/_metadata", b"first")
    with pytest.raises(FileExistsError):
        storage.write_exclusive("chk-1/_metadata", b"second")
    assert storage.read_bytes("chk-1/_metadata") == b"first"
    # no temp files left beside it
    assert [f.path for f in storage.walk_files("chk-1")] == ["chk-1/_metadata"]


def test_put_get_file_checksums(storage, tmp_path):
    data = os.urandom(300_000) + b"tail"
    src = tmp_path / "src.sst"
    src.write_bytes(data)
    size, checksum = storage.put_file(str(src), "shared/x-000001.sst")
    assert size == len(data) and checksum == checksum_of_bytes(data)
    assert checksum.startswith("crc32c:")
    # references recorded with the older CRC32 are still verified as written
    legacy = crc32_hex(zlib.crc32(data))
    assert storage.checksum("shared/x-000001.sst", "crc32") == (size, legacy)
    assert storage.checksum("shared/x-000001.sst") == (size, checksum)
    dst = tmp_path / "dst.sst"
    assert storage.get_file("shared/x-000001.sst", str(dst)) == (size, checksum)
    assert dst.read_bytes() == data
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    assert storage.put_file(str(empty), "p/empty") == (0, checksum_of_bytes(b""))
    with pytest.raises(StorageError, match="does not exist"):
        storage.get_file("shared/none.sst", str(tmp_path / "none"))


def test_copy(storage):
    storage.write_bytes("a/one", b"1")
    storage.copy("a/one", "b/two")
    assert storage.read_bytes("b/two") == b"1"


@pytest.mark.parametrize("size", [0, 300_000, THREADED_CHECKSUM_BYTES + 1])
def test_copy_checked_returns_the_copy_facts(storage, size):
    """Savepoints check copies by what copy_checked returns: the copy's bytes, checksummed
    (on file:// while copying, in a thread beside the copy for a large file)."""
    data = os.urandom(size)
    storage.write_bytes("a/src.sst", data)
    assert storage.copy_checked("a/src.sst", "b/dst.sst") == (size, checksum_of_bytes(data))
    assert storage.read_bytes("b/dst.sst") == data
    legacy = crc32_hex(zlib.crc32(data))
    assert storage.copy_checked("a/src.sst", "c/dst.sst", "crc32") == (size, legacy)
    with pytest.raises(StorageError, match="does not exist"):
        storage.copy_checked("a/none.sst", "b/none.sst")


@pytest.mark.parametrize("size", [10, THREADED_CHECKSUM_BYTES + 1])
def test_a_copy_is_independent_of_its_source(storage, tmp_path, size):
    """file:// copies by a hard link (a savepoint shares the checkpoint's immutable
    bytes); still no write through one name changes the other, on any scheme, and a
    copy onto an existing file (no link possible) replaces it with checked bytes."""
    data, other = os.urandom(size), os.urandom(size)
    storage.write_bytes("chk-1/a.sst", data)
    storage.copy_checked("chk-1/a.sst", "sp/a.sst")
    if isinstance(storage, LocalStorage):
        src, dst = (os.stat(storage.abspath(p)) for p in ("chk-1/a.sst", "sp/a.sst"))
        assert (src.st_ino, src.st_nlink) == (dst.st_ino, 2)  # shared, not copied
    storage.write_bytes("chk-1/a.sst", other)
    assert storage.read_bytes("sp/a.sst") == data
    storage.copy("chk-1/a.sst", "sp/b.sst")
    local = tmp_path / "upload"
    local.write_bytes(data)
    storage.put_file(str(local), "sp/b.sst")
    assert storage.read_bytes("chk-1/a.sst") == other
    assert storage.copy_checked("sp/a.sst", "sp/b.sst") == (size, checksum_of_bytes(data))
    storage.delete_many(["sp/a.sst"])
    assert storage.read_bytes("sp/b.sst") == data
    assert storage.read_bytes("chk-1/a.sst") == other


def test_walk_list_glob_delete_many(storage):
    files = {"job/shared/a.sst": b"aa", "job/shared/b.sst": b"bbb",
             "job/chk-1/0/s/CURRENT": b"c", "job/chk-1/_metadata": b"{}",
             "job/chk-2/_metadata": b"{}", "other/x": b"x"}
    for rel, data in files.items():
        storage.write_bytes(rel, data)
    walked = storage.walk_files("job")
    assert [f.path for f in walked] == sorted(r for r in files if r.startswith("job/"))
    assert {f.path: f.size for f in walked}["job/shared/b.sst"] == 3
    assert all(f.mtime is None or f.mtime > 0 for f in walked)
    assert storage.list_dir("job") == ["chk-1", "chk-2", "shared"]
    assert storage.list_dir("") == ["job", "other"]
    assert storage.list_dir("nothing-here") == []
    assert storage.walk_files("nothing-here") == []
    assert storage.glob("job/chk-*/_metadata") == ["job/chk-1/_metadata", "job/chk-2/_metadata"]
    failures = storage.delete_many(["job/shared/a.sst", "job/shared/b.sst", "job/shared/gone"])
    assert failures == []
    assert [f.path for f in storage.walk_files("job/shared")] == []
    assert storage.delete_many([]) == []
    storage.delete_tree("job")
    assert storage.walk_files("job") == []
    assert storage.read_bytes("other/x") == b"x"


def test_walk_listing_is_walk_files_read_lazily(storage):
    """`walk_listing` lists what `walk_files` lists, in path order, with the same sizes
    and mtimes when asked; a file deleted after the listing has no entry."""
    files = {"job/shared/a.sst": b"aa", "job/shared/b.sst": b"bbb",
             "job/chk-1/0/s/CURRENT": b"c", "job/chk-1/_metadata": b"{}",
             "job/chk-10/_metadata": b"{}", "job/chk-1.x": b"", "other/x": b"x"}
    for rel, data in files.items():
        storage.write_bytes(rel, data)
    walked = storage.walk_files("job")
    listing = storage.walk_listing("job")
    assert listing.paths == list(listing) == [f.path for f in walked] == sorted(
        r for r in files if r.startswith("job/"))
    assert len(listing) == len(walked)
    assert "job/shared/b.sst" in listing and "other/x" not in listing
    assert listing["job/shared/b.sst"].size == 3
    assert [listing[f.path] for f in walked] == walked
    assert dict(listing.items()) == {f.path: f for f in walked}
    assert listing.get("job/nothing") is None and listing.get("other/x") is None
    with pytest.raises(KeyError):
        listing["other/x"]  # not listed: never looked up, even though it exists
    later = storage.walk_listing("job")
    storage.delete_many(["job/shared/a.sst"])
    assert "job/shared/a.sst" in later  # listed before the deletion...
    if storage.scheme == "file":  # ...and only file:// reads sizes after listing
        assert later.get("job/shared/a.sst") is None
        assert [p for p, _ in later.items()] == [p for p in later if p != "job/shared/a.sst"]
    assert storage.walk_listing("nothing-here").paths == []
    assert storage.walk_listing("job/shared/b.sst").paths == ["job/shared/b.sst"]


def test_write_atomic_replaces_whole(storage):
    storage.write_atomic("leases/writer.json", b"first")
    storage.write_atomic("leases/writer.json", b"second, longer")
    assert storage.read_bytes("leases/writer.json") == b"second, longer"
    assert storage.list_dir("leases") == ["writer.json"]  # no temp file left behind


def test_open_write_creates_the_file(storage):
    with storage.open_write("out/part-0.bin") as fh:
        fh.write(b"abc")
        fh.write(b"def")
    assert storage.read_bytes("out/part-0.bin") == b"abcdef"


def test_url_of_and_local_path(storage, storage_url):
    assert storage.url_of("") == storage.url
    assert storage.url_of("a//b") == storage.url.rstrip("/") + "/a/b"
    with pytest.raises(UnsafePathError):
        storage.url_of("../x")
    local = storage.local_path("a/b")
    if storage_url.startswith("file://"):
        assert storage.is_local and local == os.path.join(storage_url[len("file://"):], "a/b")
        storage.write_bytes("a/b", b"x")
        with open(local, "rb") as fh:
            assert fh.read() == b"x"
    else:
        assert not storage.is_local and local is None
    assert storage.remote == storage_url.startswith("s3://")
    assert storage.process_local == storage_url.startswith("memory://")


def test_remove_empty_dirs_keeps_non_empty_ones(storage):
    storage.write_bytes("chk-1/0/s/CURRENT", b"c")
    storage.write_bytes("chk-2/0/s/CURRENT", b"c")
    storage.delete_many(["chk-1/0/s/CURRENT"])
    storage.remove_empty_dirs(["chk-1", "chk-1/0", "chk-1/0/s", "chk-2", "chk-2/0"])
    assert storage.list_dir("") == ["chk-2"]  # (S3 has no folders: chk-1 vanished with its file)
    assert storage.read_bytes("chk-2/0/s/CURRENT") == b"c"


def test_walk_files_of_one_file(storage):
    storage.write_bytes("a/b.bin", b"xy")
    (info,) = storage.walk_files("a/b.bin")
    assert (info.path, info.size) == ("a/b.bin", 2)


def test_child_storage_is_rooted(storage):
    job = child_storage(storage, "orders")
    job.write_bytes("chk-1/_metadata", b"m")
    assert storage.read_bytes("orders/chk-1/_metadata") == b"m"
    assert [f.path for f in job.walk_files("")] == ["chk-1/_metadata"]
    assert job.glob("chk-*/_metadata") == ["chk-1/_metadata"]
    with pytest.raises(UnsafePathError):
        child_storage(storage, "..")
    with pytest.raises(UsageError):
        child_storage(storage, "a/b")


@pytest.mark.parametrize("bad", ["/etc/passwd", "../x", "a/../../x", "a/..", "s3://b/k",
                                 "C:/x", "\\\\host\\x", ".", "./"])
def test_unsafe_paths_rejected(storage, bad):
    # ("" is not in the list: it names the root itself, by contract)
    with pytest.raises(UnsafePathError):
        storage.write_bytes(bad, b"x")
    with pytest.raises(UnsafePathError):
        storage.read_bytes(bad)


def test_safe_relpath_normalises():
    assert safe_relpath("a//b/./c") == "a/b/c"
    assert safe_relpath("a\\b") == "a/b"
    with pytest.raises(UnsafePathError, match="'..' is not allowed"):
        safe_relpath("shared/../../etc")
    with pytest.raises(UnsafePathError, match="is absolute"):
        safe_relpath("/abs")


def test_listings_see_other_writers(storage):
    """Objects written by another client (another process) show up at once."""
    storage.write_bytes("job/chk-1/_metadata", b"1")
    assert storage.list_dir("job") == ["chk-1"]
    other = storage.fs
    if storage.scheme == "s3":
        import s3fs

        other = s3fs.S3FileSystem(skip_instance_cache=True, client_kwargs={
            "endpoint_url": os.environ["AWS_ENDPOINT_URL"]})
    if storage.scheme == "file":
        other.makedirs(f"{storage.root}/job/chk-2", exist_ok=True)
    other.pipe_file(f"{storage.root}/job/chk-2/_metadata", b"2")
    assert storage.list_dir("job") == ["chk-1", "chk-2"]
    assert storage.glob("job/chk-*/_metadata") == ["job/chk-1/_metadata", "job/chk-2/_metadata"]
    other.rm_file(f"{storage.root}/job/chk-1/_metadata")
    assert storage.glob("job/chk-*/_metadata") == ["job/chk-2/_metadata"]
    assert not storage.exists("job/chk-1/_metadata")


def test_check_reachable_ok(storage):
    storage.check_reachable()


def test_memory_max_size_error_names_the_limit(tmp_path):
    storage = open_storage("memory://quota-test-1?max_bytes=1000")
    storage.write_bytes("a", b"x" * 600)
    with pytest.raises(StorageFullError, match="maximum size of 1000 bytes"):
        storage.write_bytes("b", b"x" * 600)
    src = tmp_path / "f"
    src.write_bytes(b"y" * 500)
    with pytest.raises(StorageFullError, match="1000"):
        storage.put_file(str(src), "c")
    with pytest.raises(StorageFullError, match="1000"):
        child_storage(storage, "job").write_exclusive("m", b"z" * 401)
    storage.write_bytes("d", b"x" * 400)  # exactly at the limit is fine
    assert not storage.exists("b") and not storage.exists("c")
    storage.delete_tree("")
    with pytest.raises(UsageError, match="max_bytes must be an integer"):
        open_storage("memory://q?max_bytes=lots")


@pytest.mark.parametrize("value", ["-1", "0", "-0", "1e6", "1_000", "%2B5", "12.5", "", " ",
                                   "\u0661\u0662"])  # the last: Arabic-Indic digits
def test_memory_max_bytes_must_be_a_positive_integer(value):
    url = f"memory://quota-bad?max_bytes={value}"
    with pytest.raises(UsageError) as info:
        open_storage(url)
    message = str(info.value)
    assert "\n" not in message and url in message and "max_bytes must be an integer >= 1" in message
    with pytest.raises(UsageError, match="max_bytes must be"):
        open_storage("memory://quota-bad?max_bytes=5&max_bytes=-1")
    assert open_storage("memory://quota-ok?max_bytes=1")._quota.max_bytes == 1
    assert open_storage("memory://quota-ok")._quota.max_bytes == 512 * 1024 * 1024


def test_open_storage_urls(tmp_path):
    assert open_storage(str(tmp_path)).url == f"file://{tmp_path}"
    assert isinstance(open_storage(f"file://{tmp_path}"), LocalStorage)
    assert isinstance(open_storage("memory://x"), MemoryStorage)
    assert isinstance(open_storage("s3://bucket/x", key="k", secret="s"), S3Storage)
    with pytest.raises(UsageError, match="unsupported scheme 'ftp'"):
        open_storage("ftp://host/x")
    with pytest.raises(UsageError, match="names no bucket"):
        open_storage("s3:///prefix")
    with pytest.raises(UsageError, match="empty"):
        open_storage("")


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_s3_fails_fast_with_storage_error(monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{_closed_port()}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    storage = open_storage("s3://no-server-bucket/prefix")
    started = time.monotonic()
    with pytest.raises(StorageError, match="unreachable") as err:
        storage.check_reachable()
    assert "\n" not in str(err.value)
    with pytest.raises(StorageError):
        storage.read_bytes("x")
    # generous bound: the point is "seconds, not minutes of retries"
    assert time.monotonic() - started < 30


def test_memory_max_size_holds_under_concurrent_writes(tmp_path):
    storage = open_storage(f"memory://quota-race-{os.getpid()}?max_bytes=1000")
    src = tmp_path / "f"
    src.write_bytes(b"z" * 300)
    barrier = threading.Barrier(8)

    def upload(i: int) -> bool:
        barrier.wait()
        try:
            storage.put_file(str(src), f"f{i}")
            return True
        except StorageFullError:
            return False

    with ThreadPoolExecutor(8) as pool:
        ok = list(pool.map(upload, range(8)))
    assert sum(ok) == 3
    assert sum(f.size for f in storage.walk_files("")) <= 1000
    storage.delete_tree("")


# -- storage options (credentials passed explicitly, never through os.environ) -----------
AWS_VARS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
            "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_DEFAULT_REGION", "AWS_PROFILE")


@pytest.mark.s3
def test_s3_storage_options_replace_the_environment(s3_server, monkeypatch):
    import pickle

    for var in AWS_VARS:
        monkeypatch.delenv(var, raising=False)
    secret = "do-not-show-this-secret"
    options = {"key": "testing", "secret": secret, "client_kwargs": {"endpoint_url": s3_server}}
    url = f"s3://ckpt-test/opts-{os.getpid()}-{time.time_ns()}"
    before = dict(os.environ)
    storage = open_storage(url, **options)
    child = child_storage(storage, "job")
    child.write_bytes("a", b"1")  # the child keeps the root's options
    assert storage.read_bytes("job/a") == b"1"
    assert dict(os.environ) == before
    assert child.options == options and secret not in repr(child.options)
    assert "'secret': '***'" in repr(child.options) and s3_server in repr(child.options)
    # What executors get: pickled options that open the same storage in another process.
    shipped = pickle.loads(pickle.dumps(child.options))
    assert open_storage(url, **shipped).read_bytes("job/a") == b"1"


@pytest.mark.s3
def test_environment_is_the_default_read_once_never_written(s3_server):
    url = f"s3://ckpt-test/env-{os.getpid()}-{time.time_ns()}"
    before = dict(os.environ)
    storage = open_storage(url)  # the fixture's AWS_* variables
    storage.write_bytes("x", b"y")
    assert dict(os.environ) == before
    # Captured as explicit options, so that executors elsewhere reach the same storage.
    assert storage.options["key"] == os.environ["AWS_ACCESS_KEY_ID"]
    assert storage.options["client_kwargs"] == {"endpoint_url": s3_server}


def test_local_and_memory_roots_ignore_storage_options(tmp_path):
    local = open_storage(f"file://{tmp_path}/r", key="k", secret="s")
    local.write_bytes("a", b"1")
    assert local.read_bytes("a") == b"1" and len(local.options) == 0


def test_run_config_and_task_params_show_no_secret():
    from statebackend.job.config import RunConfig
    from statebackend.job.task import TaskParams

    config = RunConfig(input="i", storage="s3://b/x", run_id="r",
                       storage_options={"key": "AKIA1", "secret": "hidden-value",
                                        "token": "tok-value"})
    assert "hidden-value" not in repr(config) and "tok-value" not in repr(config)
    assert config.storage_options["secret"] == "hidden-value"
    params = TaskParams(job=None, options={}, storage_url="s3://b/x", job_dir="j",
                        checkpoint_id=1, parallelism=1, max_parallelism=1, parent_handles=(),
                        output_url=None, quarantine_url="q", run_dir="run=r", run_id="r",
                        storage_options=config.storage_options)
    assert "hidden-value" not in repr(params) and "AKIA1" not in repr(params)


def test_file_walks_over_many_folders_hold_few_descriptors(tmp_path):
    """read_many, delete_many and remove_empty_dirs over 600 folders with 64 descriptors
    allowed (a retention of 10,000 checkpoints under the common limit of 1,024)."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import os, resource
        from statebackend.storage import open_storage
        s = open_storage("file://{tmp_path}/store")
        paths = [f"chk-{{i}}/0/s/MANIFEST" for i in range(600)]
        for p in paths:
            s.write_bytes(p, p.encode())
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
        assert list(s.read_many(paths)) == [p.encode() for p in paths]
        assert s.delete_many(paths) == []
        s.remove_empty_dirs([f"chk-{{i}}/0/s" for i in range(600)]
                            + [f"chk-{{i}}/0" for i in range(600)]
                            + [f"chk-{{i}}" for i in range(600)])
        print(sorted(os.listdir("{tmp_path}/store")))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(
                              os.path.dirname(os.path.abspath(__file__))))), check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
