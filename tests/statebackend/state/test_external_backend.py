"""The external backend (statebackend.state.external): state in a real PostgreSQL server.

Runs of the keyed aggregation on the local engine against pandas, through the public
API: a failed attempt's pre-committed rows stay invisible and are deleted; a driver
killed between ``_metadata`` and the database commit is finished by the next run (each
epoch applied once); a reader on another connection never sees a run's writes before
its commit; a database restart during a run fails it in one line and loses nothing;
restore and rescale move no state bytes; vacuum keeps exactly what retained versions read.
"""

from __future__ import annotations

import json
import socket
import threading

import psycopg
import pyarrow as pa
import pytest

from demo.sample_data import DAY_MS, DEFAULT_START_TS_MS, expected_totals, generate_events
from jobs import keyed_aggregation as ka
from statebackend.checkpoint.store import CheckpointStore
from statebackend.cli.app import main
from statebackend.errors import UsageError
from statebackend.job import JobRunError, RunConfig, external_commit, run_job
from statebackend.rescale.executor import RescaleOptions, rescale
from statebackend.state.external import ExternalStateBackend
from statebackend.state.external_rows import ROWS_SCHEMA
from statebackend.state.external_store import (
    ExternalRead,
    ExternalStore,
    commit_version,
    discard_uncommitted,
    ensure_schema,
    load_range,
    newest,
    vacuum,
    write_epoch,
)
from statebackend.storage import open_storage
from tests.jobs.run_reference import assert_totals_equal, final_state

JOB = "keyed_aggregation"
CODEC = {d.name: d for d in ka.JOB.descriptors}["totals"].codec


def test_the_store_names_no_password_and_refuses_bad_names():
    store = ExternalStore("postgresql://app:s3cret@127.0.0.1:5432/state")
    assert store.identity == "postgresql://app@127.0.0.1:5432/state#ckpt_state"
    assert "s3cret" not in repr(store) and "s3cret" not in repr(RunConfig(
        input="i", storage="file:///s", run_id="r", state_db=store.url))
    with pytest.raises(UsageError, match="is not a postgresql://"):
        ExternalStore("mysql://127.0.0.1/x")
    with pytest.raises(UsageError, match="plain lower-case SQL name"):
        ExternalStore("postgresql://127.0.0.1/x", table="state; DROP TABLE x")


def test_an_unreachable_database_is_one_line_naming_the_cause():
    with socket.socket() as s:  # a loopback port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(UsageError) as info:
        ExternalStore(f"postgresql://app:s3cret@127.0.0.1:{port}/state").connect()
    text = str(info.value)
    assert "\n" not in text and "s3cret" not in text
    assert f"postgresql://app@127.0.0.1:{port}/state#ckpt_state cannot be reached" in text
    assert "Connection refused" in text, text


@pytest.fixture
def table(postgres_server, request):
    """A fresh table name per test on the session's server."""
    name = "t_" + request.node.name.lower().replace("[", "_").replace("]", "")[:30]
    store = ExternalStore(postgres_server.url, name.replace("-", "_"))
    with store.connect() as conn:
        for suffix in ("_committed",):
            conn.execute(f"DROP VIEW IF EXISTS {store.table}{suffix}")
        for suffix in ("", "_versions", "_head"):
            conn.execute(f"DROP TABLE IF EXISTS {store.table}{suffix}")
    return store


def rows_table(rows) -> pa.Table:
    """(key_group, state, key, user_key, value) tuples as a pre-commit's table."""
    columns = list(zip(*rows, strict=True)) or [[]] * len(ROWS_SCHEMA)
    return pa.Table.from_arrays([pa.array(c, type=f.type) for c, f in
                                 zip(columns, ROWS_SCHEMA, strict=True)], schema=ROWS_SCHEMA)


def _rows(store, conn, version, kgs=(0, 127), parent=None):
    groups = load_range(conn, ExternalRead(store, JOB, version, parent), kgs)
    return {(state, key, user_key): v for (_, state), entries in newest(groups).items()
            for (key, user_key), v in entries.items()}


def test_versions_read_their_chain_and_vacuum_keeps_what_retained_versions_read(table):
    store = table
    with store.connect() as conn:
        ensure_schema(store, conn)
        write_epoch(store, conn, JOB, 1, (0, 127), rows_table([(0, "s", b"a", b"", b"1"),
                                                               (5, "s", b"b", b"", b"1")]))
        commit_version(store, conn, JOB, 1, None)
        write_epoch(store, conn, JOB, 2, (0, 127), rows_table([(0, "s", b"a", b"", b"2"),
                                                               (5, "s", b"b", b"", None)]))
        assert _rows(store, conn, 1) == {("s", b"a", b""): b"1", ("s", b"b", b""): b"1"}
        with pytest.raises(UsageError, match="version 2 .* is not committed"):
            _rows(store, conn, 2)  # pre-committed only
        commit_version(store, conn, JOB, 2, 1)
        assert not commit_version(store, conn, JOB, 2, 1)  # idempotent: applied once
        assert _rows(store, conn, 2) == {("s", b"a", b""): b"2"}
        # a branch from version 1 (a restore of checkpoint 1) does not see version 2
        write_epoch(store, conn, JOB, 3, (0, 127), rows_table([(5, "s", b"c", b"u", b"3")]))
        commit_version(store, conn, JOB, 3, 1)
        assert _rows(store, conn, 3) == {("s", b"a", b""): b"1", ("s", b"b", b""): b"1",
                                         ("s", b"c", b"u"): b"3"}
        # a failure
        write_epoch(store, conn, JOB, 4, (0, 63), rows_table([(1, "s", b"x", b"", b"9")]))
        assert discard_uncommitted(store, conn, JOB) == 1
        before = {v: _rows(store, conn, v) for v in (2, 3)}
        result = vacuum(store, conn, JOB, {2: 1, 3: 1})
        assert result.rows_deleted == 0 and result.versions_deleted == ()
        assert {v: _rows(store, conn, v) for v in (2, 3)} == before
        # version 5 (over 3) is recorded in _metadata but its commit was cut short: the
        # vacuum keeps its chain through the parent the record names, and its rows
        write_epoch(store, conn, JOB, 5, (0, 127), rows_table([(0, "s", b"a", b"", b"5")]))
        result = vacuum(store, conn, JOB, {5: 3})  # checkpoint 2 retired; head (3) kept
        assert (result.rows_deleted, result.versions_deleted) == (2, (2,))
        assert _rows(store, conn, 3) == before[3]
        assert _rows(store, conn, 3, (5, 5)) == {("s", b"b", b""): b"1",
                                                 ("s", b"c", b"u"): b"3"}
        pending = _rows(store, conn, 5, parent=3)  # through the parent its record names
        assert pending == {**before[3], ("s", b"a", b""): b"5"}
        commit_version(store, conn, JOB, 5, 3)
        assert _rows(store, conn, 5) == pending


def test_discard_finds_every_uncommitted_epoch_through_the_index_and_old_tables_migrate(table):
    """The epochs no version names, wherever they fall among the committed ones (one
    probe of the (job, epoch) index each, no scan of the rows kept), of this job only;
    a table of an older release gets that index instead of its (job, key_group) one."""
    store = table
    with store.connect() as conn:
        ensure_schema(store, conn)
        conn.execute(f"DROP INDEX {store.table}_by_epoch")  # as an older release made it
        conn.execute(f"CREATE INDEX {store.table}_by_group ON {store.table} "
                     "(job, key_group, epoch)")
        ensure_schema(store, conn)
        indexes = {r[0] for r in conn.execute(
            "SELECT indexname FROM pg_indexes WHERE tablename = %s", (store.table,))}
        assert indexes == {f"{store.table}_pkey", f"{store.table}_by_epoch"}
        rows = {e: rows_table([(e % 128, "s", f"k{i}".encode(), b"", b"v")
                               for i in range(e)]) for e in range(1, 9)}
        for epoch, parent in ((1, None), (3, 1), (6, 3), (8, 6)):
            write_epoch(store, conn, JOB, epoch, (0, 127), rows[epoch])
            commit_version(store, conn, JOB, epoch, parent)
        for epoch in (2, 4, 5, 7):  # failed or fenced attempts, before and after the head
            write_epoch(store, conn, JOB, epoch, (0, 127), rows[epoch])
        write_epoch(store, conn, "another_job", 4, (0, 127), rows[4])
        assert discard_uncommitted(store, conn, JOB) == 2 + 4 + 5 + 7
        assert discard_uncommitted(store, conn, JOB) == 0
        left = conn.execute(f"SELECT job, epoch, count(*) FROM {store.table} "
                            "GROUP BY job, epoch ORDER BY job, epoch").fetchall()
        assert left == [("another_job", 4, 4), *((JOB, e, e) for e in (1, 3, 6, 8))]


def _days(tmp_path, n: int, keys: int = 400, events: int = 3000):
    return [generate_events(str(tmp_path / f"in{d}"), n_events=events, n_keys=keys,
                            seed=70 + d, start_ts_ms=DEFAULT_START_TS_MS + d * DAY_MS)
            for d in range(n)]


def _want(days) -> dict:
    final = expected_totals(days)
    return {(k, None): {"count": int(r["count"]), "sum": float(r["sum"]),
                        "min_ts": int(r["min_ts"]), "max_ts": int(r["max_ts"])}
            for k, r in final.iterrows()}


def _config(tmp_path, store: ExternalStore, d: int, **kw) -> RunConfig:
    return RunConfig(input=str(tmp_path / f"in{d}"), storage=f"file://{tmp_path}/store",
                     run_id=f"d{d}", output=str(tmp_path / "out"),
                     local_dir=str(tmp_path / "local"), engine="local", backend="external",
                     state_db=store.url, state_table=store.table, **kw)


def _committed_view(store: ExternalStore, conn) -> tuple[int | None, int, int]:
    """(head version, keys, total count) of the readers' view, in one statement."""
    rows = conn.execute(f"SELECT h.version, c.value FROM {store.table}_head h "
                        f"LEFT JOIN {store.table}_committed c ON c.job = h.job "
                        "WHERE h.job = %s", (JOB,)).fetchall()
    if not rows:
        return None, 0, 0
    counts = [CODEC.decode(bytes(v))["count"] for _, v in rows if v is not None]
    return int(rows[0][0]), len(counts), sum(counts)


def test_runs_match_pandas_across_failures_kills_rescale_and_a_database_restart(
        tmp_path, table, postgres_server, monkeypatch):
    store, days = table, _days(tmp_path, 4)
    state = CheckpointStore(open_storage(f"file://{tmp_path}/store"), JOB)
    run_job(ka.JOB, _config(tmp_path, store, 0, parallelism=3))
    assert_totals_equal(_state(tmp_path, store), _want(days[:1]))

    # A failed attempt pre-commits rows (subtask 1 fails after its snapshot): invisible,
    # and deleted by the next run before its tasks.
    with pytest.raises(JobRunError, match="injected failure in subtask 1"):
        run_job(ka.JOB, _config(tmp_path, store, 1, fail_subtask=1))
    reader = psycopg.connect(store.url, autocommit=True)
    assert _committed_view(store, reader) == (1, *_summary(days[:1]))
    assert reader.execute(f"SELECT count(*) FROM {store.table} WHERE epoch = 2"
                          ).fetchone()[0] > 0

    # The driver dies between _metadata and the database commit: the readers still see
    # version 1; the next run finishes version 2 first, then commits its own.
    def killed(*_a, **_kw):
        assert _committed_view(store, reader) == (1, *_summary(days[:1]))
        raise KeyboardInterrupt("driver killed")

    monkeypatch.setattr(external_commit, "commit", killed)
    with pytest.raises(KeyboardInterrupt):
        run_job(ka.JOB, _config(tmp_path, store, 1))
    monkeypatch.undo()
    assert state.latest().external.version == 3  # epochs: one per run attempt
    assert _committed_view(store, reader)[0] == 1

    r = rescale(state, "latest", 2)  # a query per new subtask: nothing moves
    assert (r["bytes_downloaded"], r["bytes_uploaded"], r["checkpoint_id"]) == (0, 0, 3)
    # its rows are in the database: unknown to the record, not 0
    assert r["rows"] is None and [s["rows"] for s in r["subtasks"]] == [None, None]
    assert state.latest().summary()["rows"] is None
    plan = rescale(state, "latest", 3, options=RescaleOptions(dry_run=True))["plan_text"]
    assert "(external backend: each new subtask's range is a query at the same database " \
        "version; 0 bytes" in plan[0] and "memory" not in plan[0]
    assert state.latest().external.version == 3

    # The database restarts while run d2 snapshots: the run fails in one line, nothing
    # is committed; the next attempt of d2 succeeds.
    real = ExternalStateBackend.take_local_snapshot

    def restarted(self, *a, **kw):
        postgres_server.restart()
        return real(self, *a, **kw)

    reader.close()
    monkeypatch.setattr(ExternalStateBackend, "take_local_snapshot", restarted)
    with pytest.raises(JobRunError, match="failed in.*state database postgresql://"):
        run_job(ka.JOB, _config(tmp_path, store, 2))
    monkeypatch.undo()
    s2 = run_job(ka.JOB, _config(tmp_path, store, 2))
    assert (s2["checkpoint_id"], s2["parallelism"]) == (4, 2)
    assert set(s2["restore_modes"]) <= {"query", "local-instance"}
    reader = psycopg.connect(store.url, autocommit=True)
    assert _committed_view(store, reader) == (5, *_summary(days[:3]))
    versions = reader.execute(f"SELECT version, parent FROM {store.table}_versions "
                              "WHERE job = %s ORDER BY version", (JOB,)).fetchall()
    assert versions == [(1, None), (3, 1), (5, 3)]  # each epoch applied once
    assert reader.execute(f"SELECT count(*) FROM {store.table} WHERE epoch IN (2, 4)"
                          ).fetchone()[0] == 0  # the failed attempts' rows are gone
    assert_totals_equal(_state(tmp_path, store), _want(days[:3]))
    reader.close()


def _state(tmp_path, store: ExternalStore) -> dict:
    return final_state(f"file://{tmp_path}/store", JOB, store)["totals"]


def _summary(days) -> tuple[int, int]:
    final = expected_totals(days)
    return len(final), int(final["count"].sum())


def test_a_reader_never_sees_a_run_before_its_commit(tmp_path, table):
    """Another connection reads the committed view in a loop while runs write: every
    read is exactly one committed version's state (pandas), never a mix."""
    assert_reads_are_committed_states(
        tmp_path, table, lambda d, **kw: _config(tmp_path, table, d, **kw), _committed_view)


def assert_reads_are_committed_states(tmp_path, store: ExternalStore, config, view) -> None:
    """Runs 4 days of 20,000 events (``config(day, **options)``) while another connection
    reads ``view(store, conn)`` -> (version, keys, total count) in a loop: every read is
    one committed checkpoint's pandas summary, and the first and last are seen."""
    days = _days(tmp_path, 4, keys=3000, events=20_000)
    run_job(ka.JOB, config(0, parallelism=2))
    seen: list[tuple] = []
    stop = threading.Event()

    def read_loop() -> None:
        with psycopg.connect(store.url, autocommit=True) as conn:
            while True:  # one more read after the stop: the last commit is seen
                done = stop.is_set()
                seen.append(view(store, conn))
                if done:
                    return

    thread = threading.Thread(target=read_loop)
    thread.start()
    try:
        for d in range(1, len(days)):
            run_job(ka.JOB, config(d))
    finally:
        stop.set()
        thread.join()
    state = CheckpointStore(open_storage(f"file://{tmp_path}/store"), JOB)
    expected = {state.load(d + 1).external.version: _summary(days[: d + 1])
                for d in range(len(days))}
    assert len(seen) > 10
    for version, keys, total in seen:
        assert (keys, total) == expected[version], (version, keys, total)
    assert {v for v, _, _ in seen} >= {min(expected), max(expected)}


def test_without_the_database_the_run_and_the_dump_refuse_in_one_line(tmp_path, table):
    store, _ = table, _days(tmp_path, 1, keys=20, events=50)
    cfg = _config(tmp_path, store, 0, parallelism=1)
    with pytest.raises(UsageError, match="runs on the external backend: pass its database"):
        run_job(ka.JOB, RunConfig(**{**cfg.__dict__, "state_db": None}))
    run_job(ka.JOB, cfg)
    with pytest.raises(UsageError, match=r"keeps its state in postgresql://.*pass that"):
        final_state(f"file://{tmp_path}/store", JOB)
    other = ExternalStore(store.url, "elsewhere")
    with pytest.raises(UsageError, match="not postgresql://.*#elsewhere"):
        run_job(ka.JOB, _config(tmp_path, other, 0).__class__(
            **{**_config(tmp_path, other, 0).__dict__, "run_id": "again"}))


def test_cli_dump_validate_and_retention_vacuum_through_the_database(tmp_path, table, capsys):
    """`ckpt dump`, `validate --deep` read the rows at the checkpoint's version;
    `ckpt retain --state-db` vacuums: the kept checkpoint still equals pandas."""
    store, days = table, _days(tmp_path, 3, keys=200, events=1500)
    for d in range(3):
        run_job(ka.JOB, _config(tmp_path, store, d, **({"parallelism": 2} if d == 0 else {})))
    root = f"file://{tmp_path}/store"
    db = ["--state-db", store.url, "--state-table", store.table]

    def ckpt(*argv: str) -> tuple[int, str, str]:
        code = main(["--storage", root, "--job", JOB, *argv])
        out, err = capsys.readouterr()
        return code, out, err

    code, _, err = ckpt("dump", "--out", str(tmp_path / "x.jsonl"))
    assert code == 2 and "keeps its state in postgresql://" in err and len(err.splitlines()) == 1
    code, _, _ = ckpt("dump", "--out", str(tmp_path / "rows.jsonl"), *db)
    rows = [json.loads(x) for x in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert_totals_equal({(r["key"], None): r["value"] for r in rows}, _want(days))
    code, out, _ = ckpt("show")
    assert code == 0 and f"mvcc version 3 (over 2) of {JOB} in {store.identity}" in out
    code, out, _ = ckpt("validate", "--deep", "--report", "none", "--json", *db)
    assert code == 0 and json.loads(out)["success"], out
    # a rescale reads no database; one passed along with the others is checked to be the
    # checkpoint's own before anything is written
    code, _, err = ckpt("rescale", "-p", "3", "--state-db", store.url, "--state-table",
                        "elsewhere")
    assert code == 2 and len(err.splitlines()) == 1, err
    assert f"keeps its state in {store.identity}, not " in err and "#elsewhere" in err
    assert CheckpointStore(open_storage(root), JOB).checkpoint_ids() == [1, 2, 3]
    code, out, err = ckpt("rescale", "-p", "3", "--json", *db)
    assert code == 0 and json.loads(out)["bytes_uploaded"] == 0, err
    code, out, err = ckpt("rescale", "-p", "2", "--json")  # without it, as before
    assert code == 0 and json.loads(out)["checkpoint_id"] == 5, err

    with store.connect() as conn:
        rows_before = conn.execute(f"SELECT count(*) FROM {store.table}").fetchone()[0]
    code, out, _ = ckpt("retain", "--keep", "1", "--dry-run", "--json", *db)
    assert json.loads(out)["vacuum"]["retained_versions"] == [1, 2, 3]  # nothing retired yet
    code, out, _ = ckpt("retain", "--keep", "1", "--json", *db)
    report = json.loads(out)
    assert code == 0 and report["retired"] == [1, 2, 3, 4]
    vac = report["vacuum"]
    assert vac["vacuumed"] and vac["retained_versions"] == [3] and vac["versions_deleted"] == []
    with store.connect() as conn:
        rows_after = conn.execute(f"SELECT count(*) FROM {store.table}").fetchone()[0]
    assert rows_after == rows_before - vac["rows_deleted"] and vac["rows_deleted"] > 0
    assert rows_after == len(_want(days))  # one row per key: what version 3 reads
    assert_totals_equal(_state(tmp_path, store), _want(days))
