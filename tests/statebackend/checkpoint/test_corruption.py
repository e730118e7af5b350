"""Storage corruption must fail loudly or be repaired, never be carried forward (issue 10).

Defect 1: a damaged data block inside an SST whose recorded checksum matches (corruption
before upload) made every full scan end early without an error: ``ckpt dump`` wrote half
the rows, ``validate --deep`` passed, rescale dropped the damaged subtask's keys.

Defect 6: a shared SST damaged *in storage* was referenced again after a local recovery
(local-instance / local-snapshot restores read nothing from storage).
"""

from __future__ import annotations

import json
import os

import pytest

from statebackend.checkpoint.dump import checkpoint_rows
from statebackend.checkpoint.metadata import CheckpointMetadata, FileRef
from statebackend.checkpoint.restore import (
    DEFAULT_REUSE_CHECK,
    FROM_STORAGE,
    RestoreOptions,
    ReuseCheck,
    restore_subtask,
    restored_readonly,
)
from statebackend.checkpoint.snapshot import checkpoint_backends
from statebackend.checkpoint.store import CheckpointStore, metadata_path
from statebackend.cli import app as cli
from statebackend.errors import CkptError, CorruptStateError, StorageError
from statebackend.rescale import executor
from statebackend.rescale.executor import RescaleOptions, rescale
from statebackend.state.kinds import StateDescriptor
from statebackend.state.sst import export_sst
from statebackend.storage import checksum_algorithm, checksum_of_bytes, open_storage
from statebackend.validation.validate import ValidationOptions, validate_checkpoint
from tests.statebackend.helpers import (
    DESCRIPTORS,
    close_all,
    dump_backends,
    fill,
    keys,
    open_backends,
    recommit_record,
    route,
)

M = 128
JOB = "orders"


# -- builders ----------------------------------------------------------------------

def full_checkpoint(tmp_path, url: str, p: int = 2, n: int = 5000
                    ) -> tuple[CheckpointStore, CheckpointMetadata, list[dict]]:
    """Checkpoint 1 of ``p`` subtasks holding every state kind; returns its rows too."""
    store = CheckpointStore(open_storage(url), JOB)
    backends = open_backends(str(tmp_path / "src"), p, M)
    try:
        fill(backends, keys(n))
        expected = dump_backends(backends)
        meta = checkpoint_backends(store, backends, parent=None, run_id="r1")
    finally:
        close_all(backends)
    return store, meta, expected


def sst_of_state(store: CheckpointStore, meta: CheckpointMetadata, subtask: int,
                 state: str) -> FileRef:
    """The shared SST of ``subtask`` that holds ``state`` (its name is in the SST properties)."""
    refs = [f for f in meta.subtasks[subtask].shared_files
            if state.encode() in store.storage.read_bytes(f.path)]
    assert refs, f"no SST of state {state!r} in subtask {subtask}"
    return max(refs, key=lambda f: f.size)


def flip_bytes(data: bytes, at: int, n: int = 64) -> bytes:
    out = bytearray(data)
    for i in range(at, at + n):
        out[i] ^= 0xFF
    return bytes(out)


def damage_block_before_upload(store: CheckpointStore, checkpoint_id: int, ref: FileRef) -> None:
    """Flip bytes in a data block (first third, far from the footer), then record the new
    checksum in ``_metadata``: the file looks intact to every file-level check."""
    data = flip_bytes(store.storage.read_bytes(ref.path), len(store.storage.read_bytes(
        ref.path)) // 3)
    store.storage.write_bytes(ref.path, data)
    raw = json.loads(store.storage.read_bytes(metadata_path(checkpoint_id)))
    for st in raw["subtasks"]:
        for f in st["shared_files"]:
            if f["path"] == ref.path:
                f["checksum"] = checksum_of_bytes(data, checksum_algorithm(f["checksum"]))
                f["size"] = len(data)
    recommit_record(store, checkpoint_id, json.dumps(raw).encode())


@pytest.fixture
def damaged(tmp_path):
    """Checkpoint 1 (P=2) whose subtask 1 SST of value state 'totals' has a bad block."""
    store, meta, expected = full_checkpoint(tmp_path, f"file://{tmp_path}/store")
    ref = sst_of_state(store, meta, 1, "totals")
    damage_block_before_upload(store, meta.checkpoint_id, ref)
    return store, store.load(meta.checkpoint_id), expected, ref


# -- defect 1: every full scan checks the iterator's status ------------------------------

def test_dump_cli_fails_with_one_line_and_writes_no_file(damaged, tmp_path, capsys):
    store, meta, expected, ref = damaged
    out = tmp_path / "dump.jsonl"
    code = cli.main(["--storage", store.root_storage.url, "--job", JOB, "dump", "--out",
                     str(out)])
    err = capsys.readouterr().err
    assert code != 0
    assert len(err.strip().splitlines()) == 1, err
    assert "Corruption" in err and "subtask 1 of checkpoint 1" in err and ref.path in err
    assert "'totals'" in err
    assert not out.exists() and not [p for p in os.listdir(tmp_path) if ".tmp-" in p]


def test_dump_of_intact_checkpoint_still_equals_the_source(tmp_path):
    store, meta, expected = full_checkpoint(tmp_path, f"file://{tmp_path}/store", n=1000)
    out = tmp_path / "dump.jsonl"
    assert cli.main(["--storage", store.root_storage.url, "--job", JOB, "dump", "--out",
                     str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows == json.loads(json.dumps(expected))


def test_every_scan_entry_point_raises(damaged):
    store, meta, _, ref = damaged
    handle = meta.subtasks[1]
    with restored_readonly(store.storage, handle, DESCRIPTORS, M) as be:
        with pytest.raises(CorruptStateError, match="column family 'totals'"):
            be.count_rows()
        with pytest.raises(CorruptStateError, match=ref.path):
            list(be.iter_raw("totals"))
        for values in (True, False):  # the bulk read: silent bulk iterators + checked tail
            with pytest.raises(CorruptStateError, match=ref.path):
                be.read_raw("totals", values=values)
        with pytest.raises(CorruptStateError):
            be.count_keys("totals", be.key_group_range)
        with pytest.raises(CorruptStateError, match=ref.path):  # streamed into an SST
            export_sst(os.path.join(be.local_dir, "export.sst"), be, "totals",
                       be.key_group_range)
        # the other column families are intact and scan to the end
        assert be.count_keys("events") == handle.row_counts["events"]
    with pytest.raises(CorruptStateError, match="subtask 1 of checkpoint 1"):
        list(checkpoint_rows(store, meta))


def test_map_state_items_raises_instead_of_returning_fewer_entries(tmp_path):
    store, meta, expected = full_checkpoint(tmp_path, f"file://{tmp_path}/store")
    damage_block_before_upload(store, 1, sst_of_state(store, meta, 0, "attrs"))
    meta = store.load(1)
    want: dict[str, dict] = {}
    for r in expected:
        if r["state"] == "attrs" and r["subtask"] == 0:
            want.setdefault(r["key"], {})[r["user_key"]] = r["value"]
    failed = 0
    with restored_readonly(store.storage, meta.subtasks[0], DESCRIPTORS, M) as be:
        attrs = be.map_state("attrs")
        for key, entries in want.items():
            try:
                got = dict(attrs.items(key))
            except CorruptStateError:
                failed += 1
                continue
            assert got == entries, key  # never a silently shortened map
    assert 0 < failed < len(want)


def test_deep_validation_fails_on_a_damaged_block(damaged):
    store, meta, _, _ = damaged
    result = validate_checkpoint(store, 1, ValidationOptions(level="deep"))
    assert not result.success
    assert "subtasks_restore" in result.failed_checks
    check = next(c for c in result.summary["checks"] if c["name"] == "subtasks_restore")
    (row,) = check["offending_rows"]
    assert row["subtask"] == 1 and "Corruption" in row["restore_error"]


@pytest.mark.parametrize("damaged_subtask,q,engine", [
    (0, 1, "spark"), (1, 1, "spark"), (1, 4, "spark"), (0, 1, "processes"), (1, 1, "processes")])
def test_rescale_fails_and_commits_nothing(spark, tmp_path, monkeypatch, damaged_subtask, q,
                                           engine):
    """P=2 -> 1: the damaged subtask is either the base kept whole (counted with a
    checked scan) or the exported import; P=2 -> 4: the bases are compacted (counted
    from the compaction's output, no scan: the compaction reads every block). As Spark
    tasks, or locally with the imports exported in worker processes (the error crosses
    the process boundary as the same line)."""
    url = f"file://{tmp_path}/store"
    store, meta, _ = full_checkpoint(tmp_path, url)
    ref = sst_of_state(store, meta, damaged_subtask, "totals")
    damage_block_before_upload(store, 1, ref)
    before = state_files(store)
    options = RescaleOptions()
    if engine == "processes":
        monkeypatch.setattr(executor, "IMPORT_PROCESSES_FROM_BYTES", 0)
        monkeypatch.setattr(executor, "IMPORT_PROCESSES_COLD_FROM_BYTES", 0)
        options = RescaleOptions(engine="local")
    with pytest.raises(CkptError, match="Corruption") as info:
        rescale(store, "latest", q, spark=spark, options=options)
    assert f"subtask {damaged_subtask} of checkpoint 1" in str(info.value)
    assert "\n" not in str(info.value)
    assert store.checkpoint_ids() == [1]
    assert state_files(store) == before  # nothing committed, nothing left behind


def state_files(store: CheckpointStore) -> list[str]:
    return sorted(f.path for f in store.storage.walk_files("")
                  if f.path.startswith(("shared/", "chk-")))


# -- defect 6: local recovery must not reference a file damaged in storage ---------------

VALUES = (StateDescriptor("totals", "value"),)


def value_checkpoint(tmp_path, url: str, n: int = 4000
                     ) -> tuple[CheckpointStore, CheckpointMetadata, dict, str]:
    """Checkpoint 1 of two subtasks of one value state; returns the dict reference too."""
    store = CheckpointStore(open_storage(url), JOB)
    work = str(tmp_path / "work")
    backends = open_backends(work, 2, M, VALUES)
    reference = put(backends, {k: {"v": i} for i, k in enumerate(keys(n))})
    meta = checkpoint_backends(store, backends, parent=None)
    close_all(backends)
    return store, meta, reference, work


def put(backends, values: dict) -> dict:
    ks = list(values)
    for b, idx in zip(backends, route(ks, M, len(backends)), strict=True):
        if idx:
            b.value_state("totals").put_many([ks[i] for i in idx], [values[ks[i]] for i in idx])
    return values


def restore_local(store, meta, work, check: ReuseCheck = DEFAULT_REUSE_CHECK):
    return [restore_subtask(store.storage, h, os.path.join(work, f"sub-{h.index}"), VALUES, M,
                            RestoreOptions(reuse_check=check)) for h in meta.subtasks]


def assert_all_referenced_files_intact(store: CheckpointStore, meta: CheckpointMetadata) -> None:
    for f in meta.files:
        assert store.storage.checksum(f.path, checksum_algorithm(f.checksum)) == \
            (f.size, f.checksum), f.path


def fresh_state(store: CheckpointStore, meta: CheckpointMetadata, where: str) -> dict:
    out = {}
    for h in meta.subtasks:
        with restore_subtask(store.storage, h, where + f"/sub-{h.index}", VALUES, M,
                             FROM_STORAGE) as b:
            assert b.restore_mode == "download"
            out.update({r["key"]: r["value"] for r in dump_backends([b])})
    return out


def continue_and_check(store, meta, backends, reference, damaged_ref, tmp_path) -> None:
    """Next run on the recovered instances: new checkpoint must hold only intact files."""
    try:
        b = backends[1]
        assert b.reuploaded == (damaged_ref.path,)
        assert damaged_ref.local_name not in b.uploaded
        updates = {k: {"v": -1} for k in list(reference)[::10]}
        reference = {**reference, **put(backends, updates)}
        second = checkpoint_backends(store, backends, parent=meta.checkpoint_id)
    finally:
        close_all(backends)
    assert damaged_ref.path not in {f.path for f in second.files}
    reuploaded = [f for f in second.subtasks[1].shared_files
                  if f.local_name == damaged_ref.local_name]
    assert len(reuploaded) == 1 and reuploaded[0].checksum == damaged_ref.checksum
    assert_all_referenced_files_intact(store, second)
    assert fresh_state(store, second, str(tmp_path / "fresh")) == reference


def largest_shared(meta: CheckpointMetadata, subtask: int) -> FileRef:
    return max(meta.subtasks[subtask].shared_files, key=lambda f: f.size)


@pytest.mark.parametrize("dirty", [False, True], ids=["local-instance", "local-snapshot"])
def test_truncated_shared_file_is_found_by_sizes_and_uploaded_again(durable_storage_url,
                                                                   tmp_path, dirty):
    store, meta, reference, work = value_checkpoint(tmp_path, durable_storage_url)
    victim = largest_shared(meta, 1)
    store.storage.write_bytes(victim.path, store.storage.read_bytes(victim.path)[:-100])
    if dirty:  # a write after the snapshot: the instance is not clean, the snapshot is
        (b,) = [restore_subtask(store.storage, meta.subtasks[1], f"{work}/sub-1", VALUES, M,
                                RestoreOptions(reuse_check=None))]
        b.value_state("totals").put(next(k for k in reference if k in _keys_of(b)), {"v": 0})
        b.close()
    backends = restore_local(store, meta, work, ReuseCheck(checksum_sample=0))  # sizes only
    expected_mode = "local-snapshot" if dirty else "local-instance"
    assert [b.restore_mode for b in backends] == ["local-instance", expected_mode]
    report = backends[1].reuse_report
    assert report.checksums_checked == 0
    assert report.sizes_checked == len(meta.subtasks[1].shared_files)
    assert report.damaged == (f"{victim.path}: {victim.size - 100} bytes, recorded "
                              f"{victim.size}",)
    assert backends[0].reuploaded == ()
    continue_and_check(store, meta, backends, reference, victim, tmp_path)


def _keys_of(backend) -> set[str]:
    return {r["key"] for r in dump_backends([backend])}


@pytest.mark.parametrize("check", [ReuseCheck(checksum_all=True),
                                   ReuseCheck(checksum_sample=1000)], ids=["all", "sample"])
def test_same_size_damage_is_found_by_checksums(durable_storage_url, tmp_path, check):
    store, meta, reference, work = value_checkpoint(tmp_path, durable_storage_url)
    victim = largest_shared(meta, 1)
    data = store.storage.read_bytes(victim.path)
    store.storage.write_bytes(victim.path, flip_bytes(data, len(data) // 3))
    backends = restore_local(store, meta, work, check)
    assert [b.restore_mode for b in backends] == ["local-instance", "local-instance"]
    n_shared = len(meta.subtasks[1].shared_files)
    assert backends[1].reuse_report.checksums_checked == n_shared
    continue_and_check(store, meta, backends, reference, victim, tmp_path)


def test_sizes_alone_do_not_see_same_size_damage(tmp_path):
    """Why checksums are sampled: the size probe cannot see a same-size change."""
    store, meta, _, work = value_checkpoint(tmp_path, f"file://{tmp_path}/store")
    victim = largest_shared(meta, 1)
    data = store.storage.read_bytes(victim.path)
    store.storage.write_bytes(victim.path, flip_bytes(data, len(data) // 3))
    backends = restore_local(store, meta, work, ReuseCheck(checksum_sample=0))
    try:
        assert backends[1].reuploaded == ()
    finally:
        close_all(backends)


def test_damaged_remote_and_damaged_local_copy_fail_loudly(tmp_path):
    store, meta, _, work = value_checkpoint(tmp_path, f"file://{tmp_path}/store")
    victim = largest_shared(meta, 1)
    store.storage.write_bytes(victim.path, b"gone")
    local = os.path.join(work, "sub-1", "db", victim.local_name)
    with open(local, "r+b") as fh:  # in place: the local snapshot's hard link changes too
        fh.seek(os.path.getsize(local) // 3)
        fh.write(b"\x00" * 64)
    with pytest.raises(StorageError, match="neither can be trusted") as info:
        restore_subtask(store.storage, meta.subtasks[1], os.path.join(work, "sub-1"), VALUES, M)
    assert victim.path in str(info.value) and local in str(info.value)


def test_default_restore_checks_sizes(tmp_path):
    """The job's restore (defaults) catches a missing shared file without being asked."""
    store, meta, _, work = value_checkpoint(tmp_path, f"file://{tmp_path}/store")
    victim = largest_shared(meta, 0)
    store.storage.delete_many([victim.path])
    backends = restore_local(store, meta, work)
    try:
        assert backends[0].reuploaded == (victim.path,)
        assert backends[0].reuse_report.damaged == (f"{victim.path}: missing",)
    finally:
        close_all(backends)


# -- defect 6: validation names every checkpoint that references a damaged file ----------

@pytest.mark.parametrize("deep", [False, True], ids=["manifest", "deep"])
@pytest.mark.parametrize("damage", ["truncate", "same-size"])
def test_validation_names_the_damaged_file(tmp_path, deep, damage):
    store, meta, reference, work = value_checkpoint(tmp_path, f"file://{tmp_path}/store")
    backends = restore_local(store, meta, work)
    put(backends, {k: {"v": 7} for k in list(reference)[:50]})
    checkpoint_backends(store, backends, parent=1)  # chk-2 references chk-1's SSTs
    close_all(backends)
    victim = next(f for f in store.load(2).files if f.path in {g.path for g in meta.files}
                  and f.path.startswith("shared/"))
    data = store.storage.read_bytes(victim.path)
    bad = data[:-10] if damage == "truncate" else flip_bytes(data, len(data) // 3)
    store.storage.write_bytes(victim.path, bad)
    check = "file_sizes_match" if damage == "truncate" else "file_checksums_match"
    for cid in (1, 2):
        result = validate_checkpoint(store, cid, ValidationOptions(
            level="deep" if deep else "manifest"))
        assert not result.success
        assert check in result.failed_checks
        stored = json.loads(store.storage.read_bytes(f"reports/chk-{cid}/summary.json"))
        assert stored["success"] is False
        failed = next(c for c in stored["checks"] if c["name"] == check)
        assert [r["path"] for r in failed["offending_rows"]] == [victim.path]


def test_deep_validation_names_a_damaged_file_of_a_refused_record(tmp_path):
    """Nothing restores when the strict parser refuses the record: checksums still run."""
    store, meta, _, _ = value_checkpoint(tmp_path, f"file://{tmp_path}/store")
    victim = largest_shared(meta, 0)
    data = store.storage.read_bytes(victim.path)
    store.storage.write_bytes(victim.path, flip_bytes(data, len(data) // 3))
    raw = json.loads(store.storage.read_bytes(metadata_path(1)))
    raw["subtasks"][1]["private_files"].append(
        {"path": "../outside", "local_name": "X", "size": 1, "checksum": "crc32c:00000000"})
    recommit_record(store, 1, json.dumps(raw).encode())
    result = validate_checkpoint(store, 1, ValidationOptions(level="deep"))
    assert not result.success
    assert {"metadata_parses", "file_checksums_match"} <= set(result.failed_checks)
    failed = next(c for c in result.summary["checks"] if c["name"] == "file_checksums_match")
    assert [r["path"] for r in failed["offending_rows"]] == [victim.path]

