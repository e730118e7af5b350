"""`statebackend.checkpoint.attempt`: upload first, then commit `_metadata` or discard.

On a real file:// store: what stays after a commit (the winners' files, no attempt
records), after a failed commit and after a discard (nothing of the attempt; another
writer's checkpoint of the same id untouched; another attempt's uploads into the same
``chk-<id>/`` untouched), what a crash after the commit leaves for `cleanup_committed`,
and that nothing outside ``shared/`` and ``chk-<id>/`` is deleted.
"""

from __future__ import annotations

import pytest

from statebackend.checkpoint.attempt import (
    Attempt,
    attempt_records,
    cleanup_committed,
    record_uploads,
)
from statebackend.checkpoint.layout import ATTEMPTS_DIR, metadata_path
from statebackend.checkpoint.metadata import FileRef, SubtaskHandle
from statebackend.checkpoint.store import CheckpointStore, MetadataParts, build_metadata
from statebackend.errors import CkptError, LeaseConflictError, MissingFilesError
from statebackend.state.keygroups import key_group_range_for_subtask
from statebackend.storage import open_storage

M, P = 128, 2


@pytest.fixture()
def store(tmp_path) -> CheckpointStore:
    return CheckpointStore(open_storage(f"file://{tmp_path}/store"), "job")


def upload(store: CheckpointStore, cid: int, subtask: int, attempt: int, tag: str,
           token: str = "") -> FileRef:
    """One task attempt's upload (a shared file and its private CURRENT), recorded with
    the driver attempt's ``token``."""
    shared = FileRef(f"shared/{cid}-{subtask}-{tag}.sst", f"{tag}.sst", 3, "crc32:0")
    private = f"chk-{cid}/{subtask}/{tag}/CURRENT"
    store.storage.write_bytes(shared.path, b"sst")
    store.storage.write_bytes(private, b"cur")
    record_uploads(store.storage, cid, subtask, attempt, [shared.path, private], token)
    return shared


def metadata(store: CheckpointStore, cid: int, refs: list[FileRef]):
    handles = []
    for i, ref in enumerate(refs):
        r = key_group_range_for_subtask(M, P, i)
        handles.append(SubtaskHandle(i, r.start, r.end, f"b{i}", f"s{cid}", (ref,), (),
                                     {"v": 1}, ref.size))
    return build_metadata(MetadataParts(
        job=store.job, checkpoint_id=cid, parent=None, max_parallelism=M,
                          states=[{"name": "v"}], handles=handles))


def files(store: CheckpointStore) -> set[str]:
    return {f.path for f in store.storage.walk_files("")}


def test_commit_keeps_the_winners_and_drops_retried_attempts(store):
    win0, win1 = upload(store, 1, 0, 0, "a"), upload(store, 1, 1, 1, "b")
    lost = upload(store, 1, 1, 0, "lost")  # subtask 1's first attempt failed after uploading
    assert len(attempt_records(store.storage, 1)) == 3
    meta = metadata(store, 1, [win0, win1])
    Attempt(store, 1).commit(meta, winners=[(0, 0), (1, 1)])
    left = files(store)
    assert {win0.path, win1.path, metadata_path(1)} <= left
    assert lost.path not in left and "chk-1/1/lost/CURRENT" not in left
    assert not any(f"/{ATTEMPTS_DIR}/" in p for p in left)
    assert store.load(1) == meta


def test_failed_commit_discards_the_attempt_and_reraises(store):
    attempt = Attempt(store, 1)
    ref = upload(store, 1, 0, 0, "a", attempt.token)
    missing = FileRef("shared/never-uploaded.sst", "x.sst", 3, "crc32:0")
    attempt.add_uploaded([ref.path])
    with pytest.raises(MissingFilesError, match="never-uploaded.sst"):
        attempt.commit(metadata(store, 1, [ref, missing]))
    assert files(store) == set()  # nothing half-committed stays behind


def test_discard_on_discard_runs_first_and_everything_goes(store):
    calls = []
    attempt = Attempt(store, 1, on_discard=lambda: calls.append(files(store)))
    ref = upload(store, 1, 0, 0, "a", attempt.token)
    attempt.add_uploaded([ref.path])
    assert attempt.discard() is True
    assert calls and ref.path in calls[0]  # called before the uploads went
    assert files(store) == set()


def test_discard_leaves_another_attempts_uploads_to_the_same_id(store):
    """Issue 20: a writer paused past its lease and the writer that took over both upload
    into chk-1/ (a checkpoint's id is its parent's + 1); one's discard must not take the
    other's files. A lost worker's unrecorded file is an orphan left to gc."""
    ours, theirs = Attempt(store, 1), Attempt(store, 1)
    mine = upload(store, 1, 0, 0, "mine", ours.token)
    other = upload(store, 1, 0, 0, "other", theirs.token)
    store.storage.write_bytes("chk-1/1/orphan/CURRENT", b"x")  # a lost worker's private file
    assert ours.discard() is True
    left = files(store)
    assert mine.path not in left and "chk-1/0/mine/CURRENT" not in left
    assert {other.path, "chk-1/0/other/CURRENT", "chk-1/1/orphan/CURRENT"} <= left
    assert [r["token"] for r in attempt_records(store.storage, 1)] == [theirs.token]


def test_discard_never_touches_another_writers_checkpoint(store):
    theirs = upload(store, 1, 0, 0, "theirs"), upload(store, 1, 1, 0, "theirs1")
    Attempt(store, 1).commit(metadata(store, 1, list(theirs)), winners=[(0, 0), (1, 0)])
    committed = files(store)
    attempt = Attempt(store, 1)
    ours = upload(store, 1, 0, 7, "ours", attempt.token)
    attempt.add_uploaded([ours.path])
    with pytest.raises(LeaseConflictError, match="committed by another writer"):
        attempt.commit(metadata(store, 1, [ours, theirs[1]]))
    assert files(store) == committed
    assert store.load(1).files == metadata(store, 1, list(theirs)).files


def test_only_paths_of_the_checkpoint_are_deleted(store):
    store.storage.write_bytes("chk-2/0/x/CURRENT", b"other checkpoint")
    store.storage.write_bytes("savepoints/sp/_metadata", b"{}")
    attempt = Attempt(store, 1)
    record_uploads(store.storage, 1, 0, 0, ["chk-2/0/x/CURRENT", "savepoints/sp/_metadata",
                                            "../outside", "chk-1/_metadata"], attempt.token)
    store.storage.write_bytes("chk-1/_metadata", b"{}")  # never an attempt's to delete
    assert attempt.discard() is True
    store.storage.delete_many(["chk-1/_metadata"])
    assert files(store) == {"chk-2/0/x/CURRENT", "savepoints/sp/_metadata"}


def test_crash_after_commit_is_finished_by_cleanup_committed(store, monkeypatch):
    win, lost = upload(store, 1, 0, 1, "w"), upload(store, 1, 0, 0, "l")
    win1 = upload(store, 1, 1, 0, "w1")
    meta = metadata(store, 1, [win, win1])
    monkeypatch.setattr(Attempt, "cleanup", lambda *a, **k: None)  # the crash
    Attempt(store, 1).commit(meta, winners=[(0, 1), (1, 0)])
    monkeypatch.undo()
    assert lost.path in files(store) and attempt_records(store.storage, 1)
    cleanup_committed(store, store.load(1))
    left = files(store)
    assert lost.path not in left and attempt_records(store.storage, 1) == []
    assert {win.path, win1.path, metadata_path(1)} <= left


def test_commit_of_another_id_is_refused(store):
    ref = upload(store, 2, 0, 0, "a")
    with pytest.raises(CkptError, match="attempt at checkpoint 1 cannot commit checkpoint 2"):
        Attempt(store, 1).commit(metadata(store, 2, [ref, ref]))
    assert ref.path in files(store)  # refused before anything was written or deleted
