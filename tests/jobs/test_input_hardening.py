"""Input hardening (issue 20, defects 6, 7, 8, 12): containment, streaming and its bound,
one key rule, invalid UTF-8.

Each correctness test runs the keyed aggregation job through `run_job` on both engines
(and, where a reader is involved, both readers) and compares the final state with
pandas over the rows the documented rules accept (statebackend.job.input, module doc):

- FIFOs and sockets in the input folder are skipped and reported; a run never waits
  on them; symlinks out of the input root are skipped and reported, their content in
  no state, output or quarantine;
- a gzip bomb goes to Spark under ``auto`` (the driver counts decompressed bytes, only
  up to the limit) and a forced local-engine run stops at
  ``CKPT_LOCAL_ENGINE_MAX_MEMORY_BYTES`` in one line, its memory far below the bomb;
- Parquet keys of other types than strings, integers and booleans are refused in one
  line; integer and boolean keys give the same state on both engines;
- JSON lines with invalid UTF-8 are quarantined as ``invalid_utf8``, never merged; JSON
  keys that are not strings, integers or booleans are ``invalid_key`` on every reader;
- s3:// input (moto) follows the same rules through fsspec.
"""

from __future__ import annotations

import gzip
import json
import os
import socket
import subprocess
import sys
from decimal import Decimal

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from demo.sample_data import expected_totals, generate_events
from jobs import keyed_aggregation as ka
from statebackend.checkpoint.dump import checkpoint_rows
from statebackend.engines import ENGINE_ENV, Workload, choose_engine
from statebackend.errors import InputError, RejectThresholdError
from statebackend.job import (
    Input,
    Job,
    PerKey,
    RunConfig,
    arrow_input,
    not_null,
    reducing_state,
    run_job,
)
from statebackend.job.input import COUNT_BLOCK_BYTES, input_weight, list_input
from tests.jobs.helpers import assert_state_equals, dump_latest, store_of

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MIB = 2**20
TS = 1_798_761_600_000
# (engine, input reader): the local engine reads with Arrow; Spark with its default
# readers (Parquet by Spark, JSON by Arrow), and with Spark's own readers for both.
ENGINE_READERS = [("local", "auto"), ("spark", "auto"), ("spark", "spark")]


@pytest.fixture(params=ENGINE_READERS, ids=lambda p: f"{p[0]}-{p[1]}")
def engine_reader(request) -> tuple[str, str]:
    return request.param


def cfg(tmp_path, inp, run_id: str, engine: str, reader: str = "auto", lineage: str = "store",
        **kw) -> RunConfig:
    kw.setdefault("parallelism", 2)
    return RunConfig(input=str(inp), storage=f"file://{tmp_path}/{lineage}", job="agg",
                     run_id=run_id, output=str(tmp_path / f"out-{lineage}"), engine=engine,
                     input_reader=reader, master="local[2]", **kw)


def event(key, ts: int = TS, value: float = 1.0) -> bytes:
    return json.dumps({"key": key, "ts": ts, "value": value}).encode()


def files_under(folder) -> dict[str, bytes]:
    out = {}
    for base, _, names in os.walk(folder):
        for name in names:
            with open(os.path.join(base, name), "rb") as fh:
                out[os.path.join(base, name)] = fh.read()
    return out


def quarantine(tmp_path, run_id: str, lineage: str = "store") -> pd.DataFrame:
    folder = tmp_path / f"out-{lineage}" / "_quarantine" / f"run={run_id}"
    if not folder.exists():
        return pd.DataFrame(columns=["key", "ts", "value", "reason", "run_id", "raw"])
    return pq.read_table(folder).to_pandas()


# -- containment ------------------------------------------------------------------------
def _need_posix():
    if not hasattr(os, "mkfifo") or not hasattr(socket, "AF_UNIX"):
        pytest.skip("needs FIFOs and Unix sockets (POSIX)")


@pytest.mark.timeout(300)
def test_fifos_and_sockets_are_skipped_and_reported_never_read(spark, tmp_path, engine_reader):
    _need_posix()
    engine, reader = engine_reader
    inp = tmp_path / "in"
    events = generate_events(str(inp), n_events=600, n_keys=50, seed=501, fmt="json")
    more = generate_events(str(tmp_path / "p"), n_events=300, n_keys=50, seed=502)
    os.replace(tmp_path / "p" / "part-00000.parquet", inp / "more.parquet")
    os.mkfifo(inp / "stream.jsonl")  # reading it would wait for a writer forever
    os.mkfifo(inp / "pipe.parquet")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(inp / "s.jsonl"))
    try:
        s = run_job(ka.JOB, cfg(tmp_path, inp, "r1", engine, reader), spark)
    finally:
        sock.close()
    assert s["engine"] == engine
    assert s["input_files_skipped"] == 3
    assert s["input_files_skipped_names"] == ["pipe.parquet (fifo)", "s.jsonl (socket)",
                                              "stream.jsonl (fifo)"]
    assert (s["events_read"], s["events_rejected"]) == (900, 0)
    assert_state_equals(dump_latest(f"file://{tmp_path}/store", "agg"),
                        expected_totals([events, more]))


def test_a_folder_of_only_fifos_is_refused_in_one_line(tmp_path):
    _need_posix()
    (tmp_path / "in").mkdir()
    os.mkfifo(tmp_path / "in" / "a.jsonl")
    with pytest.raises(InputError) as info:
        list_input(str(tmp_path / "in"))
    msg = str(info.value)
    assert "\n" not in msg and "only 1 skipped (a.jsonl (fifo))" in msg


@pytest.mark.timeout(300)
def test_symlinks_out_of_the_input_root_are_skipped_and_reported(spark, tmp_path,
                                                                 engine_reader):
    engine, reader = engine_reader
    inp = tmp_path / "in"
    events = generate_events(str(inp), n_events=500, n_keys=40, seed=503, fmt="json")
    outside = tmp_path / "outside"
    generate_events(str(outside), n_events=50, n_keys=5, seed=504, key_prefix="secret")
    secret = outside / "secret.jsonl"
    secret.write_bytes(event("secret-json") + b"\nTOPSECRET\n")
    (inp / "leak.jsonl").symlink_to(secret)
    (inp / "up.jsonl").symlink_to(os.path.join("..", "outside", "secret.jsonl"))  # relative
    (inp / "leak.parquet").symlink_to(outside / "part-00000.parquet")
    (inp / "folder").symlink_to(outside)  # a folder outside: not descended either
    (inp / "hop.jsonl").symlink_to(inp / "leak.jsonl")  # a chain that ends outside
    (inp / "dangling.jsonl").symlink_to(inp / "gone.jsonl")
    # a link to a regular file inside the root is read (once: `_staging` is ignored)
    inside = generate_events(str(inp / "_staging"), n_events=120, n_keys=10, seed=505,
                             fmt="json", key_prefix="in")
    (inp / "alias.jsonl").symlink_to(inp / "_staging" / "part-00000.jsonl")

    s = run_job(ka.JOB, cfg(tmp_path, inp, "r1", engine, reader), spark)
    outside_root = "symlink outside the input root"
    assert s["input_files_skipped_names"] == [
        "dangling.jsonl (broken symlink)", f"folder ({outside_root})",
        f"hop.jsonl ({outside_root})", f"leak.jsonl ({outside_root})",
        f"leak.parquet ({outside_root})", f"up.jsonl ({outside_root})"]
    assert (s["events_read"], s["events_rejected"]) == (620, 0)
    state = dump_latest(f"file://{tmp_path}/store", "agg")
    assert not [k for k in state if k.startswith("secret")]
    assert_state_equals(state, expected_totals([events, inside]))
    written = files_under(tmp_path / "out-store") | files_under(tmp_path / "store")
    assert not [p for p, data in written.items() if b"secret" in data or b"TOPSECRET" in data]


@pytest.mark.timeout(60)
def test_the_arrow_reader_neither_follows_nor_waits_on_what_replaced_a_listed_file(tmp_path):
    _need_posix()
    os.mkfifo(tmp_path / "late.jsonl")
    with pytest.raises(InputError, match=r"late.jsonl is a fifo, not a regular file"):
        list(arrow_input.read_file(ka.JOB.input, {}, str(tmp_path / "late.jsonl")))
    (tmp_path / "real.jsonl").write_bytes(event("a") + b"\n")
    (tmp_path / "link.jsonl").symlink_to(tmp_path / "real.jsonl")
    with pytest.raises(InputError, match=r"link.jsonl became a symlink .* not followed"):
        list(arrow_input.read_file(ka.JOB.input, {}, str(tmp_path / "link.jsonl")))


# -- streaming and its bound ------------------------------------------------------------
BOMB_BYTES = 320 * MIB


@pytest.fixture(scope="module")
def gzip_bomb(tmp_path_factory):
    """A folder with one .jsonl.gz of ~1.6 MB that expands to 320 MiB of valid events,
    written as a stream (the test never holds it)."""
    folder = tmp_path_factory.mktemp("bomb") / "in"
    folder.mkdir()
    # 16 distinct lines, repeated: deflate finds each repeat (about 200x)
    lines = b"".join(event(f"k{i}", TS + i, float(i % 13)) + b"\n" for i in range(16))
    block = lines * (MIB // len(lines))  # whole lines, about 1 MiB
    written = 0
    with gzip.open(folder / "bomb.jsonl.gz", "wb", compresslevel=6) as fh:
        while written < BOMB_BYTES:
            fh.write(block)
            written += len(block)
    return folder, written


def test_a_gzip_bomb_goes_to_spark_under_auto(gzip_bomb, monkeypatch):
    folder, expanded = gzip_bomb
    monkeypatch.delenv(ENGINE_ENV, raising=False)  # tests default to Spark: ask for auto
    files = list_input(str(folder))
    assert files.total_bytes < 2 * MIB and expanded >= 300 * MIB, files.total_bytes
    assert files.total_bytes * 8 < 64 * MIB  # the old 8x guess took the local engine
    weight = input_weight(files)
    # counted decompressed, and only one block past the auto limit (not 320 MiB)
    assert 64 * MIB < weight <= 64 * MIB + COUNT_BLOCK_BYTES
    picked = choose_engine(None, "local[2]", Workload(input_bytes=weight))
    assert picked.engine == "spark"
    assert "CKPT_LOCAL_ENGINE_MAX_BYTES" in picked.reason and "decompressed" in picked.reason


_CHILD = r"""
import json, resource, sys
import fsspec, gzip, pyarrow.json, pyarrow.parquet  # loaded before the baseline
from jobs import keyed_aggregation as ka
from statebackend.errors import CkptError
from statebackend.job import RunConfig, run_job
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
error = None
try:
    run_job(ka.JOB, RunConfig(input=sys.argv[1], storage=sys.argv[2], job="agg",
                              run_id="bomb", output=sys.argv[3], engine="local",
                              parallelism=1, master="local[1]"))
except CkptError as exc:
    error = str(exc)
grew = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
print(json.dumps({"error": error, "grew": grew}))
"""


@pytest.mark.timeout(600)
def test_a_forced_local_run_stops_at_the_memory_bound_in_one_line(gzip_bomb, tmp_path):
    folder, expanded = gzip_bomb
    env = {**os.environ, "PYTHONPATH": ROOT, "CKPT_LOCAL_ENGINE_MAX_MEMORY_BYTES": str(16 * MIB)}
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(folder), f"file://{tmp_path}/st",
                           str(tmp_path / "out")], env=env, capture_output=True, text=True,
                          timeout=540, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    msg = got["error"]
    assert msg is not None and "\n" not in msg
    assert f"input {folder}:" in msg and "bomb.jsonl.gz" in msg
    assert "CKPT_LOCAL_ENGINE_MAX_MEMORY_BYTES=16777216 (16.0 MiB)" in msg
    assert "--engine spark" in msg and "nothing was committed" in msg
    # it stopped reading early: its peak memory grew far less than the input expands to
    assert got["grew"] < 100 * MIB < expanded, got
    assert store_of(f"file://{tmp_path}/st", "agg").checkpoint_ids() == []


def test_the_bound_counts_parquet_as_decoded(tmp_path, monkeypatch):
    inp = tmp_path / "in"
    inp.mkdir()
    n = 400_000  # one long key over and over: a small file, ~40 MB decoded
    pq.write_table(pa.table({"key": pa.array(["k" * 100] * n), "ts": pa.array(
        np.full(n, TS, np.int64)), "value": pa.array(np.ones(n))}), inp / "a.parquet")
    assert (inp / "a.parquet").stat().st_size < MIB
    monkeypatch.setenv("CKPT_LOCAL_ENGINE_MAX_MEMORY_BYTES", str(8 * MIB))
    with pytest.raises(InputError, match=r"CKPT_LOCAL_ENGINE_MAX_MEMORY_BYTES=8388608 \(8.0 "
                                         r"MiB\); run it with --engine spark"):
        run_job(ka.JOB, cfg(tmp_path, inp, "r1", "local"))
    assert store_of(f"file://{tmp_path}/store", "agg").checkpoint_ids() == []


def test_json_lines_are_parsed_chunk_by_chunk_with_the_same_rows(tmp_path, monkeypatch):
    """Tiny chunks (the local engine, in process): lines cut at every block boundary
    give the rows pandas reads, malformed lines and CRLF endings included."""
    inp = tmp_path / "in"
    events = generate_events(str(inp), n_events=3000, n_keys=200, seed=506, fmt="json")
    data = (inp / "part-00000.jsonl").read_bytes()
    os.remove(inp / "part-00000.jsonl")
    lines = data.splitlines()
    with gzip.open(inp / "a.jsonl.gz", "wb") as fh:
        fh.write(b"\n".join(lines[:1500]) + b"\nnot json\n\n  \t\n")
    long_key = "L" * 20_000  # longer than a chunk
    (inp / "b.jsonl").write_bytes(b"\r\n".join(lines[1500:]) + b"\r\n" + event(long_key))
    monkeypatch.setattr(arrow_input, "CHUNK_BYTES", 5000)
    monkeypatch.setattr(arrow_input, "READ_BYTES", 777)
    s = run_job(ka.JOB, cfg(tmp_path, inp, "r1", "local"))
    assert (s["events_read"], s["rejects_by_reason"]) == (3002, {"malformed": 1})
    extra = pd.DataFrame({"key": [long_key], "ts": [TS], "value": [1.0]})
    assert_state_equals(dump_latest(f"file://{tmp_path}/store", "agg"),
                        expected_totals([events, extra]))
    monkeypatch.setattr(arrow_input, "MAX_LINE_BYTES", 10_000)
    with pytest.raises(InputError, match=r"b.jsonl: a line is longer than"):
        run_job(ka.JOB, cfg(tmp_path, inp, "r2", "local"))


# -- key columns ------------------------------------------------------------------------
BAD_KEY_TYPES = {
    "binary": pa.array([b"k\xff", b"k1"], pa.binary()),
    "struct<x: int64>": pa.array([{"x": 1}, {"x": 2}]),
    "double": pa.array([1.5, 2.0]),
    "decimal128(5, 2)": pa.array([Decimal("1.10"), Decimal("2.00")], pa.decimal128(5, 2)),
    "timestamp[ms]": pa.array([1, 2], pa.timestamp("ms")),
    "list<element: int64>": pa.array([[1], [2]]),
}


@pytest.mark.parametrize("engine", ["local", "spark"])
@pytest.mark.parametrize("type_name", list(BAD_KEY_TYPES))
def test_parquet_keys_of_other_types_are_refused_in_one_line(spark, tmp_path, engine,
                                                             type_name):
    inp = tmp_path / "in"
    generate_events(str(inp), n_events=100, n_keys=10, seed=507)  # a good file first
    bad = inp / "part-00001.parquet"
    pq.write_table(pa.table({"key": BAD_KEY_TYPES[type_name], "ts": [TS, TS],
                             "value": [1.0, 2.0]}), bad)
    with pytest.raises(InputError) as info:
        run_job(ka.JOB, cfg(tmp_path, inp, "r1", engine), spark)
    msg = str(info.value)
    assert "\n" not in msg and len(msg) < 400
    assert msg.startswith(f"input file {bad}: key column 'key' has type {type_name}; keys "
                          "must be strings, integers or booleans (cast it when writing the "
                          "file)")
    assert store_of(f"file://{tmp_path}/store", "agg").checkpoint_ids() == []
    assert not (tmp_path / "out-store").exists() or not [
        p for p in files_under(tmp_path / "out-store") if p.endswith(".parquet")]


def test_a_binary_key_is_one_error_line_from_the_command_line(tmp_path):
    inp = tmp_path / "in"
    inp.mkdir()
    pq.write_table(pa.table({"key": BAD_KEY_TYPES["binary"], "ts": [TS, TS],
                             "value": [1.0, 2.0]}), inp / "a.parquet")
    env = {**os.environ, "PYTHONPATH": ROOT, ENGINE_ENV: "auto"}
    proc = subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), "ckpt"), "run",
         "jobs.keyed_aggregation:JOB", "--input", str(inp), "--storage",
         str(tmp_path / "store"), "--run-id", "c1", "--output", str(tmp_path / "out"),
         "--parallelism", "1", "--master", "local[1]"],
        env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr[-3000:]
    assert "key column 'key' has type binary; keys must be strings, integers or booleans" \
        in lines[0]


def _key_text(value) -> str:
    """The documented key text of an accepted Parquet key (the reference)."""
    if isinstance(value, bool | np.bool_):
        return "true" if value else "false"
    return str(int(value))


ACCEPTED_KEYS = {
    "int64": pa.array([-3, 0, 7, 2**40, -(2**63)] * 20, pa.int64()),
    "uint64": pa.array([2**64 - 1, 5, 2**63] * 20, pa.uint64()),
    "int8": pa.array([-128, 1, 127] * 20, pa.int8()),
    "uint16": pa.array([65535, 1] * 20, pa.uint16()),
    "bool": pa.array([True, False, True] * 20),
    "dictionary": pa.array(["a", "b", "a"] * 20).dictionary_encode(),
}


def test_integer_and_boolean_parquet_keys_are_the_same_on_both_engines(spark, tmp_path):
    frames = []
    for i, (name, keys) in enumerate(ACCEPTED_KEYS.items()):
        n = len(keys)
        table = pa.table({"key": keys, "ts": pa.array(TS + np.arange(n) * 1000 + i),
                          "value": pa.array(np.arange(n) * 0.5 + i)})
        (tmp_path / name).mkdir()
        pq.write_table(table, tmp_path / name / "part-00000.parquet")
        df = table.to_pandas()
        df["key"] = [v if isinstance(v, str) else _key_text(v) for v in keys.to_pylist()]
        frames.append(df)
    lineages = {"local": ("local", "auto"), "spark": ("spark", "auto"),
                "spark-arrow": ("spark", "arrow")}
    for lineage, (engine, reader) in lineages.items():
        for name in ACCEPTED_KEYS:
            s = run_job(ka.JOB, cfg(tmp_path, tmp_path / name, name, engine, reader,
                                    lineage=lineage), spark)
            assert s["events_rejected"] == 0, (lineage, name, s["rejects_by_reason"])
    states = {lin: dump_latest(f"file://{tmp_path}/{lin}", "agg") for lin in lineages}
    assert states["local"] == states["spark"] == states["spark-arrow"]
    assert {"18446744073709551615", "-9223372036854775808", "true", "false"} <= \
        set(states["local"])
    assert_state_equals(states["local"], expected_totals(frames))


# -- JSON lines: invalid UTF-8 and key types ----------------------------------------------
def _invalid_utf8_input(inp) -> tuple[list[bytes], pd.DataFrame]:
    """Lines (some not UTF-8) and the pandas reference of the valid ones."""
    inp.mkdir()
    good = [event(f"g{i % 7}", TS + i, float(i)) for i in range(40)]
    odd = [event("k", TS, 1.0).replace(b'"k"', b'"k\xff"'),   # differ only in the bad byte
           event("k", TS, 2.0).replace(b'"k"', b'"k\xfe"'),
           # the replacement character itself, valid UTF-8: a key of its own
           event("k", TS, 4.0).replace(b'"k"', '"k\ufffd"'.encode()),
           event("ok", TS, 8.0)]
    (inp / "a.jsonl").write_bytes(b"\n".join(good[:20] + odd) + b"\n")
    with gzip.open(inp / "b.jsonl.gz", "wb") as fh:
        fh.write(b"\n".join([*good[20:], odd[0].replace(b"1.0", b"16.0")]) + b"\n")
    lines = good + odd + [odd[0].replace(b"1.0", b"16.0")]
    valid = []
    for line in lines:
        try:
            valid.append(json.loads(line.decode("utf-8")))  # strict: the reference
        except UnicodeDecodeError:
            continue
    return lines, pd.DataFrame(valid)


def test_invalid_utf8_lines_are_quarantined_never_merged(spark, tmp_path, engine_reader):
    engine, reader = engine_reader
    inp = tmp_path / "in"
    lines, reference = _invalid_utf8_input(inp)
    invalid = [ln for ln in lines if b"\xff" in ln or b"\xfe" in ln]
    assert len(invalid) == 3 and len(reference) == len(lines) - 3
    s = run_job(ka.JOB, cfg(tmp_path, inp, "r1", engine, reader,
                            max_reject_fraction=0.5), spark)
    assert (s["events_read"], s["events_rejected"]) == (len(lines), 3)
    assert s["rejects_by_reason"] == {"invalid_utf8": 3}
    state = dump_latest(f"file://{tmp_path}/store", "agg")
    assert state["k\ufffd"]["count"] == 1  # not merged with k\xff, k\xfe
    assert_state_equals(state, expected_totals([reference]))
    q = quarantine(tmp_path, "r1")
    assert sorted(q["reason"]) == ["invalid_utf8"] * 3
    assert sorted(q["raw"]) == sorted(ln.decode("utf-8", "backslashreplace") for ln in invalid)
    assert q[["key", "ts", "value"]].isna().all().all()
    # they count against --max-reject-fraction like any reject
    with pytest.raises(RejectThresholdError, match=r"3 of \d+ .*invalid_utf8=3"):
        run_job(ka.JOB, cfg(tmp_path, inp, "r2", engine, reader, max_reject_fraction=0.01),
                spark)


JSON_KEYS = [  # (the key's JSON text, the accepted key text or the reject reason)
    ('"str"', "str"), ('"1.5"', "1.5"), ('"{\\"x\\": 1}"', '{"x": 1}'), ('"-7"', "-7"),
    ("5", "5"), ("-0", "0"), ("12345678901234567890123", "12345678901234567890123"),
    ("true", "true"), ("false", "false"),
    ("1.5", "invalid_key"), ("1e7", "invalid_key"), ("12345678.0", "invalid_key"),
    ("1.0", "invalid_key"), ('{"x": 1}', "invalid_key"), ("[1, 2]", "invalid_key"),
    ("null", "missing_key"),
]


def test_json_keys_follow_one_rule_on_every_engine_and_reader(spark, tmp_path, engine_reader):
    engine, reader = engine_reader
    inp = tmp_path / "in"
    inp.mkdir()
    lines = [f'{{"key": {k}, "ts": {TS + i}, "value": {i}.5}}' for i, (k, _) in
             enumerate(JSON_KEYS)]
    (inp / "a.jsonl").write_text("\n".join(lines) + "\n")
    s = run_job(ka.JOB, cfg(tmp_path, inp, "r1", engine, reader, max_reject_fraction=0.9),
                spark)
    # the reference: Python's JSON parser and the documented rule
    accepted, reasons = [], {}
    for line, (_, want) in zip(lines, JSON_KEYS, strict=True):
        row = json.loads(line)
        key = row["key"]
        if key is None:
            reasons["missing_key"] = reasons.get("missing_key", 0) + 1
        elif isinstance(key, str | int):
            text = key if isinstance(key, str) else json.dumps(key)
            accepted.append({**row, "key": text})
            assert text == want
        else:
            reasons["invalid_key"] = reasons.get("invalid_key", 0) + 1
            assert want == "invalid_key"
    assert s["rejects_by_reason"] == reasons == {"invalid_key": 6, "missing_key": 1}
    assert_state_equals(dump_latest(f"file://{tmp_path}/store", "agg"),
                        expected_totals([pd.DataFrame(accepted)]))
    q = quarantine(tmp_path, "r1")
    bad = q[q["reason"] == "invalid_key"]
    assert sorted(bad["raw"]) == sorted(ln for ln, (_, w) in zip(lines, JSON_KEYS, strict=True)
                                        if w == "invalid_key")
    assert bad["key"].isna().all() and bad["ts"].notna().all()


# -- s3:// input: the same rules over fsspec ----------------------------------------------
@pytest.mark.parametrize("engine", ["local", "spark"])
def test_s3_input_streams_counts_and_quarantines_like_local_files(spark, s3_server, tmp_path,
                                                                  engine, monkeypatch):
    """gzip JSON lines with an invalid byte and a Parquet file with an integer key, on
    s3:// (the Arrow reader over fsspec on both engines): the same rows, reasons and
    state as pandas; the engine choice counts the gzip decompressed over s3 as well."""
    import uuid

    import fsspec

    from tests.conftest import S3_BUCKET

    inp = tmp_path / "in"
    inp.mkdir()
    lines, reference = _invalid_utf8_input(tmp_path / "j")
    os.replace(tmp_path / "j" / "b.jsonl.gz", inp / "b.jsonl.gz")
    n = 50
    table = pa.table({"key": pa.array(np.arange(n) % 9, pa.int32()),
                      "ts": pa.array(TS + np.arange(n, dtype=np.int64)),
                      "value": pa.array(np.arange(n) * 0.25)})
    pq.write_table(table, inp / "a.parquet")
    options = {"key": "testing", "secret": "testing",
               "client_kwargs": {"endpoint_url": s3_server}}
    prefix = f"{S3_BUCKET}/hardening-{uuid.uuid4().hex[:8]}"
    fsspec.filesystem("s3", **options).put(str(inp) + "/", f"{prefix}/in/", recursive=True)
    url = f"s3://{prefix}/in"

    monkeypatch.setenv("CKPT_LOCAL_ENGINE_MAX_BYTES", "1000")
    files = list_input(url)  # the s3_server fixture's AWS_* variables, captured
    assert input_weight(files) > 1000  # counted by streaming the gzip object
    s = run_job(ka.JOB, RunConfig(input=url, storage=f"file://{tmp_path}/store", job="agg",
                                  run_id="r1", output=str(tmp_path / "out-store"),
                                  engine=engine, parallelism=2, master="local[2]",
                                  max_reject_fraction=0.5), spark)
    gz_lines = gzip.decompress((inp / "b.jsonl.gz").read_bytes()).splitlines()
    valid = []
    for line in gz_lines:
        try:
            valid.append(json.loads(line.decode("utf-8")))
        except UnicodeDecodeError:
            continue
    assert (s["input_reader"], s["events_rejected"]) == ("arrow", 1)
    assert s["rejects_by_reason"] == {"invalid_utf8": 1}
    parquet_rows = table.to_pandas().assign(key=lambda d: d["key"].astype(str))
    assert_state_equals(dump_latest(f"file://{tmp_path}/store", "agg"),
                        expected_totals([pd.DataFrame(valid), parquet_rows]))


def test_invalid_utf8_is_quarantined_when_the_key_column_is_named_utf8(tmp_path):
    """The reason of a bad key (invalid_<key>) must not be mistaken for invalid_utf8:
    with a key column named ``utf8`` the Arrow reader used to crash on such a line."""
    def count(key: str, rows: pa.Table, state) -> None:
        state["n"].add(rows.num_rows)

    job = Job(name="by_utf8", input=Input(
        schema=pa.schema([("utf8", pa.string()), ("v", pa.int64())]), key="utf8",
        rules=(not_null("utf8"),)), states=(reducing_state("n", lambda a, b: a + b),),
        logic=PerKey(count))
    inp = tmp_path / "in"
    inp.mkdir()
    good = [{"utf8": f"k{i % 3}", "v": i} for i in range(9)]
    lines = [json.dumps(r).encode() for r in good] + [b'{"utf8": "k\xff", "v": 1}',
                                                      b'{"utf8": 1.5, "v": 2}']
    (inp / "a.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    s = run_job(job, RunConfig(input=str(inp), storage=f"file://{tmp_path}/store",
                               run_id="r1", engine="local", max_reject_fraction=0.5,
                               quarantine=str(tmp_path / "q")))
    # both are invalid_utf8: the bad key's reason is invalid_<key>
    assert s["rejects_by_reason"] == {"invalid_utf8": 2}
    store = store_of(f"file://{tmp_path}/store", "by_utf8")
    state = {r["key"]: r["value"] for r in checkpoint_rows(store, store.latest())}
    assert state == pd.DataFrame(good).groupby("utf8").size().to_dict()
