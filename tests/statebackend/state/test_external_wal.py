"""The external backend's WAL mode (statebackend.state.external_wal) on a real PostgreSQL.

Runs of the keyed aggregation on the local engine against pandas, through the public
API: pre-commits are WAL files in checkpoint storage (a failed attempt, or one that dies
half-way through writing its WAL, leaves the database untouched); the driver killed
between ``_metadata`` and the apply is finished by the next run, across a rescale, each
epoch applied once; a damaged WAL is refused by name with nothing applied; a database
restart during the pre-commit does not touch it; readers of the current state never see
a run's writes before its apply; a savepoint exports the state and a new job starts
from it.
"""

from __future__ import annotations

import json
import uuid

import psycopg
import pytest

from jobs import keyed_aggregation as ka
from statebackend.airflow.operators import CkptMigrateOperator
from statebackend.checkpoint.store import CheckpointStore
from statebackend.cli.app import main
from statebackend.errors import MetadataError, StateDatabaseError, UsageError
from statebackend.job import (
    JobRunError,
    ReadOptions,
    RunConfig,
    external_commit,
    read_state,
    run_job,
)
from statebackend.job.transform import TransformOptions, transform_state
from statebackend.lifecycle.savepoint import create_savepoint
from statebackend.rescale.executor import rescale
from statebackend.state import external_wal
from statebackend.state.external import ExternalStateBackend
from statebackend.state.external_store import ExternalRead, ExternalStore, newest
from statebackend.state.external_wal import (
    WalCommit,
    apply,
    ensure_wal_schema,
    is_wal_file,
    load_current,
    read_wal,
    write_wal,
)
from statebackend.storage import open_storage
from tests.jobs.run_reference import assert_totals_equal, final_state
from tests.statebackend.state.test_external_backend import (
    CODEC,
    JOB,
    _committed_view,
    _days,
    _summary,
    _want,
    assert_reads_are_committed_states,
    rows_table,
)


@pytest.fixture
def table(postgres_server, request):
    """A fresh table name per test on the session's server."""
    store = ExternalStore(postgres_server.url, "w_" + request.node.name.lower()[:30])
    with store.connect() as conn:
        for suffix in ("_kv", "_applied"):
            conn.execute(f"DROP TABLE IF EXISTS {store.table}{suffix}")
    return store


def _config(tmp_path, store: ExternalStore, d: int, **kw) -> RunConfig:
    return RunConfig(**{
        "input": str(tmp_path / f"in{d}"), "storage": f"file://{tmp_path}/store",
        "run_id": f"d{d}", "output": str(tmp_path / "out"), "local_dir": str(tmp_path / "l"),
        "engine": "local", "backend": "external", "state_db": store.url,
        "state_table": store.table, "state_mode": "wal", **kw})


def _current(store: ExternalStore, conn, job: str = JOB) -> tuple[int | None, int, int]:
    """(applied epoch, keys, total count) of the job's current rows, in one statement."""
    rows = conn.execute(f"SELECT a.epoch, k.value FROM {store.table}_applied a "
                        f"LEFT JOIN {store.table}_kv k ON k.job = a.job AND k.state = 'totals' "
                        "WHERE a.job = %s", (job,)).fetchall()
    if not rows:
        return None, 0, 0
    counts = [CODEC.decode(bytes(v))["count"] for _, v in rows if v is not None]
    return int(rows[0][0]), len(counts), sum(counts)


def _rows(store, conn, epoch, kgs=(0, 127)) -> dict:
    groups = load_current(conn, ExternalRead(store, JOB, epoch, mode="wal"), kgs)
    return {(state, key, user_key): v for (_, state), entries in newest(groups).items()
            for (key, user_key), v in entries.items()}


def test_apply_is_idempotent_by_epoch_and_refuses_another_base(tmp_path, table):
    store = table
    path = str(tmp_path / "wal-1.arrow")
    assert write_wal(path, rows_table([(0, "s", b"a", b"", b"1"),
                                       (5, "s", b"b", b"u", b"1")])) == 2
    data = open(path, "rb").read()
    with pytest.raises(MetadataError, match="WAL here is not a readable WAL file"):
        read_wal(data[: len(data) // 2], "here")
    first = read_wal(data, "here")
    write_wal(path, rows_table([(0, "s", b"a", b"", b"2"), (5, "s", b"b", b"u", None)]))
    second = read_wal(open(path, "rb").read(), "there")
    with store.connect() as conn:
        ensure_wal_schema(store, conn)
        assert apply(store, conn, WalCommit(JOB, 1, 10, None), [first])
        assert not apply(store, conn, WalCommit(JOB, 1, 10, None), [first])  # applied once
        with pytest.raises(StateDatabaseError, match="over 9, but .* holds epoch 10: "
                                                     "nothing applied"):
            apply(store, conn, WalCommit(JOB, 2, 11, 9), [second])
        assert _rows(store, conn, 10) == {("s", b"a", b""): b"1", ("s", b"b", b"u"): b"1"}
        assert apply(store, conn, WalCommit(JOB, 2, 11, 10), [second])
        assert _rows(store, conn, 11) == {("s", b"a", b""): b"2"}
        # a paused driver finishing epoch 10's commit late: superseded, nothing goes back
        assert not apply(store, conn, WalCommit(JOB, 1, 10, None), [first])
        assert _rows(store, conn, 11) == {("s", b"a", b""): b"2"}
        with pytest.raises(UsageError, match="epoch 10 .* is not the current state .* "
                                             "holds epoch 11 \\(checkpoint 2\\)"):
            _rows(store, conn, 10)
        assert apply(store, conn, WalCommit(JOB, 3, 12, None), [first])  # full: replaces
        assert _rows(store, conn, 12) == {("s", b"a", b""): b"1", ("s", b"b", b"u"): b"1"}


def _wal_refs(state: CheckpointStore, cid: int) -> list:
    return [f for s in state.load(cid).subtasks for f in s.files if is_wal_file(f.local_name)]


def test_runs_match_pandas_across_failures_torn_wals_kills_rescale_and_a_restart(
        tmp_path, table, postgres_server, monkeypatch):
    store, days = table, _days(tmp_path, 4)
    state = CheckpointStore(open_storage(f"file://{tmp_path}/store"), JOB)
    run_job(ka.JOB, _config(tmp_path, store, 0, parallelism=3))
    reader = psycopg.connect(store.url, autocommit=True)
    one = state.latest().external
    assert (one.mode, one.parent) == ("wal", None) and len(_wal_refs(state, 1)) == 3
    assert _current(store, reader) == (one.version, *_summary(days[:1]))

    # A failed attempt and one that dies half-way through its WAL: nothing committed,
    # the database untouched (a pre-commit never writes to it).
    with pytest.raises(JobRunError, match="injected failure in subtask 1"):
        run_job(ka.JOB, _config(tmp_path, store, 1, fail_subtask=1))
    real_write = external_wal.write_wal

    def torn(path, rows):
        real_write(path, rows)
        with open(path, "r+b") as fh:
            fh.truncate(max(1, fh.seek(0, 2) // 2))
        raise OSError("disk gone while writing the WAL")

    monkeypatch.setattr("statebackend.state.external.write_wal", torn)
    with pytest.raises(JobRunError, match="disk gone"):
        run_job(ka.JOB, _config(tmp_path, store, 1))
    monkeypatch.undo()
    assert state.latest().checkpoint_id == 1
    assert _current(store, reader) == (one.version, *_summary(days[:1]))

    # The driver dies between _metadata and the apply: readers keep checkpoint 1's state;
    # a rescale carries the pending WALs; the next run applies them first, then its own.
    monkeypatch.setattr(external_commit, "commit", lambda *a, **k: (_ for _ in ()).throw(
        KeyboardInterrupt("driver killed")))
    with pytest.raises(KeyboardInterrupt):
        run_job(ka.JOB, _config(tmp_path, store, 1))
    monkeypatch.undo()
    two = state.latest().external
    assert (two.parent, _current(store, reader)[0]) == (one.version, one.version)
    r = rescale(state, "latest", 4)
    assert (r["bytes_downloaded"], r["checkpoint_id"]) == (0, 3)
    assert rescale(state, "latest", 2)["checkpoint_id"] == 4  # split WALs carried once
    assert {f.path for f in _wal_refs(state, 4)} == {f.path for f in _wal_refs(state, 2)}

    # A damaged WAL of the pending checkpoint is refused by name; nothing is applied.
    wal = _wal_refs(state, 4)[0]
    path = tmp_path / "store" / JOB / wal.path
    good = path.read_bytes()
    path.write_bytes(good[:-7])
    with pytest.raises(MetadataError, match=f"WAL .*{wal.path} of checkpoint 4 is torn"):
        run_job(ka.JOB, _config(tmp_path, store, 2))
    assert _current(store, reader)[0] == one.version
    path.write_bytes(good)

    # The database restarts while run d2 snapshots: a pre-commit needs no database, so
    # the run commits (unless a subtask was still restoring: then it fails in one line
    # and its retry commits); its prepare finished checkpoint 4's apply first.
    real = ExternalStateBackend.take_local_snapshot

    def restarted(self, *a, **kw):
        postgres_server.restart()
        return real(self, *a, **kw)

    reader.close()
    monkeypatch.setattr(ExternalStateBackend, "take_local_snapshot", restarted)
    try:
        s2 = run_job(ka.JOB, _config(tmp_path, store, 2))
    except JobRunError as exc:  # another subtask was still restoring: its query broke
        assert "state database postgresql://" in str(exc) and "\n" not in str(exc)
        assert state.latest().checkpoint_id == 4  # nothing committed
        monkeypatch.undo()
        s2 = run_job(ka.JOB, _config(tmp_path, store, 2))
    monkeypatch.undo()
    assert (s2["checkpoint_id"], s2["parallelism"]) == (5, 2)
    assert state.latest().external.parent == two.version  # over the finished epoch
    reader = psycopg.connect(store.url, autocommit=True)
    assert _current(store, reader) == (state.latest().external.version, *_summary(days[:3]))
    s3 = run_job(ka.JOB, _config(tmp_path, store, 3))
    last = state.latest().external
    assert _current(store, reader) == (last.version, *_summary(days))
    applied = reader.execute(f"SELECT checkpoint_id FROM {store.table}_applied "
                             "WHERE job = %s", (JOB,)).fetchone()[0]
    assert applied == s3["checkpoint_id"] == 6
    assert_totals_equal(final_state(f"file://{tmp_path}/store", JOB, store)["totals"],
                        _want(days))
    # an older checkpoint is not the database's state: refused in one line
    with pytest.raises(UsageError, match="is not the current state .*restore older state "
                                         "from a savepoint"):
        from statebackend.checkpoint.dump import checkpoint_rows
        next(iter(checkpoint_rows(state, state.load(5), store)))
    with pytest.raises(UsageError, match="in wal mode, not mvcc: run it with --state-mode "
                                         "wal"):
        run_job(ka.JOB, _config(tmp_path, store, 3, run_id="again", state_mode="mvcc"))
    reader.close()


def test_a_reader_never_sees_a_run_before_its_apply(tmp_path, table):
    assert_reads_are_committed_states(
        tmp_path, table, lambda d, **kw: _config(tmp_path, table, d, **kw), _current)


def test_a_savepoint_exports_the_state_and_a_new_job_starts_from_it(tmp_path, table):
    store, days = table, _days(tmp_path, 3, keys=300, events=2000)
    for d in range(2):
        run_job(ka.JOB, _config(tmp_path, store, d, parallelism=2))
    state = CheckpointStore(open_storage(f"file://{tmp_path}/store"), JOB)
    with pytest.raises(UsageError, match="pass that database"):
        create_savepoint(state, "latest", "nodb")
    saved = create_savepoint(state, "latest", "sp", store)
    assert (saved.state_backend, saved.external) == ("memory", None)
    run_job(ka.JOB, _config(tmp_path, store, 2))  # the job moves on
    # a new job from the savepoint, at another parallelism, back in WAL mode: its
    # first run writes a full WAL that becomes that job's rows
    run_job(ka.JOB, _config(tmp_path, store, 2, job="copy", start_from=f"{JOB}/savepoints/sp",
                            parallelism=3))
    copy = CheckpointStore(open_storage(f"file://{tmp_path}/store"), "copy")
    assert copy.latest().external.parent is None
    want = _want(days)
    assert_totals_equal(final_state(f"file://{tmp_path}/store", "copy", store)["totals"],
                        want)
    assert_totals_equal(final_state(f"file://{tmp_path}/store", JOB, store)["totals"], want)
    with psycopg.connect(store.url, autocommit=True) as conn:
        assert _current(store, conn, "copy")[1:] == _summary(days)


def test_cli_runs_exports_shows_validates_and_retains_in_wal_mode(tmp_path, table, capsys):
    """`ckpt run --state-mode wal`, `show`, `validate --deep`, `retain` (nothing to
    vacuum), `savepoint` (an export) and a new job from it, all through the CLI."""
    store, days = table, _days(tmp_path, 3, keys=200, events=1500)
    root = f"file://{tmp_path}/store"
    db = ["--state-db", store.url, "--state-table", store.table]

    def ckpt(*argv: str, job: str = JOB) -> tuple[int, str, str]:
        code = main(["--storage", root, "--job", job, *argv])
        out, err = capsys.readouterr()
        return code, out, err

    def run(d: int, *extra: str, job: str = JOB) -> None:
        code, _, err = ckpt("run", "jobs.keyed_aggregation:JOB", "--input",
                            str(tmp_path / f"in{d}"), "--run-id", f"d{d}", "--output",
                            str(tmp_path / f"out-{job}"), "--engine", "local", "--backend",
                            "external", "--state-mode", "wal", *db, *extra, job=job)
        assert code == 0, err

    run(0, "--parallelism", "2")
    first_wals = {f.path for f in _wal_refs(CheckpointStore(open_storage(root), JOB), 1)}
    run(1)
    code, out, _ = ckpt("show")
    version = CheckpointStore(open_storage(root), JOB).latest().external.version
    assert code == 0 and f"wal version {version} (over" in out
    code, out, _ = ckpt("validate", "--deep", "--report", "none", "--json", *db)
    assert code == 0 and json.loads(out)["success"], out
    code, out, _ = ckpt("retain", "--keep", "1", "--json", *db)
    assert code == 0 and json.loads(out)["retired"] == [1] and "vacuum" not in json.loads(out)
    code, _, err = ckpt("savepoint", "--name", "sp")
    assert code == 2 and "pass that database" in err and len(err.splitlines()) == 1
    code, out, _ = ckpt("savepoint", "--name", "sp", "--json", *db)
    assert code == 0 and json.loads(out)["source_checkpoint"] == 2
    run(2, "--start-from", f"{JOB}/savepoints/sp", "--parallelism", "3", job="copy")
    assert_totals_equal(final_state(root, "copy", store)["totals"], _want(days))
    code, out, err = ckpt("gc", "--grace-seconds", "0", "--json")
    assert code == 0, err
    stored = {f.path for f in open_storage(f"{root}/{JOB}").walk_files("")}
    assert len(first_wals) == 2 and not first_wals & stored  # the retired run's WALs went


@pytest.mark.parametrize("mode", ["mvcc", "wal"])
def test_doctor_finishes_a_commit_a_crash_cut_short(tmp_path, postgres_server, monkeypatch,
                                                    capsys, mode):
    """The driver dies between ``_metadata`` and the database commit: `ckpt doctor
    --state-db` reports it (without the database: not checked), ``--repair --dry-run``
    plans the finish and changes nothing, ``--repair`` finishes it once: readers then see
    the pandas state of both days, and the next run continues from it."""
    store = ExternalStore(postgres_server.url, f"doc_{mode}_{uuid.uuid4().hex[:8]}")
    days = _days(tmp_path, 3, keys=150, events=1200)
    root = f"file://{tmp_path}/store"
    db = ["--state-db", store.url, "--state-table", store.table]
    view = _current if mode == "wal" else _committed_view

    def doctor(*argv: str) -> tuple[int, str]:
        code = main(["--storage", root, "--job", JOB, "doctor", *argv])
        out, err = capsys.readouterr()
        assert len(err.splitlines()) <= 1, err
        return code, out + err

    run_job(ka.JOB, _config(tmp_path, store, 0, parallelism=2, state_mode=mode))
    monkeypatch.setattr(external_commit, "commit", lambda *a, **k: (_ for _ in ()).throw(
        KeyboardInterrupt("driver killed")))
    with pytest.raises(KeyboardInterrupt):
        run_job(ka.JOB, _config(tmp_path, store, 1, state_mode=mode))
    monkeypatch.undo()
    state = CheckpointStore(open_storage(root), JOB)
    one, two = state.load(1).external.version, state.load(2).external.version
    reader = psycopg.connect(store.url, autocommit=True)
    assert view(store, reader) == (one, *_summary(days[:1]))

    # reading it as data: by version in MVCC mode; refused in WAL mode, naming the repair
    plan = TransformOptions(target_job="copy", dry_run=True, state_db=store)
    if mode == "wal":
        with pytest.raises(UsageError, match="commit was cut short; `ckpt doctor --repair"):
            transform_state(root, f"{JOB}:latest", lambda k, s: s, ka.JOB, "sp", plan)
    else:
        assert transform_state(root, f"{JOB}:latest", lambda k, s: s, ka.JOB, "sp", plan
                               )["plan"]["checkpoint_id"] == 2
    code, out = doctor()
    assert code == 0 and f"external state in {store.identity}: not checked" in out
    code, out = doctor("--json", *db)
    report = json.loads(out)
    assert code == 0 and [p["kind"] for p in report["problems"]] == ["commit-pending"]
    assert report["external"] == {"checkpoint": 2, "store": store.identity, "mode": mode,
                                  "version": two, "held": one, "pending": True}
    code, out = doctor("--repair", "--dry-run", *db)
    assert code == 0 and "finish-commit" in out and "nothing changed" in out
    assert view(store, reader)[0] == one
    code, out = doctor("--repair")  # the database is needed to finish: no such action
    assert code == 0 and "finish-commit" not in out
    code, out = doctor("--repair", *db)
    assert code == 0 and "did make 1 change(s)" in out and "finish-commit" in out
    assert view(store, reader) == (two, *_summary(days[:2]))
    code, out = doctor(*db)
    assert code == 0 and "healthy" in out and f"holds {mode} version {two}" in out

    s = run_job(ka.JOB, _config(tmp_path, store, 2, state_mode=mode))
    assert view(store, reader) == (state.latest().external.version, *_summary(days))
    assert s["checkpoint_id"] == 3
    assert_totals_equal(final_state(root, JOB, store)["totals"], _want(days))
    code, out = doctor("--state-table", "other", "--state-db", store.url)
    assert code == 2 and "keeps its state in" in out
    reader.close()


@pytest.mark.parametrize("mode", ["mvcc", "wal"])
def test_read_state_and_a_transform_read_the_database(tmp_path, postgres_server, spark, mode):
    """`read_state` and `transform_state` read an external checkpoint's key groups from
    its database: the latest equals pandas, an older one too in MVCC mode (by version)
    and is refused in one line in WAL mode (one current state); without the database
    both refuse in one line before any work. The transform's savepoint starts a RocksDB
    job that continues equal to pandas."""
    store = ExternalStore(postgres_server.url, f"rd_{mode}_{uuid.uuid4().hex[:8]}")
    days = _days(tmp_path, 3, keys=200, events=1500)
    root = f"file://{tmp_path}/store"
    for d in range(2):
        run_job(ka.JOB, _config(tmp_path, store, d, parallelism=2, state_mode=mode))

    def totals(checkpoint) -> dict:
        df = read_state(spark, root, JOB, checkpoint, state="totals",
                        options=ReadOptions(state_db=store))
        return {(r["key"], None): {f: r[f] for f in ("count", "sum", "min_ts", "max_ts")}
                for r in df.collect()}

    assert_totals_equal(totals("latest"), _want(days[:2]))
    if mode == "mvcc":
        assert_totals_equal(totals(1), _want(days[:1]))
    else:
        with pytest.raises(UsageError, match="keeps only the latest applied checkpoint"):
            totals(1)
    with pytest.raises(UsageError, match="pass that database"):
        read_state(spark, root, JOB, state="totals")
    with pytest.raises(UsageError, match="pass that database"):
        transform_state(root, f"{JOB}:latest", lambda key, states: states, ka.JOB, "sp",
                        TransformOptions(target_job="copy", dry_run=True))

    # the provider's operator: the database as an argument (or a postgres connection)
    common = {"storage": root, "job": "copy", "source": f"{JOB}:latest", "savepoint": "sp",
              "transform_ref": "tests.jobs.test_transform:_identity",
              "target_ref": "jobs.keyed_aggregation:JOB", "dry_run": True}
    with pytest.raises(UsageError, match="pass that database"):
        CkptMigrateOperator(task_id="nodb", **common).execute({})
    planned = CkptMigrateOperator(task_id="plan", state_db=store.url,
                                  state_table=store.table, **common).execute({})
    assert planned["dry_run"] and planned["plan"]["source_job"] == JOB
    out = transform_state(root, f"{JOB}:latest", lambda key, states: states, ka.JOB, "sp",
                          TransformOptions(target_job="copy", parallelism=3, state_db=store))
    assert out["entries"] == {"totals": _summary(days[:2])[0]}
    run_job(ka.JOB, RunConfig(input=str(tmp_path / "in2"), storage=root, run_id="d2",
                              output=str(tmp_path / "out-copy"), local_dir=str(tmp_path / "l"),
                              engine="local", job="copy", start_from="copy/savepoints/sp"))
    assert_totals_equal(final_state(root, "copy")["totals"], _want(days))
