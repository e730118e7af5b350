"""The engine choice (statebackend.job.engine): a pure decision, tested without Spark."""

from __future__ import annotations

import pytest

from statebackend import defaults
from statebackend.errors import UsageError
from statebackend.job.engine import (
    ENGINE_ENV,
    MAX_BYTES_ENV,
    MAX_STATE_BYTES_ENV,
    choose_engine,
    input_weight,
    is_local_master,
    local_master_cores,
    requested_engine,
)
from statebackend.job.input import InputFiles

MIB = 2**20


@pytest.fixture(autouse=True)
def _no_engine_env(monkeypatch):
    for var in (ENGINE_ENV, MAX_BYTES_ENV, MAX_STATE_BYTES_ENV):
        monkeypatch.delenv(var, raising=False)


def choice(requested=None, *, input_mib=1.0, master="local[2]", first=False, state_mib=0.0):
    return choose_engine(requested, input_bytes=int(input_mib * MIB), master=master,
                         first_run_without_parallelism=first,
                         parent_state_bytes=int(state_mib * MIB))


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
    with pytest.raises(UsageError, match=f"{MAX_BYTES_ENV}='lots' is not a byte count"):
        choice()
    monkeypatch.delenv(MAX_BYTES_ENV)
    with pytest.raises(UsageError, match="--engine 'turbo' is unknown"):
        requested_engine("turbo")
    monkeypatch.setenv(ENGINE_ENV, "fast")
    with pytest.raises(UsageError, match=f"{ENGINE_ENV} 'fast' is unknown"):
        requested_engine(None)


def test_masters_and_their_cores(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 6)
    assert [is_local_master(m) for m in ("local", "local[3]", "local[*]", "local[2,4]",
                                         "spark://h:7077", "sc://h:1", "", None)] == \
        [True, True, True, True, False, False, False, False]
    assert [local_master_cores(m) for m in ("local", "local[3]", "local[*]", "local[2,4]")] \
        == [1, 3, 6, 2]


def test_gzip_input_counts_as_what_it_expands_to():
    files = InputFiles("file:///in", (), ("a.json", "b.json.gz"), total_bytes=3 * MIB,
                       gz_bytes=1 * MIB)
    assert input_weight(files) == 2 * MIB + 8 * MIB
