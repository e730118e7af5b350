"""The library's run protocol, for any job: the example job and keyed aggregation.

Each scenario, against an independent pandas reference, on file:// and on the
moto S3 server: two runs, a re-run of a committed run id (skipped), a crashed
attempt (``fail_subtask``), a rescale to another parallelism, one more run.
Output of every run and the final state must equal the reference.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import pandas as pd
import pytest

from demo.sample_data import generate_events
from examples import user_activity
from jobs import BUILTIN_JOBS
from jobs import keyed_aggregation as ka
from statebackend.checkpoint.store import CheckpointStore
from statebackend.errors import UsageError
from statebackend.job import JobRunError, RunConfig, load_job, run_job
from statebackend.job.publish import run_dir_name
from statebackend.rescale.executor import rescale
from statebackend.state.external_store import ExternalStore
from statebackend.storage import open_storage
from tests.jobs.run_reference import (
    BAD_LINES,
    activity_events,
    activity_reference,
    assert_totals_equal,
    check_totals_output,
    final_state,
    read_output,
    totals_days,
    totals_reference,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def out_url(storage_url: str, tmp_path) -> str:
    return f"{storage_url}-out" if storage_url.startswith("s3://") else str(tmp_path / "out")


def scenario(spark, tmp_path, storage_url: str, job, days, reference, check_output,
             check_state, engine: str = "spark", backend: str | None = None,
             state_db: ExternalStore | None = None) -> None:
    """runs d0, d1; re-run d0; crash d2; rescale 3 -> 2; run d2: all against pandas,
    with the runs' tasks on ``engine`` (statebackend.job.engine) and the state on
    ``backend`` (None: the default, rocksdb; external: in ``state_db``)."""
    output = out_url(storage_url, tmp_path)
    store = CheckpointStore(open_storage(storage_url), job.name)
    expected_outputs, expected_state = reference

    def config(d: int, **kw) -> RunConfig:
        return RunConfig(input=str(tmp_path / f"in{d}"), storage=storage_url, run_id=f"d{d}",
                         output=output, local_dir=str(tmp_path / "local"), engine=engine,
                         backend=backend, state_db=state_db and state_db.url,
                         state_table=state_db.table if state_db else "ckpt_state", **kw)

    s0 = run_job(job, config(0, parallelism=3), spark)
    s1 = run_job(job, config(1), spark)
    assert [s0["checkpoint_id"], s1["checkpoint_id"]] == [1, 2]
    assert (s0["engine"], s1["engine"]) == (engine, engine)
    assert s0["job_kind"] == job.name and s0["parallelism"] == 3
    for d in (0, 1):
        check_output(read_output(output, run_dir_name(f"d{d}")), expected_outputs[d])

    again = run_job(job, config(0), spark)
    assert (again["skipped"], again["checkpoint_id"], again["published"]) == (True, 1, False)

    with pytest.raises(JobRunError, match=r"injected failure in subtask 1.*checkpoint 2 stays"):
        run_job(job, config(2, fail_subtask=1), spark)
    assert store.checkpoint_ids() == [1, 2] and store.checkpoint_dirs() == [1, 2]
    referenced = {f.path for m in store.load_all() for f in m.files}
    assert {i.path for i in store.storage.walk_files("shared")} <= referenced
    assert not open_storage(output).exists(f"{run_dir_name('d2')}/_SUCCESS")

    r = rescale(store, "latest", 2, spark=spark)
    assert (r["checkpoint_id"], r["to_parallelism"]) == (3, 2)

    s2 = run_job(job, config(2), spark)
    assert (s2["checkpoint_id"], s2["parallelism"], s2["parent"]) == (4, 2, 3)
    check_output(read_output(output, run_dir_name("d2")), expected_outputs[2])
    check_state(final_state(storage_url, job.name, state_db), expected_state)
    assert [(m.kind, m.run_id) for m in store.load_all()] == [
        ("checkpoint", "d0"), ("checkpoint", "d1"), ("rescale", None), ("checkpoint", "d2")]
    assert {m.state_backend for m in store.load_all()} == {backend or "rocksdb"}


def check_activity_output(got: pd.DataFrame, want: pd.DataFrame) -> None:
    got = got.set_index("user").sort_index()
    assert got.index.is_unique
    pd.testing.assert_frame_equal(got, want, check_dtype=False)


def activity_days(tmp_path) -> list[pd.DataFrame]:
    return [activity_events(str(tmp_path / f"in{d}"), rows=1500, users=300, seed=90 + d, day=d,
                            fmt="json" if d == 1 else "parquet", bad=d == 1)
            for d in range(3)]


def test_example_job_matches_pandas(spark, tmp_path, durable_storage_url):
    _example_scenario(spark, tmp_path, durable_storage_url, user_activity.job)


def test_example_job_vectorized_form_matches_pandas(spark, tmp_path):
    """The same job in the vectorized form (file:// only: same protocol, half the time)."""
    _example_scenario(spark, tmp_path, f"file://{tmp_path}/store", user_activity.job_vectorized)


def _example_scenario(spark, tmp_path, storage_url: str, job) -> None:
    days = activity_days(tmp_path)
    scenario(spark, tmp_path, storage_url, job, days, activity_reference(days),
             check_activity_output, lambda got, want: _assert_equal(got, want))


def _assert_equal(got, want) -> None:
    assert got == want


def test_keyed_aggregation_matches_pandas(spark, tmp_path, durable_storage_url):
    days = totals_days(str(tmp_path), 3, seed=300)
    scenario(spark, tmp_path, durable_storage_url, ka.JOB, days, totals_reference(days),
             check_totals_output,
             lambda got, want: assert_totals_equal(got["totals"], want["totals"]))


@pytest.mark.parametrize("job", [ka.JOB, user_activity.job], ids=["keyed_aggregation",
                                                                  "user_activity"])
def test_local_engine_matches_pandas(spark, tmp_path, durable_storage_url, job):
    """The same scenario with the runs in this process (no Spark task): re-run, crashed
    subtask, a rescale between runs, JSON with bad lines and Parquet input."""
    if job is ka.JOB:
        days = totals_days(str(tmp_path), 3, seed=301)
        scenario(spark, tmp_path, durable_storage_url, job, days, totals_reference(days),
                 check_totals_output,
                 lambda got, want: assert_totals_equal(got["totals"], want["totals"]),
                 engine="local")
    else:
        days = activity_days(tmp_path)
        scenario(spark, tmp_path, durable_storage_url, job, days, activity_reference(days),
                 check_activity_output, _assert_equal, engine="local")


@pytest.mark.parametrize(("job", "engine"), [(ka.JOB, "spark"), (user_activity.job, "local")],
                         ids=["keyed_aggregation-spark", "user_activity-local"])
def test_memory_backend_matches_pandas(spark, tmp_path, job, engine):
    """The same scenario with the state in memory (statebackend.state.memory): a crashed
    attempt, a rescale that moves key-group files and one more run, against pandas."""
    storage_url = f"file://{tmp_path}/store"
    if job is ka.JOB:
        days = totals_days(str(tmp_path), 3, seed=302)
        scenario(spark, tmp_path, storage_url, job, days, totals_reference(days),
                 check_totals_output,
                 lambda got, want: assert_totals_equal(got["totals"], want["totals"]),
                 engine=engine, backend="memory")
    else:
        days = activity_days(tmp_path)
        scenario(spark, tmp_path, storage_url, job, days, activity_reference(days),
                 check_activity_output, _assert_equal, engine=engine, backend="memory")


@pytest.mark.parametrize(("job", "engine"), [(ka.JOB, "spark"), (user_activity.job, "local")],
                         ids=["keyed_aggregation-spark", "user_activity-local"])
def test_external_backend_matches_pandas(spark, tmp_path, postgres_server, job, engine):
    """The same scenario with the state in PostgreSQL (statebackend.state.external): the
    Spark tasks restore by a query and pre-commit their epoch; the rescale moves nothing."""
    storage_url = f"file://{tmp_path}/store"
    state_db = ExternalStore(postgres_server.url, f"rp_{engine}")
    if job is ka.JOB:
        days = totals_days(str(tmp_path), 3, seed=304)
        scenario(spark, tmp_path, storage_url, job, days, totals_reference(days),
                 check_totals_output,
                 lambda got, want: assert_totals_equal(got["totals"], want["totals"]),
                 engine=engine, backend="external", state_db=state_db)
    else:
        days = activity_days(tmp_path)
        scenario(spark, tmp_path, storage_url, job, days, activity_reference(days),
                 check_activity_output, _assert_equal, engine=engine, backend="external",
                 state_db=state_db)


def test_quarantine_reasons_of_the_example(spark, tmp_path):
    activity_events(str(tmp_path / "in"), rows=400, users=50, seed=7, day=0, fmt="json",
                    bad=True)
    s = run_job(user_activity.job, RunConfig(input=str(tmp_path / "in"),
                                             storage=f"file://{tmp_path}/store", run_id="q",
                                             output=str(tmp_path / "out")), spark)
    assert s["events_read"] == 404 and s["events_rejected"] == 4
    assert s["rejects_by_reason"] == {"empty_user": 1, "invalid_ts": 1, "malformed": 1,
                                      "missing_user": 1}
    q = pd.read_parquet(tmp_path / "out" / "_quarantine" / "run=q")
    assert list(q.columns) == ["user", "ts", "category", "reason", "run_id", "raw"]
    assert q.set_index("reason").loc["invalid_ts", "ts"] == "soon"
    assert sorted(q["raw"]) == sorted(BAD_LINES)


def test_states_of_another_job_are_refused(spark, tmp_path):
    activity_events(str(tmp_path / "in"), rows=100, users=10, seed=8, day=0)
    url = f"file://{tmp_path}/store"
    run_job(user_activity.job, RunConfig(input=str(tmp_path / "in"), storage=url, run_id="a",
                                         output=str(tmp_path / "o1")), spark)
    with pytest.raises(UsageError, match=r"cannot continue the lineage of 'user_activity' "
                                         r"\(checkpoint 1\): its key: the key column changes "
                                         r"from 'user' to 'key'.*\(2 more refused\)"):
        run_job(ka.JOB, RunConfig(input=str(tmp_path / "in"), storage=url, job="user_activity",
                                  run_id="b", output=str(tmp_path / "o2")), spark)


def test_a_state_mode_on_another_backend_is_refused_before_any_work(tmp_path):
    """``--state-mode`` chooses how the external backend commits: on another backend it
    contradicts the run's choice, so the run refuses it and commits nothing."""
    activity_events(str(tmp_path / "in"), rows=100, users=10, seed=9, day=0)
    url = f"file://{tmp_path}/store"
    for backend in ("memory", "rocksdb"):
        with pytest.raises(UsageError, match=rf"^--state-mode wal \(ckpt_jobs: state_mode\) is "
                                             rf"a mode of the external backend; this run of job "
                                             rf"'user_activity' is on the {backend} backend$"):
            run_job(user_activity.job, RunConfig(
                input=str(tmp_path / "in"), storage=url, run_id="a", engine="local",
                output=str(tmp_path / "out"), backend=backend, state_mode="wal"))
    assert CheckpointStore(open_storage(url), "user_activity").load_all() == []
    s = run_job(user_activity.job, RunConfig(input=str(tmp_path / "in"), storage=url,
                                             run_id="a", engine="local",
                                             output=str(tmp_path / "out"), backend="memory"))
    assert s["checkpoint_id"] == 1  # the same run, without the contradiction


def test_builtin_names_and_load_job():
    assert load_job(BUILTIN_JOBS["keyed_aggregation"]) is ka.JOB
    assert load_job("examples.user_activity:job") is user_activity.job
    for ref, fragment in (("examples.user_activity", "package.module:attribute"),
                          ("examples.nope:job", "module 'examples.nope' not found"),
                          ("examples.user_activity:nope", "has no attribute 'nope'"),
                          ("examples.user_activity:INPUT", "is a Input, not a")):
        with pytest.raises(UsageError, match=fragment):
            load_job(ref)


@pytest.mark.parametrize("module", sorted({ref.split(":")[0] for ref in BUILTIN_JOBS.values()}))
def test_a_job_modules_help_names_its_job_and_options(module):
    """``python -m jobs.X --help``: the job is fixed (no MODULE:ATTR), its options listed."""
    done = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True,
                          text=True, timeout=120, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    assert done.returncode == 0, done.stderr
    job = load_job(next(r for r in BUILTIN_JOBS.values() if r.startswith(module + ":")))
    assert "MODULE:ATTR" not in done.stdout and "--run-id" in done.stdout
    for opt in job.options:
        assert "--" + opt.name.replace("_", "-") in done.stdout


def _ckpt(*args: str, cwd: str = ROOT, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT, **(env or {})}
    return subprocess.run([sys.executable, "-m", "statebackend.cli.app", *args], env=env,
                          capture_output=True, text=True, timeout=400, cwd=cwd)


def test_ckpt_run_cli_with_a_job_option(tmp_path):
    """`ckpt run examples.user_activity:job`: two runs, a skipped re-run, --normalize-case."""
    days = [activity_events(str(tmp_path / f"in{d}"), rows=600, users=80, seed=60 + d, day=d)
            for d in range(2)]
    expected, state = activity_reference(days, normalize=False)
    store = f"file://{tmp_path}/store"

    def run(d: int) -> dict:
        proc = _ckpt("run", "examples.user_activity:job", "--input", str(tmp_path / f"in{d}"),
                     "--storage", store, "--run-id", f"d{d}", "--output", str(tmp_path / "out"),
                     "--parallelism", "2", "--master", "local[1]", "--normalize-case", "false",
                     "--engine", "auto", "--json")
        assert proc.returncode == 0, proc.stderr[-3000:]
        summary = json.loads(proc.stdout)
        assert summary.get("engine", "local") == "local", summary
        return summary

    first, second, again = run(0), run(1), run(1)
    assert (first["checkpoint_id"], second["checkpoint_id"]) == (1, 2)
    assert (again["skipped"], again["checkpoint_id"]) == (True, 2)
    assert first["job"] == "user_activity" and first["job_kind"] == "user_activity"
    for d in (0, 1):
        check_activity_output(read_output(str(tmp_path / "out"), f"run=d{d}"), expected[d])
    assert final_state(store, "user_activity") == state

    # a warning is one line on stderr (not a second, unprefixed one from logging)
    warned = _ckpt("run", "examples.user_activity:job", "--input", str(tmp_path / "in1"),
                   "--storage", store, "--run-id", "d1-again", "--output",
                   str(tmp_path / "out"), "--parallelism", "3", "--engine", "local")
    assert warned.returncode == 0, warned.stderr[-3000:]
    assert [x for x in warned.stderr.splitlines() if "ignored" in x] == [
        "ckpt run: warning: parallelism 3 ignored: the lineage keeps 2 (use rescale-restore "
        "to change parallelism)"], warned.stderr

    bad = _ckpt("run", "examples.user_activity:job", "--input", str(tmp_path / "in0"),
                "--storage", store, "--run-id", "d9", "--output", str(tmp_path / "out"),
                "--normalize-case", "maybe")
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines()[-1] == (
        "ckpt: error: job 'user_activity': option 'normalize_case' must be of type bool, "
        "got 'maybe'")


def test_commit_records_metrics_context_and_run_history(spark, tmp_path):
    """`_metadata` carries the run's metrics and who ran it; every outcome is in the
    history (runs/history/) that the Checkpoints page reads."""
    from statebackend.airflow.page.data import read_run_records

    days = totals_days(str(tmp_path), 2, seed=900)
    storage = f"file://{tmp_path}/store"
    ctx = {"airflow": {"dag_id": "agg_pipeline", "run_id": "scheduled__x", "task_id": "run_job",
                       "try_number": 1}}

    def config(d: int, **kw) -> RunConfig:
        return RunConfig(input=str(tmp_path / f"in{d}"), storage=storage, run_id=f"d{d}",
                         output=str(tmp_path / "out"), parallelism=2, context=ctx, **kw)

    s0 = run_job(ka.JOB, config(0), spark)
    with pytest.raises(JobRunError):
        run_job(ka.JOB, config(1, fail_subtask=1), spark)
    run_job(ka.JOB, config(0), spark)  # skipped
    store = CheckpointStore(open_storage(storage), ka.JOB.name)
    meta = store.latest()
    metrics = meta.extra["metrics"]
    assert meta.extra["context"] == ctx
    run = metrics["run"]
    assert (run["events_read"], run["events_rejected"], run["keys_touched"]) == (
        s0["events_read"], s0["events_rejected"], s0["keys_touched"])
    assert run["bytes_uploaded"] == meta.bytes_uploaded
    assert run["state_rows"] == sum(sum(s.row_counts.values()) for s in meta.subtasks)
    assert [s["index"] for s in metrics["subtasks"]] == [0, 1]
    assert sum(s["events"] for s in metrics["subtasks"]) == len(days[0])
    assert set(run["phases"]) == {"restore", "process", "timers", "snapshot", "upload"}
    records = read_run_records(store)
    assert [(r["run_id"], r["outcome"]) for r in records] == [
        ("d0", "committed"), ("d1", "failed"), ("d0", "skipped")]
    assert records[1]["error"] and "injected failure" in records[1]["error"]
    assert records[0]["checkpoint_id"] == 1 and records[0]["context"] == ctx["airflow"]


def test_a_run_reports_the_state_it_holds_in_memory_and_warns_near_the_limit(spark, tmp_path,
                                                                              capsys,
                                                                              monkeypatch):
    """The memory backend's summary names its largest subtask's state as the limit counts
    it (the same on Spark): a limit just under that figure fails the same run from
    scratch, one just over it commits with one warning line (the next growth would fail)."""
    from statebackend.airflow.page.data import run_metrics as page_run_metrics
    from statebackend.cli import app as cli

    days = [generate_events(str(tmp_path / "in"), n_events=120_000, n_keys=80_000, seed=11,
                            start_ts_ms=1_800_000_000_000, fmt="parquet")]
    want = totals_reference(days)[1]["totals"]

    def run(name: str, *flags: str) -> tuple[int, str, str]:
        code = cli.main(["run", "jobs.keyed_aggregation:JOB", "--storage",
                         f"file://{tmp_path}/{name}", "--input", str(tmp_path / "in"),
                         "--output", str(tmp_path / f"out-{name}"), "--run-id", "d0",
                         "--engine", "local", "--parallelism", "2", "--backend", "memory",
                         *flags])
        out, err = capsys.readouterr()
        return code, out, err

    code, out, err = run("roomy", "--json")
    summary = json.loads(out)
    mem = summary["state_memory"]
    held = mem["held_bytes"]
    assert code == 0 and err == "" and "warnings" not in summary
    assert mem["limit_bytes"] == 2048 * 2**20 and mem["share"] == round(held / 2**31, 4)
    assert held > 4 * 2**20  # the limits below are whole MiB: one over it is within 80%
    total = mem["total_bytes"]
    assert mem["subtasks"] == 2 and held < total < 2 * held
    assert_totals_equal(final_state(f"file://{tmp_path}/roomy", "keyed_aggregation")["totals"],
                        want)
    # a rescale of it runs no task: asked for Spark, it starts none (it would take
    # seconds to regroup a record in milliseconds)
    def no_spark(*_a, **_kw):
        raise AssertionError("a memory-backend rescale started a Spark session")

    monkeypatch.setattr("statebackend.cli.rescale.rescale_spark", no_spark)
    code, out, err = cli.main(["--storage", f"file://{tmp_path}/roomy", "--job",
                               "keyed_aggregation", "rescale", "-p", "3", "--engine", "spark",
                               "--json"]), *capsys.readouterr()
    scaled = json.loads(out)
    assert code == 0 and (scaled["engine"], scaled["bytes_uploaded"]) == ("local", 0), err
    assert scaled["rows"] == len(want)
    monkeypatch.undo()
    on_spark = run_job(ka.JOB, RunConfig(
        input=str(tmp_path / "in"), storage=f"file://{tmp_path}/spark", run_id="d0",
        output=str(tmp_path / "out-spark"), parallelism=2, backend="memory"), spark)
    assert on_spark["engine"] == "spark" and on_spark["state_memory"] == mem

    code, _, err = run("tight", "--memory-limit-mb", str(held // 2**20))
    assert code != 0 and f"limit of {held // 2**20} MiB" in err and "rocksdb" in err, err
    assert CheckpointStore(open_storage(f"file://{tmp_path}/tight"),
                           "keyed_aggregation").load_all() == []

    over = -(-held // 2**20)
    code, out, err = run("near", "--memory-limit-mb", str(over))
    assert code == 0, err
    line = f"subtask {mem['subtask']} holds {held / 2**20:.1f} MiB of state in memory, " \
        f"{held / (over * 2**20):.0%} of the limit of {over:.1f} MiB per subtask " \
        "(--memory-limit-mb)"
    assert err.splitlines() == [err.splitlines()[0]] and line in err, err
    clause = f"state in memory up to {held / 2**20:.1f} MiB (subtask {mem['subtask']}, " \
        f"{held / (over * 2**20):.0%} of its limit), {total / 2**20:.1f} MiB in all 2 subtasks"
    assert out.rstrip().endswith("; " + clause), out
    # the commit record keeps it: per subtask, and the run's line on the Checkpoints page
    meta = CheckpointStore(open_storage(f"file://{tmp_path}/near"), "keyed_aggregation").latest()
    metrics = meta.extra["metrics"]
    assert max(s["memory_bytes"] for s in metrics["subtasks"]) == held
    assert sum(s["memory_bytes"] for s in metrics["subtasks"]) == total
    assert metrics["run"]["state_memory"] == {**mem, "limit_bytes": over * 2**20,
                                              "share": round(held / (over * 2**20), 4)}
    assert page_run_metrics(meta)["state_memory"] == clause
    code, out, _ = cli.main(["--storage", f"file://{tmp_path}/near", "--job",
                             "keyed_aggregation", "show", "--json"]), *capsys.readouterr()
    assert code == 0 and json.loads(out)["state_memory"] == metrics["run"]["state_memory"]
    cli.main(["--storage", f"file://{tmp_path}/near", "--job", "keyed_aggregation", "show"])
    assert "  state in memory   " + clause.removeprefix("state in memory ") in \
        capsys.readouterr().out
    for garbage in (None, "x", {"subtask": "0", "held_bytes": 1}, {"subtask": True,
                                                                    "held_bytes": 1}):
        tampered = replace(meta, extra={**meta.extra, "metrics": {
            **metrics, "run": {**metrics["run"], "state_memory": garbage}}})
        assert page_run_metrics(tampered)["state_memory"] is None
    assert_totals_equal(final_state(f"file://{tmp_path}/near", "keyed_aggregation")["totals"],
                        want)
    # every subtask's limit holds, but the local engine's one process holds them all: on a
    # machine of 1.5 times their sum the run commits and says so in one line
    monkeypatch.setattr("statebackend.job.run.machine_memory_bytes", lambda: total * 3 // 2)
    code, out, err = run("crowded")
    assert code == 0 and err.splitlines() == [
        f"ckpt run: warning: the local engine's process holds {total / 2**20:.1f} MiB of state "
        f"in memory over 2 subtasks, 67% of this machine's {total * 1.5 / 2**20:.1f} MiB: a "
        "run whose state grows further may be killed for lack of memory; run it on Spark "
        "(--engine spark) or move the job to rocksdb"], err
    assert_totals_equal(final_state(f"file://{tmp_path}/crowded",
                                    "keyed_aggregation")["totals"], want)
