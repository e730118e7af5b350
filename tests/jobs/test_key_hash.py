"""The lineage's key hash (issue 24, deliverable 1): a new lineage records ``spark``
(Spark SQL's ``hash()``, so the Spark engine routes rows inside the JVM); a lineage
whose records name no hash (every lineage of earlier releases) keeps ``murmur3`` and
its Python routing. Both continue on both engines and validate ``--full``, rescale, and
hold the same state as pandas, whichever hash placed their keys.
"""

from __future__ import annotations

import json

import pytest

from jobs import keyed_aggregation as ka
from statebackend import defaults
from statebackend.checkpoint.store import CheckpointStore
from statebackend.cli import app as cli
from statebackend.job import RunConfig, run_job
from statebackend.rescale.executor import RescaleOptions, rescale
from statebackend.storage import open_storage
from tests.jobs.run_reference import (
    assert_totals_equal,
    final_state,
    totals_days,
    totals_reference,
)

JOB = "keyed_aggregation"


def _run(tmp_path, storage: str, d: int, engine: str, spark) -> dict:
    return run_job(ka.JOB, RunConfig(input=str(tmp_path / f"in{d}"), storage=storage,
                                     run_id=f"d{d}", output=str(tmp_path / "out"),
                                     parallelism=3, engine=engine), spark)


def _record(storage: str, checkpoint_id: int) -> dict:
    store = CheckpointStore(open_storage(storage), JOB)
    data = store.read_record(checkpoint_id)
    assert data is not None
    return json.loads(data)


@pytest.mark.parametrize("first_hash", ["murmur3", "spark"])
def test_either_hash_continues_on_both_engines_rescales_and_validates(
        spark, tmp_path, monkeypatch, first_hash):
    days = totals_days(str(tmp_path), 4, seed=430)
    storage = f"file://{tmp_path}/store"
    with monkeypatch.context() as patch:  # the lineage's first run picks its hash
        patch.setattr(defaults, "KEY_HASH", first_hash)
        _run(tmp_path, storage, 0, "spark", spark)
    # a record of earlier releases names no hash: murmur3 is what it means
    assert _record(storage, 1).get("key_hash") == (None if first_hash == "murmur3"
                                                    else "spark")
    _run(tmp_path, storage, 1, "local", spark)
    store = CheckpointStore(open_storage(storage), JOB)
    rescale(store, "latest", 2, spark=spark, options=RescaleOptions(master="local[2]"))
    _run(tmp_path, storage, 2, "spark", spark)
    _run(tmp_path, storage, 3, "local", spark)
    assert {CheckpointStore(open_storage(storage), JOB).load(i).key_hash
            for i in range(1, 6)} == {first_hash}
    assert_totals_equal(final_state(storage, JOB)["totals"],
                        totals_reference(days)[1]["totals"])
    for checkpoint in ("1", "latest"):
        assert cli.main(["--storage", storage, "--job", JOB, "validate", checkpoint,
                         "--full", "--report", "none"]) == 0


def test_a_record_with_an_unknown_key_hash_is_refused_in_one_line(tmp_path, capsys):
    totals_days(str(tmp_path), 1, seed=431)
    storage = f"file://{tmp_path}/store"
    _run(tmp_path, storage, 0, "local", None)
    store = CheckpointStore(open_storage(storage), JOB)
    record = _record(storage, 1)
    record["key_hash"] = "md5"
    store.storage.write_bytes("chk-1/_metadata", json.dumps(record).encode())
    assert cli.main(["--storage", storage, "--job", JOB, "show", "1"]) != 0
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "key_hash 'md5' is not one of ['murmur3', 'spark']" in err
