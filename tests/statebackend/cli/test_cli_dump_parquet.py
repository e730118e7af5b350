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
from statebackend.checkpoint.leases import list_leases
from statebackend.checkpoint.store import CheckpointStore
from statebackend.cli import app as cli
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


def test_subtasks_are_written_at_once_while_the_checkpoint_is_held(job, tmp_path, monkeypatch):
    """Every subtask's restore runs at the same time (a barrier of P would time out in
    turns), each seeing the dump's hold lease on checkpoint 1."""
    barrier = threading.Barrier(P, timeout=60)
    seen: list[list[tuple[int, ...]]] = []
    original = dumping.restored_readonly

    def restored_together(storage, *args, **kwargs):
        seen.append([x.checkpoint_ids for x in list_leases(storage)
                     if x.purpose == "dump of checkpoint 1"])
        barrier.wait()
        return original(storage, *args, **kwargs)

    monkeypatch.setattr(dumping, "restored_readonly", restored_together)
    store = job["store"]
    count = dumping.dump_parquet(store, store.load(1), str(tmp_path / "d"), workers=P)
    assert count == len(job["rows"]) and seen == [[(1,)]] * P
    assert [x for x in list_leases(store.storage) if x.purpose.startswith("dump")] == []


def test_a_failing_subtask_leaves_no_dump(job, tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise OSError("disk gone")

    monkeypatch.setattr(dumping, "restored_readonly", broken)
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
