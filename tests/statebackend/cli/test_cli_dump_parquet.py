"""``ckpt dump --format parquet``: one file per subtask, written in parallel, equal to the
JSON-lines dump; the checkpoint held while it reads; nothing half-written; one-line
refusals."""

from __future__ import annotations

import json
import os
import threading

import pyarrow.parquet as pq
import pytest

from statebackend.checkpoint import dump_parquet as dumping
from statebackend.checkpoint.dump import backend_rows, rows_table
from statebackend.checkpoint.leases import list_leases
from statebackend.checkpoint.store import CheckpointStore
from statebackend.cli import app as cli
from statebackend.state.codecs import BytesCodec, RecordCodec, StrCodec
from statebackend.state.kinds import StateDescriptor
from statebackend.state.timers import register_timers, with_timers
from statebackend.state.ttl import StateTtl
from statebackend.storage import open_storage
from tests.statebackend.helpers import close_all, fill, keys, open_backends

JOB = "orders"
P = 3


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    from statebackend.checkpoint.snapshot import checkpoint_backends

    base = tmp_path_factory.mktemp("dump-parquet")
    url = f"file://{base}/store"
    store = CheckpointStore(open_storage(url), JOB)
    backends = open_backends(str(base / "work"), P)
    fill(backends, keys(600) + ["ключ", "🙂"])
    checkpoint_backends(store, backends, parent=None)
    close_all(backends)
    out = base / "rows.jsonl"
    assert cli.main(["--storage", url, "--job", JOB, "dump", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    return {"url": url, "store": store, "rows": rows}


def _canonical(rows):
    return sorted(json.dumps(r, sort_keys=True) for r in rows)


def _dump(capsys, url: str, out, *extra: str) -> tuple[int, str, str]:
    code = cli.main(["--storage", url, "--job", JOB, "dump", *extra, "--out", str(out),
                     "--format", "parquet"])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_one_file_per_subtask_equal_to_the_jsonl_dump(job, tmp_path, capsys):
    out = tmp_path / "rows.parquet"
    code, text, _ = _dump(capsys, job["url"], out)
    assert code == 0 and f"wrote {len(job['rows'])} rows of checkpoint 1" in text
    assert sorted(os.listdir(out)) == [f"part-{i:05d}.parquet" for i in range(P)]
    for i in range(P):
        part = pq.read_table(out / f"part-{i:05d}.parquet").to_pylist()
        assert part and {r["subtask"] for r in part} == {i}
    table = pq.read_table(out).to_pylist()
    assert _canonical({**r, "value": json.loads(r["value"])} for r in table) == \
        _canonical(job["rows"])
    assert [n for n in os.listdir(tmp_path) if ".tmp-" in n] == []


RECORD = RecordCodec((("i", "int32"), ("big", "int64"), ("f32", "float32"), ("f", "float64"),
                      ("ok", "bool")))
EVERY_CODEC = (
    StateDescriptor("rec", "value", RECORD),
    StateDescriptor("rec_ttl", "value", RECORD, ttl=StateTtl(1_000, "event")),
    StateDescriptor("text", "value", StrCodec()),
    StateDescriptor("raw", "value", BytesCodec()),
    StateDescriptor("by_user", "map", RECORD),
    StateDescriptor("doc", "value"),
    StateDescriptor("events", "list", ttl=StateTtl(1_000, "event")),
)
FLOATS = (0.0, -0.0, 1.5, 1e16, 1e-7, 3.141592653589793, float("nan"), float("inf"),
          float("-inf"), 123456789.125, 5e-324)


@pytest.mark.parametrize("kind", ["rocksdb", "memory"])
@pytest.mark.parametrize("batch_rows", [50, 1_000_000])
def test_the_column_wise_read_gives_the_rows_and_text_of_the_row_path(tmp_path, kind,
                                                                     batch_rows, monkeypatch):
    """Every codec, map and TTL states (expired entries too), timers, keys and text that
    JSON escapes, floats Python writes its own way: the Parquet dump's table equals the
    one built from ``ckpt dump``'s rows, in spans of key groups or in one."""
    monkeypatch.setattr(dumping, "BATCH_ROWS", batch_rows)
    (backend,) = open_backends(str(tmp_path), 1, descriptors=with_timers(EVERY_CODEC), kind=kind)
    try:
        ks = keys(400) + ["ключ", "🙂", 'quo"te\\', "tab\tnew\nline", ""]
        records = [{"i": -i, "big": 2**40 + i, "f32": FLOATS[i % len(FLOATS)] / 3,
                    "f": FLOATS[i % len(FLOATS)], "ok": i % 3 == 0}
                   for i in range(len(ks))]
        backend.set_time(event_time=10_000)
        backend.value_state("rec").put_many(ks, records)
        # half of them written long ago: expired at the clock, still in the dump
        backend.value_state("rec_ttl").put_many(ks, records,
                                                timestamps=[5_000 + 10 * (i % 2) * 500
                                                            for i in range(len(ks))])
        backend.value_state("text").put_many(ks, [f"{k} \u00e9\\ \"{i}\"" for i, k in
                                                  enumerate(ks)])
        backend.value_state("raw").put_many(ks, [k.encode() + bytes([i % 256])
                                                 for i, k in enumerate(ks)])
        backend.map_state("by_user").put_many(
            [(k, u, r) for k, r in zip(ks, records, strict=True) for u in ("a", "ü", "")])
        backend.value_state("doc").put_many(ks, [{"z": i, "a": [k, None]} for i, k in
                                                 enumerate(ks)])
        backend.list_state("events").add_many(ks, [{"n": i} for i in range(len(ks))])
        register_timers(backend, ks[:50], list(range(50)))
        want = rows_table(backend_rows(backend, 4))
        got = dumping.dump_table(backend, 4, {"rec": len(ks), "by_user": 3 * len(ks)})
        assert got.num_rows == want.num_rows > 9 * len(ks)
        assert got.equals(want)
        assert {"NaN", "Infinity", "-Infinity", "1e+16", "1e-07", "-0.0", "5e-324"} <= {
            json.dumps(r["f"]) for r in records}  # (what the text above has to hold)
    finally:
        backend.close()


def test_subtasks_are_written_at_once_while_the_checkpoint_is_held(job, tmp_path, monkeypatch):
    """Every subtask's restore runs at the same time (a barrier of P would time out in
    turns), each seeing the dump's hold lease on checkpoint 1."""
    barrier = threading.Barrier(P, timeout=60)
    seen: list[list[tuple[int, ...]]] = []
    original = dumping.restored_copy

    def restored_together(storage, *args, **kwargs):
        seen.append([x.checkpoint_ids for x in list_leases(storage)
                     if x.purpose == "dump of checkpoint 1"])
        barrier.wait()
        return original(storage, *args, **kwargs)

    monkeypatch.setattr(dumping, "restored_copy", restored_together)
    store = job["store"]
    count = dumping.dump_parquet(store, store.load(1), str(tmp_path / "d"), workers=P)
    assert count == len(job["rows"]) and seen == [[(1,)]] * P
    assert [x for x in list_leases(store.storage) if x.purpose.startswith("dump")] == []


def test_a_failing_subtask_leaves_no_dump(job, tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise OSError("disk gone")

    monkeypatch.setattr(dumping, "restored_copy", broken)
    out = tmp_path / "d"
    with pytest.raises(Exception, match="disk gone"):
        dumping.dump_parquet(job["store"], job["store"].load(1), str(out))
    assert os.listdir(tmp_path) == []


def test_an_earlier_dump_or_file_is_replaced_anything_else_refused(job, tmp_path, capsys):
    out = tmp_path / "d"
    assert _dump(capsys, job["url"], out)[0] == 0
    assert _dump(capsys, job["url"], out)[0] == 0  # an earlier dump: replaced
    assert len(pq.read_table(out)) == len(job["rows"])
    single = tmp_path / "old.parquet"
    single.write_bytes(b"not a dump")
    assert _dump(capsys, job["url"], single)[0] == 0 and single.is_dir()
    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    code, text, err = _dump(capsys, job["url"], other)
    assert code == 2 and text == "" and err.count("\n") == 1
    assert "holding 'notes.txt', not only the part files of an earlier dump" in err
    assert os.listdir(other) == ["notes.txt"]
