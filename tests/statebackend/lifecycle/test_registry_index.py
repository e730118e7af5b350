"""Registry index (issue 14): a warm build plans like a cold one, and never deletes on
its own say: a stale entry is re-parsed, a damaged index is ignored, and a tampered
one (even with a valid digest) can mislead a plan but not the executors. Signed with
this host's key (issue 26), it spares the executors the records it vouches for, and
a tampered or foreign index is not signed: executors read the records, and the next
build that writes the index parses them all again."""

from __future__ import annotations

import hashlib
import json
import os
import time

import pytest

from statebackend.checkpoint.store import CheckpointStore, metadata_path
from statebackend.errors import MetadataError, UsageError
from statebackend.lifecycle import index_signing
from statebackend.lifecycle.gc import collect_garbage, plan_gc
from statebackend.lifecycle.registry import INDEX_FILE, build_registry, parse_index
from statebackend.lifecycle.retention import plan_retention, retain
from statebackend.storage import open_storage
from tests.statebackend.lifecycle.test_registry import meta, write_meta


@pytest.fixture
def store(tmp_path):
    """chk-1..4 on file://: a.sst in 1-2, b.sst in 2-4, c.sst in 3-4; an old orphan."""
    s = CheckpointStore(open_storage(f"file://{tmp_path}/store"), "j")
    for m in (meta(1, ["shared/a.sst"]), meta(2, ["shared/a.sst", "shared/b.sst"]),
              meta(3, ["shared/b.sst", "shared/c.sst"]), meta(4, ["shared/b.sst", "shared/c.sst"])):
        write_meta(s, m)
    s.storage.write_bytes("shared/orphan.sst", b"o")
    old = os.path.getmtime(s.storage.abspath("shared/orphan.sst")) - 7200
    os.utime(s.storage.abspath("shared/orphan.sst"), (old, old))
    return s


@pytest.fixture(params=["signed", "unsigned"])
def signing(request, monkeypatch, tmp_path) -> bool:
    """Indexes signed with a key of this test, or never (``CKPT_INDEX_KEY_FILE=off``)."""
    signed = request.param == "signed"
    monkeypatch.setenv("CKPT_INDEX_KEY_FILE", str(tmp_path / "key") if signed else "off")
    return signed


def plans(registry) -> tuple:
    return (plan_retention(registry, 1).to_json(), plan_gc(registry, grace_seconds=60).to_json())


def files(store) -> set[str]:
    return {f.path for f in store.storage.walk_files("") if not f.path.startswith("_index/")}


def rewrite_index(store, change) -> None:
    """Edit the index body and sign it again: the digest no longer protects anything."""
    head, _, body = store.storage.read_bytes(INDEX_FILE).partition(b"\n")
    obj = json.loads(body)
    change(obj)
    body = json.dumps(obj).encode()
    header = dict(json.loads(head), sha256=hashlib.sha256(body).hexdigest())
    store.storage.write_bytes(INDEX_FILE, json.dumps(header).encode() + b"\n" + body)


def entry_positions(obj: dict) -> dict[int, list[int]]:
    """Each checkpoint's positions into ``paths`` (format /2: one blob, counts per id)."""
    import base64
    from array import array

    blob = array("I")
    blob.frombytes(base64.b64decode(obj["refs"]))
    out, start = {}, 0
    for cid, count in zip(obj["ids"], obj["counts"], strict=True):
        out[cid] = list(blob[start:start + count])
        start += count
    return out


def set_entry_positions(obj: dict, positions: dict[int, list[int]]) -> None:
    import base64
    from array import array

    obj["counts"] = [len(positions[cid]) for cid in obj["ids"]]
    blob = array("I", [i for cid in obj["ids"] for i in positions[cid]])
    obj["refs"] = base64.b64encode(blob.tobytes()).decode()


def entry_paths(obj: dict, checkpoint_id: int) -> list[str]:
    return [obj["paths"][i] for i in entry_positions(obj)[checkpoint_id]]


def set_entry_paths(obj: dict, checkpoint_id: int, paths: list[str]) -> None:
    for p in paths:
        if p not in obj["paths"]:
            obj["paths"].append(p)
            obj["sizes"].append(10)
    positions = entry_positions(obj)
    positions[checkpoint_id] = [obj["paths"].index(p) for p in paths]
    set_entry_positions(obj, positions)


def test_warm_build_plans_exactly_like_a_cold_one(store):
    now = time.time()
    cold = build_registry(store, use_index=False, now=now)
    assert not store.storage.exists(INDEX_FILE)  # only update_index writes it
    build_registry(store, update_index=True)
    warm = build_registry(store, now=now)
    assert warm.indexed_ids == {1, 2, 3, 4} and cold.indexed_ids == frozenset()
    assert warm.owner_paths == cold.owner_paths and warm.referenced == cold.referenced
    assert plans(warm) == plans(cold)
    assert warm.checkpoints[4] == cold.checkpoints[4]  # the real record, read on access


def test_a_changed_record_is_parsed_again_and_refused_when_malformed(store):
    build_registry(store, update_index=True)
    path = store.storage.abspath(metadata_path(1))
    os.chmod(path, 0o644)
    with open(path, "wb") as fh:
        fh.write(b"{not json")
    with pytest.raises(MetadataError, match="chk-1/_metadata"):
        build_registry(store)
    with pytest.raises(MetadataError, match="chk-1/_metadata"):
        collect_garbage(store, grace_seconds=0)


def test_a_new_checkpoint_extends_the_index_and_a_retired_one_leaves_it(store):
    build_registry(store, update_index=True)
    write_meta(store, meta(5, ["shared/c.sst", "shared/d.sst"]))
    reg = build_registry(store, update_index=True)
    assert reg.indexed_ids == {1, 2, 3, 4} and "shared/d.sst" in reg.owner_paths["chk-5"]
    retain(store, 2)
    after = build_registry(store)
    assert sorted(after.checkpoints) == [4, 5] and after.indexed_ids == {4, 5}
    assert after.referenced == build_registry(store, use_index=False).referenced


@pytest.mark.parametrize("damage", [b"", b"garbage", b"{}\n{}"])
def test_a_damaged_index_is_ignored(store, damage):
    now = time.time()
    cold = build_registry(store, use_index=False, now=now)
    store.storage.write_bytes(INDEX_FILE, damage)
    warm = build_registry(store, now=now)
    assert warm.indexed_ids == frozenset() and plans(warm) == plans(cold)


def test_an_edited_index_with_a_wrong_digest_is_ignored(store):
    build_registry(store, update_index=True)
    data = store.storage.read_bytes(INDEX_FILE).replace(b"shared/c.sst", b"shared/x.sst")
    store.storage.write_bytes(INDEX_FILE, data)
    assert build_registry(store).indexed_ids == frozenset()


def test_tampered_index_never_makes_gc_delete_a_referenced_file(store, signing):
    build_registry(store, update_index=True)
    rewrite_index(store, lambda obj: [set_entry_paths(obj, c, []) for c in (1, 2, 3, 4)])
    before = files(store)
    plan = plan_gc(build_registry(store), grace_seconds=0)
    # the tampered index does mislead a plan ...
    assert {"shared/b.sst", "shared/c.sst"} <= {f.path for f in plan.deletions}
    assert plan.indexed_ids == (1, 2, 3, 4)  # ... that the executors check: not vouched for
    report = collect_garbage(store, grace_seconds=0)
    # ... so only the true orphan goes: without a key the executor re-reads the real
    # records; with one, GC's own build does not trust the index and parses them
    assert [f.path for f in report.deleted] == ["shared/orphan.sst"]
    assert files(store) == before - {"shared/orphan.sst"}
    assert ("shared/c.sst" in report.spared) is not signing
    assert (build_registry(store).vouched_before is not None) is signing


def test_tampered_index_never_makes_retention_delete_a_kept_or_unlisted_file(store, signing):
    build_registry(store, update_index=True)
    store.storage.write_bytes("runs/r1.json", b"{}")  # no checkpoint lists it

    def change(obj):
        set_entry_paths(obj, 4, ["chk-4/0/s/MANIFEST"])            # hides b.sst and c.sst
        set_entry_paths(obj, 3, ["chk-3/0/s/MANIFEST"])
        set_entry_paths(obj, 1, entry_paths(obj, 1) + ["runs/r1.json"])  # claims a file
    rewrite_index(store, change)
    plan = plan_retention(build_registry(store), 1)
    planned = {a.path for a in plan.deletions}
    assert {"shared/b.sst", "runs/r1.json"} <= planned  # misled plan
    report = retain(store, 1)
    deleted = {a.path for a in report.deleted}
    assert deleted.isdisjoint({"shared/b.sst", "shared/c.sst", "runs/r1.json"})
    assert {"shared/a.sst", metadata_path(1)} <= deleted  # what the real records release
    kept = store.load(4)
    assert all(store.storage.exists(f.path) for f in kept.files)
    assert store.storage.exists("runs/r1.json")


@pytest.mark.parametrize("change", [
    lambda obj: set_entry_positions(obj, {**entry_positions(obj), 2: [len(obj["paths"])]}),
    lambda obj: obj.update(counts=[c + 1 for c in obj["counts"]]),
    lambda obj: obj.update(ids=obj["ids"][::-1]),
    lambda obj: obj.update(record_mtimes=["x"] * len(obj["ids"])),
    lambda obj: obj.update(refs="not base64!"),
], ids=["position-beyond-table", "counts", "ids-order", "mtimes", "refs"])
def test_a_signed_index_with_bad_columns_is_ignored(store, change):
    now = time.time()
    cold = build_registry(store, use_index=False, now=now)
    build_registry(store, update_index=True)
    rewrite_index(store, change)
    warm = build_registry(store, now=now)
    assert warm.indexed_ids == frozenset() and plans(warm) == plans(cold)


def test_an_index_of_the_previous_format_is_ignored_then_rewritten(store):
    now = time.time()
    cold = build_registry(store, use_index=False, now=now)
    build_registry(store, update_index=True)
    head, _, body = store.storage.read_bytes(INDEX_FILE).partition(b"\n")
    store.storage.write_bytes(INDEX_FILE, head.replace(b"index/3", b"index/2") + b"\n" + body)
    assert build_registry(store, now=now).indexed_ids == frozenset()
    build_registry(store, update_index=True)
    warm = build_registry(store, now=now)
    assert warm.indexed_ids == {1, 2, 3, 4} and plans(warm) == plans(cold)


def test_a_path_at_two_positions_is_one_file_to_the_planners(store):
    """The index keys its table by (path, size): if a record of shared/b.sst says another
    size, b.sst sits at two positions. Retiring chk-2 (listing one) must not release
    b.sst while chk-4 (listing the other) keeps it."""
    build_registry(store, update_index=True)

    def change(obj):
        obj["paths"].append("shared/b.sst")
        obj["sizes"].append(11)
        positions = entry_positions(obj)
        twin = len(obj["paths"]) - 1
        first = obj["paths"].index("shared/b.sst")
        positions[2] = [twin if i == first else i for i in positions[2]]
        set_entry_positions(obj, positions)
    rewrite_index(store, change)
    warm = build_registry(store)
    assert warm.indexed_ids == {1, 2, 3, 4}
    planned = {a.path for a in plan_retention(warm, 1).deletions}
    assert "shared/a.sst" in planned and "shared/b.sst" not in planned
    assert warm.owners_of("shared/b.sst") == ("chk-2", "chk-3", "chk-4")


def _spy_reads(store) -> list[int]:
    read: list[int] = []
    real = store.read_records

    def spy(ids):
        ids = list(ids)
        read.extend(ids)
        return real(ids)

    store.read_records = spy
    return read


def _age(store, seconds: float, skip: tuple[str, ...] = ()) -> None:
    for f in store.storage.walk_files(""):
        if f.path not in skip and not f.path.startswith("_index/"):
            path = store.storage.abspath(f.path)
            then = os.path.getmtime(path) - seconds
            os.utime(path, (then, then))


def test_the_executor_reads_only_records_that_could_list_a_planned_deletion(store, monkeypatch):
    """Scenario 11 at scale: a record is written after the files it lists, so records
    older than the oldest planned deletion are not read again; a tampered index still
    cannot make GC delete a file that a newer record lists (unsigned indexes; signed ones:
    below)."""
    monkeypatch.setenv("CKPT_INDEX_KEY_FILE", "off")
    _age(store, 5 * 3600, skip=("shared/orphan.sst",))  # the lineage 5 h old, the orphan 2 h
    build_registry(store, update_index=True)
    plan = plan_gc(build_registry(store), grace_seconds=3600)
    assert [f.path for f in plan.deletions] == ["shared/orphan.sst"]
    assert plan.indexed_ids == ()  # no record is younger than the orphan: none re-read

    write_meta(store, meta(5, ["shared/c.sst", "shared/e.sst"]))  # committed now
    build_registry(store, update_index=True)
    rewrite_index(store, lambda obj: set_entry_paths(obj, 5, []))  # hides e.sst
    plan = plan_gc(build_registry(store), grace_seconds=0)
    assert {"shared/orphan.sst", "shared/e.sst"} <= {f.path for f in plan.deletions}
    assert plan.indexed_ids == (5,)
    read = _spy_reads(store)
    report = collect_garbage(store, grace_seconds=0)
    assert 5 in read and not {1, 2, 3, 4} & set(read)
    assert "shared/e.sst" in report.spared and store.storage.exists("shared/e.sst")
    assert "shared/orphan.sst" in {f.path for f in report.deleted}
    assert all(store.storage.exists(f.path) for f in store.load(5).files)


def test_a_signed_index_spares_the_executors_the_records_it_vouches_for(store, signing):
    """GC's worst case (issue 26): every orphan older than every record. A signed index
    vouches for records older than the listing it was built from, so the executor reads
    none of them; a record indexed within the slack of that listing is read."""
    _age(store, 5 * 3600)  # the lineage 5 h old, the orphan 7 h
    build_registry(store, update_index=True)
    registry = build_registry(store)
    assert registry.indexed_ids == {1, 2, 3, 4}
    assert (registry.vouched_before is not None) is signing
    plan = plan_gc(registry, grace_seconds=0)
    assert [f.path for f in plan.deletions] == ["shared/orphan.sst"]
    assert plan.indexed_ids == (() if signing else (1, 2, 3, 4))
    assert plan_retention(registry, 1).indexed_ids == (() if signing else (1, 2, 3, 4))

    write_meta(store, meta(5, ["shared/c.sst", "shared/e.sst"]))  # committed now
    store.storage.write_bytes("shared/orphan2.sst", b"o")
    _age(store, 7200, skip=tuple(f.path for f in store.storage.walk_files("")
                                 if not f.path.endswith("orphan2.sst")))
    build_registry(store, update_index=True)  # indexes chk-5 right after its commit
    registry = build_registry(store)
    assert registry.indexed_ids == {1, 2, 3, 4, 5}
    orphans = ["shared/orphan.sst", "shared/orphan2.sst"]
    plan = plan_gc(registry, grace_seconds=3600)
    assert [f.path for f in plan.deletions] == orphans
    assert plan.indexed_ids == ((5,) if signing else (1, 2, 3, 4, 5))
    read = _spy_reads(store)
    report = collect_garbage(store, grace_seconds=3600)
    assert [f.path for f in report.deleted] == orphans
    assert sorted(read) == ([5] if signing else [1, 2, 3, 4, 5])
    assert all(store.storage.exists(f.path) for f in store.load(5).files)


def test_only_this_hosts_key_signs_an_index(store, monkeypatch, tmp_path):
    """An index whose body was edited (digest recomputed, MAC kept), signed with another
    key, or copied from another job is not signed here: it still plans, the executors
    read every record it gave, and the next build that writes it parses every record."""
    monkeypatch.setenv("CKPT_INDEX_KEY_FILE", str(tmp_path / "ours"))
    build_registry(store, update_index=True)
    data = store.storage.read_bytes(INDEX_FILE)
    ours = index_signing.signing_key()
    assert ours is not None and json.loads(data.partition(b"\n")[0])["mac"]
    assert parse_index(data, "j", ours).signed
    assert not parse_index(data, "j", b"k" * 32).signed  # another host's key
    assert not parse_index(data, "j", None).signed       # no key
    copied = data.replace(b'"job": "j"', b'"job": "k"', 1)
    assert not parse_index(copied, "k", ours).signed     # another job's index

    rewrite_index(store, lambda obj: set_entry_paths(obj, 4, []))  # MAC kept, digest new
    tampered = build_registry(store)
    assert tampered.indexed_ids == {1, 2, 3, 4} and tampered.vouched_before is None
    assert tampered.ids_to_recheck() == (1, 2, 3, 4)

    monkeypatch.setenv("CKPT_INDEX_KEY_FILE", str(tmp_path / "theirs"))
    build_registry(store, update_index=True)  # their key: signed by them from now on
    monkeypatch.setenv("CKPT_INDEX_KEY_FILE", str(tmp_path / "ours"))
    foreign = build_registry(store)
    assert foreign.indexed_ids == {1, 2, 3, 4} and foreign.ids_to_recheck() == (1, 2, 3, 4)
    read = _spy_reads(store)
    rebuilt = build_registry(store, update_index=True)
    assert rebuilt.indexed_ids == frozenset() and sorted(read) == [1, 2, 3, 4]
    assert build_registry(store).vouched_before is not None


def test_hosts_sharing_a_store_key_trust_each_others_index(store, monkeypatch, tmp_path):
    """Two hosts with keys of their own (Kubernetes pods, each with an empty home) but
    the same store key (the provider's ``index_key_conn_id``): an index one writes
    vouches for its records on the other, whose executors then read none of them; a
    host opening the store without that key does not trust it."""
    shared = b"s" * 32
    _age(store, 5 * 3600)
    monkeypatch.setenv("CKPT_INDEX_KEY_FILE", str(tmp_path / "host-a"))
    build_registry(CheckpointStore(store.root_storage, "j", shared), update_index=True)
    monkeypatch.setenv("CKPT_INDEX_KEY_FILE", str(tmp_path / "host-b"))
    on_b = CheckpointStore(store.root_storage, "j", shared)
    registry = build_registry(on_b)
    assert registry.indexed_ids == {1, 2, 3, 4} and registry.vouched_before is not None
    read = _spy_reads(on_b)
    report = collect_garbage(on_b, grace_seconds=0)
    assert [f.path for f in report.deleted] == ["shared/orphan.sst"] and read == []
    without = build_registry(CheckpointStore(store.root_storage, "j"))  # host b's own key
    assert without.vouched_before is None and without.ids_to_recheck() == (1, 2, 3, 4)
    assert "s" * 32 not in repr(on_b)
    with pytest.raises(UsageError, match=r"^registry index key from connection 'k' has 5 "
                                         r"bytes; at least 16 are needed"):
        index_signing.checked_key(b"short", "connection 'k'")


def test_the_key_file_is_private_and_made_once(monkeypatch, tmp_path, caplog):
    path = tmp_path / "state" / "ckpt" / "index-key"
    monkeypatch.setenv("CKPT_INDEX_KEY_FILE", str(path))
    key = index_signing.signing_key()
    assert key is not None and len(key) == index_signing.KEY_BYTES
    assert path.stat().st_mode & 0o777 == 0o600
    assert path.parent.stat().st_mode & 0o777 == 0o700
    index_signing._key_at.cache_clear()
    assert index_signing.signing_key() == key  # read back, not made again

    loose = tmp_path / "loose"
    loose.write_bytes(b"s" * 32)
    loose.chmod(0o644)
    monkeypatch.setenv("CKPT_INDEX_KEY_FILE", str(loose))
    with caplog.at_level("WARNING"):
        assert index_signing.signing_key() is None
    assert "readable by nobody else" in caplog.text and str(loose) in caplog.text

    monkeypatch.setenv("CKPT_INDEX_KEY_FILE", "off")
    assert index_signing.signing_key() is None


def test_without_a_key_the_index_carries_no_mac(store, monkeypatch):
    monkeypatch.setenv("CKPT_INDEX_KEY_FILE", "off")
    build_registry(store, update_index=True)
    header = json.loads(store.storage.read_bytes(INDEX_FILE).partition(b"\n")[0])
    assert "mac" not in header
    assert build_registry(store).vouched_before is None
