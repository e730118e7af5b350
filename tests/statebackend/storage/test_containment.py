"""file:// storage never follows a symlink below its root (issue 20, defect 6).

Real files and real symlinks under ``tmp_path``: a storage root ``store/`` and, beside
it, ``outside/`` with a canary. Every primitive and the lifecycle commands (``ckpt
retain``, ``gc``, ``savepoint``) are run against symlinks to ``outside/``; after each,
``outside/`` must be exactly as before (same entries, same bytes) and nothing of it may
have been copied into the store. The rule (local.py): no symlink below the root is
followed, wherever it points (inside the root too); the root itself may be a symlink.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import threading

import pytest

from statebackend.checkpoint.store import CheckpointStore
from statebackend.cli.app import main
from statebackend.errors import StorageError, UnsafePathError
from statebackend.storage import open_storage
from tests.statebackend.lifecycle.test_lifecycle_scenarios import Job, keys

CANARY = b"canary: must never be read, changed or deleted through the store"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))
CKPT_BIN = os.path.join(os.path.dirname(sys.executable), "ckpt")  # the console script


def snapshot(folder) -> dict[str, object]:
    """Every entry under ``folder``: files by bytes, folders by their names."""
    out: dict[str, object] = {}
    for dirpath, dirnames, filenames in os.walk(folder):
        out[os.path.relpath(dirpath, folder)] = sorted(dirnames + filenames)
        for name in filenames:
            path = os.path.join(dirpath, name)
            with open(path, "rb") as fh:
                out[os.path.relpath(path, folder)] = fh.read()
    return out


def stored_bytes(folder) -> set[bytes]:
    """The contents of every regular file under ``folder`` (symlinks not followed)."""
    found = set()
    for dirpath, _, filenames in os.walk(folder):
        for name in filenames:
            path = os.path.join(dirpath, name)
            if not os.path.islink(path):
                with open(path, "rb") as fh:
                    found.add(fh.read())
    return found


@pytest.fixture
def tree(tmp_path):
    """(storage at store/, outside/ path, snapshot of outside/) with, in store/job/:
    ``real/a.txt``; ``link -> outside/`` (a folder); ``flink -> outside/canary.txt``;
    ``inlink -> real`` and ``finlink -> real/a.txt`` (symlinks that stay inside)."""
    outside = tmp_path / "outside"
    (outside / "sub").mkdir(parents=True)
    (outside / "empty").mkdir()
    (outside / "canary.txt").write_bytes(CANARY)
    (outside / "sub" / "deep.txt").write_bytes(CANARY + b" (deep)")
    job = tmp_path / "store" / "job"
    (job / "real").mkdir(parents=True)
    (job / "real" / "a.txt").write_bytes(b"inside")
    os.symlink(outside, job / "link")
    os.symlink(outside / "canary.txt", job / "flink")
    os.symlink("real", job / "inlink")
    os.symlink("real/a.txt", job / "finlink")
    storage = open_storage(f"file://{tmp_path}/store")
    before = snapshot(outside)
    yield storage, outside, before
    assert snapshot(outside) == before, "something outside the storage root changed"


REFUSED = {
    "read_bytes dir": lambda s, t: s.read_bytes("job/link/canary.txt"),
    "read_bytes file": lambda s, t: s.read_bytes("job/flink"),
    "read_bytes inside link": lambda s, t: s.read_bytes("job/inlink/a.txt"),
    "read_bytes_if_exists": lambda s, t: s.read_bytes_if_exists("job/link/canary.txt"),
    "exists dir": lambda s, t: s.exists("job/link/canary.txt"),
    "exists file": lambda s, t: s.exists("job/flink"),
    "info": lambda s, t: s.info("job/link/sub/deep.txt"),
    "info file": lambda s, t: s.info("job/finlink"),
    "write_bytes dir": lambda s, t: s.write_bytes("job/link/new.txt", b"x"),
    "write_bytes file": lambda s, t: s.write_bytes("job/flink", b"overwritten"),
    "write_bytes new folder": lambda s, t: s.write_bytes("job/link/newdir/x", b"x"),
    "write_exclusive dir": lambda s, t: s.write_exclusive("job/link/new.txt", b"x"),
    "write_exclusive file": lambda s, t: s.write_exclusive("job/flink", b"x"),
    "write_atomic dir": lambda s, t: s.write_atomic("job/link/canary.txt", b"x"),
    "write_atomic file": lambda s, t: s.write_atomic("job/flink", b"x"),
    "open_write": lambda s, t: s.open_write("job/flink").__enter__(),
    "put_file dir": lambda s, t: s.put_file(str(t / "local.bin"), "job/link/up.bin"),
    "put_file file": lambda s, t: s.put_file(str(t / "local.bin"), "job/flink"),
    "get_file": lambda s, t: s.get_file("job/flink", str(t / "got.bin")),
    "get_file dir": lambda s, t: s.get_file("job/link/canary.txt", str(t / "got.bin")),
    "copy from": lambda s, t: s.copy("job/link/canary.txt", "job/real/copied.txt"),
    "copy from file": lambda s, t: s.copy("job/flink", "job/real/copied.txt"),
    "copy to dir": lambda s, t: s.copy("job/real/a.txt", "job/link/canary.txt"),
    "copy to file": lambda s, t: s.copy("job/real/a.txt", "job/flink"),
    "copy_checked from": lambda s, t: s.copy_checked("job/link/canary.txt", "job/real/c.txt"),
    "copy_checked to": lambda s, t: s.copy_checked("job/real/a.txt", "job/flink"),
    "checksum": lambda s, t: s.checksum("job/flink"),
    "checksum dir": lambda s, t: s.checksum("job/link/canary.txt"),
    "read_many dir": lambda s, t: list(s.read_many(["job/real/a.txt", "job/link/canary.txt"])),
    "read_many file": lambda s, t: list(s.read_many(["job/flink"])),
    "list_dir": lambda s, t: s.list_dir("job/link"),
    "walk_files": lambda s, t: s.walk_files("job/link"),
    "walk_listing": lambda s, t: s.walk_listing("job/link/sub"),
    "delete_tree under": lambda s, t: s.delete_tree("job/link/sub"),
    "local_path dir": lambda s, t: s.local_path("job/link/sub"),
    "local_path file": lambda s, t: s.local_path("job/flink"),
}


@pytest.mark.parametrize("op", sorted(REFUSED))
def test_primitive_refuses_a_symlink(tree, tmp_path, op):
    storage, _, _ = tree
    (tmp_path / "local.bin").write_bytes(b"local bytes")
    with pytest.raises(UnsafePathError) as caught:
        REFUSED[op](storage, tmp_path)
    message = str(caught.value)
    # one line naming the URL, the path and the symlink
    assert "\n" not in message and storage.url in message and "symbolic link" in message
    assert f"{tmp_path}/store/job/" in message
    assert not (tmp_path / "got.bin").exists() or (tmp_path / "got.bin").read_bytes() != CANARY
    assert (tmp_path / "store" / "job" / "real" / "a.txt").read_bytes() == b"inside"
    assert CANARY not in stored_bytes(tmp_path / "store")


def test_message_names_url_path_and_link(tree, tmp_path):
    storage, outside, _ = tree
    with pytest.raises(UnsafePathError) as caught:
        storage.read_bytes("job/link/sub/deep.txt")
    assert str(caught.value).startswith(
        f"{storage.url}: refused job/link/sub/deep.txt: {tmp_path}/store/job/link is a "
        f"symbolic link (to {outside})")


def test_listings_leave_symlinks_out(tree):
    storage, _, _ = tree
    assert storage.list_dir("job") == ["real"]
    assert [f.path for f in storage.walk_files("")] == ["job/real/a.txt"]
    assert list(storage.walk_listing("job")) == ["job/real/a.txt"]
    assert storage.walk_listing("job").get("job/real/a.txt").size == 6
    assert storage.glob("job/*/canary.txt") == []
    assert storage.glob("job/**/*.txt") == ["job/real/a.txt"]
    assert storage.glob("job/*") == ["job/real"]


def test_delete_many_reports_paths_behind_a_symlinked_folder(tree, tmp_path):
    storage, outside, _ = tree
    failures = storage.delete_many(["job/link/canary.txt", "job/link/sub/deep.txt",
                                    "job/real/a.txt", "job/real/missing.txt"])
    assert [path for path, _ in failures] == ["job/link/canary.txt", "job/link/sub/deep.txt"]
    for _, reason in failures:
        assert reason.startswith(f"not deleted: {tmp_path}/store/job/link is a symbolic link")
    assert not (tmp_path / "store" / "job" / "real" / "a.txt").exists()
    assert (outside / "canary.txt").read_bytes() == CANARY


def test_delete_many_of_a_symlink_removes_the_link_only(tree, tmp_path):
    storage, outside, _ = tree
    assert storage.delete_many(["job/flink", "job/link", "job/finlink"]) == []
    job = tmp_path / "store" / "job"
    assert not os.path.lexists(job / "flink") and not os.path.lexists(job / "link")
    assert (job / "real" / "a.txt").read_bytes() == b"inside"
    assert (outside / "canary.txt").read_bytes() == CANARY


def test_delete_tree_unlinks_symlinks_and_never_descends(tree, tmp_path):
    storage, _, _ = tree
    job = tmp_path / "store" / "job"
    (job / "real" / "nested").mkdir()
    os.symlink(tmp_path / "outside", job / "real" / "nested" / "deep-link")
    storage.delete_tree("job/link")      # the top is a symlink: the link goes
    assert not os.path.lexists(job / "link")
    storage.delete_tree("job")           # nested links are unlinked, not followed
    assert not job.exists()


def test_remove_empty_dirs_does_not_reach_through_a_symlink(tree, tmp_path):
    storage, outside, _ = tree
    storage.remove_empty_dirs(["job/link/empty", "job/link"])
    assert (outside / "empty").is_dir() and os.path.islink(tmp_path / "store" / "job" / "link")


def test_write_exclusive_over_a_symlink_names_it(tree):
    storage, _, _ = tree
    with pytest.raises(UnsafePathError, match="flink is a symbolic link"):
        storage.write_exclusive("job/flink", b"x")


def test_write_exclusive_over_a_file_removed_meanwhile_says_it_existed(tree, monkeypatch):
    """A racing lease taker's claim can vanish between our failed link and the symlink
    check: the caller still hears FileExistsError (a lost race), not a storage error.
    (The removal is injected: the real race needs three threads and luck.)"""
    storage, _, _ = tree
    storage.write_exclusive("job/claim", b"theirs")
    real = type(storage)._refuse_if_link

    def removed_first(self, folder, name, rel):
        os.unlink(name, dir_fd=folder)  # the other taker cleans up its claim
        return real(self, folder, name, rel)

    monkeypatch.setattr(type(storage), "_refuse_if_link", removed_first)
    with pytest.raises(FileExistsError):
        storage.write_exclusive("job/claim", b"ours")


def test_symlinked_job_folder_is_refused(tree, tmp_path):
    storage, outside, _ = tree
    os.symlink(outside, tmp_path / "store" / "evil")
    assert "evil" not in storage.list_dir("")
    store = CheckpointStore(storage, "evil")
    for op in (lambda: store.storage.read_bytes("canary.txt"),
               lambda: store.storage.list_dir(""), lambda: store.storage.check_reachable(),
               lambda: store.storage.write_bytes("x.txt", b"x"),
               lambda: store.storage.local_path("")):
        with pytest.raises(UnsafePathError, match="store/evil is a symbolic link"):
            op()
    failures = store.storage.delete_many(["canary.txt"])
    assert len(failures) == 1 and "evil is a symbolic link" in failures[0][1]


def test_root_may_be_a_symlink(tmp_path):
    (tmp_path / "real-root").mkdir()
    os.symlink(tmp_path / "real-root", tmp_path / "root-link")
    storage = open_storage(f"file://{tmp_path}/root-link")
    storage.write_bytes("job/chk-1/a", b"a")
    storage.write_exclusive("job/chk-1/_metadata", b"m")
    assert storage.read_bytes("job/chk-1/a") == b"a" and storage.exists("job/chk-1/_metadata")
    assert [f.path for f in storage.walk_files("job")] == ["job/chk-1/_metadata", "job/chk-1/a"]
    assert storage.walk_listing("job")["job/chk-1/a"].size == 1
    assert storage.local_path("job/chk-1/a") == f"{tmp_path}/root-link/job/chk-1/a"
    assert storage.delete_many(["job/chk-1/a"]) == []
    storage.remove_empty_dirs(["job/chk-1"])  # not empty: stays
    storage.delete_tree("job")
    assert os.listdir(tmp_path / "real-root") == []


def test_a_fifo_is_refused_without_blocking(tmp_path):
    storage = open_storage(f"file://{tmp_path}/store")
    storage.write_bytes("job/a", b"a")
    pipe = tmp_path / "store" / "job" / "pipe"
    os.mkfifo(pipe)
    outcome: list[BaseException | bytes] = []

    def read() -> None:
        try:
            outcome.append(storage.read_bytes("job/pipe"))
        except BaseException as exc:  # noqa: BLE001 - checked below
            outcome.append(exc)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(10)
    if reader.is_alive():  # blocked opening the FIFO: release it, then fail
        os.close(os.open(pipe, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(10)
        pytest.fail("reading a FIFO in storage blocked")
    assert isinstance(outcome[0], StorageError) and "not a regular file" in str(outcome[0])
    assert storage.list_dir("job") == ["a", "pipe"]
    assert [f.path for f in storage.walk_files("job")] == ["job/a"]


# -- commands ------------------------------------------------------------------------
@pytest.fixture
def linked_job(tmp_path):
    """Job ``orders`` with checkpoints 1-3 whose chk-1/0 folder is a symlink to a copy
    outside the root and whose chk-1/1 and chk-2/1 MANIFESTs are symlinks to files
    outside; plus
    ``shared/orphan.sst -> outside/canary.txt`` and ``shared/sub -> outside/``."""
    url = f"file://{tmp_path}/store"
    job = Job(open_storage(url), "orders", str(tmp_path / "local"))
    for value in range(3):
        job.write(keys(20), value)
        job.checkpoint()
    job.close()
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "canary.txt").write_bytes(CANARY)
    root = tmp_path / "store" / "orders"
    shutil.move(root / "chk-1" / "0", outside / "chk1-0")
    os.symlink(outside / "chk1-0", root / "chk-1" / "0")
    for chk in (1, 2):  # a private file of chk-1 (beside the folder link) and of chk-2
        manifest = glob.glob(f"{root}/chk-{chk}/1/*/MANIFEST-*")[0]
        shutil.move(manifest, outside / f"chk{chk}-manifest")
        os.symlink(outside / f"chk{chk}-manifest", manifest)
    os.symlink(outside / "canary.txt", root / "shared" / "orphan.sst")
    os.symlink(outside, root / "shared" / "sub")
    before = snapshot(outside)
    yield url, tmp_path, outside
    assert snapshot(outside) == before, "something outside the storage root changed"
    assert CANARY not in stored_bytes(tmp_path / "store"), "the canary was copied in"


def ckpt(url, capsys, *argv) -> tuple[int, str, str]:
    code = main(["--storage", url, "--job", "orders", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_retain_reports_files_behind_a_symlink_as_not_deleted(linked_job, capsys):
    url, tmp_path, _ = linked_job
    code, out, _ = ckpt(url, capsys, "retain", "--keep", "1", "--json")
    report = json.loads(out)
    assert report["retired"] == [1, 2]
    failed = {f["path"]: f["error"] for f in report["failures"]}
    assert code != 0 and sorted(failed) == sorted(
        "chk-1/0/" + p.removeprefix(f"{tmp_path}/outside/chk1-0/")
        for p in glob.glob(f"{tmp_path}/outside/chk1-0/*/*")) and len(failed) == 5, failed
    assert all(e.startswith(f"not deleted: {tmp_path}/store/orders/chk-1/0 is a symbolic link")
               for e in failed.values())
    # the symlinked MANIFESTs were links of the root: they are gone, their targets are not
    assert not glob.glob(f"{tmp_path}/store/orders/chk-[12]/1/*/MANIFEST-*")


def test_gc_neither_lists_nor_deletes_through_symlinks(linked_job, capsys):
    url, tmp_path, _ = linked_job
    code, out, _ = ckpt(url, capsys, "gc", "--grace-seconds", "0", "--json")
    report = json.loads(out)
    assert code == 0 and report["files_deleted"] == 0, report
    assert os.path.islink(tmp_path / "store" / "orders" / "shared" / "orphan.sst")


def test_savepoint_of_a_checkpoint_with_symlinks_fails_in_one_line(linked_job):
    url, tmp_path, _ = linked_job
    env = {**os.environ, "PYTHONPATH": ROOT, "CKPT_PROGRESS": "off"}
    done = subprocess.run(
        [CKPT_BIN, "--storage", url, "--job", "orders",
         "savepoint", "1", "--name", "sp1"], capture_output=True, text=True, env=env,
        timeout=120)
    assert done.returncode == 1, (done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "chk-1/0 is a symbolic link" in lines[0], done.stderr
    listed = subprocess.run(
        [CKPT_BIN, "--storage", url, "--job", "orders",
         "savepoints", "--json"], capture_output=True, text=True, env=env, timeout=120)
    assert listed.returncode == 0 and '"sp1"' not in listed.stdout


def test_savepoint_refuses_a_symlinked_file(linked_job, capsys):
    url, tmp_path, _ = linked_job
    code, _, err = ckpt(url, capsys, "savepoint", "2", "--name", "sp2")
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert "chk-2/1/" in err and "MANIFEST" in err and "is a symbolic link" in err
    assert not os.path.exists(tmp_path / "store" / "orders" / "savepoints" / "sp2" / "_metadata")
