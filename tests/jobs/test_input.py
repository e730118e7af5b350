"""Input of the keyed aggregation job: formats, skipped files, malformed lines, bad files."""

from __future__ import annotations

import gzip
import os
import shutil
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

from demo.sample_data import expected_totals, generate_events
from jobs.keyed_aggregation import JobRunError, RejectThresholdError, run
from statebackend.errors import InputError
from statebackend.job import RunConfig
from statebackend.job.input import list_input
from tests.jobs.helpers import assert_state_equals, dump_latest, store_of

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Lines a JSON-lines reader must not accept: each is quarantined as `malformed`.
MALFORMED = ['not json',
             '{"key":"m1","ts":1798761600000,"value":2} xyz',
             '{"key":"m2","ts":1798761600000,"value":2}{"key":"m3"}',
             '{"key":"m4","ts":1798761600000,"value":2},{"key":"m5"}',
             '{"key":"m6","ts":',
             '42']


def config(tmp_path, input_dir, run_id, reader: str = "auto", **kw) -> RunConfig:
    return RunConfig(input=str(input_dir), storage=f"file://{tmp_path}/store", job="agg",
                     run_id=run_id, output=str(tmp_path / "out"), input_reader=reader, **kw)


@pytest.fixture(params=["spark", "arrow"])
def reader(request) -> str:
    """Both input readers must give the same runs (statebackend.job.input)."""
    return request.param


def gzip_file(path, dest) -> None:
    with open(path, "rb") as src, gzip.open(dest, "wb") as dst:
        shutil.copyfileobj(src, dst)
    os.remove(path)


def test_gz_json_lines_count_like_plain_and_unsupported_files_are_reported(spark, tmp_path,
                                                                           reader):
    inp = tmp_path / "in"
    plain = generate_events(str(inp), n_events=700, n_keys=90, seed=31)  # part-00000.parquet
    zipped = generate_events(str(tmp_path / "j"), n_events=500, n_keys=90, seed=32, fmt="json")
    gzip_file(tmp_path / "j" / "part-00000.jsonl", inp / "more.jsonl.gz")
    (inp / "notes.csv").write_text("key,ts,value\nc1,1,1.0\n")
    (inp / "readme.txt").write_text("hello")
    (inp / "_SUCCESS").write_text("")  # marker files stay ignored, not reported

    s = run(config(tmp_path, inp, "r1", reader, parallelism=2), spark)
    assert s["events_read"] == 1200 and s["events_rejected"] == 0
    assert s["input_reader"] == reader
    assert (s["input_files_skipped"], s["input_files_skipped_names"]) == \
        (2, ["notes.csv", "readme.txt"])
    assert_state_equals(dump_latest(f"file://{tmp_path}/store", "agg"),
                        expected_totals([plain, zipped]))


def test_skipped_files_warn_in_text_mode(tmp_path):
    generate_events(str(tmp_path / "in"), n_events=50, n_keys=5, seed=33)
    (tmp_path / "in" / "extra.csv").write_text("key\n")
    proc = _cli(tmp_path, "--run-id", "w1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    warnings = [ln for ln in proc.stderr.splitlines() if "keyed_aggregation: warning" in ln]
    assert len(warnings) == 1 and "1 input file(s)" in warnings[0] and "skipped" in warnings[0]
    assert "extra.csv" in warnings[0]


def test_a_folder_of_only_unsupported_files_is_refused(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.csv").write_text("key,ts,value\n")
    (tmp_path / "in" / "b.json.bz2").write_bytes(b"x")
    with pytest.raises(InputError) as info:
        run(config(tmp_path, tmp_path / "in", "r1"))
    msg = str(info.value)
    assert "\n" not in msg and str(tmp_path / "in") in msg and "a.csv, b.json.bz2" in msg
    assert store_of(f"file://{tmp_path}/store", "agg").checkpoint_ids() == []
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "_SUCCESS").write_text("")
    assert list_input(str(tmp_path / "empty")).count == 0  # empty stays a valid input


def test_malformed_and_trailing_garbage_lines_are_quarantined_raw(spark, tmp_path):
    _malformed_lines_case(spark, tmp_path, "spark")


def test_malformed_lines_are_quarantined_raw_by_the_arrow_reader(spark, tmp_path):
    _malformed_lines_case(spark, tmp_path, "arrow")


def _malformed_lines_case(spark, tmp_path, reader: str) -> None:
    inp = tmp_path / "in"
    good = generate_events(str(inp), n_events=1000, n_keys=120, seed=34, fmt="json")
    missing_key = '{"ts":1798761600000,"value":3}'
    (inp / "bad.jsonl").write_text("\n".join(MALFORMED[:3] + ["", "   ", missing_key]) + "\n")
    with gzip.open(inp / "bad2.ndjson.gz", "wt") as fh:
        fh.write("\n".join(MALFORMED[3:]) + "\n")

    s = run(config(tmp_path, inp, "r1", reader, parallelism=2), spark)
    assert (s["events_read"], s["events_rejected"]) == (1007, 7)
    assert s["rejects_by_reason"] == {"malformed": 6, "missing_key": 1}
    q = pq.read_table(tmp_path / "out" / "_quarantine" / "run=r1").to_pandas()
    assert list(q.columns) == ["key", "ts", "value", "reason", "run_id", "raw"]
    bad = q[q["reason"] == "malformed"]
    assert sorted(bad["raw"]) == sorted(MALFORMED)
    assert bad[["key", "ts", "value"]].isna().all().all()
    assert q.loc[q["reason"] == "missing_key", "raw"].tolist() == [missing_key]
    assert_state_equals(dump_latest(f"file://{tmp_path}/store", "agg"), expected_totals([good]))

    # malformed lines count against --max-reject-fraction like any reject
    with pytest.raises(RejectThresholdError, match=r"7 of 1007 .*malformed=6, missing_key=1"):
        run(config(tmp_path, inp, "r2", reader, max_reject_fraction=0.005), spark)


def test_truncated_parquet_is_refused_in_one_line_naming_the_file(tmp_path):
    generate_events(str(tmp_path / "in"), n_events=300, n_keys=30, seed=35)
    good = tmp_path / "in" / "part-00000.parquet"
    bad = tmp_path / "in" / "part-00001.parquet"
    bad.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    proc = _cli(tmp_path, "--run-id", "t1")
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("keyed_aggregation: error: input file ")
    assert str(bad) in lines[0] and "not a readable Parquet file" in lines[0]
    assert store_of(f"file://{tmp_path}/store", "cli").checkpoint_ids() == []


def test_a_bad_file_among_good_ones_is_named_in_one_line(spark, tmp_path, reader):
    inp = tmp_path / "in"
    generate_events(str(inp), n_events=400, n_keys=40, seed=36, fmt="json")
    gzip_file(inp / "part-00000.jsonl", inp / "good.jsonl.gz")
    generate_events(str(tmp_path / "b"), n_events=400, n_keys=40, seed=37, fmt="json")
    gzip_file(tmp_path / "b" / "part-00000.jsonl", tmp_path / "b.gz")
    data = (tmp_path / "b.gz").read_bytes()
    (inp / "cut.jsonl.gz").write_bytes(data[: len(data) // 2])  # truncated gzip stream
    with pytest.raises(JobRunError) as info:
        run(config(tmp_path, inp, "r1", reader, parallelism=2), spark)
    msg = str(info.value)
    assert "\n" not in msg and len(msg) < 1000
    assert f"cannot read input file file://{inp / 'cut.jsonl.gz'}" in msg
    assert "no checkpoint was committed" in msg
    assert store_of(f"file://{tmp_path}/store", "agg").checkpoint_ids() == []


def _cli(tmp_path, *extra: str) -> subprocess.CompletedProcess:
    """The job module as a user runs it: the default engine (auto: local for this input)."""
    env = {**os.environ, "PYTHONPATH": ROOT}
    args = [sys.executable, "-m", "jobs.keyed_aggregation", "--input", str(tmp_path / "in"),
            "--storage", str(tmp_path / "store"), "--job", "cli", "--output",
            str(tmp_path / "out"), "--parallelism", "1", "--master", "local[1]",
            "--engine", "auto", *extra]
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_quarantine_keeps_its_columns_and_adds_raw():
    from jobs.keyed_aggregation import JOB
    from statebackend.job.task import quarantine_schema

    assert quarantine_schema(JOB).names == ["key", "ts", "value", "reason", "run_id", "raw"]


def test_reader_choice_is_spark_for_local_parquet_and_arrow_elsewhere(tmp_path):
    from statebackend.errors import UsageError
    from statebackend.job.input import InputFiles, choose_reader, choose_readers

    generate_events(str(tmp_path / "in"), n_events=10, n_keys=3, seed=38)
    local = list_input(str(tmp_path / "in"))
    assert [choose_reader(local, r) for r in ("auto", "spark", "arrow")] == \
        ["spark", "spark", "arrow"]
    # local JSON lines: Arrow's reader (faster than Spark's there); mixed folders: both
    (tmp_path / "in" / "more.jsonl").write_text('{"key":"a","ts":1,"value":1.0}\n')
    mixed = list_input(str(tmp_path / "in"))
    assert choose_readers(mixed) == {"parquet": "spark", "json": "arrow"}
    assert choose_reader(mixed) == "spark+arrow"
    assert choose_reader(mixed, "arrow") == "arrow"
    remote = InputFiles("s3://bucket/in", ("s3://bucket/in/a.parquet",), (), 1)
    assert choose_reader(remote) == "arrow"
    with pytest.raises(UsageError, match="needs a Hadoop connector for s3://"):
        choose_reader(remote, "spark")
    with pytest.raises(UsageError, match="input reader 'fast' is unknown"):
        choose_reader(local, "fast")
    with pytest.raises(UsageError, match="input reader 'fast' is unknown"):
        run(config(tmp_path, tmp_path / "in", "r1", reader="fast"))
