"""The engine choice (statebackend.engines): a pure decision, tested without Spark."""

from __future__ import annotations

import gzip

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from statebackend import defaults
from statebackend.engines import (
    ENGINE_ENV,
    MAX_BYTES_ENV,
    MAX_MEMORY_ENV,
    MAX_STATE_BYTES_ENV,
    Workload,
    choose_engine,
    is_local_master,
    local_master_cores,
    requested_engine,
)
from statebackend.errors import UsageError
from statebackend.job.arrow_input import check_parquet
from statebackend.job.input import COUNT_BLOCK_BYTES, input_weight, list_input

MIB = 2**20


@pytest.fixture(autouse=True)
def _no_engine_env(monkeypatch):
    for var in (ENGINE_ENV, MAX_BYTES_ENV, MAX_STATE_BYTES_ENV, MAX_MEMORY_ENV):
        monkeypatch.delenv(var, raising=False)


def choice(requested=None, *, input_mib=1.0, master="local[2]", first=False, state_mib=0.0):
    return choose_engine(requested, master, Workload(
        input_bytes=int(input_mib * MIB), state_bytes=int(state_mib * MIB),
        new_lineage_without_parallelism=first))


def test_auto_runs_a_small_input_locally_and_a_large_one_on_spark():
    small = choice()
    assert small.engine == "local" and "1.0 MiB within" in small.reason
    limit = defaults.LOCAL_ENGINE_MAX_BYTES / MIB
    assert choice(input_mib=limit).engine == "local"  # the limit itself is small
    big = choice(input_mib=limit + 1)
    assert big.engine == "spark" and MAX_BYTES_ENV in big.reason and "exceeds" in big.reason


def test_a_cluster_master_keeps_new_lineages_and_large_state_on_spark():
    for master in ("spark://10.0.0.1:7077", "sc://127.0.0.1:15002", "yarn"):
        assert choice(master=master).engine == "local"  # small state, known parallelism
        first = choice(master=master, first=True)
        assert first.engine == "spark" and master in first.reason
        big = choice(master=master, state_mib=defaults.LOCAL_ENGINE_MAX_STATE_BYTES / MIB + 1)
        assert big.engine == "spark" and MAX_STATE_BYTES_ENV in big.reason
    # a local master's executors are this machine: state size and first runs do not matter
    assert choice(master="local[*]", first=True, state_mib=10_000).engine == "local"


def test_asked_engine_wins_and_the_environment_sets_the_default(monkeypatch):
    assert choice("spark").engine == "spark" and choice("local", input_mib=10_000).engine \
        == "local"
    monkeypatch.setenv(ENGINE_ENV, "spark")
    picked = choice()
    assert picked.engine == "spark" and ENGINE_ENV in picked.reason
    assert choice("local").engine == "local"  # an explicit --engine beats the variable


def test_limits_come_from_the_environment_and_bad_values_are_one_line(monkeypatch):
    monkeypatch.setenv(MAX_BYTES_ENV, str(MIB // 2))
    assert choice(input_mib=1).engine == "spark"
    monkeypatch.setenv(MAX_BYTES_ENV, "lots")
    # read through statebackend.settings: one-line errors naming the variable
    with pytest.raises(UsageError, match=f"{MAX_BYTES_ENV}='lots' is not an integer"):
        choice()
    monkeypatch.delenv(MAX_BYTES_ENV)
    with pytest.raises(UsageError, match="--engine 'turbo' is unknown"):
        requested_engine("turbo")
    monkeypatch.setenv(ENGINE_ENV, "fast")
    with pytest.raises(UsageError, match=f"{ENGINE_ENV}='fast' is unknown"):
        requested_engine(None)


def test_masters_and_their_cores(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 6)
    assert [is_local_master(m) for m in ("local", "local[3]", "local[*]", "local[2,4]",
                                         "spark://h:7077", "sc://h:1", "", None)] == \
        [True, True, True, True, False, False, False, False]
    assert [local_master_cores(m) for m in ("local", "local[3]", "local[*]", "local[2,4]")] \
        == [1, 3, 6, 2]


def _gzip_lines(path, n_bytes: int, line: bytes = b'{"key":"k","ts":1,"value":1.0}\n') -> int:
    """A gzip file of about ``n_bytes`` of JSON lines, written as a stream; its size."""
    block = line * (2**20 // len(line))
    written = 0
    with gzip.open(path, "wb", compresslevel=6) as fh:
        while written < n_bytes:
            fh.write(block)
            written += len(block)
    return written


def test_gzip_input_counts_its_decompressed_bytes(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_bytes(b'{"key":"a"}\n' * 1000)
    expanded = _gzip_lines(tmp_path / "in" / "b.jsonl.gz", 3 * MIB)
    files = list_input(str(tmp_path / "in"))
    reference = (tmp_path / "in" / "a.jsonl").stat().st_size + \
        len(gzip.decompress((tmp_path / "in" / "b.jsonl.gz").read_bytes()))
    assert expanded == reference - 12_000
    assert input_weight(files) == reference  # exact below the limit, not a guess of 8x
    assert choice(input_mib=input_weight(files) / MIB).engine == "local"


def test_a_gzip_file_is_decompressed_once_per_listing_unless_a_larger_bound_needs_more(
        tmp_path):
    # a run weighs its input for the engine choice, then for the Spark direct read
    (tmp_path / "in").mkdir()
    gz = tmp_path / "in" / "b.jsonl.gz"
    size = _gzip_lines(gz, 3 * MIB)
    files = list_input(str(tmp_path / "in"))
    partial = input_weight(files, limit=MIB)
    assert MIB < partial < size  # counted only until it passed the bound
    assert input_weight(files, limit=MIB // 2) == partial  # a smaller bound: the count kept
    assert input_weight(files, limit=8 * MIB) == size  # a larger one: counted to the end
    gz.write_bytes(b"not gzip any more")  # what is counted to its end is not read again
    assert input_weight(files, limit=8 * MIB) == size
    assert input_weight(list_input(str(tmp_path / "in")), limit=8 * MIB) < MIB  # new listing


def test_a_gzip_bomb_goes_to_spark_after_counting_only_up_to_the_limit(tmp_path, monkeypatch):
    (tmp_path / "in").mkdir()
    bomb = tmp_path / "in" / "bomb.jsonl.gz"
    _gzip_lines(bomb, 40 * MIB)
    assert bomb.stat().st_size < MIB // 4  # compressed: well under 8x's guess of the limit
    monkeypatch.setenv(MAX_BYTES_ENV, str(4 * MIB))
    weight = input_weight(list_input(str(tmp_path / "in")))
    # the driver stopped decompressing one block after the limit, not at 40 MiB
    assert 4 * MIB < weight <= 4 * MIB + COUNT_BLOCK_BYTES
    picked = choice(input_mib=weight / MIB)
    assert picked.engine == "spark" and MAX_BYTES_ENV in picked.reason
    assert "(decompressed) exceeds the local engine's 4.0 MiB" in picked.reason


def test_auto_keeps_the_input_within_the_local_engines_memory_bound(monkeypatch):
    monkeypatch.setenv(MAX_MEMORY_ENV, str(MIB))  # below CKPT_LOCAL_ENGINE_MAX_BYTES
    picked = choice(input_mib=2)
    assert picked.engine == "spark" and MAX_MEMORY_ENV in picked.reason
    assert choice(input_mib=0.5).engine == "local"
    monkeypatch.setenv(MAX_MEMORY_ENV, "0")
    with pytest.raises(UsageError, match=f"{MAX_MEMORY_ENV}='0' is out of range"):
        choice()


def test_parquet_counts_at_least_its_decoded_size(tmp_path):
    (tmp_path / "in").mkdir()
    path = tmp_path / "in" / "a.parquet"
    n = 200_000  # one key over and over: dictionary pages of a few bytes
    table = pa.table({"key": pa.array(["same-key"] * n), "ts": pa.array(np.zeros(n, np.int64))})
    pq.write_table(table, path, compression="zstd")
    files = list_input(str(tmp_path / "in"))
    assert input_weight(files) == files.total_bytes  # footers not read yet: the file size
    check_parquet(files)
    meta = pq.read_metadata(path)
    uncompressed = sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))
    assert uncompressed < 10_000 and files.total_bytes < 10_000  # both far below the data
    decoded = pq.read_table(path).nbytes  # the reference: what Arrow holds
    assert n * (4 + 8) <= input_weight(files) <= decoded


def test_storage_only_this_process_reaches_stays_local(monkeypatch):
    memory = Workload(input_bytes=10 * 2**30, storage_in_process="memory://x")
    picked = choose_engine(None, "spark://h:7077", memory)
    assert picked.engine == "local" and "memory://x lives in this process" in picked.reason
    with pytest.raises(UsageError, match="memory://x lives in one process.*--engine local"):
        choose_engine("spark", "local[2]", memory)
    monkeypatch.setenv(ENGINE_ENV, "spark")  # a default, not a request: memory stays local
    assert choose_engine(None, "local[2]", memory).engine == "local"
