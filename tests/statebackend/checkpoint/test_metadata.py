"""The strict `_metadata` parser: every invariant, both parsers, records of this release.

Each case starts from a valid record and breaks one invariant; `from_bytes` and the
registry's fast path (`parse_metadata`) must refuse it with the same one-line
MetadataError naming the file and the invariant (issue 10, defects 5 and 10).
"""

from __future__ import annotations

import json

import pytest

from statebackend.checkpoint.layout import metadata_path, savepoint_metadata_path
from statebackend.checkpoint.metadata import (
    CheckpointMetadata,
    FileRef,
    SubtaskHandle,
    listed_paths,
    parse_metadata,
)
from statebackend.checkpoint.store import CheckpointStore
from statebackend.errors import MetadataError
from statebackend.lifecycle.registry import build_registry, load_savepoint
from statebackend.lifecycle.savepoint import create_savepoint
from statebackend.rescale.executor import rescale
from statebackend.state.keygroups import key_group_range_for_subtask
from statebackend.storage import open_storage
from tests.statebackend.lifecycle.test_lifecycle_scenarios import Job

WHERE = "file:///store/orders/chk-7/_metadata"


def valid_record(parallelism: int = 2, max_parallelism: int = 128) -> dict:
    """A record as this release writes it (JSON), with every state kind and codec."""
    subtasks = []
    for i in range(parallelism):
        kg = key_group_range_for_subtask(max_parallelism, parallelism, i)
        ref = FileRef(f"shared/{i}-000012.sst", "000012.sst", 100, "crc32c:0")
        manifest = FileRef(f"chk-7/{i}/s/MANIFEST-000005", "MANIFEST-000005", 10, "crc32c:1")
        subtasks.append(SubtaskHandle(i, kg.start, kg.end, f"b{i}", "s", (ref,), (manifest,),
                                      {"totals": 5, "events": 2}, 110))
    states = ({"name": "totals", "kind": "value",
               "codec": {"type": "record", "fields": [["count", "int64"], ["sum", "float64"]]}},
              {"name": "events", "kind": "list", "codec": {"type": "json"}},
              {"name": "attrs", "kind": "map", "codec": {"type": "str"}},
              {"name": "maxima", "kind": "reducing", "codec": {"type": "bytes"}},
              {"name": "avg", "kind": "aggregating"},
              {"name": "legacy"})  # kind and codec default to value / json
    meta = CheckpointMetadata(job="orders", checkpoint_id=7, parent=6,
                              parallelism=parallelism, max_parallelism=max_parallelism,
                              states=states, subtasks=tuple(subtasks), run_id="run-7",
                              input=("s3://in/2026-11-21",), extra={"rows_read": 5},
                              created_at="2026-11-21T10:00:00.123456+00:00")
    return meta.to_json()


def both_parsers_refuse(record: dict | bytes) -> str:
    """The one-line message both parsers give (they must agree)."""
    data = record if isinstance(record, bytes) else json.dumps(record).encode()
    with pytest.raises(MetadataError) as strict:
        CheckpointMetadata.from_bytes(data, WHERE)
    with pytest.raises(MetadataError) as fast:
        parse_metadata(data, WHERE, {})
    assert str(strict.value) == str(fast.value)
    message = str(strict.value)
    assert "\n" not in message and WHERE in message
    return message


def test_a_files_rows_round_trip_and_stay_optional():
    """FileRef.rows (a memory-backend key-group file's entries per state): written only
    when recorded, read back by both parsers; a reference without them reads as ()."""
    record = valid_record()
    record["subtasks"][0]["shared_files"][0]["rows"] = {"totals": 3, "events": 0}
    data = json.dumps(record).encode()
    meta = CheckpointMetadata.from_bytes(data, WHERE)
    assert parse_metadata(data, WHERE, {}) == meta
    assert meta.subtasks[0].shared_files[0].rows == (("events", 0), ("totals", 3))
    assert meta.subtasks[1].shared_files[0].rows == ()
    assert meta.to_json() == record
    assert "rows" not in meta.subtasks[1].shared_files[0].to_json()


def test_a_segments_key_groups_round_trip_and_stay_optional():
    """FileRef.key_groups (the key groups a subtask reads from a memory-backend segment,
    with their entries per state): read back by both parsers, absent elsewhere."""
    record = valid_record()
    record["subtasks"][1]["shared_files"][0]["key_groups"] = {
        "64": {"totals": 2}, "127": {"events": 1, "totals": 3}}
    data = json.dumps(record).encode()
    meta = CheckpointMetadata.from_bytes(data, WHERE)
    assert parse_metadata(data, WHERE, {}) == meta
    ref = meta.subtasks[1].shared_files[0]
    assert ref.key_groups == ((64, (("totals", 2),)), (127, (("events", 1), ("totals", 3))))
    assert ref.key_group_ids == (64, 127)
    assert meta.subtasks[1].file_key_groups == {"000012.sst": (64, 127)}
    assert meta.subtasks[0].shared_files[0].key_groups == ()
    assert meta.to_json() == record


def test_valid_record_round_trips_through_both_parsers():
    data = json.dumps(valid_record()).encode()
    meta = CheckpointMetadata.from_bytes(data, WHERE)
    assert parse_metadata(data, WHERE, {}) == meta
    assert meta.to_json() == valid_record()
    # the extremes of the range are fine: P = M = 1 and P = M = 32768
    for p, m in ((1, 1), (3, 3), (5, 32768)):
        assert CheckpointMetadata.from_json(valid_record(p, m), WHERE).parallelism == p


@pytest.mark.parametrize("broken", [b"", b"[]", b'{"subtasks": {}}', b'{"subtasks": ["x"]}',
                                    b'{"subtasks": [{"shared_files": []}]}',
                                    b'{"subtasks": [{"shared_files": [{"path": 1}], '
                                    b'"private_files": []}]}'])
def test_listed_paths_reads_a_records_references_or_says_none(broken):
    """The GC and retention re-check's reader (statebackend.lifecycle.registry): the
    paths a strict parse finds, and None (then a strict parse) for anything else."""
    data = json.dumps(valid_record()).encode()
    meta = CheckpointMetadata.from_bytes(data, WHERE)
    assert listed_paths(data) == [f.path for h in meta.subtasks for f in h.files]
    assert listed_paths(broken) is None


def _subtask(i: int):
    return lambda r: r["subtasks"][i]


def _set(path: tuple, value):
    def change(record: dict) -> None:
        target = record
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
    return change


def _swap_subtasks(record: dict) -> None:
    record["subtasks"].reverse()


def _ranges(r0: tuple[int, int], r1: tuple[int, int]):
    def change(record: dict) -> None:
        for sub, (start, end) in zip(record["subtasks"], (r0, r1), strict=True):
            sub.update(key_group_start=start, key_group_end=end)
    return change


def _p_zero(record: dict) -> None:
    record.update(parallelism=0, subtasks=[])


def _deep_extra(record: dict) -> None:
    nested: object = 1
    for _ in range(40):
        nested = [nested]
    record["extra"] = {"x": nested}


def _key_group_served_twice(record: dict) -> None:
    files = record["subtasks"][0]["shared_files"]
    files[0]["key_groups"] = {"3": {"totals": 1}}
    files.append({**files[0], "path": "shared/x-seg.kgs", "local_name": "seg.kgs"})


def _states_twice(record: dict) -> None:
    record["states"].append(dict(record["states"][0]))


CASES = [
    # (case, change, fragment of the one-line message)
    ("p-zero-no-subtasks", _p_zero, "parallelism 0 is out of range 1..max_parallelism 128"),
    ("p-above-m", _set(("max_parallelism",), 1),
     "parallelism 2 is out of range 1..max_parallelism 1"),
    ("m-huge", _set(("max_parallelism",), 10**12),
     "max_parallelism 1000000000000 is out of range 1..32768"),
    ("m-zero", _set(("max_parallelism",), 0), "max_parallelism 0 is out of range"),
    ("p-not-subtasks", _set(("parallelism",), 3), "2 subtasks recorded for parallelism 3"),
    ("range-wild", _ranges((-50, 100000), (64, 127)),
     "subtask 0 covers key groups [-50, 100000], expected [0, 63]"),
    ("range-gap", _ranges((0, 62), (64, 127)),
     "subtask 0 covers key groups [0, 62], expected [0, 63]"),
    ("range-overlap", _ranges((0, 63), (63, 127)),
     "subtask 1 covers key groups [63, 127], expected [64, 127]"),
    ("range-short", _ranges((0, 63), (64, 126)), "expected [64, 127]"),
    ("index-order", _swap_subtasks, "subtask #0 has index 1; indexes must be 0..1 in order"),
    ("index-dup", _set(("subtasks", 1, "index"), 0), "subtask #1 has index 0"),
    ("codec-pickle", _set(("states", 1, "codec"), {"type": "pickle"}),
     "state 'events': unknown codec type 'pickle'"),
    ("codec-field", _set(("states", 0, "codec", "fields", 0, 1), "int128"),
     "unknown type 'int128'"),
    ("codec-junk", _set(("states", 1, "codec"), "json"), "codec description 'json'"),
    ("kind-unknown", _set(("states", 1, "kind"), "set"), "state 'events' has unknown kind 'set'"),
    ("state-twice", _states_twice, "state 'totals' is declared twice"),
    ("state-name", _set(("states", 0, "name"), "a/b"), "state name 'a/b' is not allowed"),
    ("size-negative", _set(("subtasks", 0, "shared_files", 0, "size"), -1), "size -1 is negative"),
    ("uploaded-negative", _set(("subtasks", 1, "bytes_uploaded"), -5),
     "subtask 1: bytes_uploaded -5 must be an integer >= 0"),
    ("uploaded-string", _set(("subtasks", 1, "bytes_uploaded"), "12"), "bytes_uploaded '12'"),
    ("rows-negative", _set(("subtasks", 0, "row_counts", "totals"), -3), "row_counts"),
    ("file-rows-negative", _set(("subtasks", 0, "shared_files", 0, "rows"), {"totals": -1}),
     "rows {'totals': -1} of 000012.sst must map state names to integers"),
    ("file-rows-list", _set(("subtasks", 0, "shared_files", 0, "rows"), [["totals", 1]]),
     "must map state names to integers"),
    ("file-key-group-outside", _set(("subtasks", 0, "shared_files", 0, "key_groups"),
                                    {"100": {"totals": 1}}),
     "000012.sst serves key group 100, outside subtask 0's [0, 63]"),
    ("file-key-group-twice", _key_group_served_twice,
     "key group 3 is served by two files of subtask 0"),
    ("file-key-groups-junk", _set(("subtasks", 0, "shared_files", 0, "key_groups"),
                                  {"x": {"totals": 1}}),
     "must map key groups to entries per state"),
    ("file-key-groups-rows", _set(("subtasks", 0, "shared_files", 0, "key_groups"),
                                  {"3": {"totals": -1}}),
     "must map key groups to entries per state"),
    ("file-key-groups-rows-differ", _set(("subtasks", 0, "shared_files", 0),
                                        {"path": "shared/s.kgs", "local_name": "s.kgs",
                                         "size": 1, "checksum": "crc32c:0",
                                         "rows": {"totals": 9},
                                         "key_groups": {"3": {"totals": 1}}}),
     "rows of s.kgs are not the sum of its key_groups"),
    ("id-zero", _set(("checkpoint_id",), 0), "checkpoint_id 0 must be at least 1"),
    ("parent-not-earlier", _set(("parent",), 7), "parent 7 must be an earlier checkpoint id"),
    ("parent-zero", _set(("parent",), 0), "parent 0 must be an earlier checkpoint id"),
    ("parent-bool", _set(("parent",), True), "parent must be an id or null"),
    ("version-bool", _set(("format_version",), True), "format version True"),
    ("rescaled-from", _set(("rescaled_from",), 0), "rescaled_from 0 must be a parallelism"),
    ("input-nested", _set(("input",), [["a"]]), "input must be a list of strings"),
    ("extra-list", _set(("extra",), [1]), "extra must be an object"),
    ("source-string", _set(("source",), "chk-1"), "source must be an object or null"),
    ("nested-extra", _deep_extra, "JSON nested more than 32 levels deep"),
]


@pytest.mark.parametrize(("case", "change", "fragment"), CASES, ids=[c[0] for c in CASES])
def test_broken_invariant_is_refused_by_both_parsers(case, change, fragment):
    record = valid_record()
    change(record)
    assert fragment in both_parsers_refuse(record)


@pytest.mark.parametrize("document", [b"[" * 100_000 + b"]" * 100_000,
                                      b'{"format_version": 1, "extra": ' + b"[" * 100_000])
def test_deeply_nested_json_is_a_metadata_error_not_a_recursion_error(document):
    assert "JSON nested too deeply" in both_parsers_refuse(document)


def test_records_written_by_this_release_stay_loadable(tmp_path):
    """checkpoint, rescale and savepoint records, re-read by both parsers."""
    url = "memory://h3-release-records"  # memory://: rescale runs in-process, no Spark
    storage = open_storage(url)
    job = Job(storage, "orders", str(tmp_path / "local"))
    try:
        job.write([f"k{i}" for i in range(40)], 1)
        job.checkpoint()
        rescale(job.store, "latest", 3)
        create_savepoint(job.store, "latest", "before-upgrade")
        store = CheckpointStore(storage, "orders")
        records = {rel: store.storage.read_bytes(rel)
                   for rel in (metadata_path(1), metadata_path(2),
                               savepoint_metadata_path("before-upgrade"))}
        for rel, data in records.items():
            assert parse_metadata(data, rel, {}) == CheckpointMetadata.from_bytes(data, rel)
        assert [m.kind for m in store.load_all()] == ["checkpoint", "rescale"]
        assert load_savepoint(store, "before-upgrade").parallelism == 3
        assert sorted(build_registry(store).checkpoints) == [1, 2]
    finally:
        job.close()
        storage.delete_tree("")


# -- lifecycle commands refuse to plan on a tampered record (through `ckpt`) --------

TAMPERS = {
    "p-zero": (_p_zero, "parallelism 0 is out of range"),
    "ranges": (_ranges((-50, 100000), (8, 15)), "subtask 0 covers key groups [-50, 100000]"),
    "m-huge": (_set(("max_parallelism",), 10**12), "max_parallelism 1000000000000 is out of"),
    "pickle": (_set(("states", 0, "codec"), {"type": "pickle"}), "unknown codec type 'pickle'"),
}


@pytest.fixture
def lineage(tmp_path):
    """Three committed checkpoints (P=2, M=16) of job "orders" on file://."""
    url = f"file://{tmp_path}/store"
    job = Job(open_storage(url), "orders", str(tmp_path / "local"))
    for version in range(3):
        job.write([f"k{i}" for i in range(30)], version)
        job.checkpoint()
    job.close()
    return url, tmp_path / "store" / "orders"


def _tamper(job_dir, checkpoint_id: int, change) -> str:
    path = job_dir / metadata_path(checkpoint_id)
    record = json.loads(path.read_text())
    change(record)
    path.chmod(0o644)
    path.write_text(json.dumps(record))
    return f"orders/{metadata_path(checkpoint_id)}"


def _files(job_dir) -> dict[str, int]:
    return {str(p.relative_to(job_dir)): p.stat().st_size
            for p in job_dir.rglob("*") if p.is_file()}


def _ckpt_error(capsys, url: str, *argv: str) -> str:
    from statebackend.cli.app import main

    code = main(["--storage", url, "--job", "orders", *argv])
    out, err = capsys.readouterr()
    assert code != 0 and out == "", (code, out)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ckpt: error: malformed metadata "), err
    return lines[0]


@pytest.mark.parametrize("tamper", sorted(TAMPERS))
def test_gc_and_retain_refuse_a_nonsense_record_and_delete_nothing(lineage, capsys, tamper):
    url, job_dir = lineage
    change, invariant = TAMPERS[tamper]
    (job_dir / "shared" / "orphan.sst").write_bytes(b"x")  # GC would delete it
    where = _tamper(job_dir, 1, change)  # the oldest: retain --keep 1 would retire it
    before = _files(job_dir)
    for argv in (["gc", "--grace-seconds", "0"], ["retain", "--keep", "1"],
                 ["gc", "--grace-seconds", "0", "--dry-run"]):
        message = _ckpt_error(capsys, url, *argv)
        assert where in message and invariant in message
    assert _files(job_dir) == before


def test_every_command_refuses_a_nonsense_latest_record(lineage, capsys, tmp_path):
    url, job_dir = lineage
    change, invariant = TAMPERS["p-zero"]
    where = _tamper(job_dir, 3, change)
    before = _files(job_dir)
    for argv in (["show"], ["show", "3", "--json"],
                 ["dump", "--out", str(tmp_path / "rows.jsonl")],
                 ["rescale", "--parallelism", "1", "--dry-run"],
                 ["savepoint", "--name", "sp"], ["leases"]):
        message = _ckpt_error(capsys, url, *argv)
        assert where in message and invariant in message, argv
    # `list` lists the others and names the broken record in its row (issue 20, defect 11)
    from statebackend.cli.app import main

    assert main(["--storage", url, "--job", "orders", "list"]) == 1
    out = capsys.readouterr().out
    assert "malformed record" in out and where in out and invariant in out
    assert _files(job_dir) == before


def test_show_and_dump_refuse_a_deeply_nested_record(lineage, capsys, tmp_path):
    url, job_dir = lineage
    (job_dir / metadata_path(3)).chmod(0o644)
    (job_dir / metadata_path(3)).write_bytes(b"[" * 100_000 + b"]" * 100_000)
    for argv in (["show"], ["dump", "--out", str(tmp_path / "rows.jsonl")], ["gc"]):
        message = _ckpt_error(capsys, url, *argv)
        assert "orders/chk-3/_metadata" in message and "nested too deeply" in message


# -- optional watermark and processing time (issue 12) --------------------------------

def test_watermark_and_processing_time_round_trip_and_show_in_the_summary():
    record = valid_record()
    record["watermark"], record["processing_time"] = 1_700_000_000_000, -5
    data = json.dumps(record).encode()
    meta = CheckpointMetadata.from_bytes(data, WHERE)
    assert (meta.watermark, meta.processing_time) == (1_700_000_000_000, -5)
    assert parse_metadata(data, WHERE, {}) == meta
    assert CheckpointMetadata.from_json(meta.to_json(), WHERE) == meta
    assert meta.summary()["watermark"] == 1_700_000_000_000
    assert meta.summary()["processing_time"] == -5


def test_records_without_watermark_load_and_are_written_unchanged():
    record = valid_record()
    assert "watermark" not in record and "processing_time" not in record  # as before
    meta = CheckpointMetadata.from_json(record, WHERE)
    assert (meta.watermark, meta.processing_time) == (None, None)
    assert meta.summary()["watermark"] is None
    record["watermark"] = None  # explicit null: "none yet"
    assert CheckpointMetadata.from_json(record, WHERE).watermark is None


@pytest.mark.parametrize("value", [True, "1700000000000", 1.5, [1]])
@pytest.mark.parametrize("key", ["watermark", "processing_time"])
def test_watermark_types_are_strict(key, value):
    record = valid_record()
    record[key] = value
    assert f"{key} {value!r} must be an integer (epoch ms) or null" in both_parsers_refuse(record)


def test_internal_states_and_ttl_are_accepted_with_their_reserved_kinds():
    record = valid_record()
    record["states"] += [{"name": "_timers", "kind": "timers", "codec": {"type": "bytes"}},
                         {"name": "_ttl", "kind": "ttl_index", "codec": {"type": "bytes"}}]
    record["states"][0]["ttl"] = {"duration_ms": 60_000, "time": "event", "update_on": "write"}
    meta = CheckpointMetadata.from_json(record, WHERE)
    assert [s["name"] for s in meta.states][-2:] == ["_timers", "_ttl"]
    record["states"][-1]["kind"] = "value"
    assert "state '_ttl' is reserved for kind 'ttl_index'" in both_parsers_refuse(record)
    record["states"][-1]["kind"] = "ttl_index"
    record["states"][1]["kind"] = "timers"  # an internal kind on a user state
    assert "state 'events' has unknown kind 'timers'" in both_parsers_refuse(record)


def test_ckpt_show_prints_the_watermark(tmp_path, capsys):
    from statebackend.checkpoint.snapshot import checkpoint_backends
    from statebackend.cli import app as cli
    from tests.statebackend.helpers import close_all, fill, keys, open_backends

    url = f"file://{tmp_path}/store"
    store = CheckpointStore(open_storage(url), "sessions")
    backends = open_backends(str(tmp_path / "work"), 1)
    try:
        fill(backends, keys(20))
        first = checkpoint_backends(store, backends, parent=None, run_id="r1")
    finally:
        close_all(backends)
    # the run protocol records the watermark; here we add it to the committed record
    store.storage.write_bytes(metadata_path(1), first.with_changes(
        watermark=1_700_000_000_000, processing_time=1_700_003_600_000).to_bytes())
    assert cli.main(["--storage", url, "--job", "sessions", "show", "1"]) == 0
    out = capsys.readouterr().out
    assert "watermark         1700000000000 (2023-11-14T22:13:20.000+00:00)" in out
    assert "processing_time   1700003600000 (2023-11-14T23:13:20.000+00:00)" in out
    assert cli.main(["--storage", url, "--job", "sessions", "show", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["watermark"] == 1_700_000_000_000
    store.storage.write_bytes(metadata_path(1), first.to_bytes())  # a record without one
    assert cli.main(["--storage", url, "--job", "sessions", "show", "1"]) == 0
    assert "watermark         -" in capsys.readouterr().out
