"""Spark SQL's ``hash()`` computed here (issue 24, deliverable 1): a key-group rule the
JVM can evaluate (``pmod(hash(key), M)``) and the local engine, rescale and validation
equally. Spark itself is the reference: the column form equals ``F.hash`` and
``pmod(hash(k), M)`` on random keys of 1-4-byte UTF-8 characters (NUL included) and
every tail length; the scalar form equals the column form; the lineage hash
(`murmur3_32_many`) is unchanged."""

from __future__ import annotations

import random

import numpy as np
import pyarrow as pa
import pytest

from statebackend.state.keygroups import murmur3_32, spark_hash
from statebackend.state.keygroups_bulk import murmur3_32_many, spark_hash_many

ALPHABET = "abcxyz0189ÄéßЖж鍵🙂\x00"


def _keys(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 17)))
            for _ in range(n)]


def test_the_column_form_equals_the_scalar_form_and_murmur3_is_unchanged():
    keys = _keys(3000, 1)
    arr = pa.array(keys)
    assert spark_hash_many(arr).tolist() == [spark_hash(k.encode()) for k in keys]
    assert murmur3_32_many(arr).tolist() == [murmur3_32(k.encode()) for k in keys]
    sliced = arr.slice(7, 100)  # an Arrow slice starts inside the buffers
    assert spark_hash_many(sliced).tolist() == [spark_hash(k.encode()) for k in keys[7:107]]
    assert spark_hash_many(pa.array(["a", None])).tolist() == [spark_hash(b"a"), 42]
    assert spark_hash_many(pa.array([], pa.string())).dtype == np.int32


@pytest.mark.parametrize("max_parallelism", [128, 4096])
def test_equal_to_sparks_own_hash_and_pmod(spark, max_parallelism):
    from pyspark.sql import functions as F

    keys = _keys(5000, 2)
    rows = spark.createDataFrame([(k,) for k in keys], "k string").select(
        "k", F.hash("k").alias("h"),
        F.expr(f"pmod(hash(k), {max_parallelism})").alias("kg")).collect()
    spark_side = {r["k"]: (r["h"], r["kg"]) for r in rows}
    ours = spark_hash_many(pa.array(keys)).astype(np.int64)
    assert [spark_side[k] for k in keys] == \
        [(int(h), int(h) % max_parallelism) for h in ours]
