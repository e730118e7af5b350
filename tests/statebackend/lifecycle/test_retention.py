"""Retention: the pure plan, then the executor on every storage backend."""

from __future__ import annotations

import pytest

from statebackend.checkpoint.leases import acquire_hold
from statebackend.checkpoint.store import CheckpointStore
from statebackend.errors import MetadataError, UsageError
from statebackend.lifecycle.registry import build_registry, make_registry
from statebackend.lifecycle.retention import (
    DEL_METADATA,
    DEL_OLD_HISTORY,
    DEL_PRIVATE,
    DEL_RELEASED_SHARED,
    KEEP_LAST_RESTORABLE,
    KEEP_LEASED,
    execute_retention,
    plan_retention,
    retain,
    summarize_text,
)
from statebackend.storage import open_storage
from tests.statebackend.lifecycle.test_registry import NOW, info, lease, meta, write_meta


def chain():
    """chk-1..4; a.sst in 1-2, b.sst in 2-4 (compaction between 2 and 3), c.sst in 3-4."""
    return [meta(1, ["shared/a.sst"]), meta(2, ["shared/a.sst", "shared/b.sst"]),
            meta(3, ["shared/b.sst", "shared/c.sst"]), meta(4, ["shared/b.sst", "shared/c.sst"])]


def listed(metas, *, skip=(), sizes=None):
    """A listing of every file ``metas`` reference, at its recorded size (``sizes``
    overrides sizes, ``skip`` leaves paths out: files lost in storage)."""
    sizes = sizes or {}
    paths = {f.path: f.size for m in metas for f in m.files}
    return [info(p, size=sizes.get(p, size)) for p, size in sorted(paths.items())
            if p not in skip]


def test_keep_newest_and_release_only_unreferenced_shared():
    reg = make_registry(job="j", now=NOW, files=listed(chain()), checkpoints=chain())
    plan = plan_retention(reg, 2)
    assert plan.retained == (3, 4) and plan.retired == (1, 2)
    actions = {a.path: a.reason for a in plan.deletions}
    assert actions == {"chk-1/_metadata": DEL_METADATA, "chk-2/_metadata": DEL_METADATA,
                       "chk-1/0/s/MANIFEST": DEL_PRIVATE, "chk-2/0/s/MANIFEST": DEL_PRIVATE,
                       "shared/a.sst": DEL_RELEASED_SHARED}
    # _metadata of every retired checkpoint comes before any of their files
    reasons = [a.reason for a in plan.deletions]
    assert reasons[:2] == [DEL_METADATA, DEL_METADATA] and DEL_METADATA not in reasons[2:]
    assert plan.to_json()["by_reason"][DEL_RELEASED_SHARED] == {"files": 1, "bytes": 10}


def test_live_lease_protects_expired_lease_does_not():
    reg = make_registry(job="j", now=NOW, files=listed(chain()), checkpoints=chain(),
                        leases=[lease("hold-live", [1]), lease("hold-old", [2], ttl=-5)])
    plan = plan_retention(reg, 1)
    assert plan.retained == (1, 4) and plan.retired == (2, 3)
    assert [d for d in plan.decisions if d.checkpoint_id == 1][0].reason == KEEP_LEASED
    deleted = {a.path for a in plan.deletions}
    assert "shared/a.sst" not in deleted  # chk-1 (leased) still lists it
    assert "shared/b.sst" not in deleted and "shared/c.sst" not in deleted


def test_savepoint_reference_keeps_a_file():
    sp = meta(1, ["shared/a.sst"], private=["savepoints/s/0/MANIFEST"], kind="savepoint")
    reg = make_registry(job="j", now=NOW, files=listed(chain()), checkpoints=chain(),
                        savepoints={"s": sp})
    plan = plan_retention(reg, 1)
    assert "shared/a.sst" not in {a.path for a in plan.deletions}
    assert plan.savepoints == ("s",)


@pytest.mark.parametrize("keep", [0, -1, True, 1.5])
def test_keep_must_be_positive_int(keep):
    reg = make_registry(job="j", now=NOW, files=[], checkpoints=chain())
    with pytest.raises(UsageError):
        plan_retention(reg, keep)


def test_bytes_are_the_recorded_sizes():
    """Released files are planned at their recorded size (issue 14: a listed size costs a
    stat per file on file://; a file whose size disagrees is the manifest check's
    business, see the restorability tests below); commit records at their listed one."""
    reg = make_registry(job="j", now=NOW, files=listed(chain(), sizes={"shared/a.sst": 999})
                        + [info("chk-1/_metadata", size=77)], checkpoints=chain())
    plan = plan_retention(reg, 2)
    sizes = {a.path: a.size for a in plan.deletions}
    assert sizes["shared/a.sst"] == 10 and sizes["chk-1/_metadata"] == 77
    assert plan.bytes_kept == 10 * 4  # b.sst, c.sst and the MANIFESTs of chk-3 and chk-4


def reasons(plan) -> dict[int, str]:
    return {d.checkpoint_id: d.reason for d in plan.decisions}


def test_never_retire_unless_a_newer_retained_checkpoint_restores():
    """Issue 10 defect 2: chk-4 misses a file and chk-3 has one with the wrong size."""
    files = listed(chain(), skip={"chk-4/0/s/MANIFEST"}, sizes={"chk-3/0/s/MANIFEST": 3})
    plan = plan_retention(make_registry(job="j", now=NOW, files=files, checkpoints=chain()), 1)
    assert reasons(plan) == {1: "beyond-keep", 2: KEEP_LAST_RESTORABLE,
                             3: "keep-above-restorable", 4: "newest"}
    assert plan.retired == (1,) and "shared/a.sst" not in {a.path for a in plan.deletions}
    j = plan.to_json()["checkpoints"]
    assert [(c["id"], c["restorable"]) for c in j] == [(1, None), (2, True), (3, False),
                                                       (4, False)]


def test_failed_validation_report_counts_as_not_restorable():
    plan = plan_retention(make_registry(job="j", now=NOW, files=listed(chain()),
                                        checkpoints=chain()), 2, damaged={4, 3})
    assert reasons(plan) == {1: "beyond-keep", 2: KEEP_LAST_RESTORABLE, 3: "newest",
                             4: "newest"}


def test_nothing_restores_nothing_is_retired():
    plan = plan_retention(make_registry(job="j", now=NOW, files=[], checkpoints=chain()), 1)
    assert plan.retired == () and plan.deletions == ()
    assert set(reasons(plan).values()) == {"keep-none-restorable", "newest"}


@pytest.fixture
def store(storage_url):
    s = CheckpointStore(open_storage(storage_url), "j")
    for m in chain():
        write_meta(s, m)
    return s


def test_retain_on_storage(store):
    dry = retain(store, 2, dry_run=True)
    assert dry.files_deleted == 0 and store.checkpoint_ids() == [1, 2, 3, 4]
    assert dry.to_json()["files_planned"] == 5
    report = retain(store, 2)
    assert store.checkpoint_ids() == [3, 4]
    assert report.files_deleted == 5 and report.bytes_deleted > 0
    assert not store.storage.exists("shared/a.sst") and store.storage.exists("shared/b.sst")
    assert build_registry(store).missing() == []
    j = report.to_json()
    assert j["retired"] == [1, 2] and j["retained"] == [3, 4] and j["failures"] == []


def test_executor_rechecks_leases_and_late_commits(store):
    plan = plan_retention(build_registry(store), 1)
    assert plan.retired == (1, 2, 3)
    # after planning: a restore holds chk-2, and chk-5 commits reusing shared/a.sst
    acquire_hold(store.storage, "restore", [2])
    write_meta(store, meta(5, ["shared/a.sst", "shared/c.sst"]))
    report = execute_retention(store, plan)
    assert store.checkpoint_ids() == [2, 4, 5]
    assert store.storage.exists("shared/a.sst")
    assert "chk-2/_metadata" in report.spared and "shared/a.sst" in report.spared
    assert build_registry(store).missing() == []


def test_retain_reads_validation_reports(store):
    """A failed report on chk-4 (and an unreadable one on chk-3) keeps chk-2 as the last
    good checkpoint; dry run and text say why."""
    store.storage.write_bytes("reports/chk-4/summary.json", b'{"success": false}')
    store.storage.write_bytes("reports/chk-3/summary.json", b"{not json")
    store.storage.write_bytes("reports/chk-2/summary.json", b'{"success": true}')
    dry = retain(store, 1, dry_run=True)
    assert reasons(dry.plan) == {1: "beyond-keep", 2: KEEP_LAST_RESTORABLE,
                                 3: "keep-above-restorable", 4: "newest"}
    assert any("keep chk-2: the newest checkpoint that restores" in line
               for line in summarize_text(dry))
    retain(store, 1)
    assert store.checkpoint_ids() == [2, 3, 4]
    assert build_registry(store).missing() == []


def test_malformed_metadata_refuses_the_whole_plan(tmp_path):
    store = CheckpointStore(open_storage(f"file://{tmp_path}"), "j")
    for m in chain():
        write_meta(store, m)
    store.storage.write_bytes("chk-9/_metadata", b"\x00garbage")
    before = sorted(f.path for f in store.storage.walk_files(""))
    with pytest.raises(MetadataError):
        retain(store, 1)
    assert sorted(f.path for f in store.storage.walk_files("")) == before


def test_retiring_a_checkpoint_removes_its_validation_report(tmp_path):
    store = CheckpointStore(open_storage(f"file://{tmp_path}/s"), "j")
    for m in chain():
        write_meta(store, m)
    store.storage.write_bytes("reports/chk-1/summary.json", b"{}")
    store.storage.write_bytes("reports/chk-4/summary.json", b"{}")
    retain(store, 2)
    assert not store.storage.exists("reports/chk-1/summary.json")
    assert store.storage.exists("reports/chk-4/summary.json")


def test_run_history_beyond_the_newest_is_planned_then_pruned(store):
    """Runs only write their outcome; retention prunes the history (plan, dry run, execute)."""
    from statebackend.checkpoint.runs import RunOutcome, record_outcome

    for i in range(5):
        record_outcome(store.storage, RunOutcome(f"run-{i}", "committed", None,
                                                 f"2026-11-2{i}T00:00:00+00:00", 1.0, None))
    history = [f.path for f in store.storage.walk_files("runs/history")]
    assert len(history) == 5  # a run never prunes
    plan = plan_retention(build_registry(store), 4, history_kept=2)
    planned = [a.path for a in plan.deletions if a.reason == DEL_OLD_HISTORY]
    assert planned == history[:3]  # the oldest (names start with the UTC start time)
    dry = retain(store, 4, dry_run=True)
    assert dry.files_deleted == 0 and len(store.storage.walk_files("runs/history")) == 5
    report = execute_retention(store, plan)
    assert {a.path for a in report.deleted} == set(history[:3])
    assert [f.path for f in store.storage.walk_files("runs/history")] == history[3:]
    assert store.checkpoint_ids() == [1, 2, 3, 4]  # nothing else retired with keep 4


def test_one_lister_of_committed_checkpoints(store):
    store.storage.write_bytes("chk-7/0/s/CURRENT", b"an attempt that never committed")
    assert store.checkpoint_ids() == [1, 2, 3, 4]
    assert store.checkpoint_dirs() == [1, 2, 3, 4, 7]
    # ids the caller knows are committed are not checked again; unknown folders are
    assert store.checkpoint_ids(known={1, 2, 3, 4}) == [1, 2, 3, 4]
    store.storage.delete_many(["chk-4/_metadata"])
    assert store.checkpoint_ids() == [1, 2, 3]
    assert build_registry(store).checkpoints.keys() == {1, 2, 3}
