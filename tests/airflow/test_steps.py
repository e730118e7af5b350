"""Task logic of the DAGs without Airflow: run keys, templates, job and options,
credentials as storage options, refusals."""

from __future__ import annotations

import os
from datetime import UTC, datetime
from types import SimpleNamespace

import pytest

from statebackend.airflow import steps
from statebackend.airflow.config import specs_from_config
from statebackend.errors import CkptError, UsageError


def make_spec(tmp_path, **over):
    job = {"input": str(tmp_path / "in/day={{ ds }}"), "output": str(tmp_path / "out/{{ ds }}"),
           "storage": f"file://{tmp_path}/store", "parallelism": 2, **over}
    return specs_from_config({"jobs": {"clicks": job}})[0]


def test_run_key_is_per_interval_and_falls_back_to_run_id():
    day = datetime(2027, 1, 1, tzinfo=UTC)
    assert steps.run_key(day, "manual__x") == steps.run_key(day, "scheduled__y")
    assert steps.run_key(day, "a") == "interval__2027-01-01T00:00:00+00:00"
    assert steps.run_key(None, "manual__2027") == "manual__2027"


def test_build_run_config_renders_the_interval(tmp_path):
    spec = make_spec(tmp_path, quarantine=str(tmp_path / "q/{{ ds_nodash }}"))
    cfg = steps.build_run_config(spec, logical_date=datetime(2027, 1, 2, tzinfo=UTC),
                                 airflow_run_id="manual__1")
    assert cfg.input.endswith("in/day=2027-01-02") and cfg.output.endswith("out/2027-01-02")
    assert cfg.quarantine.endswith("q/20270102")
    assert cfg.run_id == "interval__2027-01-02T00:00:00+00:00"
    assert (cfg.job, cfg.parallelism, cfg.max_parallelism) == ("clicks", 2, 128)
    assert cfg.start_from is None
    seeded = make_spec(tmp_path, start_from="clicks_old/savepoints/before-upgrade")
    cfg = steps.build_run_config(seeded, logical_date=datetime(2027, 1, 2, tzinfo=UTC),
                                 airflow_run_id="manual__1")
    assert cfg.start_from == "clicks_old/savepoints/before-upgrade"
    with pytest.raises(CkptError, match="'ds' is undefined"):  # no logical date: no interval
        steps.build_run_config(seeded, logical_date=None, airflow_run_id="manual__1")
    args = steps.spark_submit_args(seeded)
    assert args[args.index("--start-from") + 1] == "clicks_old/savepoints/before-upgrade"
    assert args[args.index("--engine") + 1] == "spark"  # the application is on the cluster
    assert cfg.engine is None  # $CKPT_ENGINE, else auto
    local = steps.build_run_config(make_spec(tmp_path, engine="local"),
                                   logical_date=datetime(2027, 1, 2, tzinfo=UTC),
                                   airflow_run_id="manual__1")
    assert local.engine == "local"


def test_a_spec_chooses_the_state_backend(tmp_path):
    spec = make_spec(tmp_path, backend="memory", memory_limit_mb=512)
    cfg = steps.build_run_config(spec, logical_date=datetime(2027, 1, 2, tzinfo=UTC),
                                 airflow_run_id="manual__1")
    assert (cfg.backend, cfg.memory_limit_mb) == ("memory", 512)
    args = steps.spark_submit_args(spec)
    assert args[args.index("--backend") + 1] == "memory"
    with pytest.raises(CkptError, match=r"backend 'disk' is not one of \['rocksdb', 'memory', "
                                         r"'external'\]"):
        make_spec(tmp_path, backend="disk")
    url = "postgresql://ckpt:s3cret@127.0.0.1:5432/state"
    external = make_spec(tmp_path, backend="external", state_db=url, state_table="features",
                         state_mode="wal")
    cfg = steps.build_run_config(external, logical_date=datetime(2027, 1, 2, tzinfo=UTC),
                                 airflow_run_id="manual__1")
    assert (cfg.backend, cfg.state_db, cfg.state_table, cfg.state_mode) == (
        "external", url, "features", "wal")
    args = steps.spark_submit_args(make_spec(  # no password: submit mode refuses one
        tmp_path, backend="external", state_db="postgresql://ckpt@127.0.0.1/state",
        state_mode="wal"))
    assert args[args.index("--state-mode") + 1] == "wal"
    assert "s3cret" not in repr(external) and "s3cret" not in repr(cfg)


def test_unknown_template_field_is_a_clear_error():
    with pytest.raises(CkptError, match="available fields"):
        steps.render("/in/{{ nope }}", {"ds": "x"})


def test_spark_submit_args_carry_the_run_key_template(tmp_path):
    args = steps.spark_submit_args(make_spec(tmp_path))
    assert args[args.index("--run-id") + 1].startswith("{{ 'interval__' ~ ts")
    assert args[args.index("--job") + 1] == "clicks" and "--json" in args
    assert args[0] == "jobs.keyed_aggregation:JOB"  # the configured job, resolved
    assert steps.submit_application().endswith("statebackend/cli/submit.py")
    mine = make_spec(tmp_path, job="examples.user_activity:job",
                     options={"normalize_case": False})
    args = steps.spark_submit_args(mine)
    assert args[0] == "examples.user_activity:job"
    assert args[args.index("--normalize-case") + 1] == "false"


def test_credentials_become_storage_options_and_never_reach_the_environment(
        tmp_path, caplog, monkeypatch):
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(var, raising=False)
    spec = make_spec(tmp_path, storage_conn_id="ckpt_s3")
    conn = SimpleNamespace(conn_type="aws", login="AKIA", password="s3cr3t-value",
                           extra_dejson={"endpoint_url": "http://minio:9000",
                                         "region_name": "eu-west-1"})
    before = dict(os.environ)
    with caplog.at_level("INFO"):
        options = steps.storage_options_for(spec, lambda cid: conn)
    assert options == {"key": "AKIA", "secret": "s3cr3t-value", "client_kwargs": {
        "endpoint_url": "http://minio:9000", "region_name": "eu-west-1"}}
    assert dict(os.environ) == before
    assert "s3cr3t-value" not in caplog.text and "'ckpt_s3'" in caplog.text
    assert steps.storage_options_for(make_spec(tmp_path), None) == {}


def test_unknown_job_option_names_the_entry_and_the_option(tmp_path):
    from examples.user_activity import job

    with pytest.raises(UsageError) as err:
        steps.checked_options(job, "activity", {"normalise_case": True})
    text = str(err.value)
    assert "ckpt_jobs entry 'activity'" in text and "'normalise_case'" in text
    assert "\n" not in text
    assert steps.checked_options(job, "activity", {"normalize_case": "false"}) == {
        "normalize_case": False}


def test_run_task_refuses_an_unknown_option_before_any_work(tmp_path):
    spec = make_spec(tmp_path, job="examples.user_activity:job", options={"typo": 1})
    (tmp_path / "in" / "day=2027-01-01").mkdir(parents=True)
    with pytest.raises(UsageError, match="ckpt_jobs entry 'clicks'.*no option 'typo'"):
        steps.run_pipeline_job(spec, logical_date=datetime(2027, 1, 1, tzinfo=UTC),
                               airflow_run_id="r", storage_options={})
    assert not (tmp_path / "store").exists()


def test_rescale_refused_while_pipeline_runs(tmp_path):
    spec = make_spec(tmp_path)
    asked = []
    with pytest.raises(steps.PipelineRefusedError, match="clicks_pipeline has 1 active"):
        steps.check_no_running_pipeline(spec, lambda d: asked.append(d) or 1)
    assert asked == ["clicks_pipeline"]
    assert steps.check_no_running_pipeline(spec, lambda d: 0)["active_runs"] == 0


def test_rescale_parallelism_checked_before_touching_storage(tmp_path):
    with pytest.raises(CkptError, match="1..128"):
        steps.rescale_step(make_spec(tmp_path), parallelism=0)


def test_validate_step_names_a_missing_run(tmp_path):
    spec = make_spec(tmp_path)
    with pytest.raises(CkptError, match="no checkpoint of job 'clicks' was committed by run"):
        steps.validate_step(spec, run_id="interval__2027-01-01T00:00:00+00:00",
                            storage_options={})


def test_run_job_refuses_missing_input(tmp_path):
    with pytest.raises(CkptError, match="does not exist"):
        steps.run_pipeline_job(make_spec(tmp_path), logical_date=datetime(2027, 1, 1, tzinfo=UTC),
                               airflow_run_id="r")


def test_publish_extra_is_small():
    extra = steps.publish_extra({"success": True, "data_docs_index": "file:///r/index.html",
                                 "checkpoint": {"id": 3, "run_id": "r", "parallelism": 2,
                                                "bytes_referenced": 10, "bytes_uploaded": 5}})
    assert extra == {"checkpoint_id": 3, "run_id": "r", "parallelism": 2,
                     "bytes_referenced": 10, "bytes_uploaded": 5, "validated": True,
                     "report": "file:///r/index.html"}


def test_spark_submit_run_key_renders_like_the_local_one(tmp_path):
    import jinja2

    args = steps.spark_submit_args(make_spec(tmp_path))
    template = jinja2.Environment().from_string(args[args.index("--run-id") + 1])
    day = datetime(2027, 1, 3, tzinfo=UTC)
    rendered = template.render(ts=day.isoformat(), logical_date=day, run_id="manual__x")
    assert rendered == steps.run_key(day, "manual__x")
    assert template.render(ts=None, logical_date=None, run_id="manual__x") == "manual__x"


@pytest.mark.spark
def test_a_run_task_logs_its_progress(spark, tmp_path, caplog, monkeypatch):
    """The in-task run path reports phases and subtasks to the task log, as `ckpt run`."""
    import logging
    import re

    from tests.jobs.run_reference import expected_totals, totals_days

    monkeypatch.setenv("CKPT_PROGRESS", "auto")
    monkeypatch.setenv("CKPT_PROGRESS_INTERVAL", "0.05")
    day = totals_days(str(tmp_path), 1, seed=3)[0]
    os.rename(tmp_path / "in0", tmp_path / "in")
    spec = make_spec(tmp_path, input=str(tmp_path / "in"), job="jobs.keyed_aggregation:JOB")
    with caplog.at_level(logging.INFO, logger=steps.log.name):
        summary = steps.run_pipeline_job(spec, logical_date=datetime(2027, 1, 1, tzinfo=UTC),
                                         airflow_run_id="r", spark=spark, storage_options={})
    assert summary["events_read"] - summary["events_rejected"] == len(day)
    assert summary["keys_touched"] == len(expected_totals([day]))
    lines = [r.getMessage() for r in caplog.records if r.name == steps.log.name]
    assert any(re.fullmatch(r"ckpt run: run interval__2027-01-01T00:00:00\+00:00, checkpoint 1: "
                            r"2/2 subtasks \(100%\), \d+ s", x) for x in lines), lines


def test_a_changed_job_continues_its_lineage_or_fails_before_reading_input(tmp_path):
    """Issue 21: a ckpt_jobs entry whose code changed between DAG runs: a compatible
    change continues the lineage (the page shows the new schema versions); an
    incompatible one fails in one line before its input is read."""
    from statebackend.airflow.page import data as page
    from statebackend.checkpoint.dump import checkpoint_rows
    from tests.evolution.card_spend import dumped, events, reference

    days = []
    for d, version in ((0, 1), (1, 3)):
        folder = tmp_path / "in" / f"day=2027-01-0{d + 1}"
        folder.mkdir(parents=True)
        events(200, 20, 40 + d, d).to_parquet(folder / "part.parquet")
        spec = make_spec(tmp_path, job=f"tests.evolution.card_spend:V{version}",
                         engine="local")
        summary = steps.run_pipeline_job(spec, logical_date=datetime(2027, 1, d + 1, tzinfo=UTC),
                                         airflow_run_id=f"scheduled__{d}", storage_options={})
        assert summary["checkpoint_id"] == d + 1
        days.append((events(200, 20, 40 + d, d), version))
    store = steps.open_store(spec, {})
    got = dumped(checkpoint_rows(store, store.latest()))["totals"]
    want = reference(days)["totals"]
    assert got.keys() == want.keys()
    for card, totals in want.items():
        assert got[card] == pytest.approx(totals), card
    row = page.checkpoint_row(spec, store, store.latest(), None, {})
    assert {s["name"]: s["schema_version"] for s in row["states"]}["totals"] == 2
    bad_day = tmp_path / "in" / "day=2027-01-03"
    bad_day.mkdir()
    (bad_day / "part.parquet").write_bytes(b"not parquet: reading it would fail differently")
    spec = make_spec(tmp_path, job="tests.evolution.card_spend:TOTALS_AS_MAP", engine="local")
    with pytest.raises(UsageError) as info:
        steps.run_pipeline_job(spec, logical_date=datetime(2027, 1, 3, tzinfo=UTC),
                               airflow_run_id="scheduled__2", storage_options={})
    assert "state 'totals': its kind changes from value to map" in str(info.value)
    assert "\n" not in str(info.value) and store.checkpoint_ids() == [1, 2]


def test_the_state_database_comes_from_a_postgres_connection(tmp_path, monkeypatch,
                                                             postgres_server, caplog):
    """`state_db_conn_id`: the pipeline's run and retention (with its vacuum) reach the
    external backend's database through an Airflow connection (here from Airflow's
    environment-variable secrets backend); its password is never logged, shown or put on
    spark-submit's command line."""
    from demo.sample_data import expected_totals, generate_events
    from statebackend.state.external_store import ExternalStore
    from tests.jobs.run_reference import final_state

    server = postgres_server.url  # postgresql://ckpt@127.0.0.1:PORT/postgres (trust)
    host_port = server.split("@", 1)[1].split("/", 1)[0]
    monkeypatch.setenv("AIRFLOW_CONN_CKPT_STATE_DB",
                       f"postgres://ckpt:pw-not-needed@{host_port}/postgres")
    spec = make_spec(tmp_path, backend="external", state_db_conn_id="ckpt_state_db",
                     state_table="steps_conn", engine="local")
    assert steps.state_db_for(spec) == f"postgresql://ckpt:pw-not-needed@{host_port}/postgres"
    days = []
    for d in (1, 2):
        day = datetime(2027, 1, d, tzinfo=UTC)
        days.append(generate_events(str(tmp_path / f"in/day={day:%Y-%m-%d}"), n_events=400,
                                    n_keys=50, seed=d))
        with caplog.at_level("INFO"):
            steps.run_pipeline_job(spec, logical_date=day, airflow_run_id=f"scheduled__{d}")
    assert "pw-not-needed" not in caplog.text and "pw-not-needed" not in repr(spec)
    report = steps.retain_step(spec, keep=1)
    assert report["retired"] == [1] and report["vacuum"]["vacuumed"]
    # a re-run of the first interval validates nothing (its checkpoint was retired) and
    # fails nothing; the second's validates deep from the database
    first = steps.run_key(datetime(2027, 1, 1, tzinfo=UTC), "scheduled__1")
    assert steps.validate_step(spec, run_id=first, storage_options={}) == {
        "success": True, "checkpoint_id": 1, "skipped": f"run {first!r} committed checkpoint "
        "1, since retired by retention: nothing left to validate"}
    second = steps.run_key(datetime(2027, 1, 2, tzinfo=UTC), "scheduled__2")
    deep = steps.validate_step(spec, run_id=second, level="full", report="none")
    assert deep["success"] and deep["checkpoint"]["id"] == 2
    state = final_state(spec.storage, "clicks", ExternalStore(server, "steps_conn"))["totals"]
    want = expected_totals(days)
    assert {k: v["count"] for (k, _), v in state.items()} == want["count"].to_dict()
    with pytest.raises(UsageError, match="password on the spark-submit command line"):
        steps.submitted_state_db(spec, steps.state_db_for(spec))
    with pytest.raises(CkptError, match="state_db or state_db_conn_id, not both"):
        make_spec(tmp_path, state_db=server, state_db_conn_id="ckpt_state_db")


def test_the_reports_dag_renders_the_newest_kept_checkpoint_its_events_published():
    from types import SimpleNamespace

    from statebackend.airflow.steps import published_checkpoint

    asset = "ckpt_clicks"
    events = {asset: [SimpleNamespace(extra={"checkpoint_id": 4}),
                      SimpleNamespace(extra={"checkpoint_id": 6}),
                      SimpleNamespace(extra={"checkpoint_id": "7"}),  # not an id
                      SimpleNamespace(extra=None)]}
    assert published_checkpoint(events, asset, [4, 5, 6]) == 6
    assert published_checkpoint(events, asset, [4, 5]) == 4  # 6 retired meanwhile
    assert published_checkpoint(events, asset, [8]) == "latest"
    assert published_checkpoint(None, asset, [1]) == "latest"  # a manual run
    assert published_checkpoint({"other": events[asset]}, asset, [6]) == "latest"


def test_the_registry_index_key_comes_from_a_connection(tmp_path, monkeypatch, caplog):
    """`index_key_conn_id`: GC on one worker signs the registry index with the
    connection's key, and another worker with a key file of its own (a fresh pod) trusts
    that index; the key is never logged or shown, and a connection without one is
    refused in one line naming it."""
    import json

    from demo.sample_data import generate_events
    from statebackend.airflow.connection import ConnectionConfigError
    from statebackend.checkpoint.store import CheckpointStore
    from statebackend.lifecycle.registry import build_registry

    key = "index-key-" + "7" * 30
    monkeypatch.setenv("AIRFLOW_CONN_CKPT_INDEX_KEY",
                       json.dumps({"conn_type": "generic", "password": key}))
    spec = make_spec(tmp_path, index_key_conn_id="ckpt_index_key", engine="local")
    for d in (1, 2):
        day = datetime(2027, 1, d, tzinfo=UTC)
        generate_events(str(tmp_path / f"in/day={day:%Y-%m-%d}"), n_events=200, n_keys=20,
                        seed=d)
        steps.run_pipeline_job(spec, logical_date=day, airflow_run_id=f"scheduled__{d}")
    monkeypatch.setenv("CKPT_INDEX_KEY_FILE", str(tmp_path / "worker-a"))
    with caplog.at_level("INFO"):
        steps.gc_step(spec)  # plans from a fresh index, signed with the connection's key
    monkeypatch.setenv("CKPT_INDEX_KEY_FILE", str(tmp_path / "worker-b"))
    store = steps.open_store(spec)
    assert store.index_key == key.encode()
    assert build_registry(store).vouched_before is not None
    assert build_registry(CheckpointStore(store.root_storage, "clicks")).vouched_before is None
    assert key not in caplog.text and key not in repr(store) and key not in repr(spec)
    monkeypatch.setenv("AIRFLOW_CONN_CKPT_INDEX_KEY", json.dumps({"conn_type": "generic"}))
    with pytest.raises(ConnectionConfigError, match=r"^index key connection 'ckpt_index_key' "
                                                    "has no password: put the key there"):
        steps.gc_step(spec)
    monkeypatch.setenv("AIRFLOW_CONN_CKPT_INDEX_KEY",
                       json.dumps({"conn_type": "generic", "password": "short"}))
    with pytest.raises(UsageError, match="from connection 'ckpt_index_key' has 5 bytes"):
        steps.gc_step(spec)


def test_the_page_reads_with_the_hosts_key_when_the_key_connection_is_missing(tmp_path):
    """The Checkpoints page only reads: an index key connection it cannot read costs an
    untrusted index (time), never the page."""
    from statebackend.airflow.page import app

    spec = make_spec(tmp_path, index_key_conn_id="no_such_connection")
    store = app._open_store(spec)
    assert store.index_key is None and store.job == "clicks"
