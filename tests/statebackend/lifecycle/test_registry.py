"""Registry: pure indexing (no storage) and building from a real job root."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from statebackend.checkpoint.leases import Lease, acquire_hold
from statebackend.checkpoint.metadata import CheckpointMetadata, FileRef, SubtaskHandle
from statebackend.checkpoint.store import CheckpointStore
from statebackend.errors import MetadataError
from statebackend.lifecycle.registry import build_registry, make_registry
from statebackend.storage import FileInfo, open_storage

NOW = datetime(2026, 11, 21, 12, 0, tzinfo=UTC)


def meta(cid: int, shared=(), private=None, job: str = "j", kind: str = "checkpoint",
         savepoint: str | None = None) -> CheckpointMetadata:
    """Synthetic one-subtask metadata; private defaults to chk-<id>/0/s/MANIFEST; a
    checkpoint's parent is the id before it (a linear lineage, checkpoint/lineage.py)."""
    if private is None:
        private = (f"chk-{cid}/0/s/MANIFEST",)
    refs = lambda paths: tuple(FileRef(p, p.rsplit("/", 1)[-1], 10, "crc32:0") for p in paths)  # noqa: E731
    sub = SubtaskHandle(0, 0, 127, "b", "s", refs(shared), refs(private))
    parent = cid - 1 if kind != "savepoint" and cid > 1 else None
    return CheckpointMetadata(job=job, checkpoint_id=cid, parent=parent, parallelism=1,
                              max_parallelism=128, states=({"name": "v"},), subtasks=(sub,),
                              kind=kind)


def info(path: str, age: float | None = 7200.0, size: int = 10) -> FileInfo:
    return FileInfo(path, size, None if age is None else NOW.timestamp() - age)


def lease(name: str, ids, ttl: float = 600.0, created_ago: float = 60.0) -> Lease:
    return Lease(name, "h:1", "test", tuple(ids), (NOW + timedelta(seconds=ttl)).isoformat(),
                 (NOW - timedelta(seconds=created_ago)).isoformat())


def test_references_orphans_missing():
    m1 = meta(1, ["shared/a.sst", "shared/b.sst"])
    m2 = meta(2, ["shared/b.sst", "shared/c.sst"])
    sp = meta(1, ["savepoints/x/0/a.sst"], private=["savepoints/x/0/MANIFEST"], kind="savepoint")
    files = [info(p) for p in ("shared/a.sst", "shared/b.sst", "shared/c.sst", "shared/old.sst",
                               "chk-1/_metadata", "chk-1/0/s/MANIFEST", "chk-2/_metadata",
                               "chk-3/0/t/MANIFEST", "savepoints/x/0/a.sst",
                               "savepoints/x/0/MANIFEST", "savepoints/x/_metadata",
                               "reports/chk-1/summary.json", "leases/writer.json")]
    reg = make_registry(job="j", now=NOW, files=files, checkpoints=[m2, m1],
                        savepoints={"x": sp})
    assert reg.owners_of("shared/b.sst") == ("chk-1", "chk-2")
    assert reg.owners_of("savepoints/x/0/a.sst") == ("savepoint:x",)
    assert [o.path for o in reg.orphans()] == ["chk-3/0/t/MANIFEST", "shared/old.sst"]
    assert reg.missing() == ["chk-2/0/s/MANIFEST"]
    assert reg.bytes_referenced() == 10 * len(reg.referenced)
    summary = reg.to_json()
    assert summary["checkpoints"] == [1, 2] and summary["orphans"] == 2


def test_live_and_expired_leases():
    reg = make_registry(job="j", now=NOW, files=[], checkpoints=[meta(1), meta(2)],
                        leases=[lease("hold-a", [1]), lease("hold-b", [2], ttl=-1),
                                lease("writer", [1, 2])])
    assert reg.held_ids() == {1: ("hold-a", "writer"), 2: ("writer",)}
    assert reg.live_writer().name == "writer"
    assert [x.name for x in reg.live_leases] == ["hold-a", "writer"]


@pytest.fixture
def store(storage_url):
    return CheckpointStore(open_storage(storage_url), "j")


def write_meta(store: CheckpointStore, m: CheckpointMetadata) -> None:
    for ref in m.files:
        store.storage.write_bytes(ref.path, b"x" * ref.size)
    store.commit(m)


def test_build_registry_from_storage(store):
    write_meta(store, meta(1, ["shared/a.sst"]))
    write_meta(store, meta(2, ["shared/a.sst", "shared/b.sst"]))
    store.storage.write_bytes("shared/orphan.sst", b"o")
    store.storage.write_bytes("savepoints/broken/0/x.sst", b"o")  # no _metadata: incomplete
    acquire_hold(store.storage, "validation", [1])
    reg = build_registry(store)
    assert sorted(reg.checkpoints) == [1, 2]
    assert reg.owners_of("shared/a.sst") == ("chk-1", "chk-2")
    assert [o.path for o in reg.orphans()] == ["shared/orphan.sst"]
    assert reg.incomplete_savepoints == ("broken",)
    assert reg.held_ids() == {1: (reg.leases[0].name,)}
    assert reg.missing() == []
    assert all(f.mtime is not None for f in reg.files.values())
    # the thread pool changes nothing
    assert build_registry(store, threads=1).owner_paths == reg.owner_paths


def test_malformed_metadata_and_lease_are_refused(tmp_path):
    store = CheckpointStore(open_storage(f"file://{tmp_path}"), "j")
    write_meta(store, meta(1, ["shared/a.sst"]))
    store.storage.write_bytes("chk-2/_metadata", b'{"format_version": 1, "job": "j"')
    with pytest.raises(MetadataError, match="chk-2/_metadata"):
        build_registry(store)
    store.storage.delete_many(["chk-2/_metadata"])
    store.storage.write_bytes("leases/hold-x.json", b'{"format_version": 1}')
    with pytest.raises(MetadataError, match="malformed lease"):
        build_registry(store)


@pytest.mark.parametrize("rel", ["chk-2/_metadata", "leases/hold-x.json"])
def test_deeply_nested_record_is_refused_naming_the_file(tmp_path, rel):
    store = CheckpointStore(open_storage(f"file://{tmp_path}"), "j")
    write_meta(store, meta(1, ["shared/a.sst"]))
    store.storage.write_bytes(rel, b"[" * 100_000 + b"]" * 100_000)
    with pytest.raises(MetadataError, match=f"malformed .*j/{rel}: JSON nested too deeply"):
        build_registry(store)


def test_many_checkpoints_read_in_parallel(tmp_path):
    store = CheckpointStore(open_storage(f"file://{tmp_path}"), "j")
    for cid in range(1, 201):
        write_meta(store, meta(cid, [f"shared/{cid % 7}.sst"]))  # commit checks the files
    reg = build_registry(store)
    assert len(reg.checkpoints) == 200
    assert len(reg.owners_of("shared/0.sst")) == 28


def test_fast_parse_equals_from_bytes_and_rejects_the_same():
    from statebackend.checkpoint.metadata import parse_metadata

    m = meta(3, ["shared/a.sst", "shared/b.sst"])
    memo: dict = {}
    assert parse_metadata(m.to_bytes(), "w", memo) == CheckpointMetadata.from_bytes(
        m.to_bytes(), "w")
    assert parse_metadata(m.to_bytes(), "w", memo) == m  # memo hits give equal refs
    bad = m.to_json()
    bad["subtasks"][0]["shared_files"][0]["path"] = "../../etc/passwd"
    import json

    with pytest.raises(MetadataError, match="escapes"):
        parse_metadata(json.dumps(bad).encode(), "w", memo)
    bad["subtasks"][0]["shared_files"][0].update(path="shared/a.sst", size=True)
    with pytest.raises(MetadataError, match="size"):
        parse_metadata(json.dumps(bad).encode(), "w", memo)
    with pytest.raises(MetadataError, match="not valid JSON"):
        parse_metadata(b"{", "w", memo)
