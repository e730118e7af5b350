"""The memory backend (statebackend.state.memory) against RocksDB as the reference.

- `MemoryTable` answers every read the state code makes (get, multi-get, bounded
  scans, counts) exactly as a RocksDB column family after the same random writes;
- a checkpoint of memory backends restores to the same entries (download and local),
  and the next checkpoint uploads only the key groups written since;
- a lineage moves between backends: rocksdb -> memory -> rocksdb keeps every entry of
  every state kind;
- past its limit a write fails in one line naming the limit and RocksDB; a damaged
  key-group file is refused, naming it.
"""

from __future__ import annotations

import os
import random
import struct

import numpy as np
import pyarrow as pa
import pytest
from rocksdict import Options, Rdict

from statebackend.checkpoint.restore import RestoreOptions, restore_subtask
from statebackend.checkpoint.snapshot import checkpoint_backends
from statebackend.checkpoint.store import CheckpointStore
from statebackend.errors import CorruptStateError, UsageError
from statebackend.state import memory_files
from statebackend.state.external import ExternalTable
from statebackend.state.memory import (
    MemoryStateBackend,
    forget_live_instance,
)
from statebackend.state.memory_table import (
    ENTRY_OVERHEAD,
    MemoryAccount,
    MemoryTable,
    MemoryWriteBatch,
    StateMemoryLimitError,
)
from statebackend.state.scan import checked_count, checked_entries, checked_scan, multi_get
from statebackend.storage import open_storage
from tests.statebackend.helpers import (
    DESCRIPTORS,
    close_all,
    dump_backends,
    fill,
    keys,
    open_backends,
    restore_all,
)


def _random_key(rng: random.Random) -> bytes:
    kg = rng.choice([0, 1, 7, 255, 256, 4095])
    return kg.to_bytes(2, "big") + bytes(rng.randrange(256) for _ in range(rng.randint(0, 4)))


def _group_bounds(kg: int) -> tuple[bytes, bytes | None]:
    return kg.to_bytes(2, "big"), (kg + 1).to_bytes(2, "big") if kg < 65535 else None


@pytest.mark.parametrize("seed, check_every", [(7, 100), (8, 3), (9, 1)])
def test_memory_table_reads_like_a_rocksdb_column_family(tmp_path, seed, check_every):
    """Random writes, deletes, range deletes and key-group loads, and between them (every
    step to every 100th) scans, counts, edge keys, ordered entries and multi-gets, equal
    to a RocksDB column family's: the table's ordered key list, kept across deletes and
    a few inserts, and made again after more, answers like RocksDB's order."""
    rng = random.Random(seed)
    db = Rdict(str(tmp_path / "ref"), Options(raw_mode=True))
    account = MemoryAccount(None, "test")
    table = MemoryTable("t", account)
    for step in range(3000):
        op = rng.random()
        key = _random_key(rng)
        if op < 0.45:
            value = bytes([step % 256]) * rng.randint(0, 3)
            db.put(key, value)
            table.put(key, value)
        elif op < 0.6:  # the state kinds' batch write: puts, then deletes
            # each key once, as the state kinds write (the byte count is exact for those)
            pairs = list({_random_key(rng): bytes([step % 256])
                          for _ in range(rng.randint(0, 5 if rng.random() < 0.9 else 90))
                          }.items())
            gone = [_random_key(rng) for _ in range(rng.randint(0, 2))]
            for k, v in pairs:
                db.put(k, v)
            for k in gone:
                db.delete(k)
            table.write_many(pairs, gone)
        elif op < 0.88:
            db.delete(key)
            table.delete(key)
        elif op < 0.9:  # a restore's load of one key group (sorted keys), or its drop
            kg = int.from_bytes(key[:2], "big")
            lower, upper = _group_bounds(kg)
            loaded = sorted({kg.to_bytes(2, "big") + bytes([rng.randrange(256)])
                             for _ in range(rng.randint(0, 6))})
            db.delete_range(lower, upper or b"\xff" * 3)
            for k in loaded:
                db.put(k, b"L")
            table.load(lower, loaded, [b"L"] * len(loaded))
        else:
            lo, hi = sorted((key, _random_key(rng)))
            db.delete_range(lo, hi)
            table.delete_range(lo, hi)
        if step % check_every == 0:
            lo, hi = sorted((_random_key(rng), _random_key(rng)))
            for bounds in ((None, None), (lo, None), (None, hi), (lo, hi)):
                assert list(checked_scan(table, "t", *bounds)) == \
                    list(checked_scan(db, "db", *bounds)), bounds
                assert checked_count(table, "t", *bounds) == checked_count(db, "db", *bounds)
                assert checked_entries(table, "t", *bounds, values=False)[0] == \
                    checked_entries(db, "db", *bounds, values=False)[0]
            everything = list(db.items())
            groups = sorted({k[:2] for k, _ in everything})
            assert table.key_group_prefixes() == groups
            assert table.edge_keys() == ((everything[0][0], everything[-1][0])
                                         if everything else None)
            for prefix in groups:
                mine = [k for k, _ in everything if k[:2] == prefix]
                assert table.edge_keys(prefix) == (mine[0], mine[-1])
            if rng.random() < 0.3:  # a snapshot: some key groups' entries in key order
                wanted = sorted(rng.sample(groups, min(len(groups), rng.randint(1, 4))))
                rows = [(k, v) for k, v in everything if k[:2] in wanted]
                keys_out, values_out, counts = table.ordered_entries(wanted)
                assert list(zip(keys_out, values_out, strict=True)) == rows
                assert counts == {p: n for p in wanted
                                  if (n := sum(1 for k, _ in rows if k[:2] == p))}
            probe = [_random_key(rng) for _ in range(50)]
            assert multi_get(table, probe) == multi_get(db, probe)
            # the bytes held, kept by every put and delete, as counted from scratch
            assert account.bytes == sum(len(k) + len(v) + ENTRY_OVERHEAD
                                        for k, v in table.data.items())
    assert len(table) == checked_count(db, "db") > 0
    db.close()


def test_write_batch_applies_in_order():
    account = MemoryAccount(None, "test")
    a, b = MemoryTable("a", account), MemoryTable("b", account)
    wb = MemoryWriteBatch()
    wb.set_default_column_family(a)
    wb.put(b"\x00\x01k", b"1")
    wb.put(b"\x00\x01k", b"2", b)
    wb.delete(b"\x00\x01k")
    wb.put(b"\x00\x02k", b"3")
    wb.delete_range(b"\x00\x02", b"\x00\x03", b)
    wb.delete(b"\x00\x07absent")  # deletes nothing: key group 7 does not change
    wb.apply(account)
    assert (a.get(b"\x00\x01k"), a.get(b"\x00\x02k"), b.get(b"\x00\x01k")) == (None, b"3", b"2")
    assert account.changed == {b"\x00\x01", b"\x00\x02"}
    assert account.bytes == sum(len(k) + len(v) + ENTRY_OVERHEAD
                                for t in (a, b) for k, v in t.data.items())


def test_the_external_table_remembers_every_key_a_batch_deletes():
    """The external backend's table writes what changed since its snapshot (its keys
    written, deletes included): deletes that a batch applies together (`delete_many`),
    one by one or by range count as written."""
    account = MemoryAccount(None, "test")
    table = ExternalTable("t", account)
    table.write_columns([b"\x00\x01a", b"\x00\x01b", b"\x00\x02c", b"\x00\x03d"],
                        [b"1", b"2", b"3", b"4"])
    table.written.clear()
    wb = MemoryWriteBatch()
    wb.delete(b"\x00\x01a", table)
    wb.delete(b"\x00\x01b", table)
    wb.delete_range(b"\x00\x02", b"\x00\x03", table)
    wb.apply(account)
    table.delete(b"\x00\x03d")
    assert table.written == {b"\x00\x01a", b"\x00\x01b", b"\x00\x02c", b"\x00\x03d"}
    assert table.data == {}


@pytest.mark.parametrize("seed", range(5))
def test_write_batch_equals_its_operations_one_by_one(seed):
    """A batch holds each table's puts back until that table's next delete (the
    timers alternate between two tables): the result is the ops applied in order."""
    rng = random.Random(seed)
    batch_account, ref_account = MemoryAccount(None, "batch"), MemoryAccount(None, "ref")
    tables = [MemoryTable(n, batch_account) for n in "ab"]
    refs = [MemoryTable(n, ref_account) for n in "ab"]
    for _ in range(20):
        wb = MemoryWriteBatch()
        for _ in range(rng.randrange(1, 30)):
            i = rng.randrange(2)
            key = bytes([0, rng.randrange(3)]) + bytes([rng.randrange(4)])
            op = rng.random()
            if op < 0.6:
                value = bytes([rng.randrange(256)]) * rng.randrange(1, 4)
                wb.put(key, value, tables[i])
                refs[i].put(key, value)
            elif op < 0.9:
                wb.delete(key, tables[i])
                refs[i].delete(key)
            else:
                wb.delete_range(key[:2], key[:2] + b"\x02", tables[i])
                refs[i].delete_range(key[:2], key[:2] + b"\x02")
        wb.apply(batch_account)
        assert [t.data for t in tables] == [r.data for r in refs]
        assert [list(t.scan(values=False)) for t in tables] == \
            [list(r.scan(values=False)) for r in refs]
        assert batch_account.changed == ref_account.changed


def _store(tmp_path) -> CheckpointStore:
    return CheckpointStore(open_storage(f"file://{tmp_path}/store"), "orders")


def test_checkpoints_restore_and_upload_only_changed_key_groups(tmp_path):
    store = _store(tmp_path)
    backends = open_backends(str(tmp_path / "work"), 2, kind="memory")
    fill(backends, keys(5000))
    first = checkpoint_backends(store, backends, parent=None)
    assert {h.backend for h in first.subtasks} == {"memory"}
    assert first.summary()["state_backend"] == "memory"  # ckpt show / list --json
    assert all(f.local_name.endswith(".kgs") and not h.private_files
               for h in first.subtasks for f in h.files)
    # one segment per subtask, serving each of its key groups
    assert [len(h.files) for h in first.subtasks] == [1, 1]
    assert all(h.files[0].key_group_ids == tuple(range(h.key_group_start, h.key_group_end + 1))
               for h in first.subtasks)
    # one key group changes: a segment of it is the only upload, the others are referenced
    touched = "k1"
    owner = next(b for b in backends if _owns(b, touched))
    owner.value_state("totals").put(touched, {"count": -1, "sum": 0.0, "flag": True})
    second = checkpoint_backends(store, backends)
    new = [f for h in second.subtasks for f in h.files
           if f.path not in {g.path for h in first.subtasks for g in h.files}]
    kg = owner.key_group_and_bytes(touched)[0]
    assert [f.key_group_ids for f in new] == [(kg,)]
    # the first segment still serves the owner's other key groups, and only them
    kept = next(f for h in second.subtasks for f in h.files if f.path not in {new[0].path}
                and kg - 1 in f.key_group_ids or kg + 1 in f.key_group_ids)
    assert kg not in kept.key_group_ids
    assert second.bytes_uploaded == sum(f.size for f in new)
    want = dump_backends(backends)
    close_all(backends)
    # from storage; then this process's instances (closed clean); then, as a new process
    # would, the local files
    for allow_local, mode in ((False, "download"), (True, "local-instance"),
                              (True, "local-snapshot")):
        if mode == "local-snapshot":
            for h in second.subtasks:
                forget_live_instance(str(tmp_path / "work" / f"sub-{h.index}"))
        restored = restore_all(store, second, str(tmp_path / "work"), allow_local=allow_local)
        assert {b.restore_mode for b in restored} == {mode}
        assert all(isinstance(b, MemoryStateBackend) for b in restored)
        assert dump_backends(restored) == want
        close_all(restored)


def test_snapshots_rewrite_only_files_no_snapshot_names(tmp_path):
    """A snapshot writes its new key-group files into files that neither the state nor
    the previous snapshot names (renamed, overwritten): the previous snapshot's files stay
    byte for byte (local recovery of it), and the state restores from the local files."""
    store = _store(tmp_path)
    backends = open_backends(str(tmp_path / "work"), 1, kind="memory")
    [backend] = backends
    files_dir = backend.files_path

    def local_files() -> dict[str, tuple[int, bytes]]:
        return {e.name: (e.inode(), open(e.path, "rb").read()) for e in os.scandir(files_dir)}

    fill(backends, keys(3000))
    checkpoint_backends(store, backends, parent=None)
    first = local_files()
    fill(backends, keys(3000), version=1)  # every key group changes
    checkpoint_backends(store, backends)
    second = local_files()
    fill(backends, keys(3000), version=2)
    third = checkpoint_backends(store, backends)
    now = local_files()
    named = {f.local_name for f in third.subtasks[0].files}
    previous = set(second) - set(first)
    assert set(now) == named | previous  # the first snapshot's files are gone
    assert {n: now[n] for n in previous} == {n: second[n] for n in previous}
    # the new files are the first snapshot's, rewritten (none created while one was spare)
    assert {now[n][0] for n in named} <= {inode for inode, _ in first.values()}
    assert len(named) <= len(first)
    want = dump_backends(backends)
    close_all(backends)
    forget_live_instance(os.path.dirname(files_dir))
    restored = restore_all(store, third, str(tmp_path / "work"))
    assert {b.restore_mode for b in restored} == {"local-snapshot"}
    assert dump_backends(restored) == want
    close_all(restored)


def _owns(backend, key: str) -> bool:
    try:
        backend.key_group_and_bytes(key)  # raises outside the backend's key groups
        return True
    except UsageError:
        return False


def test_a_lineage_moves_between_backends_with_every_entry(tmp_path):
    store = _store(tmp_path)
    backends = open_backends(str(tmp_path / "rocks"), 2)
    fill(backends, keys(3000))
    fill(backends, keys(500), version=3)
    want = dump_backends(backends)
    meta = checkpoint_backends(store, backends, parent=None)
    close_all(backends)
    metas = {}
    for kind, other in (("memory", "rocksdb"), ("rocksdb", "memory")):
        moved = [restore_subtask(store.storage, h, str(tmp_path / f"{kind}-{h.index}"),
                                 DESCRIPTORS, meta.max_parallelism,
                                 RestoreOptions(backend=kind)) for h in meta.subtasks]
        assert {b.kind for b in moved} == {kind}
        assert {b.restore_mode for b in moved} == {f"converted-from-{other}"}
        assert dump_backends(moved) == want
        meta = checkpoint_backends(store, moved)
        assert meta.state_backend == kind
        close_all(moved)
        metas[kind] = meta
    # Only a RocksDB subtask opens as another key-group range (a rescale's base): the
    # memory backend rescales by handing key-group files over, never through a restore.
    memory = metas["memory"].subtasks[0]
    with pytest.raises(UsageError, match="only a RocksDB subtask opens as another key-group "
                       r"range, not subtask 0 on the memory backend"):
        restore_subtask(store.storage, memory, str(tmp_path / "as-range"), DESCRIPTORS,
                        meta.max_parallelism,
                        RestoreOptions(key_groups=memory.key_group_range))
    assert not os.path.exists(tmp_path / "as-range")


def test_past_the_limit_a_write_fails_in_one_line(tmp_path):
    backend = open_backends(str(tmp_path / "work"), 1, kind="memory")[0]
    assert isinstance(backend, MemoryStateBackend)
    backend.set_memory_limit(1)
    with pytest.raises(StateMemoryLimitError) as err:
        fill([backend], keys(20_000))
    message = str(err.value)
    assert "\n" not in message and "limit of 1 MiB" in message and "rocksdb" in message
    assert backend.memory_bytes > 2**20


def test_a_damaged_local_copy_is_downloaded_again_and_garbage_is_refused(tmp_path):
    store = _store(tmp_path)
    backends = open_backends(str(tmp_path / "work"), 1, kind="memory")
    fill(backends, keys(200))
    want = dump_backends(backends)
    meta = checkpoint_backends(store, backends, parent=None)
    close_all(backends)
    forget_live_instance(str(tmp_path / "work" / "sub-0"))  # as a new process
    ref = meta.subtasks[0].files[0]
    local = os.path.join(tmp_path, "work", "sub-0", "files", ref.local_name)
    with open(local, "r+b") as fh:  # same size, other bytes
        fh.write(b"\x00" * 64)
    restored = restore_all(store, meta, str(tmp_path / "work"))
    assert restored[0].restore_mode == "download" and dump_backends(restored) == want
    close_all(restored)
    with open(local, "wb") as fh:  # not a key-group file at all
        fh.write(b"not arrow")
    backend = open_backends(str(tmp_path / "other"), 1, kind="memory")[0]
    os.replace(local, os.path.join(backend.local_dir, "files", ref.local_name))
    with pytest.raises(CorruptStateError, match=ref.local_name):
        backend.load_files([ref.local_name])


def _format_1(families: list, codec: str | None) -> bytes:
    """A key-group file as format 1 wrote it (before the values layouts)."""
    head, body = [struct.pack("<H", len(families))], []
    for name, family_keys, values in families:
        head.append(struct.pack("<H", len(name)) + name.encode()
                    + struct.pack("<I", len(family_keys)))
        for column in (family_keys, values):
            _, offsets, data = pa.array(column, pa.binary()).buffers()
            body += [offsets.to_pybytes(), data.to_pybytes() if data is not None else b""]
            head.append(struct.pack("<Q", data.size if data is not None else 0))
    payload = b"".join(head + body)
    packed = payload if codec is None else pa.Codec(codec).compress(payload, asbytes=True)
    return b"CKPTKGS1" + struct.pack("<BQ", 0 if codec is None else 1, len(payload)) + packed


@pytest.mark.parametrize("codec", ["zstd", None])
def test_key_group_files_round_trip_and_refuse_damage(codec):
    records = np.arange(3 * 9, dtype=np.uint8).reshape(3, 9)  # fixed width: byte planes
    families = [("a", [b"\x00\x01k1", b"\x00\x01k2"], [b"v1", b""]), ("b", [], []),
                ("c", [b"\x00\x01" + bytes(range(256))], [b"x" * 5000]),
                ("d", [b"\x00\x02a", b"\x00\x02b", b"\x00\x03c"], records)]
    want = [(n, k, v if isinstance(v, list) else [r.tobytes() for r in v])
            for n, k, v in families]
    data = memory_files.encode(families, codec)
    assert [(name, keys.to_pylist(), values.to_pylist())
            for name, keys, values in memory_files.decode_arrays(data)] == want
    old = _format_1(want, codec)  # files written before the layouts still read
    assert [(name, keys.to_pylist(), values.to_pylist())
            for name, keys, values in memory_files.decode_arrays(old)] == want
    for broken in (data[:-1], data[:20], data.replace(memory_files.MAGIC, b"CKPTKGS9"),
                   data + b"\x00", old[:-1]):
        with pytest.raises(ValueError):
            memory_files.decode_arrays(broken)


def test_rescale_counts_rows_from_the_key_group_files_it_regroups(tmp_path):
    """Each key-group file's reference records its entries per state (FileRef.rows), so
    a rescale (which reads no file) records every new subtask's row counts; they equal
    what a restore of that subtask counts. A source whose references predate rows leaves
    the counts unrecorded instead of guessing."""
    from dataclasses import replace

    from statebackend.rescale.executor import RescaleOptions, rescale

    store = _store(tmp_path)
    backends = open_backends(str(tmp_path / "work"), 2, kind="memory")
    fill(backends, keys(4000))
    source = checkpoint_backends(store, backends, parent=None)
    close_all(backends)
    for h in source.subtasks:
        assert all(f.rows for f in h.files)
        totals: dict[str, int] = {}
        for f in h.files:
            for name, n in f.rows:
                totals[name] = totals.get(name, 0) + n
        assert {k: v for k, v in h.row_counts.items() if v} == totals
    for target in (3, 1):
        summary = rescale(store, "latest", target, options=RescaleOptions(engine="local"))
        meta = store.latest()
        assert meta.parallelism == target
        if target == 3:  # the source's two segments straddle the new boundaries
            owners: dict[str, list[tuple[int, ...]]] = {}
            for h in meta.subtasks:
                for f in h.files:
                    owners.setdefault(f.path, []).append(f.key_group_ids)
            shared = [kgs for kgs in owners.values() if len(kgs) > 1]
            assert shared and all(not set(a) & set(b) for a, b in shared)
        # the summary (`ckpt rescale --json`) counts them too, per new subtask
        assert [s["rows"] for s in summary["subtasks"]] == [
            sum(h.row_counts.values()) for h in meta.subtasks]
        assert summary["rows"] == sum(sum(h.row_counts.values()) for h in source.subtasks)
        restored = restore_all(store, meta, str(tmp_path / f"check-{target}"), allow_local=False)
        for h, b in zip(meta.subtasks, restored, strict=True):
            assert h.row_counts == b.count_rows()
        assert sum(sum(h.row_counts.values()) for h in meta.subtasks) == \
            sum(sum(h.row_counts.values()) for h in source.subtasks)
        close_all(restored)
    # references written before rows existed: counts are left to the next run
    old = _as_key_group_files(store, store.latest())
    stripped = replace(old, subtasks=tuple(
        replace(h, shared_files=tuple(replace(f, rows=()) for f in h.shared_files))
        for h in old.subtasks))
    from statebackend.rescale.memory import regrouped
    from statebackend.rescale.plan import plan_rescale

    unknown = regrouped(stripped, plan_rescale(stripped, 2))
    # ... and said to be unknown, not 0 (`ckpt rescale`, `ckpt show`, the page)
    assert all(r.handle.row_counts == {} and r.rows is None for r in unknown)
    assert stripped.subtask_rows(unknown[0].handle) is None
    assert all(r.handle.row_counts for r in regrouped(old, plan_rescale(old, 2)))
    # --dry-run says what this backend's rescale does, and only that
    from statebackend.rescale.memory import describe

    first = describe(plan_rescale(old, 2), "memory")[0]
    assert "(memory backend: each new subtask names the files serving its key groups;" \
        in first and "external" not in first


def _as_key_group_files(store: CheckpointStore, meta):
    """``meta``'s state as the files written before segments (one per key group, named
    ``kg-<key group>-<id>.kgs``, no key groups in their references), committed as the
    next checkpoint."""
    import uuid
    from dataclasses import replace

    from statebackend.checkpoint.metadata import FileRef
    from statebackend.state.memory import key_group_sections, served_key_groups
    from statebackend.storage.checksums import checksum_of_bytes

    subtasks = []
    for h in meta.subtasks:
        refs = []
        for f in h.files:
            data = store.storage.read_bytes(f.path)
            sections, _ = key_group_sections(f.local_name, data, served_key_groups(
                f.local_name, f.key_group_ids), f.path, "test")
            for kg in f.key_group_ids:
                families = [(name, keys.to_pylist(), values.to_pylist())
                            for name, g, keys, values in sections if g == kg]
                name = f"kg-{kg:05d}-{uuid.uuid4().hex[:12]}.kgs"
                path = f"shared/{uuid.uuid4().hex}-{name}"
                encoded = memory_files.encode(families, "zstd")
                store.storage.write_bytes(path, encoded)
                refs.append(FileRef(path, name, len(encoded), checksum_of_bytes(encoded), tuple(
                    (family, len(keys)) for family, keys, _ in families)))
        subtasks.append(replace(h, shared_files=tuple(sorted(refs, key=lambda r: r.local_name))))
    return store.commit(replace(meta, checkpoint_id=meta.checkpoint_id + 1,
                                parent=meta.checkpoint_id, subtasks=tuple(subtasks)))


def _entries(rows: list[dict]) -> list[str]:
    """Dump rows without the subtask (the same entries at another parallelism)."""
    return sorted(repr(sorted((k, v) for k, v in r.items() if k != "subtask")) for r in rows)


def test_a_checkpoint_of_key_group_files_restores_rescales_and_continues(tmp_path):
    """Checkpoints written before segments (a file per key group) restore, rescale and
    continue: their next checkpoint writes segments over them."""
    from statebackend.rescale.executor import RescaleOptions, rescale

    store = _store(tmp_path)
    backends = open_backends(str(tmp_path / "work"), 2, kind="memory")
    fill(backends, keys(3000))
    checkpoint_backends(store, backends, parent=None)
    want = dump_backends(backends)
    close_all(backends)
    legacy = _as_key_group_files(store, store.latest())
    assert all(f.local_name.startswith("kg-") and not f.key_groups
               for h in legacy.subtasks for f in h.files)
    restored = restore_all(store, legacy, str(tmp_path / "legacy"), allow_local=False)
    assert dump_backends(restored) == want
    fill(restored, keys(3000)[:40], version=5)  # a few key groups change
    want = dump_backends(restored)
    mixed = checkpoint_backends(store, restored)
    close_all(restored)
    names = {f.local_name[:3] for h in mixed.subtasks for f in h.files}
    assert names == {"kg-", "seg"}
    rescale(store, "latest", 3, options=RescaleOptions(engine="local"))
    again = restore_all(store, store.latest(), str(tmp_path / "three"), allow_local=False)
    assert _entries(dump_backends(again)) == _entries(want)
    assert [h.row_counts for h in store.latest().subtasks] == [b.count_rows() for b in again]
    close_all(again)


def test_segments_mostly_rewritten_are_compacted_and_emptied_key_groups_leave(tmp_path):
    """A segment still serving under half of its entries has its key groups written
    again into the next segment (it is then no longer referenced); a key group whose
    entries are all deleted is served by no file; every checkpoint restores exactly."""
    from statebackend.state.keygroups import key_group_for_bytes

    store = _store(tmp_path)
    backends = open_backends(str(tmp_path / "work"), 1, kind="memory")
    [backend] = backends
    all_keys = keys(4000)
    by_group: dict[int, list[str]] = {}
    for k in all_keys:
        by_group.setdefault(key_group_for_bytes(k.encode(), 128), []).append(k)
    groups = sorted(by_group)
    fill(backends, all_keys)
    first = checkpoint_backends(store, backends, parent=None)
    [segment] = first.subtasks[0].files

    def rewrite(share: float, version: int) -> list[int]:
        chosen = groups[:int(len(groups) * share)]
        fill(backends, [k for g in chosen for k in by_group[g]], version=version)
        return chosen

    def check(meta) -> None:
        want = dump_backends(backends)
        restored = restore_all(store, meta, str(tmp_path / f"check-{meta.checkpoint_id}"),
                               allow_local=False)
        assert dump_backends(restored) == want
        assert restored[0].count_rows() == meta.subtasks[0].row_counts
        close_all(restored)

    rewrite(0.3, 1)  # the first segment keeps serving 70% of its entries: kept
    second = checkpoint_backends(store, backends)
    files = second.subtasks[0].files
    assert len(files) == 2 and segment.path in {f.path for f in files}
    check(second)
    rewrite(0.6, 2)  # now 40%: its key groups move into the new segment
    third = checkpoint_backends(store, backends)
    assert segment.path not in {f.path for f in third.subtasks[0].files}
    served = [kg for f in third.subtasks[0].files for kg in f.key_group_ids]
    assert sorted(served) == groups  # each key group once
    check(third)
    gone = groups[-1]
    doomed = by_group[gone]
    for name in ("totals", "events", "maxima", "avg"):
        backend.state(name).delete_many(doomed)
    backend.map_state("attrs").remove_many(doomed * 2, ["a"] * len(doomed) + ["b"] * len(doomed))
    fourth = checkpoint_backends(store, backends)
    assert sorted(kg for f in fourth.subtasks[0].files for kg in f.key_group_ids) == groups[:-1]
    check(fourth)
    close_all(backends)
